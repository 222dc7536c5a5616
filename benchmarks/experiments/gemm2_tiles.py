"""GEMM2 in tl.dot tiles against the default plan's GEMM2 (the Gluon form where the plan takes it):
the whole op at the default plan's block size, on a CUDA GPU.

    python benchmarks/experiments/gemm2_tiles.py qwen3-30b-a3b,dsv4.1-tp4 512,2048 128,128,4,3 64,128,4,3

Per geometry and M: the default plan (``plan.default_config`` in its Gluon forms), then the same
plan with GEMM2 in each tl.dot tile given (``BN,BK,WARPS,STAGES``; GEMM1 left as the plan has it),
then the default again (for the run-to-run spread): the whole op's us per layer (CUDA-graph replay
over 3 layers) and each form's output's relative L2 distance from the default's (the same sums in
another order where the tiles differ).
"""

from __future__ import annotations

import dataclasses
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))

from b12x_ops.backends.triton import plan as P  # noqa: E402
from bench_moe import experiment_points, form_output_and_us, rel_l2  # noqa: E402


def forms(M, gp, tiles):
    """(label, Config) pairs to time at ``M``: the default plan, its GEMM2 in each tl.dot tile of
    ``tiles``, the default again."""
    base = gp.with_gluon(P.default_config(M, gp.geometry))
    out = [("default", base)]
    for bn, bk, warps, stages in tiles:
        c = dataclasses.replace(base, gluon2=False, bn2=bn, bk2=bk, warps2=warps, stages2=stages)
        out.append((f"tl.dot GEMM2 {(bn, bk, warps, stages)}", c))
    return out + [("default again", base)]


def main():
    sizes = [int(m) for m in sys.argv[2].split(",")]
    tiles = [tuple(int(v) for v in t.split(",")) for t in sys.argv[3:]]
    for name, hs, M, batch in experiment_points(sys.argv[1].split(","), sizes):
        gp = hs[0]._state.plans
        want = None
        for label, cfg in forms(M, gp, tiles):
            head = (f"{name} M={M} bm={cfg.bm} gemm1 {'Gluon' if cfg.gluon else 'tl.dot'} {cfg.tiles1()[:4]}, "
                    f"gemm2 {'Gluon' if cfg.gluon2 else 'tl.dot'} {cfg.tiles2()[:4]} ({label})")
            try:
                got, t = form_output_and_us(hs, cfg, *batch)
                want = got if want is None else want
                print(f"{head}: {t:.1f} us/layer; rel L2 from the default {rel_l2(got, want):.1e}", flush=True)
            except Exception as ex:  # (a form that fails to compile or launch: say so, go on)
                print(f"{head}: FAILED {type(ex).__name__}: {str(ex)[-300:]}", flush=True)


if __name__ == "__main__":
    main()
