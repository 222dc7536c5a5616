"""GEMM2 in Gluon with warp specialization (sm_90), against the package's Gluon GEMM2 and its tl.dot GEMM2.

    python benchmarks/experiments/gluon_ws.py qwen3-30b-a3b 2048,8192 [128/64/4/168,...]   # a CUDA GPU

``gemm2_ws_kernel`` computes ``gluon_kernels.gemm2_gluon_kernel``'s tile (expert block, BN outputs) with
two partitions instead of one:

* a **producer** (one warp, few registers): for each K step, waits until the step's ring buffers are
  free (``empty``), copies the step's codes and the block's activation rows into them (``cp.async``)
  and arrives on the step's ``full`` barrier once its copies have landed (``cp.async.mbarrier.arrive``,
  one arrival a thread);
* the **consumers** (the default partition: BN / 16 warps, a warpgroup 64 output rows): wait on
  ``full``, decode the codes into the wgmma's register operand, issue the step's two MMAs, and once a
  wait covers the previous step's MMAs, arrive on its ``empty`` barrier.

Two forms are written and compile-checked for sm_90 but not yet run: ``GLUON_WS_PRODUCER_WARPS=4``
(the producer's whole warpgroup issues the copies) and ``GLUON_WS_ACT_TMA=1`` (the activation rows by
two TMA copies a step from a device-side descriptor; ``ACT_TMA`` says what it assumes).

Where the package's kernel meets every step at a CTA barrier (a warp waits for the slowest before
it may refill a buffer, and issues its own share of the copies), here a consumer warp waits only
for its data. The K loop runs over whole rings (steps past the reduction are copied as zeros and
multiplied), so each step's ring buffers and register set are known when compiling.

Per geometry and M: the default plan's GEMM2 stage (tl.dot or Gluon as the plan has it), the
package's Gluon GEMM2 in each form, then this kernel in each form (``bn/bk/stages/maxnreg``): the
stage's time alone (CUDA-graph replay, us per layer), and its per-slot rows against the tl.dot
GEMM2's of the same tile where the plan's calls are not chunked (bit for bit).
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
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from b12x_ops.backends.triton.gluon_kernels import _cp_async, _decode_operands, _gemm2_epilogue, _tile_index
    from b12x_ops.backends.triton.kernels import _block_tile

    # the producer warp's registers (its partition is allocated a warpgroup's worth: 4 x 32 x this);
    # with ``maxnreg`` 168 and 8 consumer warps that leaves the consumers 208 a thread
    PRODUCER_REGS = gl.constexpr(88)
    # the producer's warps: its partition gets a warpgroup's registers either way
    PRODUCER_WARPS = gl.constexpr(int(os.environ.get("GLUON_WS_PRODUCER_WARPS", "1")))
    # the activation rows by TMA (two copies a step, a device-side descriptor) instead of cp.async:
    # a [BK / 32, BM, 16] box of the rows seen as [N / 32 chunks, rows, 32], whose 32-byte-swizzled
    # image is assumed to be the [BM, BK / 2] operand tile's 32-byte-swizzled NVMMA layout (column
    # blocks of 16 elements, one after the other). Not yet run: the bits against tl.dot say.
    ACT_TMA = gl.constexpr(os.environ.get("GLUON_WS_ACT_TMA", "0") == "1")

    @gluon.jit(do_not_specialize=("nblocks",))
    def gemm2_ws_kernel(
        a_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr,
        nblocks,
        K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr, HAS_GS: gl.constexpr, ATOMIC: gl.constexpr,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr,
        mma: gl.constexpr, a_l: gl.constexpr, code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr,
        x_l: gl.constexpr, mma_h: gl.constexpr, a_l_h: gl.constexpr, HALF: gl.constexpr,
    ):
        """``gemm2_gluon_kernel``'s program (its signature: a drop-in for the experiment), warp-specialized.
        ``HALF`` is ignored (always the full tile)."""
        pid_m, pid_n, e = _block_tile(blk_expert_ptr, K, BN)
        if e < 0:
            return
        nrow = gl.load(blk_rows_ptr + pid_m)
        G: gl.constexpr = BN // 16
        Q: gl.constexpr = BK // 64
        BKH: gl.constexpr = BK // 2
        gl.static_assert(STAGES % 2 == 0)
        x_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, BKH * 2), element_bitwidth=16, rank=2)
        x3_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=3)
        c_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
        ring = ()
        full = ()
        empty = ()
        for i0 in gl.static_range(STAGES):
            if ACT_TMA:
                ring = ring + ((gl.allocate_shared_memory(gl.uint8, [G, Q, 32, 16], c_sl),
                                gl.allocate_shared_memory(gl.bfloat16, [BK // 32, BM, 16], x3_sl),
                                gl.allocate_shared_memory(gl.bfloat16, [BK // 32, BM, 16], x3_sl)),)
            else:
                ring = ring + ((gl.allocate_shared_memory(gl.uint8, [G, Q, 32, 16], c_sl),
                                gl.allocate_shared_memory(gl.bfloat16, [BM, BKH], x_sl),
                                gl.allocate_shared_memory(gl.bfloat16, [BM, BKH], x_sl)),)
            f = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            m_ = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            # (each producer thread once its copies land; with ACT_TMA also the TMA's expect-tx arrival)
            mbarrier.init(f, count=32 * PRODUCER_WARPS + (1 if ACT_TMA else 0))
            mbarrier.init(m_, count=1)
            full = full + (f,)
            empty = empty + (m_,)
        acc = gl.warp_specialize([
            (_consumers, (ring, full, empty, pid_n, e, s_ptr, K, N, BM, BN, BK, STAGES, FOLD, mma, a_l, code_l, p7,
                          s5_l)),
            (_producer, (ring, full, empty, a_ptr, w_ptr, pid_m, pid_n, e, nrow, nblocks, K, N, BM, BN, BK, STAGES)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])[0]
        _gemm2_epilogue(acc, pid_m * BM, pid_n, e, nrow, sorted_ptr, gs_ptr, wts_ptr, dst_ptr, K, TOPK, HAS_GS, ATOMIC,
                        BM, BN)

    @gluon.jit
    def _producer(ring, full, empty, a_ptr, w_ptr, pid_m, pid_n, e, nrow, nblocks, K: gl.constexpr, N: gl.constexpr,
                  BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
        """``PRODUCER_WARPS`` warps: each step's codes and activation rows into its ring buffers, once free."""
        G: gl.constexpr = BN // 16
        Q: gl.constexpr = BK // 64
        BKH: gl.constexpr = BK // 2
        KH: gl.constexpr = N // 2
        NQ: gl.constexpr = (KH + 31) // 32
        NSTEP: gl.constexpr = (N + BK - 1) // BK
        # (this warp's own layouts: 16 contiguous bytes a thread)
        pc_l: gl.constexpr = gl.BlockedLayout([1, 1, 1, 16], [1, 1, 32, 1], [PRODUCER_WARPS, 1, 1, 1], [3, 2, 1, 0])
        px_l: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [PRODUCER_WARPS, 1], [1, 0])
        g_c = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, pc_l))))
        q_c = gl.arange(0, Q, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, pc_l))))
        l_c = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, pc_l))))
        b_c = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, pc_l))))
        w_g = w_ptr + e.to(gl.int64) * (K * NQ * 32) + (pid_n * BN // 16 + g_c) * (NQ * 512)
        c_src = (w_g[:, None, None, None] + (q_c[None, :, None, None] * 32 + l_c[None, None, :, None]) * 16
                 + b_c[None, None, None, :])
        c_ok = ((pid_n * BN + 16 * g_c) < K)[:, None, None, None] & (l_c >= 0)[None, None, :, None] \
            & (b_c >= 0)[None, None, None, :]
        if ACT_TMA:  # (rows past the block's real ones are read as they are: only their own columns use them)
            x3_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=3)
            desc = tma.make_tensor_descriptor(a_ptr, [N // 32, nblocks * BM, 32], [32, N, 1], [BK // 32, BM, 16], x3_sl)
        else:
            offs_r = gl.arange(0, BM, layout=gl.SliceLayout(1, px_l))
            offs_h = gl.arange(0, BKH, layout=gl.SliceLayout(0, px_l))
            x_rows = a_ptr + (pid_m * BM + offs_r).to(gl.int64)[:, None] * N \
                + (32 * (offs_h // 16) + offs_h % 16)[None, :]
            rvalid = offs_r < nrow
        for kk in range((NSTEP + STAGES - 1) // STAGES):
            for s in gl.static_range(STAGES):
                kd = (kk * STAGES + s) * BK
                mbarrier.wait(empty[s], (kk & 1) ^ 1)  # (a fresh barrier's phase 1 is complete: no wait)
                bufs = ring[s]
                if ACT_TMA:  # (chunks past N are out of the box: zeros, their bytes counted all the same)
                    mbarrier.expect(full[s], 2 * BM * BKH * 2)
                    tma.async_copy_global_to_shared(desc, [kd // 32, pid_m * BM, 0], full[s], bufs[1])
                    tma.async_copy_global_to_shared(desc, [kd // 32, pid_m * BM, 16], full[s], bufs[2])
                else:
                    xm = rvalid[:, None] & ((kd // 2 + offs_h) < KH)[None, :]
                    _cp_async(bufs[1], x_rows + kd, mask=xm)
                    _cp_async(bufs[2], x_rows + kd + 16, mask=xm)
                _cp_async(bufs[0], c_src + (kd // 64) * 512, mask=c_ok & ((kd // 64 + q_c) < NQ)[None, :, None, None])
                async_copy.mbarrier_arrive(full[s], increment_count=False)

    @gluon.jit
    def _consumers(ring, full, empty, pid_n, e, s_ptr, K: gl.constexpr, N: gl.constexpr, BM: gl.constexpr,
                   BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr, mma: gl.constexpr,
                   a_l: gl.constexpr, code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr):
        """The default partition: decode, MMA, free each step's buffers once a wait covers its MMAs."""
        G: gl.constexpr = BN // 16
        Q: gl.constexpr = BK // 64
        BKH: gl.constexpr = BK // 2
        NS: gl.constexpr = N // 32
        NSTEP: gl.constexpr = (N + BK - 1) // BK
        g_c, q_c, l_c, b_c, g_s, q_s, l_s, s_s, h_s = _tile_index(BN, BK, code_l, s5_l)
        r_s = (pid_n * BN + 16 * g_s)[:, None, None, None, None] + 8 * h_s[None, None, None, None, :] \
            + (l_s // 4)[None, None, :, None, None]  # the lane's output rows
        s_src = s_ptr + e.to(gl.int64) * (K * NS) + r_s * NS
        s_ok = r_s < K
        sblk = 2 * q_s[None, :, None, None, None] + s_s[None, None, None, :, None]
        sb = gl.load(s_src + sblk, mask=s_ok & (sblk < NS), other=0).to(gl.int32)
        acc = gl.zeros([BN, BM], gl.float32, layout=mma)
        we_a = gl.zeros([BN, BKH], gl.bfloat16, layout=a_l)
        wo_a = gl.zeros([BN, BKH], gl.bfloat16, layout=a_l)
        we_b = gl.zeros([BN, BKH], gl.bfloat16, layout=a_l)
        wo_b = gl.zeros([BN, BKH], gl.bfloat16, layout=a_l)
        X2_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
        for kk in range((NSTEP + STAGES - 1) // STAGES):
            for s in gl.static_range(STAGES):
                k0 = (kk * STAGES + s) * BK
                bufs = ring[s]
                mbarrier.wait(full[s], kk & 1)
                we, wo = _decode_operands(bufs[0].load(code_l), sb, G, Q, BN, BKH, FOLD, a_l, p7)
                kn = k0 + BK
                sb = gl.load(s_src + kn // 32 + sblk, mask=s_ok & ((kn // 32 + sblk) < NS), other=0).to(gl.int32)
                if ACT_TMA:
                    xe = bufs[1]._reinterpret(gl.bfloat16, [BM, BKH], X2_SL)
                    xo = bufs[2]._reinterpret(gl.bfloat16, [BM, BKH], X2_SL)
                else:
                    xe = bufs[1]
                    xo = bufs[2]
                acc = warpgroup_mma(we, xe.permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma(wo, xo.permute((1, 0)), acc, is_async=True)
                if s % 2 == 1:
                    we_b, wo_b = we, wo
                else:
                    we_a, wo_a = we, wo
                # the previous step's MMAs are done: its buffers may be refilled
                acc, we_a, wo_a, we_b, wo_b = warpgroup_mma_wait(num_outstanding=2, deps=[acc, we_a, wo_a, we_b, wo_b])
                fence_async_shared()
                mbarrier.arrive(empty[(s + STAGES - 1) % STAGES], pred=(kk * STAGES + s) > 0)
        acc, we_a, wo_a, we_b, wo_b = warpgroup_mma_wait(num_outstanding=0, deps=[acc, we_a, wo_a, we_b, wo_b])
        return (acc,)


def use(maxnreg: int):
    """Make the package's plans launch ``gemm2_ws_kernel`` wherever they would launch the Gluon GEMM2,
    compiled with ``maxnreg`` registers a thread (a warp-specialized kernel assumes 256 without one).
    Returns the function that undoes it."""
    from b12x_ops.backends.triton import plan as P

    original, real = GK.gemm2_gluon_kernel, P.Launch.__init__

    def init(self, fn, constexprs, num_warps, num_stages, maxnreg_=None, pdl=False):
        real(self, fn, constexprs, num_warps, num_stages, maxnreg if fn is gemm2_ws_kernel else maxnreg_, pdl)

    GK.gemm2_gluon_kernel, P.Launch.__init__ = gemm2_ws_kernel, init

    def undo():
        GK.gemm2_gluon_kernel, P.Launch.__init__ = original, real

    return undo


def main():
    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P
    from bench_moe import experiment_points, graph_time

    names = sys.argv[1].split(",")
    sizes = [int(m) for m in sys.argv[2].split(",")]
    if GK.HAS_GLUON and ACT_TMA.value:  # (a device-side TMA descriptor lives in global scratch memory)
        import torch
        import triton

        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    forms = [tuple(map(int, f.split("/"))) for f in sys.argv[3].split(",")] if len(sys.argv) > 3 else [
        (128, 64, 4, 168)]
    for name, hs, M, (xs, idss, wss, outs) in experiment_points(names, sizes):
        st = hs[0]._state
        gp = st.plans
        base = gp.with_gluon(P.default_config(M, gp.geometry))
        gp.reserve(M, dataclasses.replace(base, atomic=False))
        _launch_all(st, base, xs[0], idss[0], wss[0], outs[0], stages=("prologue",))
        print(f"{name} M={M} bm={base.bm} (the plan's GEMM2: {'Gluon' if base.gluon2 else 'tl.dot'} "
              f"{(base.bn2, base.bk2, base.stages2)})", flush=True)

        def stage_us(cfg):
            return graph_time([lambda: _launch_all(st, cfg, xs[0], idss[0], wss[0], outs[0], stages=("gemm2",))],
                              reps=20) * 1e6

        print(f"  the plan's GEMM2: {stage_us(base):.1f} us", flush=True)
        for ws in (False, True) if GK.HAS_GLUON else (False,):
            for bn, bk, stages, maxnreg in forms:
                undo = use(maxnreg) if ws else (lambda: None)
                try:
                    _time_form(st, gp, base, M, xs, idss, wss, outs, stage_us, ws, bn, bk, stages, maxnreg)
                finally:  # (the next form compiles its own Gluon GEMM2 launch: the kernels differ, the keys not)
                    undo()
                    for k in [k for k in gp.launches if k[0] == "gemm2_gluon"]:
                        del gp.launches[k]


def _time_form(st, gp, base, M, xs, idss, wss, outs, stage_us, ws, bn, bk, stages, maxnreg):
    """One form's line: its bits against the tl.dot GEMM2 of its tile (where calls are not chunked),
    its stage time, registers and shared memory."""
    import torch

    from b12x_ops.backends.triton import _launch_all

    cfg = dataclasses.replace(base, gluon2=True, bn2=bn, bk2=bk, stages2=stages)
    label = f"{'warp-specialized' if ws else 'package Gluon'} GEMM2 bn {bn} bk {bk} st {stages}" + (
        f" maxnreg {maxnreg}" if ws else "")
    try:
        same = ""
        if M <= gp.slot_chunk:
            tlc = dataclasses.replace(base, gluon2=False, bn2=bn, bk2=bk, warps2=bn // 32, stages2=2, atomic=False)
            gp.arena.buffers["slots"].zero_()
            _launch_all(st, tlc, xs[0], idss[0], wss[0], outs[0], stages=("gemm2",))
            want = gp.arena.buffers["slots"].clone()
            gp.arena.buffers["slots"].zero_()
            _launch_all(st, dataclasses.replace(cfg, atomic=False), xs[0], idss[0], wss[0], outs[0], stages=("gemm2",))
            torch.cuda.synchronize()
            diff = (gp.arena.buffers["slots"] != want).sum().item()
            same = "; bit-identical to tl.dot" if diff == 0 else f"; {diff} values differ from tl.dot"
        t = stage_us(cfg)
        ck = gp.stages(cfg, M)[2].compiled
        print(f"  {label}: {t:.1f} us{same}; {getattr(ck, 'n_regs', '?')} regs, {getattr(ck, 'n_spills', '?')} "
              f"spills, {ck.metadata.shared} B shared", flush=True)
    except Exception as ex:  # (a form that fails to compile or launch: say so, go on)
        print(f"  {label}: FAILED {type(ex).__name__}: {str(ex)[-400:]}", flush=True)


if __name__ == "__main__":
    main()
