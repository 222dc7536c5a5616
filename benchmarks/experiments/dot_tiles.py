"""Experiment: which ``tl.dot`` tiles the inline-PTX decode computes right, on a CUDA GPU.

The ``tl.dot`` kernels (the blocked GEMMs and the GEMV's gemv1/gemv2) decode a weight tile of ``BN``
rows in ``mxtl.decode_repacked``; with the inline-PTX decode (``GeometryPlans.ptx``, on by default
on a GPU) the asm takes a thread's registers four at a time and reads them as the four bytes of one
code word, which holds only for some register layouts. A sweep on an H100 found GEMM1 of 32 columns
in 4 warps (32 weight rows a ``tl.dot``) wrong by a relative L2 of 1.4 (``results/dot_tiles.md``).
This runs each GEMM kernel over a grid of (BN, BK, warps), the other kernels at the default plan's
tiles, on a small geometry, and prints each output's relative L2 against the CPU reference; with
``--no-guard`` the plan's tile check (``GeometryPlans._check_dot``) is bypassed, so the tiles it
refuses are run too:

    python benchmarks/experiments/dot_tiles.py [--no-guard]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

# (stage, path, field names of its tile, the grid)
GRID = (
    ("gemm1", "blocked", ("bn1", "bk1", "warps1"), (32, 64, 128, 256), (64, 128), (2, 4, 8)),
    ("gemm2", "blocked", ("bn2", "bk2", "warps2"), (32, 64, 128, 256), (64, 128), (2, 4, 8)),
    ("gemv1", "gemv", ("bn1", None, "warps1"), (32, 64, 128, 256), (None,), (2, 4, 8)),
    ("gemv2", "gemv", ("bn2", None, "warps2"), (32, 64, 128, 256), (None,), (2, 4, 8)),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-guard", action="store_true", help="run the tiles the plan's check refuses too")
    args = ap.parse_args()

    import torch

    import b12x_ops
    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P
    from bench_moe import rel_l2

    if args.no_guard:
        P.GeometryPlans._check_dot = lambda self, cfg, kind: None
    E, K, N, top_k = 8, 512, 256, 4
    torch.manual_seed(0)
    w13, s13 = b12x_ops.quantize_mxfp4(torch.randn(E, 2 * N, K) * 0.05)
    w2, s2 = b12x_ops.quantize_mxfp4(torch.randn(E, K, N) * 0.05)
    ref = b12x_ops.prepare_experts(w13, s13, w2, s2, top_k=top_k, backend="reference")
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: a dry run under TRITON_INTERPRET=1)
    h = b12x_ops.prepare_experts(w13.to(dev), s13.to(dev), w2.to(dev), s2.to(dev), top_k=top_k, backend="triton",
                                 tune=False, max_tokens=64, frozen=False)
    st = h._state
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    print(f"device {name}, PTX decode {st.plans.ptx}, E={E} K={K} N={N} top_k={top_k}")
    print("| stage | BN | BK | warps | BN / warps | rel L2 |")
    print("|---|---|---|---|---|---|")
    for stage, path, (f_bn, f_bk, f_w), bns, bks, warps in GRID:
        m = 32 if path == "blocked" else 2
        x = torch.randn(m, K, dtype=torch.bfloat16)
        ids = torch.randint(0, E, (m, top_k), dtype=torch.int32)
        w = torch.rand(m, top_k)
        want = b12x_ops.moe_w4a8(x, ids, w, ref)
        x, ids, w = x.to(dev), ids.to(dev), w.to(dev)
        base = P.default_config(m, st.plans.geometry, gemv=path == "gemv")
        if path == "blocked":
            base = dataclasses.replace(base, bm=16, gluon=False, gluon2=False)
        for bn in bns:
            for bk in bks:
                for nw in warps:
                    change = {f_bn: bn, f_w: nw}
                    if f_bk:
                        change[f_bk] = bk
                    cfg = dataclasses.replace(base, **change)
                    out = torch.full_like(x, float("nan"))
                    try:
                        st.plans.reserve(m, cfg)
                        _launch_all(st, cfg, x, ids, w, out)
                        res = f"{rel_l2(out.cpu(), want):.1e}"
                    except Exception as ex:  # (a tile the plan refuses, or one that fails to compile)
                        res = f"{type(ex).__name__}: {str(ex)[:90]}"
                    shown = bk if f_bk else (cfg.bk1 if stage == "gemv1" else cfg.bk2)
                    print(f"| {stage} | {bn} | {shown} | {nw} | {bn / nw:g} | {res} |", flush=True)


if __name__ == "__main__":
    main()
