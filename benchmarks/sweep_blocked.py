"""Tile sweep of the blocked path's GEMMs on a CUDA GPU.

    python benchmarks/sweep_blocked.py [--geometries ...] [--sizes ...] [--layers 3] [--budget 300]
        [--g1 BN,BK,WARPS,STAGES[,g] ...] [--g2 ...] [--bm ...]

For every geometry and M, the whole op (four launches) is timed as CUDA-graph replay over
``--layers`` layers' handles for each candidate configuration: the default (with the inline-PTX
decode and without it), then per block size every GEMM1
tile with the default GEMM2 tile and
every GEMM2 tile with the best GEMM1 tile (``--g1``/``--g2``/``--bm`` replace the lists; a tile ending in ``,g``
is the GEMM's Gluon form, ``gluon_kernels``, sm_90). Each configuration's output is checked against the
reference first. Prints a table per geometry (and writes it to ``--out``); stops cleanly when
``--budget`` seconds have passed. This is how the defaults in ``plan._REGIMES`` were chosen
(``results/sweep_blocked.md`` was made when the row-major GEMMs still existed: its R rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import b12x_ops  # noqa: E402
from b12x_ops.backends.triton import _launch_all  # noqa: E402
from b12x_ops.backends.triton import plan as P  # noqa: E402
from bench_moe import (GEOMETRIES, adapt_handles, graph_time, layer_batches, load_variant, markdown_log, rel_l2,  # noqa: E402
                       random_layer)

G1 = [(64, 128, 4, 3, False), (128, 64, 8, 3, False), (64, 64, 4, 4, False), (128, 128, 8, 3, False)]
G2 = [(64, 128, 4, 3, False), (128, 128, 8, 3, False), (128, 64, 4, 3, False), (64, 256, 4, 3, False)]


def tile(spec: str) -> tuple:
    """``BN,BK,WARPS,STAGES`` (tl.dot) or ``BN,BK,WARPS,STAGES,g`` (Gluon) as ``(bn, bk, warps, stages, gluon)``."""
    parts = spec.split(",")
    if len(parts) not in (4, 5) or (len(parts) == 5 and parts[4] != "g"):
        raise SystemExit(f"sweep_blocked: tile {spec!r} is not BN,BK,WARPS,STAGES[,g]")
    return tuple(map(int, parts[:4])) + (len(parts) == 5,)


def block_sizes(M, g):
    rows = P._rows(M, g)
    if rows <= 4:
        return [16]
    if rows <= 20:
        return [16, 32]
    if rows <= 64:
        return [32, 64]
    return [64, 128]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometries", nargs="*", default=list(GEOMETRIES))
    ap.add_argument("--sizes", nargs="*", type=int, default=[64, 512, 8192])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds, split evenly between the geometries")
    ap.add_argument("--out", default="sweep_blocked.md")
    ap.add_argument("--variant", default=None,
                    help="a module under benchmarks/ whose blocked GEMMs replace the package's (bench_moe.py --variant)")
    ap.add_argument("--g1", nargs="*", default=None,
                    help="GEMM1 tiles to try, each BN,BK,WARPS,STAGES, with ,g for the Gluon form")
    ap.add_argument("--g2", nargs="*", default=None,
                    help="GEMM2 tiles to try, each BN,BK,WARPS,STAGES, with ,g for the Gluon form")
    ap.add_argument("--ptx-only", action="store_true", help="leave out the decode without inline PTX")
    ap.add_argument("--bm", nargs="*", type=int, default=None, help="block sizes to try (default: by rows an expert)")
    args = ap.parse_args(argv)
    g1s = [tile(t) for t in args.g1] if args.g1 else G1
    g2s = [tile(t) for t in args.g2] if args.g2 else G2
    variant = load_variant(args.variant)
    t_start = time.perf_counter()
    emit = markdown_log(args.out, f"# Blocked-path tile sweep ({torch.cuda.get_device_name()}); whole op, "
                                  f"us per layer, CUDA-graph replay over {args.layers} layers"
                                  f"{'; GEMMs from ' + args.variant if args.variant else ''}")

    per_geo = args.budget / len(args.geometries)
    for gi, name in enumerate(args.geometries):
        deadline = t_start + per_geo * (gi + 1)
        geo = GEOMETRIES[name]
        E, K, N, top_k, limit = geo["E"], geo["K"], geo["N"], geo["top_k"], geo["limit"]
        layers = [random_layer(E, K, N, "cuda", 100 + i) for i in range(args.layers)]
        hs = [b12x_ops.prepare_experts(*lw, top_k=top_k, swiglu_limit=limit, backend="triton", tune=False,
                                       max_tokens=max(args.sizes), frozen=False) for lw in layers]
        # the same weights with the Triton-ops decode instead of inline PTX (the transposed GEMMs)
        hs_np = [] if args.ptx_only else [
            b12x_ops.prepare_experts(*lw, top_k=top_k, swiglu_limit=limit, backend="triton", tune=False,
                                     max_tokens=max(args.sizes), frozen=False, ptx=False) for lw in layers]
        adapt_handles(variant, hs + hs_np)
        ref = b12x_ops.prepare_experts(*layers[0], top_k=top_k, swiglu_limit=limit, backend="reference")
        g = hs[0]._state.plans.geometry
        emit(f"## {name}")
        emit("")
        emit("| M | config | us | rel err | regs g1/g2 |")
        emit("|---|---|---|---|---|")
        for M in args.sizes:
            if time.perf_counter() > deadline:
                emit(f"(this geometry's {per_geo:.0f} s of the budget are spent)")
                break
            xs, idss, wss, outs = layer_batches(M, E, K, top_k, args.layers)
            want = b12x_ops.moe_w4a8(xs[0], idss[0], wss[0], ref)
            results = {}

            def trial(cfg, handles=hs, tag=""):
                if (cfg, tag) in results:
                    return results[(cfg, tag)]
                if time.perf_counter() > deadline:
                    return float("inf")
                st0 = handles[0]._state
                try:
                    st0.plans.reserve(M, cfg)
                    _launch_all(st0, cfg, xs[0], idss[0], wss[0], outs[0])
                    err = rel_l2(outs[0], want)
                    calls = [lambda h=h, x=x, ids=ids, w=w, o=o: _launch_all(h._state, cfg, x, ids, w, o)
                             for h, x, ids, w, o in zip(handles, xs, idss, wss, outs)]
                    t = graph_time(calls, reps=10) * 1e6
                    lns = st0.plans.stages(cfg)
                    regs = "/".join(str(getattr(ln.compiled, "n_regs", "?")) for ln in lns[1:3])
                except Exception as exc:  # noqa: BLE001 - a tile the GPU cannot run
                    t, err, regs = float("inf"), float("nan"), f"{type(exc).__name__}: {str(exc)[:60]}"
                results[(cfg, tag)] = t
                tiles = tag + "gemv" if cfg.gemv else tag + (
                    f"bm={cfg.bm} g1={(cfg.bn1, cfg.bk1, cfg.warps1, cfg.stages1)}{' Gluon' * cfg.gluon} "
                    f"g2={(cfg.bn2, cfg.bk2, cfg.warps2, cfg.stages2)}{' Gluon' * cfg.gluon2}")
                bad = "" if err <= 1e-2 else " WRONG"
                emit(f"| {M} | {tiles} | {t:.1f} | {err:.1e}{bad} | {regs} |")
                return t if err <= 1e-2 else float("inf")

            base_t = P.default_config(M, g, gemv=False)
            if M * top_k <= 2 * P.GEMV_MAX_SLOTS and getattr(variant, "PREPARE_OPTIONS", {}).get("gemv") is not False:
                trial(P.default_config(M, g, gemv=True))
            if hs_np:
                trial(base_t, hs_np, "(no PTX) ")
            trial(base_t)
            for bm in args.bm or block_sizes(M, g):
                c0 = dataclasses.replace(base_t, bm=bm)
                best1, bt = None, float("inf")
                for g1 in g1s:
                    c = dataclasses.replace(c0, bn1=g1[0], bk1=g1[1], warps1=g1[2], stages1=g1[3], gluon=g1[4])
                    t = trial(c)
                    if t < bt:
                        best1, bt = c, t
                if best1 is None:
                    continue
                for g2 in g2s:
                    trial(dataclasses.replace(best1, bn2=g2[0], bk2=g2[1], warps2=g2[2], stages2=g2[3], gluon2=g2[4]))
            ok = {c: t for (c, tag), t in results.items() if t < float("inf") and not tag}
            if ok:
                best = min(ok, key=ok.get)
                emit(f"| {M} | **best** {best} | **{ok[best]:.1f}** | | |")
        del hs, hs_np, ref, layers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
