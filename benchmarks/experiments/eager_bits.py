"""Experiment: does the one-launch tl.dot GEMV (what eager calls launch, ``plan.eager_form``) write the
same bits as the mma.sync GEMV it stands in for (what CUDA graphs record)? Per geometry and form
``(M, q1, q2, bn2, warps2)``: the plan's eager form (K steps of one 64-element chunk) and the same
runs in K steps of the largest power of two that divides the run (``eager_form`` before this
experiment was committed), each
against the mma.sync kernels' output, on the GPU test suite's layers and batches:

    python benchmarks/experiments/eager_bits.py
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

FORMS = {"qwen3-30b-a3b": [(1, 2, 6, 128, 8), (2, 4, 6, 64, 4), (2, 4, 12, 128, 8), (2, 4, 12, 64, 4), (2, 4, 3, 64, 4)],
         "dsv4-tp4": [(1, 4, 3, 64, 4), (2, 4, 3, 64, 4), (2, 4, 4, 64, 4), (2, 4, 8, 64, 4)],
         "gpt-oss-120b": [(1, 4, 4, 64, 4), (1, 4, 8, 64, 4)]}


def main():
    import torch
    from _samples import make_batch, make_layer
    from test_triton_gpu import GEOMETRIES

    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P

    for name, forms in FORMS.items():
        layer = make_layer(seed=sum(map(ord, name)), device="cuda", **GEOMETRIES[name])
        h = layer.prepare(backend="triton", tune=False, gemv=True, max_tokens=4, frozen=False)
        st = h._state
        g = st.plans.geometry
        for M, q1, q2, bn2, warps2 in forms:
            cfg = dataclasses.replace(P.mma_config(P.default_config(M, g, gemv=True), g, q1, q2), bn2=bn2, warps2=warps2)
            one = P.eager_form(cfg, g)
            pow2 = dataclasses.replace(cfg, fused=True, xq=False, mma=False, bk1=64 * (q1 & -q1), bk2=64 * (q2 & -q2),
                                       bn2=64, warps2=4)
            x, ids, w = make_batch(layer, M, seed=70 + M, device="cuda")
            st.plans.reserve(M, cfg)
            want = torch.full_like(x, float("nan"))
            _launch_all(st, cfg, x, ids, w, want)
            said = []
            for label, c in (("steps of one chunk (eager_form)", one), ("power-of-two steps", pow2)):
                if c is None:
                    said.append(f"{label}: no such form")
                    continue
                st.plans.reserve(M, c)
                out = torch.full_like(x, float("nan"))
                _launch_all(st, c, x, ids, w, out)
                d = (out.float() - want.float()).abs()
                said.append(f"{label} (K steps {c.bk1 // 64}/{c.bk2 // 64} chunks): " + (
                    "same bits" if torch.equal(out, want) else
                    f"{int((d > 0).sum())} of {d.numel()} values differ (max {float(d.max()):.3g})"))
            print(f"{name} M={M} mma.sync {q1}/{q2}/{bn2}/{warps2}: " + "; ".join(said), flush=True)


if __name__ == "__main__":
    main()
