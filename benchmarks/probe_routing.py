"""The blocked path's routing, before and after the multi-program rewrite, on the GPU.

    python benchmarks/probe_routing.py [--sizes 1 16 8192] [--geometries gpt-oss-120b]

Per geometry and token count M (the blocked path's default config at M, whatever the GEMV bound):
microseconds per call, CUDA-graph replay of ``--calls`` launches, median of ``--reps`` replays, of

* ``route``: the routing programs alone (the old kernel's program 0; the new kernel's
  ``cdiv(S, RT)`` first programs and, where there are several, as many placing ones after them),
  i.e. what the GEMMs wait on beyond the quantization;
* ``prologue``: the whole launch (routing and the quantization of x, as the op runs it).

The old kernel is ``old_routing.py`` (a copy kept for this comparison). Every point first checks
both kernels' routing against ``route_torch`` (twice: the new kernel's counters must be reset).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from b12x_ops.backends.triton import _raw_routing  # noqa: E402
from b12x_ops.backends.triton import kernels as K_  # noqa: E402
from b12x_ops.backends.triton import plan as P  # noqa: E402
from bench_moe import GEOMETRIES, graph_time, plan_geometry, routing  # noqa: E402
from old_routing import OLD, old_prologue_kernel  # noqa: E402

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192)


def setup(geo, M):
    g = plan_geometry(geo, device="cuda")
    gp = P.GeometryPlans(g, True, gemv=False)
    cfg = P.default_config(M, g, gemv=False)
    gp.reserve(M, cfg)
    gp.arena.need("cursor", gp.e_pad, torch.int32)  # (the old kernel's)
    return g, gp, cfg, gp.runner(cfg, M)


def launchers(g, gp, cfg, rn, x, ids, w):
    """``{(kernel, what): fn}`` for kernel in old/new, what in route/prologue."""
    a = gp.arena.buffers
    M, E = x.shape[0], g.num_experts
    ids_r, (si0, si1), w_r, (sw0, sw1), w_kind = _raw_routing(ids, w)
    ids32, w16 = ids_r.view(torch.int32), w_r.view(torch.int16)  # (the words the kernels read)
    nb = rn.blocks(M * g.top_k)
    head = (ids32, w16, x.view(torch.int16), a["xq"], a["acc"], a["lid"], a["wts"], a["sorted"], a["blk_expert"],
            a["blk_rows"])
    tail = (M, si0, si1, sw0, sw1, x.stride(0), 0, nb, w_kind, 0)
    new_args = head + (a["route_cnt"], a["route_key"], a["route_off"]) + tail
    old_args = head + (a["cursor"],) + tail
    route = K_.prologue_programs(M, g.top_k, rn.route_slots, rn.prologue_rows, 0)  # (routing and placing programs)
    old_c = dict(K=g.hidden_size, E=E, E_PAD=gp.e_pad, TOPK=g.top_k, BM=cfg.bm, CH=OLD["CH"], BCH=OLD["BCH"],
                 QR=OLD["QR"], QK=OLD["QK"], ZERO_ACC=cfg.atomic)

    def old(grid):
        return lambda: old_prologue_kernel[(grid,)](*old_args, **old_c, num_warps=OLD["warps"], num_stages=1)

    return {("new", "route"): lambda: rn.prologue((route, 1, 1), *new_args),
            ("new", "prologue"): lambda: rn.prologue((rn.prologue_programs(M, g.top_k), 1, 1), *new_args),
            ("old", "route"): old(1), ("old", "prologue"): old(1 + -(-M // OLD["QR"]))}


def check(g, gp, cfg, fn, ids, w):
    a = gp.arena.buffers
    S, bm = ids.numel(), cfg.bm
    nb = K_.num_blocks(S, g.num_experts, bm)
    lid, wts, srt, be, br = K_.route_torch(ids.cpu(), w.cpu(), 0, g.num_experts, bm)
    for _ in range(2):
        a["sorted"].fill_(-7)
        fn()
        torch.cuda.synchronize()
        assert torch.equal(a["lid"][:S].cpu(), lid) and torch.equal(a["wts"][:S].cpu(), wts)
        assert torch.equal(a["blk_expert"][:nb].cpu(), be) and torch.equal(a["blk_rows"][:nb].cpu(), br)
        assert torch.equal(K_.routed_pairs(a["sorted"].cpu(), be, br, bm), K_.routed_pairs(srt, be, br, bm))
        assert "route_cnt" not in a or not a["route_cnt"].any()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometries", nargs="*", default=list(GEOMETRIES))
    ap.add_argument("--sizes", nargs="*", type=int, default=list(SIZES))
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}; us per call (CUDA-graph replay, {args.calls} calls, median of "
          f"{args.reps}); a routing program routes up to RT slots\n")
    print("| geometry | M | S | bm | RT | routing programs | old route | new route | route speedup | old prologue | "
          "new prologue | prologue speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.geometries:
        geo = GEOMETRIES[name]
        for M in args.sizes:
            g, gp, cfg, rn = setup(geo, M)
            _, ids, w = routing(M, geo["E"], geo["top_k"], "cuda", M)
            ids[M - M // 8:, -1] = -1  # some padding slots too
            x = torch.randn(M, geo["K"], device="cuda").to(torch.bfloat16)
            fns = launchers(g, gp, cfg, rn, x, ids, w)
            for kernel in ("old", "new"):
                check(g, gp, cfg, fns[(kernel, "prologue")], ids, w)
            check(g, gp, cfg, fns[("new", "route")], ids, w)
            t = {k: graph_time([fn] * args.calls, args.reps) * 1e6 for k, fn in fns.items()}
            r = -(-(M * geo["top_k"]) // rn.route_slots)
            print(f"| {name} | {M} | {M * geo['top_k']} | {cfg.bm} | {rn.route_slots} | {r} | "
                  f"{t['old', 'route']:.1f} | {t['new', 'route']:.1f} | {t['old', 'route'] / t['new', 'route']:.1f}x | "
                  f"{t['old', 'prologue']:.1f} | {t['new', 'prologue']:.1f} | "
                  f"{t['old', 'prologue'] / t['new', 'prologue']:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
