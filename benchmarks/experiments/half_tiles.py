"""Tiles for part-empty blocks (``plan.half_tiles``, ``plan.quarter_tiles``): the whole op with the
default plan at mid-to-large M with the full tile always, with half tiles, and with half and quarter
tiles, on a CUDA GPU.

    python benchmarks/experiments/half_tiles.py gpt-oss-120b,qwen3-30b-a3b,dsv4.1-tp4 512,2048,8192 [rounds]

Per geometry and M: the default plan's blocks of at most half and at most a quarter of their rows (of
the blocks that hold any), and the whole op (CUDA-graph replay over 3 layers, us per layer) in each
form: ``B12X_OPS_TRITON_HALF=0``; ``HALF=1 QUARTER=0``; ``HALF=1 QUARTER=1``, in ``rounds`` alternating
rounds (default 2), the median of each; and each form's output's relative L2 distance from the full
tile's (summation order only, through GEMM2's atomics).
"""

from __future__ import annotations

import os
import statistics
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))

from b12x_ops.backends.triton import kernels as K_  # noqa: E402
from b12x_ops.backends.triton import plan as P  # noqa: E402
from bench_moe import GEOMETRIES, experiment_points, form_output_and_us, rel_l2  # noqa: E402

FORMS = (("full", "0", "0"), ("half", "1", "0"), ("quarter", "1", "1"))


def main():
    sizes = [int(m) for m in sys.argv[2].split(",")]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    for name, hs, M, batch in experiment_points(sys.argv[1].split(","), sizes):
        geo, gp = GEOMETRIES[name], hs[0]._state.plans
        cfg = gp.with_gluon(P.default_config(M, gp.geometry))
        us = {f[0]: [] for f in FORMS}
        outs = {}
        for _ in range(rounds):
            for form, half, quarter in FORMS:
                os.environ["B12X_OPS_TRITON_HALF"] = half
                os.environ["B12X_OPS_TRITON_QUARTER"] = quarter
                out, t = form_output_and_us(hs, cfg, *batch)
                outs.setdefault(form, out)
                us[form].append(t)
        rows = gp.arena.buffers["blk_rows"][:K_.num_blocks(M * geo["top_k"], geo["E"], cfg.bm)]
        held = int((rows > 0).sum())
        half = int(((rows > 0) & (rows <= cfg.bm // 2)).sum())
        quarter = int(((rows > 0) & (rows <= cfg.bm // 4)).sum())
        med = {f: statistics.median(v) for f, v in us.items()}
        print(f"{name} M={M} bm={cfg.bm} gluon={cfg.gluon}/{cfg.gluon2}: of {held} blocks {half} at most half full, "
              f"{quarter} at most a quarter; us/layer full {med['full']:.1f}, half {med['half']:.1f}, quarter "
              f"{med['quarter']:.1f} (quarter vs half {100 * (med['quarter'] / med['half'] - 1):+.1f} %; rounds "
              + "; ".join(f"{f} " + "/".join(f"{t:.1f}" for t in v) for f, v in us.items())
              + f"); rel L2 from full: half {rel_l2(outs['half'], outs['full']):.1e}, quarter "
              f"{rel_l2(outs['quarter'], outs['full']):.1e}", flush=True)


if __name__ == "__main__":
    main()
