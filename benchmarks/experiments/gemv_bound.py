"""Experiment: how many tokens the GEMV on mma.sync should serve where the blocked path has no Gluon.

The untuned plans take the mma.sync GEMV up to ``plan.GEMV_MMA_MAX_TOKENS`` tokens and
``GEMV_MMA_MAX_SLOTS`` slots, a bound measured on sm_90 against a blocked path that decodes with inline
PTX. GPUs other than sm_90 decode the blocked path's tl.dot GEMMs with Triton operations (1.4-1.9x
slower on an H100 standing in), so the GEMV may pay further there. Per geometry and token count: the
untuned blocked plan and the GEMV on mma.sync in the untuned form for that count (``gemv_mma_form`` with
its token bound the largest count), us per layer from CUDA-graph replay over 3 layers, the GEMV's output against the
blocked plan's. ``AS_SM`` (default 89) makes the plans those of that GPU (``bench_moe.stand_in``):

    AS_SM=89 python benchmarks/experiments/gemv_bound.py qwen3-30b-a3b,gpt-oss-120b,dsv4.1-tp4 8,12,16,24,32
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
    from b12x_ops.backends.triton import plan as P
    from bench_moe import experiment_points, rel_l2, stand_in, whole_op_us

    as_sm = int(os.environ.get("AS_SM", "89"))
    stand_in(as_sm if as_sm != 90 else None)
    names = sys.argv[1].split(",")
    sizes = [int(m) for m in sys.argv[2].split(",")]
    print(f"plans as sm_{as_sm}; us per layer (whole op, graph replay over 3 layers)", flush=True)
    for name, hs, M, (xs, idss, wss, outs) in experiment_points(names, sizes):
        gp = hs[0]._state.plans
        g = gp.geometry
        blocked = gp.with_gluon(P.default_config(M, g, gemv=False), M)
        gemv = P.mma_config(P.default_config(M, g, gemv=True), g, *P.gemv_mma_form(M, g, max(sizes)))
        times = {}
        for label, cfg in (("blocked", blocked), ("gemv", gemv)):
            gp.reserve(M, cfg)
            times[label] = whole_op_us(hs, cfg, xs, idss, wss, outs)
            if label == "blocked":
                want = outs[0].clone()
        print(f"{name} M={M} slots={M * g.top_k}: blocked (bm {blocked.bm}) {times['blocked']:.1f}  "
              f"mma.sync GEMV {gemv.bk1 // 64}/{gemv.bk2 // 64} {times['gemv']:.1f}  "
              f"(GEMV / blocked {times['gemv'] / times['blocked']:.3f}; output rel L2 {rel_l2(outs[0], want):.1e} "
              f"from the blocked plan's)", flush=True)


if __name__ == "__main__":
    main()
