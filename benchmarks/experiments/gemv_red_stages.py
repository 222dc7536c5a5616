"""Experiment (reverted with ``Config.red1``): the mma.sync GEMV at one token, its stages timed apart,
the split-K handshake (``ord``) against gemv1 by atomics with SwiGLU in gemv2 (``red``); us per layer,
CUDA-graph replay over 4 layers, two rounds:

    python benchmarks/experiments/gemv_red_stages.py
"""

import dataclasses
import os
import sys
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import torch  # noqa: E402
from b12x_ops.backends.triton import _launch_all  # noqa: E402
from b12x_ops.backends.triton import plan as P  # noqa: E402
from bench_moe import GEOMETRIES, experiment_handles, graph_time, layer_batches  # noqa: E402
for name, q2 in (("gpt-oss-120b", 4), ("qwen3-30b-a3b", 6), ("dsv4.1-tp4", 6)):
    geo = GEOMETRIES[name]
    hs = experiment_handles(name, 1, layers=4)
    gp = hs[0]._state.plans
    M = 1
    xs, idss, wss, outs = layer_batches(M, geo["E"], geo["K"], geo["top_k"], len(hs))
    base = P.mma_config(P.default_config(M, gp.geometry, gemv=True), gp.geometry, P.gemv_mma_form(1, gp.geometry)[0], q2)
    res = {}
    for r in range(2):
        for red in (False, True):
            cfg = dataclasses.replace(base, red1=red)
            gp.reserve(M, cfg)
            def t(stages):
                return graph_time([lambda h=h, x=x, i=i, w=w, o=o: _launch_all(h._state, cfg, x, i, w, o, stages)
                                   for h, x, i, w, o in zip(hs, xs, idss, wss, outs)], reps=20) * 1e6
            row = [t(("prologue",)), t(("prologue", "gemm1")), t(("gemm2",)), t(("gemm1",)), t(("prologue", "gemm1", "gemm2"))]
            res.setdefault(red, []).append(row)
    for red, rows in res.items():
        print(name, "red" if red else "ord", "xquant / xquant+gemv1 / gemv2 / gemv1 / all:", " | ".join(" ".join(f"{v:5.1f}" for v in row) for row in rows), flush=True)
    hs = None
    torch.cuda.empty_cache()
