"""The op's launches at gpt-oss M = 16 and 64 (or ``--sizes``, ``--geometry``), once each between
profiler start and stop, for Nsight Compute:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section SchedulerStats --section LaunchStats \
        python benchmarks/profile_blocked.py [--sizes 16 64] [--geometry qwen3-30b-a3b]

(one layer, random codes, tuning off; ncu flushes the caches before each pass, so the weights come
from HBM). ``results/ncu_blocked.txt`` is its output on the H200.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import b12x_ops  # noqa: E402
from bench_moe import GEOMETRIES, layer_batches, random_layer  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="*", type=int, default=[16, 64])
    ap.add_argument("--geometry", default="gpt-oss-120b", choices=list(GEOMETRIES))
    args = ap.parse_args(argv)
    sizes = args.sizes
    geo = GEOMETRIES[args.geometry]
    E, K, N, top_k = geo["E"], geo["K"], geo["N"], geo["top_k"]
    h = b12x_ops.prepare_experts(*random_layer(E, K, N, "cuda", 100), top_k=top_k, swiglu_limit=geo["limit"],
                                 backend="triton", tune=False, max_tokens=max(sizes), frozen=False)
    for M in sizes:
        xs, idss, wss, outs = layer_batches(M, E, K, top_k, 1)
        b12x_ops.moe_w4a8_out(xs[0], idss[0], wss[0], h, outs[0])  # (warm)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        b12x_ops.moe_w4a8_out(xs[0], idss[0], wss[0], h, outs[0])
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
