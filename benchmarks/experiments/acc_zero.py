"""Where GEMM2's fp32 accumulator is zeroed: in the prologue, or by the Gluon GEMM1's programs
before their main loop or after their epilogue (``plan.ACC_ZERO_MODES``), timed side by side.

    python benchmarks/experiments/acc_zero.py qwen3-30b-a3b,dsv4.1-tp4,gpt-oss-120b 512,2048,8192   # a CUDA GPU

The prologue's quantizing programs write x's quant-dequant and zero the accumulator's rows: at 8192
tokens the zeros are half its bytes (gpt-oss 94 MB, DSv4 168, Qwen3 67). GEMM1 is bound by its
main loop, not by memory, so its programs can take the zeros (``gluon_kernels.gemm1_gluon_kernel``'s
``ZERO_ACC``), as long as their stores do not hold up their copies. A first comparison in two
processes (``compare_trees.sh``) saw the prologue 12-36 us shorter and GEMM1 about as much longer,
within the spread between processes; here every mode runs in one process, in alternating rounds.

Per geometry and M (atomic plans with the Gluon GEMM1: 32-row blocks and more), for each mode: the
whole op and the prologue with GEMM1 alone, CUDA-graph replay over the benchmark's layers, us per
layer, the median of ``ROUNDS`` rounds that take the modes in turn; and each mode's output against
the prologue mode's (relative L2: the reductions add in another order).
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))

ROUNDS = 7
REPS = 10


def main():
    import torch

    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P
    from bench_moe import experiment_points, rel_l2, time_events, warm_graph

    names = sys.argv[1].split(",")
    sizes = [int(m) for m in sys.argv[2].split(",")]
    modes = list(P.ACC_ZERO_MODES)
    for name, hs, M, (xs, idss, wss, outs) in experiment_points(names, sizes):
        gp = hs[0]._state.plans
        cfg = gp.with_gluon(P.default_config(M, gp.geometry), M)
        print(f"{name} M={M} bm={cfg.bm} GEMM1 {'Gluon' if cfg.gluon else 'tl.dot'} "
              f"{(cfg.bn1, cfg.bk1, cfg.stages1)}", flush=True)
        if not (cfg.atomic and cfg.gluon):
            print("  skipped: not an atomic plan with the Gluon GEMM1", flush=True)
            continue
        gp.reserve(M, cfg)
        graphs, got = {}, {}
        for mode in modes:  # (the mode is read when a call builds its launches: at each capture)
            os.environ["B12X_OPS_TRITON_ACC_ZERO"] = mode
            rows = list(zip(hs, xs, idss, wss, outs))
            whole = [lambda h=h, x=x, i=i, w=w, o=o: _launch_all(h._state, cfg, x, i, w, o) for h, x, i, w, o in rows]
            part = [lambda h=h, x=x, i=i, w=w, o=o: _launch_all(h._state, cfg, x, i, w, o, stages=("prologue", "gemm1"))
                    for h, x, i, w, o in rows]
            _launch_all(hs[0]._state, cfg, xs[0], idss[0], wss[0], outs[0])
            torch.cuda.synchronize()
            got[mode] = outs[0].clone()
            assert gp.stages(cfg, M)[1].constexprs["ZERO_ACC"] == P.ACC_ZERO_MODES[mode]
            graphs[mode] = (warm_graph(whole), warm_graph(part))
        os.environ.pop("B12X_OPS_TRITON_ACC_ZERO")
        times = {m: ([], []) for m in modes}
        for _ in range(ROUNDS):
            for mode in modes:
                for j, g in enumerate(graphs[mode]):
                    times[mode][j].append(time_events(g.replay, REPS) / len(hs) * 1e6)
        base = None
        for mode in modes:
            w, p = (sorted(t)[ROUNDS // 2] for t in times[mode])
            base = base or (w, p)
            print(f"  {mode:>10}: whole op {w:8.1f} us ({(w / base[0] - 1) * 100:+5.1f} %), prologue + GEMM1 "
                  f"{p:8.1f} us ({(p / base[1] - 1) * 100:+5.1f} %); rel L2 against prologue "
                  f"{rel_l2(got[mode], got[modes[0]]):.1e}", flush=True)
        del graphs
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
