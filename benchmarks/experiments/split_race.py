"""How often the GEMV kernels with split parts give other bits run to run, and in which kernel.

For each geometry, split pair and token count (the cases of the GPU test
``test_gpu_gemv_split_matches_reference_and_is_deterministic``), the first call's output is kept,
then ``--reps`` calls run gemv1 (x quantized first where the plan does) and gemv2 as separate
launches: each call's ``act`` rows (gemv1's output, the routed slots') and ``out`` are compared with
the first call's, and a run of gemv2 alone on the first call's ``act`` too. Prints the counts of
calls that differed per case.

    PYTHONPATH=. python benchmarks/experiments/split_race.py --reps 200 [--geometries dsv4-tp4]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))

from _samples import make_batch, make_layer  # noqa: E402
from test_triton_gpu import GEOMETRIES  # noqa: E402  (the GPU test's geometries, whose cases this repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--splits", nargs="*", default=None,
                    help="split1,split2 pairs (default: 2,2 3,3 5,2*top_k as the GPU test)")
    ap.add_argument("--device", default="cuda", help="cpu: under TRITON_INTERPRET=1 (a check of the script)")
    ap.add_argument("--geometries", nargs="*", default=["dsv4-tp4", "gpt-oss-120b", "odd-ep"])
    args = ap.parse_args()
    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P

    for name in args.geometries:
        layer = make_layer(seed=sum(map(ord, name)), device=args.device, **GEOMETRIES[name])
        h = layer.prepare(backend="triton", tune=False, gemv=True, max_tokens=4, deterministic=True)
        st = h._state
        g = st.plans.geometry
        pairs = [tuple(map(int, p.split(","))) for p in args.splits] if args.splits else [(2, 2), (3, 3), (5, 2 * g.top_k)]
        for split1, split2 in pairs:
            for i, M in enumerate((1, 3, 4)):
                cfg = dataclasses.replace(P.default_config(M, g, gemv=True), split1=split1, split2=split2)
                st.plans.reserve(M, cfg)
                x, ids, w = make_batch(layer, M, seed=40 + i, device=args.device, padding_rows=min(1, M // 3))
                out = torch.full_like(x, float("nan"))
                _launch_all(st, cfg, x, ids, w, out)
                ours = ((ids >= layer.offset) & (ids < layer.offset + layer.E)).flatten()
                act = st.plans.arena.buffers["act"]
                a0 = act[: M * g.top_k * g.intermediate_size].view(M * g.top_k, -1)[ours].clone()
                o0 = out.clone()
                bad_all = bad_act = bad_out = bad_g2 = 0
                for _ in range(args.reps):
                    _launch_all(st, cfg, x, ids, w, out)
                    bad_all += int(not torch.equal(out, o0))
                    _launch_all(st, cfg, x, ids, w, out, stages=("prologue", "gemm1"))
                    a = act[: M * g.top_k * g.intermediate_size].view(M * g.top_k, -1)[ours]
                    bad_act += int(not torch.equal(a, a0))
                    _launch_all(st, cfg, x, ids, w, out, stages=("gemm2",))
                    bad_out += int(not torch.equal(out, o0))
                    act[: M * g.top_k * g.intermediate_size].view(M * g.top_k, -1)[ours] = a0  # gemv2 alone on the first act
                    _launch_all(st, cfg, x, ids, w, out, stages=("gemm2",))
                    bad_g2 += int(not torch.equal(out, o0))
                print(f"{name} split1={split1} split2={split2} M={M} mma={cfg.mma} xq={cfg.xq} bn1={cfg.bn1} "
                      f"bk1={cfg.bk1} bn2={cfg.bn2} bk2={cfg.bk2}: differing calls of {args.reps}: whole {bad_all}, "
                      f"act {bad_act}, out after stages {bad_out}, gemv2 on the first act {bad_g2}", flush=True)


if __name__ == "__main__":
    main()
