"""The prologue's quantizing programs in other shapes (``plan.PROLOGUE``: QR rows of QK-column
pieces a program, its warps), at the default plan, on a CUDA GPU.

    python benchmarks/experiments/prologue_shapes.py qwen3-30b-a3b,dsv4.1-tp4 2048,8192 4,512,8 8,512,8 4,1024,8

Per geometry and M, for each ``QR,QK,WARPS`` given (the package's own first, whatever the list
says, and again last for the run-to-run spread): the prologue alone and the whole op (CUDA-graph
replay over 3 layers, us per layer), and the output's relative L2 distance from the first form's
(x's quantization is the same whatever the shape; the sums differ by the atomics' order only).
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))

from b12x_ops.backends.triton import _launch_all  # noqa: E402
from b12x_ops.backends.triton import plan as P  # noqa: E402
from bench_moe import experiment_points, form_output_and_us, graph_time, rel_l2  # noqa: E402


def set_shape(gp, qr, qk, warps):
    """Make the prologue launches of ``gp`` with ``QR = qr``, ``QK = qk`` and ``warps`` from now on
    (the cached ones are dropped: their key does not hold these)."""
    P.PROLOGUE.update(QR=qr, QK=qk, warps=warps)
    for key in [k for k in gp.launches if k[0] == "prologue"]:
        del gp.launches[key]


def main():
    sizes = [int(m) for m in sys.argv[2].split(",")]
    own = (P.PROLOGUE["QR"], P.PROLOGUE["QK"], P.PROLOGUE["warps"])
    shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[3:]]
    shapes = [own] + [s for s in shapes if s != own] + [own]
    for name, hs, M, batch in experiment_points(sys.argv[1].split(","), sizes):
        gp = hs[0]._state.plans
        cfg = gp.with_gluon(P.default_config(M, gp.geometry))
        want = None
        for qr, qk, warps in shapes:
            set_shape(gp, qr, qk, warps)
            try:
                got, t = form_output_and_us(hs, cfg, *batch)
                want = got if want is None else want
                xs, idss, wss, outs = batch
                calls = [lambda h=h, x=x, ids=ids, w=w, o=o: _launch_all(h._state, cfg, x, ids, w, o, stages=("prologue",))
                         for h, x, ids, w, o in zip(hs, xs, idss, wss, outs)]
                tp = graph_time(calls, reps=10) * 1e6
                print(f"{name} M={M} bm={cfg.bm} prologue QR={qr} QK={qk} warps={warps}: prologue {tp:.1f} us/layer, "
                      f"whole op {t:.1f}; rel L2 from the first {rel_l2(got, want):.1e}", flush=True)
            except Exception as ex:  # (a shape that fails to compile or launch: say so, go on)
                print(f"{name} M={M} prologue QR={qr} QK={qk} warps={warps}: FAILED {type(ex).__name__}: "
                      f"{str(ex)[-300:]}", flush=True)
        set_shape(gp, *own)


if __name__ == "__main__":
    main()
