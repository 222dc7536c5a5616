"""GEMM2 in Gluon as a persistent kernel (sm_90): the next tile's first copies in flight under the
current tile's epilogue, against the package's Gluon GEMM2.

    python benchmarks/experiments/gluon_persistent.py qwen3-30b-a3b,dsv4.1-tp4,gpt-oss-120b 2048,8192   # a CUDA GPU
    GLUON_PERSISTENT_HALF=1 python benchmarks/experiments/gluon_persistent.py ...   # the half tiles too

The question (``benchmarks/results/gemm2_epilogue.md``): at 128-row blocks one 16-warp GEMM2
program fills an SM, so its pipeline fill (the first ``STAGES - 2`` steps' copies, from HBM) and
its epilogue (the layout conversion, then 16 fp32 reductions of 16 bytes a thread) run with nothing
beside them; with the reductions predicated off GEMM2 took 7-21 % less. Here ``programs``
programs an SM (the launch's grid capped at that many an SM) walk the tiles in the plan's order,
``t = pid, pid + grid, ...`` (block-major, as ``kernels._block_tile``), keeping their copy ring
across tiles: once a tile's main loop has drained the ring, the next tile's first copies are
issued, then the tile's epilogue runs while they land. The reductions are fire-and-forget, so the
next tile's main loop also runs under them.

``gemm2_persistent_kernel`` is a drop-in for ``gluon_kernels.gemm2_gluon_kernel`` (its signature and
layouts): the script swaps it into the plans and caps the launch's grid. ``gemm2_deferred_kernel``
walks the same way (full tiles only) and also defers each tile's reductions: its accumulator goes to
shared memory beside the ring (224 KB in all at 256 x 128 tiles), and the next tile's main loop
issues them a piece after each step of its first trip, beside its MMAs. It reuses the package's
step (``_step_in_set``: decode, the two asynchronous MMAs, the ring's copies) and epilogue. By default
it runs every tile in full (a block of at most BM / 2 rows too: more MMA rows than the package's
half tiles); ``GLUON_PERSISTENT_HALF=1`` runs those as the package's kernel does (the tile of BM / 2
on the first half of the ring's activation buffers), at a cost in registers (``HALF_TILES``).

Per geometry and M (128-row plans only: their GEMM2 is the 16-warp Gluon form): the plan's GEMM2
alone, then each kernel at each ``programs`` (CUDA-graph replay, us per layer), its
per-slot rows against the package kernel's where the plan's calls are not chunked (deterministic
mode: bit for bit, the half tiles aside, which compute the same products), and the whole op's output
in the plan's atomic mode against the package's (relative L2: the reductions add in another order).
"""

from __future__ import annotations

import dataclasses
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))

from b12x_ops.backends.triton import gluon_kernels as GK  # noqa: E402

if GK.HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from b12x_ops.backends.triton.gluon_kernels import (_barrier, _gemm2_epilogue, _gemm2_sources, _load_scales,
                                                        _operand_sources, _prefill, _ring, _step_in_set, _steps,
                                                        warpgroup_mma_wait)

    # the half tiles (GLUON_PERSISTENT_HALF=1). Offline (triton 3.6, sm_90) the walk with both tile
    # sizes in its loop no longer keeps the MMAs in flight at Qwen3 (ptxas waits for each step's)
    # and spills 88 bytes at gpt-oss; with full tiles only it keeps them at every geometry
    HALF_TILES = gl.constexpr(os.environ.get("GLUON_PERSISTENT_HALF", "0") == "1")

    @gluon.jit(do_not_specialize=("nblocks",))
    def gemm2_persistent_kernel(
        a_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr,
        nblocks,
        K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr, HAS_GS: gl.constexpr, ATOMIC: gl.constexpr,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr,
        mma: gl.constexpr, a_l: gl.constexpr, code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr,
        x_l: gl.constexpr, mma_h: gl.constexpr, a_l_h: gl.constexpr, HALF: gl.constexpr,
    ):
        """``gemm2_gluon_kernel``'s tiles (expert block, BN outputs), a program walking every
        ``num_programs``-th one; the blocks past the batch's real ones (expert -1) end the walk, as
        they all come after the real ones. With ``HALF`` and ``HALF_TILES`` a block of at most BM / 2
        rows runs the tile of BM / 2 on the first half of the ring's activation buffers (the first
        copies always fill all BM rows, zeros past the block's, as they are issued before the tile's
        size is looked at); else every tile is a full one."""
        NT: gl.constexpr = (K + BN - 1) // BN
        # the ring (``gluon_kernels._mainloop``'s), kept for the program's whole walk, and its view
        # for half tiles
        ring = _ring(BN, BM, BK, STAGES)
        ring_h = ()
        for i0 in gl.static_range(STAGES):
            ring_h = ring_h + ((ring[i0][0], ring[i0][1].slice(0, BM // 2), ring[i0][2].slice(0, BM // 2)),)
        ntiles = nblocks * NT
        step = gl.num_programs(0)
        t = gl.program_id(0)
        e = gl.load(blk_expert_ptr + t // NT, mask=t < ntiles, other=-1)
        if e >= 0:
            _first_copies(t, e, ring, a_ptr, blk_rows_ptr, w_ptr, s_ptr, K, N, BM, BN, BK, STAGES, code_l, s5_l, x_l)
        while e >= 0:
            pid_m = t // NT
            pid_n = t % NT
            nrow = gl.load(blk_rows_ptr + pid_m)
            if HALF_TILES and HALF:
                if nrow <= BM // 2:
                    acc_h = _tile_loop(pid_m, pid_n, e, nrow, ring_h, a_ptr, w_ptr, s_ptr, K, N, BM, BM // 2, BN, BK,
                                       STAGES, FOLD, mma_h, a_l_h, code_l, p7, s5_l, x_l)
                    tn, en = _next_then_epilogue(acc_h, t + step, ntiles, pid_m, pid_n, e, nrow, ring, a_ptr,
                                                 sorted_ptr, blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr,
                                                 wts_ptr, dst_ptr, K, N, TOPK, HAS_GS, ATOMIC, BM, BM // 2, BN, BK,
                                                 STAGES, code_l, s5_l, x_l)
                else:
                    acc = _tile_loop(pid_m, pid_n, e, nrow, ring, a_ptr, w_ptr, s_ptr, K, N, BM, BM, BN, BK, STAGES,
                                     FOLD, mma, a_l, code_l, p7, s5_l, x_l)
                    tn, en = _next_then_epilogue(acc, t + step, ntiles, pid_m, pid_n, e, nrow, ring, a_ptr,
                                                 sorted_ptr, blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr,
                                                 wts_ptr, dst_ptr, K, N, TOPK, HAS_GS, ATOMIC, BM, BM, BN, BK, STAGES,
                                                 code_l, s5_l, x_l)
            else:
                acc = _tile_loop(pid_m, pid_n, e, nrow, ring, a_ptr, w_ptr, s_ptr, K, N, BM, BM, BN, BK, STAGES, FOLD,
                                 mma, a_l, code_l, p7, s5_l, x_l)
                tn, en = _next_then_epilogue(acc, t + step, ntiles, pid_m, pid_n, e, nrow, ring, a_ptr, sorted_ptr,
                                             blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr, K,
                                             N, TOPK, HAS_GS, ATOMIC, BM, BM, BN, BK, STAGES, code_l, s5_l, x_l)
            t = tn
            e = en

    @gluon.jit
    def _next_then_epilogue(acc, tn, ntiles, pid_m, pid_n, e, nrow, ring, a_ptr, sorted_ptr, blk_expert_ptr,
                            blk_rows_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr, K: gl.constexpr, N: gl.constexpr,
                            TOPK: gl.constexpr, HAS_GS: gl.constexpr, ATOMIC: gl.constexpr, BLK: gl.constexpr,
                            BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                            code_l: gl.constexpr, s5_l: gl.constexpr, x_l: gl.constexpr):
        """Once a tile's main loop has drained the ring: the next tile's (``tn`` of ``ntiles``) first
        copies, then this tile's epilogue (``BM`` of its ``BLK``-row block's rows) while they land.
        Returns ``(tn, its expert)`` (-1: none, and the walk ends)."""
        NT: gl.constexpr = (K + BN - 1) // BN
        en = gl.load(blk_expert_ptr + tn // NT, mask=tn < ntiles, other=-1)
        if en >= 0:
            _first_copies(tn, en, ring, a_ptr, blk_rows_ptr, w_ptr, s_ptr, K, N, BLK, BN, BK, STAGES, code_l, s5_l, x_l)
        _gemm2_epilogue(acc, pid_m * BLK, pid_n, e, nrow, sorted_ptr, gs_ptr, wts_ptr, dst_ptr, K, TOPK, HAS_GS,
                        ATOMIC, BM, BN)
        return tn, en

    @gluon.jit
    def _sources(pid_m, pid_n, e, nrow, a_ptr, w_ptr, s_ptr, K: gl.constexpr, N: gl.constexpr, BLK: gl.constexpr,
                 BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, code_l: gl.constexpr, s5_l: gl.constexpr,
                 x_l: gl.constexpr):
        """A tile's copy and scale sources (the first ``BM`` rows of its ``BLK``-row block), as
        ``gluon_kernels._gemm2_block`` and ``_mainloop`` make them:
        ``(c_src, c_ok, s_src, s_ok, sblk, x_rows, rvalid_x)``."""
        w_g, gvalid, s_row, s_ok, x_rows, rvalid_x = _gemm2_sources(pid_m, pid_n, e, nrow, a_ptr, w_ptr, s_ptr, K, N,
                                                                    BLK, BM, BN, BK, code_l, s5_l, x_l)
        c_src, c_ok, s_src, sblk = _operand_sources(w_g, gvalid, s_row, BN, BK, code_l, s5_l)
        return c_src, c_ok, s_src, s_ok, sblk, x_rows, rvalid_x

    @gluon.jit
    def _first_copies(t, e, ring, a_ptr, blk_rows_ptr, w_ptr, s_ptr, K: gl.constexpr, N: gl.constexpr, BM: gl.constexpr,
                      BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, code_l: gl.constexpr,
                      s5_l: gl.constexpr, x_l: gl.constexpr):
        """Tile ``t``'s first STAGES - 2 steps' copies into the ring's first buffers (``_prefill``), all
        ``BM`` rows of its block."""
        NT: gl.constexpr = (K + BN - 1) // BN
        pid_m = t // NT
        nrow = gl.load(blk_rows_ptr + pid_m)
        c_src, c_ok, s_src, s_ok, sblk, x_rows, rvalid_x = _sources(pid_m, t % NT, e, nrow, a_ptr, w_ptr, s_ptr, K, N,
                                                                    BM, BM, BN, BK, code_l, s5_l, x_l)
        _prefill(ring, c_src, c_ok, x_rows, rvalid_x, N, BK, STAGES, code_l, x_l, STAGES - 2)

    @gluon.jit
    def _tile_loop(pid_m, pid_n, e, nrow, ring, a_ptr, w_ptr, s_ptr, K: gl.constexpr, N: gl.constexpr,
                   BLK: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                   FOLD: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr, code_l: gl.constexpr, p7: gl.constexpr,
                   s5_l: gl.constexpr, x_l: gl.constexpr):
        """``gluon_kernels._steps`` of a tile whose first copies are out (``_first_copies``), on the
        first ``BM`` rows of its ``BLK``-row block (``ring``: views of that many rows): its fp32
        ``[BN, BM]`` accumulator, the ring drained."""
        c_src, c_ok, s_src, s_ok, sblk, x_rows, rvalid_x = _sources(pid_m, pid_n, e, nrow, a_ptr, w_ptr, s_ptr, K, N,
                                                                    BLK, BM, BN, BK, code_l, s5_l, x_l)
        return _steps(ring, c_src, c_ok, s_src, s_ok, sblk, x_rows, rvalid_x, N, BN, BM, BK, STAGES, FOLD, mma, a_l,
                      code_l, p7, x_l)

    # the deferred form's reductions: the previous tile's output in STAGES pieces of its tokens, one
    # after each step of the next tile's first trip (peeled, so that each step's piece is known when
    # compiling)

    @gluon.jit(do_not_specialize=("nblocks",))
    def gemm2_deferred_kernel(
        a_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr,
        nblocks,
        K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr, HAS_GS: gl.constexpr, ATOMIC: gl.constexpr,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr,
        mma: gl.constexpr, a_l: gl.constexpr, code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr,
        x_l: gl.constexpr, mma_h: gl.constexpr, a_l_h: gl.constexpr, HALF: gl.constexpr,
    ):
        """``gemm2_persistent_kernel``'s walk (full tiles only) with each tile's reductions deferred:
        its accumulator goes to shared memory (``out_s``, [BN, BM] fp32 beside the ring: 128 + 96 KB at
        BN = 256, BM = 128), and the next tile's main loop issues them a piece after each of its first
        STAGES steps, so they run beside its MMAs; the last tile's go after the walk."""
        NT: gl.constexpr = (K + BN - 1) // BN
        NSTEP: gl.constexpr = (N + BK - 1) // BK
        gl.static_assert(NSTEP >= STAGES + NSTEP % STAGES)  # (a whole trip to peel)
        gl.static_assert(BM % STAGES == 0)
        ring = _ring(BN, BM, BK, STAGES)
        # outputs contiguous (a reduction's 4 adjacent outputs one 16-byte load), 16-byte vectors
        # swizzled across tokens (the accumulator's store: a warp's lanes on 4 tokens 2 apart)
        out_s = gl.allocate_shared_memory(gl.float32, [BN, BM], gl.SwizzledSharedLayout(4, 1, 8, [0, 1]))
        ntiles = nblocks * NT
        step = gl.num_programs(0)
        t = gl.program_id(0)
        e = gl.load(blk_expert_ptr + t // NT, mask=t < ntiles, other=-1)
        if e >= 0:
            _first_copies(t, e, ring, a_ptr, blk_rows_ptr, w_ptr, s_ptr, K, N, BM, BN, BK, STAGES, code_l, s5_l, x_l)
        pm = t * 0  # the previous tile (none yet: its expert -1)
        pn = t * 0
        pe = e * 0 - 1
        pnrow = t * 0
        while e >= 0:
            pid_m = t // NT
            pid_n = t % NT
            nrow = gl.load(blk_rows_ptr + pid_m)
            acc = _deferred_tile_loop(pid_m, pid_n, e, nrow, ring, out_s, pm, pn, pe, pnrow, a_ptr, sorted_ptr, w_ptr,
                                      s_ptr, gs_ptr, wts_ptr, dst_ptr, K, N, TOPK, HAS_GS, ATOMIC, BM, BN, BK, STAGES,
                                      FOLD, mma, a_l, code_l, p7, s5_l, x_l)
            tn = t + step
            en = gl.load(blk_expert_ptr + tn // NT, mask=tn < ntiles, other=-1)
            if en >= 0:
                _first_copies(tn, en, ring, a_ptr, blk_rows_ptr, w_ptr, s_ptr, K, N, BM, BN, BK, STAGES, code_l,
                              s5_l, x_l)
            # (every warp read the previous tile's pieces in the first trip, and met at a barrier since)
            out_s.store(acc)
            pm = pid_m
            pn = pid_n
            pe = e
            pnrow = nrow
            t = tn
            e = en
        _barrier()
        if pe >= 0:
            for j in gl.static_range(STAGES):
                _reduce_piece(out_s, j, pm, pn, pe, pnrow, sorted_ptr, gs_ptr, wts_ptr, dst_ptr, K, TOPK, HAS_GS,
                              ATOMIC, BM, BN, STAGES)

    @gluon.jit
    def _reduce_piece(out_s, j: gl.constexpr, pm, pn, pe, pnrow, sorted_ptr, gs_ptr, wts_ptr, dst_ptr, K: gl.constexpr,
                      TOPK: gl.constexpr, HAS_GS: gl.constexpr, ATOMIC: gl.constexpr, BM: gl.constexpr,
                      BN: gl.constexpr, PIECES: gl.constexpr):
        """Piece ``j`` of ``PIECES`` (its tokens) of a tile's output in ``out_s`` through the package's
        epilogue (already in its write layout, so its conversion moves nothing)."""
        CW: gl.constexpr = BM // PIECES
        out_l: gl.constexpr = GK._out_layout(BN, CW, gl.num_warps())
        piece = out_s.slice(j * CW, CW, dim=1).load(out_l)
        _gemm2_epilogue(piece, pm * BM + j * CW, pn, pe, pnrow - j * CW, sorted_ptr, gs_ptr, wts_ptr, dst_ptr, K, TOPK,
                        HAS_GS, ATOMIC, CW, BN)

    @gluon.jit
    def _deferred_tile_loop(pid_m, pid_n, e, nrow, ring, out_s, pm, pn, pe, pnrow, a_ptr, sorted_ptr, w_ptr, s_ptr,
                            gs_ptr, wts_ptr, dst_ptr, K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr,
                            HAS_GS: gl.constexpr, ATOMIC: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                            BK: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr, mma: gl.constexpr,
                            a_l: gl.constexpr, code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr,
                            x_l: gl.constexpr):
        """``_tile_loop`` (full tiles): ``gluon_kernels._steps`` with the first trip peeled, and after
        each of its STAGES steps one piece of the previous tile's reductions (``pe`` < 0: none)."""
        BKH: gl.constexpr = BK // 2
        D: gl.constexpr = STAGES - 2
        KS: gl.constexpr = N // 32
        NSTEP: gl.constexpr = (N + BK - 1) // BK
        c_src, c_ok, s_src, s_ok, sblk, x_rows, rvalid_x = _sources(pid_m, pid_n, e, nrow, a_ptr, w_ptr, s_ptr, K, N,
                                                                    BM, BM, BN, BK, code_l, s5_l, x_l)
        sb = _load_scales(s_src, s_ok & (sblk < KS), KS % 2 == 0)
        acc = gl.zeros([BN, BM], gl.float32, layout=mma)
        we_a = gl.zeros([BN, BKH], gl.bfloat16, layout=a_l)
        wo_a = gl.zeros([BN, BKH], gl.bfloat16, layout=a_l)
        we_b = gl.zeros([BN, BKH], gl.bfloat16, layout=a_l)
        wo_b = gl.zeros([BN, BKH], gl.bfloat16, layout=a_l)
        K1: gl.constexpr = NSTEP % STAGES
        for p in gl.static_range(K1):
            acc, sb, we_a, wo_a, we_b, wo_b = _step_in_set((K1 - p) % 2 == 1, p * BK, acc, sb, we_a, wo_a, we_b, wo_b,
                                                           ring[p], ring[(p + D) % STAGES], c_src, c_ok, s_src, s_ok,
                                                           sblk, x_rows, rvalid_x, N, BN, BM, BK, STAGES, FOLD, a_l,
                                                           code_l, p7, x_l)
        for s in gl.static_range(STAGES):  # the first trip, a piece of the previous tile's reductions a step
            acc, sb, we_a, wo_a, we_b, wo_b = _step_in_set(s % 2 == 1, (K1 + s) * BK, acc, sb, we_a, wo_a, we_b, wo_b,
                                                           ring[(K1 + s) % STAGES], ring[(K1 + s + D) % STAGES], c_src,
                                                           c_ok, s_src, s_ok, sblk, x_rows, rvalid_x, N, BN, BM, BK,
                                                           STAGES, FOLD, a_l, code_l, p7, x_l)
            if pe >= 0:
                _reduce_piece(out_s, s, pm, pn, pe, pnrow, sorted_ptr, gs_ptr, wts_ptr, dst_ptr, K, TOPK, HAS_GS,
                              ATOMIC, BM, BN, STAGES)
        for kk in range(1, NSTEP // STAGES):
            for s in gl.static_range(STAGES):
                acc, sb, we_a, wo_a, we_b, wo_b = _step_in_set(s % 2 == 1, (K1 + STAGES * kk + s) * BK, acc, sb, we_a,
                                                               wo_a, we_b, wo_b, ring[(K1 + s) % STAGES],
                                                               ring[(K1 + s + D) % STAGES], c_src, c_ok, s_src, s_ok,
                                                               sblk, x_rows, rvalid_x, N, BN, BM, BK, STAGES, FOLD,
                                                               a_l, code_l, p7, x_l)
        acc, we_a, wo_a, we_b, wo_b = warpgroup_mma_wait(num_outstanding=0, deps=[acc, we_a, wo_a, we_b, wo_b])
        async_copy.wait_group(0)
        _barrier()
        return acc

def use(kernel, programs: int):
    """Make the plans launch ``kernel`` (``gemm2_persistent_kernel`` or ``gemm2_deferred_kernel``)
    wherever they would launch the Gluon GEMM2, its grid capped at ``programs`` an SM. Returns the
    function that undoes it."""
    import torch

    from b12x_ops.backends.triton import plan as P

    cap = programs * torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    original, call = GK.gemm2_gluon_kernel, P.Launch.__call__

    def capped(self, grid, *args):
        if self.fn is kernel:
            grid = (min(grid[0], cap), grid[1], grid[2])
        return call(self, grid, *args)

    GK.gemm2_gluon_kernel, P.Launch.__call__ = kernel, capped

    def undo():
        GK.gemm2_gluon_kernel, P.Launch.__call__ = original, call

    return undo


def main():
    import torch

    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P
    from bench_moe import experiment_points, graph_time, rel_l2

    names = sys.argv[1].split(",")
    sizes = [int(m) for m in sys.argv[2].split(",")]
    programs = [int(p) for p in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1]
    for name, hs, M, (xs, idss, wss, outs) in experiment_points(names, sizes):
        st = hs[0]._state
        gp = st.plans
        base = gp.with_gluon(P.default_config(M, gp.geometry), M)
        print(f"{name} M={M} bm={base.bm} (the plan's GEMM2: {'Gluon' if base.gluon2 else 'tl.dot'} "
              f"{(base.bn2, base.bk2, base.stages2)})", flush=True)
        if not (base.gluon2 and base.bm == 128):
            print("  skipped: not a 128-row Gluon GEMM2 plan", flush=True)
            continue
        det = dataclasses.replace(base, atomic=False)
        gp.reserve(M, det)

        def stage_us(cfg):
            return graph_time([lambda: _launch_all(st, cfg, xs[0], idss[0], wss[0], outs[0], stages=("gemm2",))],
                              reps=20) * 1e6

        def slots(cfg):
            gp.arena.buffers["slots"].zero_()
            _launch_all(st, cfg, xs[0], idss[0], wss[0], outs[0], stages=("gemm2",))
            return gp.arena.buffers["slots"].clone()

        def output(cfg):
            _launch_all(st, cfg, xs[0], idss[0], wss[0], outs[0])
            return outs[0].clone()

        def forget():  # (each kernel compiles its own Gluon GEMM2 launch: the kernels differ, the keys not)
            for k in [k for k in gp.launches if k[0] == "gemm2_gluon"]:
                del gp.launches[k]

        _launch_all(st, base, xs[0], idss[0], wss[0], outs[0])  # (fills the arena: block table, activations)
        want_out = output(base)
        chunked = M > gp.slot_chunk
        want = None if chunked else slots(det)
        print(f"  the package's Gluon GEMM2: {stage_us(base):.1f} us", flush=True)
        forget()
        for (label, kernel), n in [(f, n) for f in (("persistent", gemm2_persistent_kernel),
                                                   ("deferred reductions", gemm2_deferred_kernel)) for n in programs]:
            undo = use(kernel, n)
            try:
                got_out = output(base)
                same = ""
                if want is not None:
                    diff = int((slots(det) != want).sum())
                    same = "; per-slot rows bit-identical" if diff == 0 else f"; {diff} per-slot values differ"
                t = stage_us(base)
                ck = gp.stages(base, M)[2].compiled
                print(f"  {label}, {n} a SM: {t:.1f} us{same}; whole op rel L2 {rel_l2(got_out, want_out):.1e}; "
                      f"{getattr(ck, 'n_regs', '?')} regs, {getattr(ck, 'n_spills', '?')} spills, "
                      f"{ck.metadata.shared} B shared", flush=True)
            except Exception as ex:  # (a form that fails to compile or launch: say so, go on)
                print(f"  {label}, {n} a SM: FAILED {type(ex).__name__}: {str(ex)[-400:]}", flush=True)
            finally:
                undo()
                forget()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
