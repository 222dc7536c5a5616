"""GEMM2's block order at large M: the plan's (expert-major: each expert's blocks one after another)
against the blocks taken round-robin over the experts (every expert's first block, then every
expert's second, ...), GEMM2 alone, on a CUDA GPU.

    python benchmarks/experiments/gemm2_order.py qwen3-30b-a3b,dsv4.1-tp4,gpt-oss-120b 2048,8192

The question: at large M the fp32 accumulator (M x K x 4 bytes: 67 MB at Qwen3's 8192 tokens) does
not fit in the L2, and in expert-major order every expert's blocks add into rows spread over all the
tokens, so GEMM2's atomics keep missing it. An expert's rows are roughly in token order (the
routing places each tile's slots in slot order), so its first block holds its first tokens: in
round-robin order the atomics of one round touch about a block's share of the tokens, while each
expert's weights are read once a round instead of once.

A full call fills the arena (block table, rows, activations); the script then permutes the block
table, each block's rows and its activation rows in place and times GEMM2 alone in each order,
alternating (CUDA-graph replay over 3 layers, us per layer), and checks that GEMM2 and finalize give
the same output in both orders (relative L2; the atomics add in another order). Not a plan: the
prologue would have to write the order.
"""

from __future__ import annotations

import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))

import b12x_ops  # noqa: E402
from b12x_ops.backends.triton import _launch  # noqa: E402
from bench_moe import GEOMETRIES, experiment_points, graph_time, rel_l2  # noqa: E402


def round_robin(blk_expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The permutation (new position -> block) taking the used blocks round-robin over the experts;
    the unused entries (expert -1, at the end) stay where they are."""
    be = blk_expert.long().cpu()
    n = int((be >= 0).sum())
    e = be[:n]
    j = torch.arange(n) - torch.searchsorted(e, e)  # (the block table is in expert order)
    perm = torch.argsort(j * num_experts + e, stable=True)
    return torch.cat([perm, torch.arange(n, be.numel())]).to(blk_expert.device)


def permute(a: dict, perm: torch.Tensor, bm: int, n: int) -> None:
    """Reorder the first ``perm.numel()`` blocks of the arena's block table, rows and activations."""
    nb = perm.numel()
    for name in ("blk_expert", "blk_rows"):
        a[name][:nb] = a[name][:nb][perm]
    rows = a["sorted"][: nb * bm].view(nb, bm)
    rows.copy_(rows[perm])
    act = a["act"][: nb * bm * n].view(nb, bm * n)
    act.copy_(act[perm])


def main():
    for name, hs, M, (xs, idss, wss, outs) in experiment_points(sys.argv[1].split(","),
                                                               [int(m) for m in sys.argv[2].split(",")]):
        geo = GEOMETRIES[name]
        gp = hs[0]._state.plans
        _, cfg = gp.plan_for(M)
        rn = gp.runner_for(M)
        b12x_ops.moe_w4a8_out(xs[0], idss[0], wss[0], hs[0], outs[0])  # (fills the arena)
        a = gp.arena.buffers
        nb = rn.blocks(M * geo["top_k"])
        perm = round_robin(a["blk_expert"][:nb], geo["E"])
        inv = torch.argsort(perm)
        used = int((a["blk_expert"][:nb] >= 0).sum())

        def out_now():
            if cfg.atomic:
                a["acc"][: M * geo["K"]].zero_()
            _launch(hs[0]._state, rn, xs[0], idss[0], wss[0], outs[0], ("gemm2", "finalize"))
            return outs[0].clone()

        def gemm2_us():
            calls = [lambda h=h, x=x, i=i, w=w, o=o: _launch(h._state, rn, x, i, w, o, ("gemm2",))
                     for h, x, i, w, o in zip(hs, xs, idss, wss, outs)]
            return graph_time(calls, 10) * 1e6

        want = out_now()
        times = {"expert-major": [], "round-robin": []}
        for _ in range(2):
            times["expert-major"].append(gemm2_us())
            permute(a, perm, cfg.bm, geo["N"])
            times["round-robin"].append(gemm2_us())
            got = out_now()
            permute(a, inv, cfg.bm, geo["N"])
        print(f"{name} M={M} bm={cfg.bm} blocks={used} atomic={cfg.atomic} gluon2={cfg.gluon2}: GEMM2 alone, "
              f"us/layer: expert-major {', '.join(f'{t:.1f}' for t in times['expert-major'])}; round-robin "
              f"{', '.join(f'{t:.1f}' for t in times['round-robin'])}; rel L2 of the output between the orders "
              f"{rel_l2(got, want):.1e}", flush=True)


if __name__ == "__main__":
    main()
