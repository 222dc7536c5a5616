"""Large-M experiments on the blocked GEMM1: the package's kernel against ``joined_gemm1`` (one dot
over up and gate rows, so 256 W13 rows fit a 16-warp program at 128 registers).

    python benchmarks/experiments/large_m.py [--geometries ...] [--sizes 2048 8192]   # a CUDA GPU
    TRITON_INTERPRET=1 python benchmarks/experiments/large_m.py --check                # the CPU

On a GPU: the whole op (CUDA-graph replay over 3 layers, us per layer) at each size with the
default config, the default with GEMM1 at 128 rows and 8 warps, and the joined GEMM1 at several
tiles; each output is compared with the default's. ``--check`` runs the joined kernel under the
interpreter against the reference backend on small odd layers (both W13 layouts, N not a
multiple of the tile).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(_HERE)), "tests"))

import b12x_ops  # noqa: E402
from b12x_ops.backends.triton import plan as P  # noqa: E402
from experiments.joined_gemm1 import gemm1_joined_kernel  # noqa: E402


def use_joined(gp, cfg):
    """Make ``cfg``'s GEMM1 launch the joined kernel (the same compile-time parameters, those it
    declares: it has no half tiles and no programmatic dependent launch)."""
    ln = gp.launch("gemm1", cfg)
    key = next(k for k, v in gp.launches.items() if v is ln)
    constexprs = {k: v for k, v in ln.constexprs.items() if k in gemm1_joined_kernel.arg_names}
    gp.launches[key] = P.Launch(gemm1_joined_kernel, constexprs, ln.num_warps, ln.num_stages)
    return key


def check():
    from _samples import make_batch, make_layer, rel_l2

    for E, K, N, top_k, M, layout, limit, bm, bn in [(4, 128, 96, 2, 12, "w13", 7.0, 16, 32),
                                                     (3, 192, 160, 2, 9, "w31", None, 16, 64),
                                                     (4, 64, 96, 3, 7, "w13", 5.0, 32, 32),
                                                     (3, 96, 96, 3, 7, "w31", None, 16, 64)]:
        layer = make_layer(E, K, N, top_k, layout=layout, limit=limit)
        x, ids, w = make_batch(layer, M)
        h = layer.prepare(backend="triton", max_tokens=16, gemv=False, tune=False)
        gp = h._state.plans
        cap, cfg = gp.plan_for(M)
        cfg = dataclasses.replace(cfg, bm=bm, bn1=bn, bk1=64)
        gp.reserve(cap, cfg)
        use_joined(gp, cfg)
        gp.add(cap, cfg)
        err = rel_l2(b12x_ops.moe_w4a8(x, ids, w, h), b12x_ops.moe_w4a8(x, ids, w, layer.prepare()))
        print(f"E={E} K={K} N={N} top-{top_k} M={M} {layout} limit={limit} bm={bm} bn={bn}: rel err {err:.1e}")
        assert err < 1e-3


def bench(args):
    from bench_moe import experiment_points, form_output_and_us, rel_l2

    for name, hs, M, batch in experiment_points(args.geometries, args.sizes):
        gp = hs[0]._state.plans
        base = P.default_config(M, gp.geometry, gemv=False)
        variants = [("default", base, False),
                    ("g1 (128,128,8,3)", dataclasses.replace(base, bm=128, bn1=128, warps1=8, stages1=3), False)]
        for bm in ((base.bm, 128) if base.bm != 128 else (128,)):
            for bn, w, st in ((128, 16, 3), (128, 16, 2), (64, 8, 3), (64, 16, 3)):
                variants.append((f"joined ({bn},128,{w},{st})",
                                 dataclasses.replace(base, bm=bm, bn1=bn, bk1=128, warps1=w, stages1=st), True))
        first = None
        for label, cfg, joined in variants:
            key = use_joined(gp, cfg) if joined else None
            try:
                o, t = form_output_and_us(hs, cfg, *batch)
                first = o if first is None else first
                print(f"{name} M={M} bm={cfg.bm} {label}: {t:.1f} us, diff from default {rel_l2(o, first):.1e}",
                      flush=True)
            except Exception as exc:  # noqa: BLE001 - a tile the GPU cannot run
                print(f"{name} M={M} bm={cfg.bm} {label}: failed: {type(exc).__name__}: {str(exc)[:100]}")
            if key is not None:
                gp.launches.pop(key, None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometries", nargs="*", default=["gpt-oss-120b", "qwen3-30b-a3b", "dsv4.1-tp4"])
    ap.add_argument("--sizes", nargs="*", type=int, default=[2048, 8192])
    ap.add_argument("--check", action="store_true", help="the joined kernel against the reference (interpreter)")
    args = ap.parse_args(argv)
    check() if args.check else bench(args)


if __name__ == "__main__":
    main()
