"""Where the Gluon GEMMs pay, by block size: the whole op at mid-to-large M with the default plan
against 128-row plans (tl.dot, and GEMM1 in Gluon) and 64-row plans with GEMM2 in Gluon, on a CUDA GPU
(sm_90 for the Gluon forms).

    python benchmarks/experiments/gluon_regimes.py gpt-oss-120b,qwen3-30b-a3b,dsv4.1-tp4 512,1024,2048,4096

Per geometry and M, each form's whole op (CUDA-graph replay over 3 layers, us per layer) and its output's
relative L2 distance from the default plan's (the forms differ in block size and summation order, not in
what they compute).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))

from b12x_ops.backends.triton import _launch_all  # noqa: E402
from b12x_ops.backends.triton import plan as P  # noqa: E402
from bench_moe import GEOMETRIES, experiment_handles, layer_batches, whole_op_us  # noqa: E402


def forms(M, gp):
    """(label, Config) pairs to time at ``M``: the plan's default, then the alternatives."""
    g = gp.geometry
    base = gp.with_gluon(P.default_config(M, g))
    bm128 = P.Config(P._REGIMES[-1][1][0][0], *P._REGIMES[-1][1][0][1], *P._REGIMES[-1][1][0][2],
                     base.atomic)
    out = [("default plan", base),
           ("128-row blocks, tl.dot", bm128),
           ("128-row blocks, GEMM1 in Gluon", dataclasses.replace(bm128, gluon=True, **P.GLUON_GEMM1))]
    for bn2 in (128, 256):
        if base.bm <= 64:
            out.append((f"default plan, GEMM2 in Gluon bn {bn2}",
                        dataclasses.replace(base, gluon2=True, bn2=bn2, bk2=64, stages2=4)))
    return out


def rel_l2(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    names = sys.argv[1].split(",")
    sizes = [int(m) for m in sys.argv[2].split(",")]
    for name in names:
        geo = GEOMETRIES[name]
        E, K, top_k = geo["E"], geo["K"], geo["top_k"]
        hs = experiment_handles(name, max(sizes))
        gp = hs[0]._state.plans
        for M in sizes:
            xs, idss, wss, outs = layer_batches(M, E, K, top_k, 3)
            print(f"{name} M={M}", flush=True)
            want = None
            for label, cfg in forms(M, gp):
                try:
                    gp.reserve(M, cfg)
                    _launch_all(hs[0]._state, cfg, xs[0], idss[0], wss[0], outs[0])
                    got = outs[0].clone()
                    want = got if want is None else want
                    t = whole_op_us(hs, cfg, xs, idss, wss, outs)
                    print(f"  {label} (bm {cfg.bm}): {t:.1f} us/layer; rel L2 from the default "
                          f"{rel_l2(got, want):.1e}", flush=True)
                except Exception as ex:  # (a form that fails to compile or launch: say so, go on)
                    print(f"  {label}: FAILED {type(ex).__name__}: {str(ex)[-300:]}", flush=True)
        del hs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
