"""The GEMMs in Gluon (``gluon_kernels``) against the ``tl.dot`` GEMMs, on the GPU:
the same bits, and the time of each stage alone and of the whole op (CUDA-graph replay over 3 layers).

    python benchmarks/experiments/gluon_gemms.py gpt-oss-120b,qwen3-30b-a3b,dsv4.1-tp4 2048,8192 [128/64/4,... [256/64/4,...]]

(a form's optional fourth number caps its registers a thread: ``64/64/4/128``)

Per geometry and M: the default plan, then Gluon forms of its GEMM1 (bn1/bk1/stages1, the
third argument) and of its GEMM2 (bn2/bk2/stages2, the fourth); for each, the stage's output against the
``tl.dot`` stage's with the same K step (bit for bit: ``act`` after GEMM1; the per-slot rows of the
deterministic GEMM2), the stage's time alone, the whole op's time, and the registers and shared
memory it compiled to.
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
from bench_moe import experiment_points, graph_time, whole_op_us  # noqa: E402

FORMS = [(64, 64, 4), (128, 64, 4), (128, 128, 4), (128, 64, 6)]  # GEMM1's (bn1, bk1, stages1)
FORMS2 = [(128, 64, 4), (256, 64, 4), (256, 128, 4)]  # GEMM2's (bn2, bk2, stages2)


def main():
    names = sys.argv[1].split(",")
    sizes = [int(m) for m in sys.argv[2].split(",")]
    forms = [tuple(map(int, f.split("/"))) for f in sys.argv[3].split(",") if f] if len(sys.argv) > 3 else FORMS
    forms2 = [tuple(map(int, f.split("/"))) for f in sys.argv[4].split(",") if f] if len(sys.argv) > 4 else FORMS2
    for name, hs, M, (xs, idss, wss, outs) in experiment_points(names, sizes):
        st = hs[0]._state
        gp = st.plans
        base = P.default_config(M, gp.geometry)  # (tl.dot GEMMs: ``with_gluon`` is not applied)
        print(f"{name} M={M} bm={base.bm}", flush=True)
        rows = []
        # one routing pass for every comparison (with several routing programs the order of a
        # block's rows depends on their atomics)
        gp.reserve(M, dataclasses.replace(base, atomic=False))
        _launch_all(st, base, xs[0], idss[0], wss[0], outs[0], stages=("prologue",))
        for stage, form in [("gemm1", None)] + [("gemm1", f) for f in forms] + [("gemm2", f) for f in forms2]:
            if form is None:
                cfg, label = base, "tl.dot (default plan)"
            elif stage == "gemm1":
                cfg = dataclasses.replace(base, gluon=True, bn1=form[0], bk1=form[1], stages1=form[2])
                label = f"gemm1 gluon bn {form[0]} bk {form[1]} st {form[2]}"
            else:
                cfg = dataclasses.replace(base, gluon2=True, bn2=form[0], bk2=form[1], stages2=form[2])
                label = f"gemm2 gluon bn {form[0]} bk {form[1]} st {form[2]}"
            capped = None
            if form is not None and len(form) > 3:  # (a register cap: this form's launch, compiled apart)
                ln = gp.stages(cfg, M)[1 if stage == "gemm1" else 2]
                capped = next(k for k, v in gp.launches.items() if v is ln)
                gp.launches[capped] = P.Launch(ln.fn, ln.constexprs, ln.num_warps, ln.num_stages, form[3],
                                               pdl=gp.pdl)
                label += f" maxnreg {form[3]}"
            try:
                same = ""
                if form is not None and stage == "gemm2" and M > gp.slot_chunk:
                    same = f"; bits not compared (deterministic calls run in chunks of {gp.slot_chunk} tokens)"
                elif form is not None:
                    # bits: the stage's output against the tl.dot stage's with the same tile and K step
                    # (GEMM2 in the deterministic form: per-slot rows, no atomics)
                    if stage == "gemm1":
                        tlc = dataclasses.replace(base, bn1=form[0], bk1=form[1], warps1=form[0] // 16, stages1=2)
                        gc, buf = cfg, "act"
                    else:
                        tlc = dataclasses.replace(base, bn2=form[0], bk2=form[1], warps2=form[0] // 32,
                                                  stages2=2, atomic=False)
                        gc, buf = dataclasses.replace(cfg, atomic=False), "slots"
                    gp.arena.buffers[buf].zero_()
                    _launch_all(st, tlc, xs[0], idss[0], wss[0], outs[0], stages=(stage,))
                    want = gp.arena.buffers[buf].clone()
                    got = gp.arena.buffers[buf]
                    got.zero_()
                    _launch_all(st, gc, xs[0], idss[0], wss[0], outs[0], stages=(stage,))
                    torch.cuda.synchronize()
                    words = got.view(torch.int16)  # (bf16 activations, fp32 slot rows: 16-bit words)
                    diff = (words != want.view(torch.int16)).sum().item()
                    same = ("; bit-identical to tl.dot" if diff == 0
                            else f"; {diff} of {words.numel()} 16-bit words differ")
                ln = gp.stages(cfg, M)[1 if stage == "gemm1" else 2]
                t1 = graph_time([lambda: _launch_all(st, cfg, xs[0], idss[0], wss[0], outs[0],
                                                     stages=(stage,))], reps=20) * 1e6
                t = whole_op_us(hs, cfg, xs, idss, wss, outs)
                ck = ln.compiled
                rows.append(f"  {label}: {stage} {t1:.1f} us, whole op {t:.1f} us/layer{same}; "
                            f"{getattr(ck, 'n_regs', '?')} regs, {getattr(ck, 'n_spills', '?')} spills, "
                            f"{ck.metadata.shared} B shared")
                # (the whole op's calls routed other batches: route this one again)
                _launch_all(st, base, xs[0], idss[0], wss[0], outs[0], stages=("prologue",))
            except Exception as ex:  # (a form that fails to compile or launch: say so, go on)
                rows.append(f"  {label}: FAILED {type(ex).__name__}: {str(ex)[-300:]}")
            if capped is not None:
                del gp.launches[capped]
            print(rows[-1], flush=True)


if __name__ == "__main__":
    main()
