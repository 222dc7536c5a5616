"""Expert blocks of 256 rows against the default plan at large M, on a CUDA GPU (sm_90 for the Gluon
GEMM1).

    python benchmarks/experiments/large_blocks.py qwen3-30b-a3b,gpt-oss-120b 4096,8192

A GEMM1 program decodes its weight tile once for the block's rows, so a 256-row block halves the
decode a multiply-add against 128-row blocks. The 16-warp Gluon GEMM1 of 128-row blocks cannot hold
a 256-column accumulator (128 registers a thread at 512 threads), so 256-row blocks take the 8-warp
form (64 columns of up and of gate a program). GEMM2 keeps its 128-row tile by running each block
in two programs (``Config.split2``, ``kernels.gemm2_kernel``'s ``SUB``), or takes a 256-row tile.

Per geometry and M, each form's whole op (CUDA-graph replay over 3 layers, us per layer), GEMM1 and
GEMM2 alone (the same replay, one stage), and the output's relative L2 distance from the default
plan's.
"""

from __future__ import annotations

import dataclasses
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))

from b12x_ops.backends.triton import plan as P  # noqa: E402
from bench_moe import experiment_points, form_output_and_us, graph_time, rel_l2  # noqa: E402


def forms(M, gp):
    """(label, Config) pairs to time at ``M``: the default plan, 256-row plans, the default again.
    GEMM1 of 256-row blocks is the 8-warp Gluon form where the GPU takes it (else tl.dot 64x64)."""
    base = gp.with_gluon(P.default_config(M, gp.geometry))
    g1 = dict(bn1=64, bk1=64, warps1=8, stages1=4, gluon=gp.gluon)
    if not gp.gluon:
        g1.update(warps1=4, stages1=2)
    big = dataclasses.replace(base, bm=256, gluon2=False, **g1)
    out = [("default", base)]
    for label, c in (
            ("GEMM2 128-row halves (128,128,4,3)", dict(bn2=128, bk2=128, warps2=4, stages2=3, split2=2)),
            ("GEMM2 128-row halves (128,64,4,2)", dict(bn2=128, bk2=64, warps2=4, stages2=2, split2=2)),
            ("GEMM2 256-row tile (64,64,4,2)", dict(bn2=64, bk2=64, warps2=4, stages2=2, split2=1)),
            ("GEMM2 256-row tile (128,128,8,3)", dict(bn2=128, bk2=128, warps2=8, stages2=3, split2=1))):
        out.append((f"256-row blocks, {label}", dataclasses.replace(big, **c)))
    if gp.gluon:  # (GEMM1 in 6 stages: 216 KB of shared memory)
        out.append(("256-row blocks, GEMM1 6 stages, GEMM2 halves (128,128,4,3)",
                    dataclasses.replace(big, stages1=6, bn2=128, bk2=128, warps2=4, stages2=3, split2=2)))
    return out + [("default again", base)]


def stage_us(hs, cfg, batch, stage):
    """One stage of ``cfg`` alone, replayed over every layer's handle (us per layer)."""
    from b12x_ops.backends.triton import _launch

    xs, idss, wss, outs = batch
    rn = hs[0]._state.plans.runner(cfg)
    calls = [lambda h=h, x=x, i=i, w=w, o=o: _launch(h._state, rn, x, i, w, o, (stage,))
             for h, x, i, w, o in zip(hs, xs, idss, wss, outs)]
    return graph_time(calls, reps=10) * 1e6


def main():
    sizes = [int(m) for m in sys.argv[2].split(",")]
    for name, hs, M, batch in experiment_points(sys.argv[1].split(","), sizes):
        gp = hs[0]._state.plans
        print(f"{name} M={M}", flush=True)
        want = None
        for label, cfg in forms(M, gp):
            try:
                got, t = form_output_and_us(hs, cfg, *batch)
                want = got if want is None else want
                t1, t2 = (stage_us(hs, cfg, batch, s) for s in ("gemm1", "gemm2"))
                nmax = gp.runner(cfg).blocks(M * gp.geometry.top_k)
                nb = int(gp.arena.buffers["blk_rows"][:nmax].gt(0).sum())
                print(f"  {label} (bm {cfg.bm}, {nb} blocks): {t:.1f} us/layer (gemm1 {t1:.1f}, gemm2 {t2:.1f}); "
                      f"rel L2 from the default {rel_l2(got, want):.1e}", flush=True)
            except Exception as ex:  # (a form that fails to compile or launch: say so, go on)
                print(f"  {label}: FAILED {type(ex).__name__}: {str(ex)[-300:]}", flush=True)


if __name__ == "__main__":
    main()
