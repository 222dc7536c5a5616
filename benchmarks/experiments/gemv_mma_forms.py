"""Experiment: the GEMV path's forms on mma.sync (``gluon_gemv``) against the tl.dot GEMV, whole op.

Per geometry and token count: the tl.dot GEMV's default plan, then each mma.sync form ``q1/q2``
(gemv1's and gemv2's 64-element chunks a program; q1 = 0: the untuned plan's) or
``q1/q2/bn1/warps1/bn2/warps2`` (also the programs' columns and warps; ``mma_config``'s are
64/4/64/4), either one with ``@w`` for w chunks' loads in flight in both kernels (``Config.window``;
without it every load first), us per layer from CUDA-graph replay over 4 layers, each form's output
against the tl.dot plan's; the forms are timed ``ROUNDS`` times in turn (default 1), all times printed:

    python benchmarks/experiments/gemv_mma_forms.py qwen3-30b-a3b,gpt-oss-120b,dsv4.1-tp4 1,2 2/4,4/4 [ROUNDS]

(At a73717c it also took a third field, gemv1 quantizing x in its programs instead of after x's own
launch: no faster, removed again; ``benchmarks/results/gemv_mma.md``.)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def parse_form(text: str) -> tuple[tuple[int, ...], int]:
    """``q1/q2[/bn1/warps1/bn2/warps2][@window]`` as ``(fields, window)``."""
    fields, _, window = text.partition("@")
    return tuple(int(v) for v in fields.split("/")), int(window or 0)


def main():
    import dataclasses

    import torch

    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P
    from bench_moe import GEOMETRIES, experiment_handles, graph_time, layer_batches, rel_l2

    names = sys.argv[1].split(",")
    sizes = [int(m) for m in sys.argv[2].split(",")]
    forms = [parse_form(f) for f in (sys.argv[3] if len(sys.argv) > 3 else "2/4").split(",")]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    for name in names:
        geo = GEOMETRIES[name]
        hs = experiment_handles(name, max(sizes), layers=4)
        gp = hs[0]._state.plans
        for M in sizes:
            xs, idss, wss, outs = layer_batches(M, geo["E"], geo["K"], geo["top_k"], len(hs))
            base = P.default_config(M, gp.geometry, gemv=True)

            def whole(cfg):
                gp.reserve(M, cfg)
                return graph_time([lambda h=h, x=x, i=i, w=w, o=o: _launch_all(h._state, cfg, x, i, w, o)
                                   for h, x, i, w, o in zip(hs, xs, idss, wss, outs)], reps=20) * 1e6

            t0 = whole(base)
            want = outs[0].clone()
            print(f"{name} M={M}: tl.dot GEMV {base.tiles1()} / {base.tiles2()}: {t0:.1f} us/layer", flush=True)
            times = {}
            for r in range(rounds):
                for form in forms:
                    fields, window = form
                    label = "mma.sync " + "/".join(map(str, fields)) + (f"@{window}" if window else "")
                    try:
                        q1 = fields[0] or P.gemv_mma_form(1, gp.geometry)[0]
                        cfg = dataclasses.replace(P.mma_config(base, gp.geometry, q1, fields[1]), window=window)
                        if len(fields) > 2:
                            cfg = dataclasses.replace(cfg, bn1=fields[2], warps1=fields[3], bn2=fields[4],
                                                      warps2=fields[5])
                        times.setdefault(form, []).append(whole(cfg))
                        if r == rounds - 1:
                            ts = " ".join(f"{t:.1f}" for t in times[form])
                            print(f"  {label}: {ts} us/layer ({min(times[form]) / t0:.3f}); output rel L2 "
                                  f"{rel_l2(outs[0], want):.1e} from the tl.dot GEMV's", flush=True)
                    except Exception as ex:  # (a form that fails to compile or launch: say so, go on)
                        print(f"  {label}: FAILED {type(ex).__name__}: {str(ex)[-500:]}", flush=True)
        hs = None  # (let the geometry's handles go before the next)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
