"""Is an eager call paced by the host or by the GPU? One layer, per call:

- graph: CUDA-graph replay of one call (the kernels' time, back to back);
- eager: the wall time a call of a synchronized loop of calls (what the benchmark's eager column is);
- host: the host's time to issue a call (10 calls, then a synchronization);
- queued: the GPU's time a call when the calls wait in the stream's queue: a long sleep kernel first,
  then the loop's calls issued behind it, timed by events from the sleep's end to the last call's
  end. The host never starves the GPU there, so ``queued - graph`` is what launching the kernels
  one by one (outside a graph) costs the GPU itself, and ``eager - queued`` is the host's share.

    PYTHONPATH=. python benchmarks/experiments/eager_gpu.py --geometries qwen3-30b-a3b dsv4.1-tp4 --sizes 1 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "tests"))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))

import b12x_ops  # noqa: E402
from _samples import make_batch, make_layer  # noqa: E402
from bench_moe import host_time  # noqa: E402

GEOMETRIES = {
    "gpt-oss-120b": dict(E=128, K=2880, N=2880, top_k=4, limit=7.0),
    "dsv4.1-tp4": dict(E=384, K=5120, N=576, top_k=6, limit=10.0, layout="w31"),
    "qwen3-30b-a3b": dict(E=128, K=2048, N=768, top_k=8),
}


def per_call(fn, loop, rounds=7):
    """Median over ``rounds`` of the wall seconds a call of ``loop`` synchronized calls."""
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(loop):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / loop)
    return statistics.median(out)


def queued(fn, loop, rounds=7):
    """Median over ``rounds`` of the GPU seconds a call with ``loop`` calls queued behind a sleep."""
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # (tens of ms: longer than issuing the loop)
        a.record()
        for _ in range(loop):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / loop)
    return statistics.median(out)


def path(h, M) -> str:
    """What an eager call of ``M`` tokens takes on handle ``h`` (the triton backend)."""
    st = h._state
    if st.fast.get(M) is not None:
        return "chain (fast path)"
    rn = st.plans.runner_for(M, lambda: False)
    if rn.cfg.fused:
        return "one launch (triton's launcher)"
    return "chain" if (st.chains.get(id(rn)) or (None, 0, None))[2] else "triton's launcher"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometries", nargs="*", default=list(GEOMETRIES))
    ap.add_argument("--sizes", nargs="*", type=int, default=[1, 2, 4])
    ap.add_argument("--loop", type=int, default=50)
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; us a call, one layer")
    print("| geometry | M | eager path | graph | eager | host | queued | queued - graph | eager - queued |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.geometries:
        layer = make_layer(seed=1, device="cuda", **GEOMETRIES[name])
        h = layer.prepare(backend="triton", tune=False, max_tokens=max(args.sizes))
        for M in args.sizes:
            x, ids, w = make_batch(layer, M, seed=M, device="cuda", foreign=False)
            out = torch.empty_like(x)

            def call():
                b12x_ops.moe_w4a8_out(x, ids, w, h, out)

            for _ in range(10):
                call()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                call()
            g.replay()
            graph = queued(g.replay, args.loop)
            eager = per_call(call, args.loop)
            host = host_time(call, 10, 7)
            q = queued(call, args.loop)
            print(f"| {name} | {M} | {path(h, M)} | {graph * 1e6:.1f} | {eager * 1e6:.1f} | {host * 1e6:.1f} | {q * 1e6:.1f} | "
                  f"{(q - graph) * 1e6:.1f} | {(eager - q) * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
