"""Half tiles for half-empty blocks (``plan.half_tiles``) on and off: the whole op with the default
plan at mid-to-large M, on a CUDA GPU.

    python benchmarks/experiments/half_tiles.py gpt-oss-120b,qwen3-30b-a3b,dsv4.1-tp4 512,2048,8192

Per geometry and M: the default plan's blocks of at most half their rows (of the blocks that hold
any), the whole op with ``B12X_OPS_TRITON_HALF=0`` and ``=1`` (CUDA-graph replay over 3 layers, us
per layer; the off form again last, for the run-to-run spread), and the on form's output's relative
L2 distance from the off form's.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))

from b12x_ops.backends.triton import kernels as K_  # noqa: E402
from b12x_ops.backends.triton import plan as P  # noqa: E402
from bench_moe import GEOMETRIES, experiment_points, form_output_and_us, rel_l2  # noqa: E402


def main():
    sizes = [int(m) for m in sys.argv[2].split(",")]
    for name, hs, M, batch in experiment_points(sys.argv[1].split(","), sizes):
        geo, gp = GEOMETRIES[name], hs[0]._state.plans
        cfg = gp.with_gluon(P.default_config(M, gp.geometry))
        res = []
        for half in ("0", "1", "0"):
            os.environ["B12X_OPS_TRITON_HALF"] = half
            res.append(form_output_and_us(hs, cfg, *batch))
        rows = gp.arena.buffers["blk_rows"][:K_.num_blocks(M * geo["top_k"], geo["E"], cfg.bm)]
        held = int((rows > 0).sum())
        small = int(((rows > 0) & (rows <= cfg.bm // 2)).sum())
        print(f"{name} M={M} bm={cfg.bm} gluon={cfg.gluon}/{cfg.gluon2}: {small} of {held} blocks at most half "
              f"full; half tiles off {res[0][1]:.1f} us/layer, on {res[1][1]:.1f}, off again {res[2][1]:.1f}; "
              f"rel L2 on from off {rel_l2(res[1][0], res[0][0]):.1e}", flush=True)


if __name__ == "__main__":
    main()
