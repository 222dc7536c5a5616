"""The blocked path's eager calls by their chain against triton's launcher, on one handle a geometry.

Per geometry and token count, in alternating rounds with chains on and off (``chain.ENABLED``, which the
fast path obeys; the kernels and the graph replay are the same): the eager overhead of a loop of
calls and of a call from an idle GPU (``bench_moe.eager_and_graph``, both against graph replay of the
same call), and the host's time to issue a call (``bench_moe.host_time``). First, the output of a
chained call against a launched one (atomic adds: equal to rounding) and a check that the call went by
the chain (the handle's fast path holds it, with the count's sizes).

    PYTHONPATH=. python benchmarks/experiments/blocked_chain.py --geometries qwen3-30b-a3b gpt-oss-120b --sizes 16 2048
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import b12x_ops  # noqa: E402
from bench_moe import (GEOMETRIES, eager_and_graph, experiment_handles, host_time, layer_batches,  # noqa: E402
                       markdown_log, rel_l2)


def measure(call, rounds):
    """``(graph, loop overhead, idle overhead, host/call)`` us: medians of ``rounds`` rounds."""
    eager, graph, over, _, _, idle = eager_and_graph(call, reps=10, rounds=rounds, loop=30)
    return graph * 1e6, over * 1e6, idle * 1e6, host_time(call) * 1e6


def main(argv=None):
    from b12x_ops.backends.triton import _blocked_sizes
    from b12x_ops.backends.triton import chain

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometries", nargs="*", default=list(GEOMETRIES))
    ap.add_argument("--sizes", nargs="*", type=int, default=[16, 2048])
    ap.add_argument("--rounds", type=int, default=3, help="rounds a mode, alternating")
    ap.add_argument("--out", default="blocked_chain.md")
    a = ap.parse_args(argv)
    emit = markdown_log(a.out, f"# Blocked-path eager calls: chain against launcher ({torch.cuda.get_device_name()})")
    emit("")
    emit("us a call; overheads above graph replay of the same call (loop: a synchronized loop of 30 calls; "
         "idle: a call from an idle GPU, the replay queued behind it); medians of the rounds.")
    emit("")
    emit("| geometry | M | graph | chain: loop | chain: from idle | chain: host/call | launcher: loop | "
         "launcher: from idle | launcher: host/call | chained vs launched rel L2 |")
    emit("|---|---|---|---|---|---|---|---|---|---|")
    for name in a.geometries:
        (h,) = experiment_handles(name, max(a.sizes), layers=1)
        st = h._state
        for M in a.sizes:
            (x,), (ids,), (w,), (o,) = layer_batches(M, GEOMETRIES[name]["E"], GEOMETRIES[name]["K"],
                                                    GEOMETRIES[name]["top_k"], 1)
            rn = st.plans.runner_for(M, lambda: False)
            if rn.cfg.gemv:
                emit(f"| {name} | {M} | (the GEMV path) |  |  |  |  |  |  |  |")
                continue
            chain.ENABLED = True
            st.fast.pop(M, None)
            on = b12x_ops.moe_w4a8(x, ids, w, h)
            blob = st.chains[id(rn)][2]  # (built at prepare; the call went by it, kept in the fast path up to its bound)
            sizes = _blocked_sizes(rn, M, GEOMETRIES[name]["top_k"])
            assert blob is not None and st.fast.get(M, (blob, sizes)) == (blob, sizes), (name, M)
            chain.ENABLED = False
            off = b12x_ops.moe_w4a8(x, ids, w, h)
            err = rel_l2(on, off)
            assert err <= 1e-3, (name, M, err)

            def call():
                b12x_ops.moe_w4a8_out(x, ids, w, h, o)

            res = {True: [], False: []}
            for _ in range(a.rounds):
                for mode in (True, False):
                    chain.ENABLED = mode
                    res[mode].append(measure(call, 1))
            chain.ENABLED = True
            med = {k: [sorted(r[i] for r in v)[len(v) // 2] for i in range(4)] for k, v in res.items()}
            g = sorted(r[0] for v in res.values() for r in v)[a.rounds]
            emit(f"| {name} | {M} | {g:.1f} | " + " | ".join(f"{v:.1f}" for v in med[True][1:]) + " | "
                 + " | ".join(f"{v:.1f}" for v in med[False][1:]) + f" | {err:.1e} |")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
