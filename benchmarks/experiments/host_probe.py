"""Where an eager call's host time goes on a GPU machine: per-call microseconds of the op and of
its pieces, each layer peeled off in turn (an experiment: ``benchmarks/NOTES.md`` says what it found).

    python benchmarks/experiments/host_probe.py [--sizes 1 64] [--calls 10] [--geometry qwen3-30b-a3b]

Per token count, on a layer of one of the benchmark's geometries (Qwen3-30B-A3B by default): host time
per call (``--calls`` calls between synchronizations, so the launch queue never fills; median of
20 such runs) of

* ``op``: ``b12x_ops.moe_w4a8_out`` as an engine calls it (dispatcher, checks, plan, launches);
* ``op, launches stubbed``: the same with every precompiled launch returning at once;
* ``backend run``: the backend's ``run`` alone (no dispatcher, no checks);
* ``launches alone``: the call's launches replayed with their argument lists made beforehand;
* ``launches, addresses given``: the same through triton's launcher with the call's own tensors
  too replaced by their addresses made per call (given a tensor, the launcher calls its
  ``data_ptr()`` and asks the driver about the pointer; given an int it takes it as is). The
  handle's own tensors (weights, scales, the scratch arena) are addresses made once in every
  column (``_operands``);
* ``launches, launcher object``: the recorded launches through triton's launcher object (its
  Python ``__call__``) instead of its C function (``plan._direct_launch``);
* ``empty custom op``: an op registered with ``Library.define`` + ``impl`` doing nothing, on the
  same CUDA tensors (the dispatcher's floor).

Written before the launch chains (``backends/triton/chain.py``): a compiled call now launches by its
chain's one C call, not through ``Launch.__call__``, so the probe records no launches ("0 launches"):
``op, launches stubbed`` times the op with its launches (a second ``op``), the three ``launches`` columns
an empty list. ``op``, ``backend run`` and ``empty custom op`` still time what they say
(``results/eager_dsv4_h100.md`` reads only ``op``).
"""

from __future__ import annotations

import argparse
import os
import sys
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import b12x_ops  # noqa: E402
from b12x_ops.backends import triton as TB  # noqa: E402
from b12x_ops.backends.triton import plan as P  # noqa: E402
from bench_moe import GEOMETRIES, host_time, random_layer, routing  # noqa: E402


def host_us(fn, calls, runs=20):
    """``bench_moe.host_time`` of ``fn`` in us, after 20 untimed calls."""
    for _ in range(20):
        fn()
    return host_time(fn, calls, runs) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="*", type=int, default=[1, 64])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--geometry", default="qwen3-30b-a3b", choices=sorted(GEOMETRIES))
    args = ap.parse_args()
    geo = GEOMETRIES[args.geometry]
    E, K, N, top_k = geo["E"], geo["K"], geo["N"], geo["top_k"]
    h = b12x_ops.prepare_experts(*random_layer(E, K, N, "cuda", 5), top_k=top_k, swiglu_limit=geo["limit"],
                                 backend="triton", tune=False,
                                 max_tokens=max(args.sizes))
    lib = torch.library.Library("b12x_probe", "DEF")
    lib.define("empty(Tensor x, Tensor ids, Tensor w, Tensor(a!) out) -> ()")
    lib.impl("empty", lambda x, ids, w, out: None, "CUDA")
    empty = torch.ops.b12x_probe.empty.default
    print(f"torch {torch.__version__}; us per call, host (median of 20 runs of {args.calls} calls)")
    print("| M | path | op | op, launches stubbed | backend run | launches alone | launches, addresses given | "
          "launches, launcher object | empty custom op |")
    print("|---|---|---|---|---|---|---|---|---|")
    for M in args.sizes:
        _, ids, w = routing(M, E, top_k, "cuda", M)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        st = h._state
        t_op = host_us(lambda: b12x_ops.moe_w4a8_out(x, ids, w, h, out), args.calls)
        t_run = host_us(lambda: TB.run(st, x, ids, w, out), args.calls)
        t_empty = host_us(lambda: empty(x, ids, w, out), args.calls)
        # the launches with their argument lists captured from one call
        recorded = []
        orig = P.Launch.__call__

        def record(self, grid, *a):
            recorded.append((self, grid, a))
            return orig(self, grid, *a)

        P.Launch.__call__ = record
        TB.run(st, x, ids, w, out)
        P.Launch.__call__ = orig
        t_launch = host_us(lambda: [ln(g, *a) for ln, g, a in recorded], args.calls)

        def via_object(ln, g, a):  # (through triton's launcher object)
            stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
            ln._run(g[0], g[1], g[2], stream, ln._function, ln._packed, None, None, None, *ln._full_args(a))

        def given(ln, g, a):
            via_object(ln, g, tuple([v.data_ptr() if type(v) is torch.Tensor else v for v in a]))

        t_given = host_us(lambda: [given(ln, g, a) for ln, g, a in recorded], args.calls)
        t_object = host_us(lambda: [via_object(ln, g, a) for ln, g, a in recorded], args.calls)
        P.Launch.__call__ = lambda self, grid, *a: None
        try:
            t_stub = host_us(lambda: b12x_ops.moe_w4a8_out(x, ids, w, h, out), args.calls)
        finally:
            P.Launch.__call__ = orig
        path = "GEMV" if st.plans.runner_for(M).cfg.gemv else "blocked"
        print(f"| {M} | {path}, {len(recorded)} launches | {t_op:.1f} | {t_stub:.1f} | {t_run:.1f} | {t_launch:.1f} | "
              f"{t_given:.1f} | {t_object:.1f} | {t_empty:.1f} |", flush=True)


if __name__ == "__main__":
    main()
