"""Tile sweep of the small-M (GEMV) path on a CUDA GPU.

    python benchmarks/sweep_gemv.py [--geometries ...] [--sizes 1 2 4 8] [--layers 4] [--budget 240]

For every geometry and M, each gemv1 candidate and each gemv2 candidate is timed alone (CUDA-graph
replay of that kernel over ``--layers`` layers' handles, so weights come from HBM), then the whole
op with the best pair and with the current default is timed and checked against the reference.
Times are us per layer; the HBM limit is the distinct experts' weight and scale bytes over
``--bw``. Writes a markdown table to ``--out`` as it goes; stops cleanly when ``--budget`` seconds
have passed. It times the tiles the tuner chooses from (``plan.gemv_candidates``), a few beside
them (``EXTRA1``/``EXTRA2``), and ``plan.gemv_config``'s default.
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

# Beside the tuner's candidates, (bn, bk, warps, stages, steps a program): 128-row tiles on 8 warps (gemv1's
# split is then its K steps over that many, gemv2's top_k times its N steps over it). (32-row tiles, once
# here, sum wrong under the inline-PTX decode and are refused: ``plan.DOT_PTX_TILES``.)
EXTRA = [(128, 256, 8, 1, 1), (128, 128, 8, 1, 1), (64, 256, 8, 1, 1), (64, 128, 4, 3, 3)]


def sweep_tiles(geometry):
    t1, t2 = P.gemv_candidates(geometry)
    for bn, bk, warps, stages, per in EXTRA:
        s1 = -(-geometry.hidden_size // bk)
        s2 = -(-geometry.intermediate_size // bk)
        t1.append((bn, bk, warps, stages, -(-s1 // per)))
        t2.append((bn, bk, warps, stages, geometry.top_k * -(-s2 // per)))
    return t1, t2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometries", nargs="*", default=list(GEOMETRIES))
    ap.add_argument("--sizes", nargs="*", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bw", type=float, default=4.27e12, help="copy bandwidth in bytes/s for the limit column")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds, split evenly between the geometries")
    ap.add_argument("--out", default="sweep_gemv.md")
    ap.add_argument("--variant", default=None,
                    help="a module under benchmarks/ whose GEMV kernels replace the package's (bench_moe.load_variant)")
    args = ap.parse_args(argv)
    variant = load_variant(args.variant)
    t_start = time.perf_counter()
    emit = markdown_log(args.out, f"# GEMV-path tile sweep ({torch.cuda.get_device_name()}); us per layer, "
                                  f"CUDA-graph replay over {args.layers} layers; limit at {args.bw / 1e12:.2f} TB/s"
                                  f"{'; kernels from ' + args.variant if args.variant else ''}")

    per_geo = args.budget / len(args.geometries)
    for gi, name in enumerate(args.geometries):
        deadline = t_start + per_geo * (gi + 1)
        geo = GEOMETRIES[name]
        E, K, N, top_k, limit = geo["E"], geo["K"], geo["N"], geo["top_k"], geo["limit"]
        expert_bytes = 2 * N * K // 2 + 2 * N * K // 32 + K * N // 2 + K * N // 32
        layers = [random_layer(E, K, N, "cuda", 100 + i) for i in range(args.layers)]
        hs = adapt_handles(variant, [b12x_ops.prepare_experts(*lw, top_k=top_k, swiglu_limit=limit, backend="triton",
                                                              tune=False, gemv=True, max_tokens=max(args.sizes),
                                                              frozen=False) for lw in layers])
        ref = b12x_ops.prepare_experts(*layers[0], top_k=top_k, swiglu_limit=limit, backend="reference")
        g = hs[0]._state.plans.geometry
        emit(f"## {name}")
        emit("")
        emit("| M | kernel | tiles (bn, bk, warps, stages, split) | us | regs | note |")
        emit("|---|---|---|---|---|---|")
        for M in args.sizes:
            if time.perf_counter() > deadline:
                emit(f"(this geometry's {per_geo:.0f} s of the budget are spent)")
                break
            xs, idss, wss, outs = layer_batches(M, E, K, top_k, args.layers)
            distinct = sum(int(torch.unique(i_).numel()) for i_ in idss) / args.layers
            emit(f"| {M} | limit | | {distinct * expert_bytes / args.bw * 1e6:.1f} | | |")
            want = b12x_ops.moe_w4a8(xs[0], idss[0], wss[0], ref)
            base = P.default_config(M, g, gemv=True)
            st0 = hs[0]._state
            st0.plans.reserve(M, base)

            def timed(cfg, stages):
                st0.plans.reserve(M, cfg)  # (the split-K buffers of cfg)
                calls = [lambda h=h, x=x, ids=ids, w=w, o=o: _launch_all(h._state, cfg, x, ids, w, o, stages)
                         for h, x, ids, w, o in zip(hs, xs, idss, wss, outs)]
                return graph_time(calls, reps=10) * 1e6

            best = {}
            G1, G2 = sweep_tiles(g)
            for kind, cands in (("gemv1", G1), ("gemv2", G2)):
                stage = "gemm1" if kind == "gemv1" else "gemm2"
                if kind == "gemv2":  # its input: the best gemv1's activations
                    _launch_all(st0, best.get("gemv1", (None, base))[1], xs[0], idss[0], wss[0], outs[0], ("gemm1",))
                for tl5 in cands:
                    if time.perf_counter() > deadline:
                        break
                    f = ("bn1", "bk1", "warps1", "stages1", "split1") if kind == "gemv1" else \
                        ("bn2", "bk2", "warps2", "stages2", "split2")
                    cfg = dataclasses.replace(base, **dict(zip(f, tl5)))
                    try:
                        t = timed(cfg, (stage,))
                        ln = st0.plans.stages(cfg)[1 if kind == "gemv1" else 2]
                        regs = getattr(ln.compiled, "n_regs", "?")
                        note = ""
                    except Exception as exc:  # noqa: BLE001 - a tile the GPU cannot run
                        t, regs, note = float("inf"), "", f"{type(exc).__name__}: {str(exc)[:60]}"
                    if t < best.get(kind, (float("inf"),))[0]:
                        best[kind] = (t, cfg)
                    emit(f"| {M} | {kind} | {tl5} | {t:.1f} | {regs} | {note} |")
            if "gemv1" in best and "gemv2" in best:
                c1, c2 = best["gemv1"][1], best["gemv2"][1]
                pair = dataclasses.replace(c1, bn2=c2.bn2, bk2=c2.bk2, warps2=c2.warps2, stages2=c2.stages2,
                                           split2=c2.split2)
                for tag, cfg in (("default", base), ("best pair", pair)):
                    _launch_all(st0, cfg, xs[0], idss[0], wss[0], outs[0])
                    err = rel_l2(outs[0], want)
                    t = timed(cfg, ("gemm1", "gemm2"))
                    tiles = f"{cfg.tiles1()} / {cfg.tiles2()}"
                    emit(f"| {M} | **whole op, {tag}** | {tiles} | **{t:.1f}** | | rel err {err:.1e}"
                         f"{'' if err <= 1e-2 else ' WRONG'} |")
        del hs, ref, layers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
