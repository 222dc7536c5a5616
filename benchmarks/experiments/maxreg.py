"""The whole op with its two GEMMs compiled under a register cap (triton's ``maxnreg``), for more
programs an SM; an experiment (``benchmarks/NOTES.md`` has what it found).

    python benchmarks/experiments/maxreg.py gpt-oss-120b,qwen3-30b-a3b,dsv4.1-tp4 16,64
    python benchmarks/experiments/maxreg.py gpt-oss-120b,qwen3-30b-a3b,dsv4.1-tp4 1,2,4 gemv
    python benchmarks/experiments/maxreg.py gpt-oss-120b,qwen3-30b-a3b,dsv4.1-tp4 2,4 mma [80/None,None/48 ...]
    MAXREG_PTX=0 python benchmarks/experiments/maxreg.py qwen3-30b-a3b 1,2 gemv None/None 128/None

The first form caps the blocked path's gemm1/gemm2, the second the GEMV path's gemv1/gemv2 (at
M = 1, 130 registers left gemv1 three 4-warp programs an SM; 128, its default cap since, four;
``None`` here means no cap at all), the third the mma.sync GEMV's (``gluon_gemv``) in the plan a
GPU prepare runs untuned (``GeometryPlans.default``), with the cap pairs given (default below):
more programs an SM, fewer waves, against the spills a cap brings. The GEMV form takes cap pairs too.
``MAXREG_PTX=0`` prepares with ``ptx=False``: the Triton-operations decode, the one GPUs other than sm_90
run (``plan.ptx_status``; it leaves out Gluon as well), so an sm_90 GPU can stand in for them in timing
their caps.

Prints, per geometry and M, the time per layer (CUDA-graph replay over 3 layers) for each
(GEMM1 cap / GEMM2 cap) pair, the registers the kernels got and the error against the reference.
"""

from __future__ import annotations

import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))

import b12x_ops  # noqa: E402
from b12x_ops.backends.triton import _launch_all  # noqa: E402
from b12x_ops.backends.triton import plan as P  # noqa: E402
from bench_moe import GEOMETRIES, graph_time, layer_batches, random_layer  # noqa: E402

def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())

MODE = sys.argv[3] if len(sys.argv) > 3 else "blocked"
GEMV = MODE in ("gemv", "mma")
# (the first pair again last: run-to-run noise)
# (GEMV: 128 is gemv1's default cap at 1-2 tokens; 96 would fit five of its 4-warp programs an SM,
# with 8-16 bytes of spills offline)
combos = ([(None, None), (128, None), (96, None), (None, 80), (128, 80), (96, 64), (128, 64), (None, None)] if GEMV
          else [(None, None), (80, None), (None, 72), (80, 72), (None, 64), (72, 64), (None, None)])
if MODE == "mma":  # (offline, triton 3.6: gemv1 at 80 is six 4-warp programs an SM with 40-88 bytes of stack;
    # gemv2 at 48 five 8-warp (Qwen3) or ten 4-warp programs, 0-24 bytes)
    combos = [(None, None), (80, None), (None, 48), (80, 48), (None, 64), (None, None)]
if GEMV and len(sys.argv) > 4:  # (the cap pairs given)
    combos = [tuple(None if v == "None" else int(v) for v in c.split("/")) for c in sys.argv[4:]]
PTX = False if os.environ.get("MAXREG_PTX") == "0" else None
for name in sys.argv[1].split(","):
    geo = GEOMETRIES[name]
    E, K, N, top_k, limit = geo["E"], geo["K"], geo["N"], geo["top_k"], geo["limit"]
    layers = [random_layer(E, K, N, "cuda", 100 + i) for i in range(3)]
    hs = [b12x_ops.prepare_experts(*lw, top_k=top_k, swiglu_limit=limit, backend="triton", tune=False,
                                   max_tokens=64, frozen=False, ptx=PTX) for lw in layers]
    ref = b12x_ops.prepare_experts(*layers[0], top_k=top_k, swiglu_limit=limit, backend="reference")
    for M in map(int, sys.argv[2].split(",")):
        xs, idss, wss, outs = layer_batches(M, E, K, top_k, 3)
        want = b12x_ops.moe_w4a8(xs[0], idss[0], wss[0], ref)
        gp = hs[0]._state.plans
        cfg = gp.default(M) if MODE == "mma" else P.default_config(M, gp.geometry, gemv=GEMV)
        if MODE == "mma" and not cfg.mma:
            print(name, M, f"not on mma.sync here: {cfg}", flush=True)
            continue
        row = []
        for c1, c2 in combos:
            gp.reserve(M, cfg)
            for ln, mr in zip(gp.stages(cfg)[1:3], (c1, c2)):  # (GEMM1's and GEMM2's launches, or the GEMV's)
                # compiled again at the next call, by the launch itself, under the cap (None: none at all)
                ln.options = {k: v for k, v in ln.options.items() if k != "maxnreg"} | ({"maxnreg": mr} if mr else {})
                ln.compiled = None
            _launch_all(hs[0]._state, cfg, xs[0], idss[0], wss[0], outs[0])
            err = rel(outs[0], want)
            calls = [lambda h=h, x=x, ids=ids, w=w, o=o: _launch_all(h._state, cfg, x, ids, w, o)
                     for h, x, ids, w, o in zip(hs, xs, idss, wss, outs)]
            t = graph_time(calls, reps=20) * 1e6
            regs = "/".join(f'{getattr(ln.compiled, "n_regs", "?")}r{getattr(ln.compiled, "n_spills", "?")}s'
                            for ln in gp.stages(cfg)[1:3])
            row.append(f"{c1}/{c2}: {t:.1f} us ({regs}, err {err:.1e})")
        print(name, M, " | ".join(row), flush=True)
    del hs, ref, layers
    torch.cuda.empty_cache()
