"""GEMM2's reduction into ``out`` at large M: fp32 atomic adds into one accumulator row a token (the
default above 256 slots) against one fp32 row a slot that the finalize sums (the deterministic
form), on a CUDA GPU.

    python benchmarks/experiments/reduction.py gpt-oss-120b,qwen3-30b-a3b,dsv4.1-tp4 2048,8192

The slot buffer is sized so that no call runs in chunks. Per geometry and M, each form's whole op
(CUDA-graph replay over 3 layers, us per layer), GEMM2 and the finalize alone (same replay), and its
output's relative L2 distance from the atomic form's (they differ only in summation order).
"""

from __future__ import annotations

import dataclasses
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))

from b12x_ops.backends.triton import _launch_all  # noqa: E402
from b12x_ops.backends.triton import plan as P  # noqa: E402
from bench_moe import experiment_points, form_output_and_us, graph_time, rel_l2  # noqa: E402


def stage_us(handles, cfg, stage, xs, idss, wss, outs):
    """us per layer of ``stage`` alone in ``cfg``, replayed from one CUDA graph over every layer."""
    calls = [lambda h=h, x=x, i=i, w=w, o=o: _launch_all(h._state, cfg, x, i, w, o, stages=(stage,))
             for h, x, i, w, o in zip(handles, xs, idss, wss, outs)]
    return graph_time(calls, reps=10) * 1e6


def main():
    sizes = [int(m) for m in sys.argv[2].split(",")]
    P.SLOT_BUFFER_BYTES = 2 << 30  # (one fp32 row a slot for every size asked: no chunks)
    for name, hs, M, batch in experiment_points(sys.argv[1].split(","), sizes):
        gp = hs[0]._state.plans
        base = gp.with_gluon(P.default_config(M, gp.geometry))
        print(f"**{name} M={M}** ({base})", flush=True)
        ref = None
        for atomic in (True, False):
            cfg = dataclasses.replace(base, atomic=atomic)
            out, us = form_output_and_us(hs, cfg, *batch)
            ref = out if ref is None else ref
            g2 = stage_us(hs, cfg, "gemm2", *batch)
            fin = stage_us(hs, cfg, "finalize", *batch)
            label = "atomic adds into one fp32 row a token" if atomic else "one fp32 row a slot"
            print(f"  {label}: whole op {us:.1f} us/layer, gemm2 {g2:.1f}, finalize {fin:.1f}; "
                  f"rel L2 from the atomic form {rel_l2(out, ref):.1e}", flush=True)


if __name__ == "__main__":
    main()
