"""How fast could the Gluon GEMM1 be on fp8 MMAs? A timing probe, not a kernel: its outputs are wrong.

    python benchmarks/experiments/fp8_probe.py qwen3-30b-a3b,dsv4.1-tp4,gpt-oss-120b 2048,8192   # a CUDA GPU

At 128-row blocks the package's Gluon GEMM1 runs at about 60 % of the H200's measured bf16 peak, and
its main loop issues about a quarter of what the SM could (offline count: 89 instructions a warp a
K step of 64 against a step's ~1400 cycles of bf16 MMA an SM). Hopper's e4m3 wgmma is twice the bf16
rate, and a weight's E2M1 code is an E4M3 byte after a few bit moves, so the question before any
layout work (the handle's code layout is shaped for the bf16 decode; an fp8 decode wants its own,
``benchmarks/NOTES.md``) is what the tensor cores would give: this kernel is the package's GEMM1
program (``gluon_kernels.gemm1_gluon_kernel``: the same grid, ring, copies, register sets, waits and
epilogue) with

* the activations copied as ``[BM, BK]`` e4m3 bytes (half the bytes of the two bf16 halves; read
  from the package's bf16 x buffer as bytes, so their values are garbage),
* each code word turned into two e4m3 words by a mask, a shift and a byte add of the scale
  (``_DECODE8``, 7 instructions for 8 weights against the bf16 decode's 13; a real fp8 decode
  would cost about this after a layout change, plus per-block table work), joined into the
  ``[R, BK]`` e4m3 operand (k width 4) in registers,
* one e4m3 wgmma a step (``m64nBMk32`` twice) instead of the two bf16 ones.

``FP8_PROBE_DECODE=0`` skips the decode too (the code bytes are the operand as they are): what the
MMAs and the copies alone take.

Per geometry and M (plans with both Gluon GEMMs): GEMM1 alone, GEMM2 alone (``gemm2_fp8_probe_kernel``:
the same main loop, the intermediate's bytes read as e4m3) and the whole op with both, the package's
kernels against the probe's, CUDA-graph replay over the benchmark's layers, us per layer, the median
of alternating rounds, with each launch's registers and spills. Results: ``benchmarks/results/fp8_mma.md``.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))

from b12x_ops.backends.triton import gluon_kernels as GK  # noqa: E402

ROUNDS = 5
REPS = 10

if GK.HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from b12x_ops.backends.triton.gluon_kernels import (_barrier, _cp_async, _gemm1_epilogue, _gemm1_sources,
                                                        _gemm2_epilogue, _operand_sources, _tile_index, _to_operand,
                                                        warpgroup_mma, warpgroup_mma_wait)
    from b12x_ops.backends.triton.kernels import _block_tile

    DECODE = gl.constexpr(os.environ.get("FP8_PROBE_DECODE", "1") != "0")

    # a code word ($2) and its 4 scale bytes ($3) -> two words of 4 e4m3 bytes: the even nibbles'
    # bits 7 and 4..2 by one mask, the odd ones' after a shift, the scale added to each byte's
    # exponent field (no carry handling: the values are not the weights')
    _DECODE8 = gl.constexpr("""
{
.reg .b32 s, e, o;
shl.b32 s, $3, 3;
and.b32 e, $2, 0x9C9C9C9C;
add.u32 $0, e, s;
shl.b32 o, $2, 2;
and.b32 o, o, 0x9C9C9C9C;
add.u32 $1, o, s;
}
""")

    @gluon.constexpr_function
    def _mma8(R, BM):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[R // 16, 1], instr_shape=[16, BM, 32])

    @gluon.constexpr_function
    def _a8(R, BM):
        return gl.DotOperandLayout(operand_index=0, parent=_mma8(R, BM), k_width=4)

    @gluon.constexpr_function
    def _x8(R, BK):
        return gl.BlockedLayout([1, 16], [32 // (BK // 16), BK // 16], [R // 16, 1], [1, 0])

    @gluon.jit
    def _ring8(R: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
        x_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, BK), element_bitwidth=8, rank=2)
        c_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
        ring = ()
        for i0 in gl.static_range(STAGES):
            ring = ring + ((gl.allocate_shared_memory(gl.uint8, [R // 16, BK // 64, 32, 16], c_sl),
                            gl.allocate_shared_memory(gl.float8e4nv, [BM, BK], x_sl)),)
        return ring

    @gluon.jit
    def _copies8(kd, bufs, c_src, c_ok, x_rows, rvalid_x, offs_k, q_c, K: gl.constexpr, NQ: gl.constexpr):
        xm = rvalid_x[:, None] & ((kd + offs_k) < K)[None, :]
        _cp_async(bufs[1], x_rows + kd, mask=xm)
        _cp_async(bufs[0], c_src + (kd // 64) * 512, mask=c_ok & ((kd // 64 + q_c) < NQ)[None, :, None, None])

    @gluon.jit
    def _decode8(codes, sb, G: gl.constexpr, Q: gl.constexpr, R: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
                 p7: gl.constexpr):
        BKH: gl.constexpr = BK // 2
        t = _to_operand(codes, G, Q, R, BKH)
        if DECODE:
            sc = gl.expand_dims(gl.expand_dims(sb.to(gl.uint8), 4), 6)
            sc = gl.broadcast(sc, gl.full([G, Q, 32, 2, 2, 2, 2], 0, gl.uint8, layout=p7))[0]
            sc = _to_operand(gl.reshape(sc, (G, Q, 32, 16)), G, Q, R, BKH)
            sc = gl.convert_layout(sc, t.type.layout, assert_trivial=True)
            e8, o8 = gl.inline_asm_elementwise(_DECODE8, "=r,=r,r,r", [t, sc], dtype=(gl.float8e4nv, gl.float8e4nv),
                                               is_pure=True, pack=4)
        else:
            e8 = t.to(gl.float8e4nv, bitcast=True)
            o8 = e8
        w8 = gl.reshape(gl.join(e8, o8), (R, BK))
        return gl.convert_layout(w8, _a8(R, BM))

    @gluon.jit
    def _step8(k0, acc, sb, cur, nxt, c_src, c_ok, s_src, s_ok, sblk, x_rows, rvalid_x, RED: gl.constexpr,
               R: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, code_l: gl.constexpr,
               p7: gl.constexpr):
        G: gl.constexpr = R // 16
        Q: gl.constexpr = BK // 64
        KS: gl.constexpr = RED // 32
        NQ: gl.constexpr = (RED // 2 + 31) // 32
        D: gl.constexpr = STAGES - 2
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, _x8(R, BK)))
        q_c = gl.arange(0, Q, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, code_l))))
        async_copy.wait_group(D - 1)
        _barrier()
        _copies8(k0 + D * BK, nxt, c_src, c_ok, x_rows, rvalid_x, offs_k, q_c, RED, NQ)
        async_copy.commit_group()
        w8 = _decode8(cur[0].load(code_l), sb, G, Q, R, BM, BK, p7)
        kn = k0 + BK
        sb = gl.load(s_src + kn // 32, mask=s_ok & ((kn // 32 + sblk) < KS), other=0).to(gl.int32)
        acc = warpgroup_mma(w8, cur[1].permute((1, 0)), acc, is_async=True)
        # (triton 3.6's wait takes no 8-bit operands in its list, so only the accumulator is listed:
        # the operand registers may be rewritten while an MMA reads them, which changes values, not
        # the timing this probe is for)
        return warpgroup_mma_wait(num_outstanding=1, deps=[acc]), sb

    @gluon.jit
    def _mainloop8(w_g, gvalid, s_row, s_ok, x_rows, rvalid_x, RED: gl.constexpr, R: gl.constexpr, BM: gl.constexpr,
                   BK: gl.constexpr, STAGES: gl.constexpr, code_l: gl.constexpr, p7: gl.constexpr,
                   s5_l: gl.constexpr):
        KS: gl.constexpr = RED // 32
        NQ: gl.constexpr = (RED // 2 + 31) // 32
        D: gl.constexpr = STAGES - 2
        NSTEP: gl.constexpr = (RED + BK - 1) // BK
        ring = _ring8(R, BM, BK, STAGES)
        c_src, c_ok, s_src, sblk = _operand_sources(w_g, gvalid, s_row, R, BK, code_l, s5_l)
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, _x8(R, BK)))
        q_c = gl.arange(0, BK // 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, code_l))))
        for i0 in gl.static_range(STAGES - 2):
            if i0 * BK < RED:
                _copies8(i0 * BK, ring[i0], c_src, c_ok, x_rows, rvalid_x, offs_k, q_c, RED, NQ)
            async_copy.commit_group()
        sb = gl.load(s_src, mask=s_ok & (sblk < KS), other=0).to(gl.int32)
        acc = gl.zeros([R, BM], gl.float32, layout=_mma8(R, BM))
        K1: gl.constexpr = NSTEP % STAGES
        for p in gl.static_range(K1):
            acc, sb = _step8(p * BK, acc, sb, ring[p], ring[(p + D) % STAGES], c_src, c_ok, s_src, s_ok, sblk, x_rows,
                             rvalid_x, RED, R, BM, BK, STAGES, code_l, p7)
        for kk in range(NSTEP // STAGES):
            for s in gl.static_range(STAGES):
                acc, sb = _step8((K1 + STAGES * kk + s) * BK, acc, sb, ring[(K1 + s) % STAGES],
                                 ring[(K1 + s + D) % STAGES], c_src, c_ok, s_src, s_ok, sblk, x_rows, rvalid_x, RED, R,
                                 BM, BK, STAGES, code_l, p7)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        async_copy.wait_group(0)
        _barrier()
        return acc

    @gluon.jit
    def _block8(pid_m, pid_n, e, nrow, xq_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, K: gl.constexpr,
                N: gl.constexpr, TOPK: gl.constexpr, UP_FIRST: gl.constexpr, HAS_LIMIT: gl.constexpr,
                HAS_GS: gl.constexpr, BLK: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                STAGES: gl.constexpr, code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr):
        """``gluon_kernels._gemm1_block`` on the probe's main loop."""
        R: gl.constexpr = 2 * BN
        x_l: gl.constexpr = _x8(R, BK)
        offs_r = gl.arange(0, BM, layout=gl.SliceLayout(1, x_l))
        rvalid_x = offs_r < nrow
        slot_x = gl.load(sorted_ptr + pid_m * BLK + offs_r, mask=rvalid_x, other=0)
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, x_l))
        x8 = xq_ptr.to(gl.pointer_type(gl.float8e4nv))  # (the bf16 buffer's first K bytes a row: garbage values)
        x_rows = x8 + (slot_x // TOPK).to(gl.int64)[:, None] * (2 * K) + offs_k[None, :]
        w_g, gvalid, s_row, s_ok = _gemm1_sources(pid_n, e, w_ptr, s_ptr, K, N, UP_FIRST, BN, BK, code_l, s5_l)
        acc = _mainloop8(w_g, gvalid, s_row, s_ok, x_rows, rvalid_x, K, R, BM, BK, STAGES, code_l, p7, s5_l)
        _gemm1_epilogue(acc, pid_m * BLK, pid_n, e, nrow, gs_ptr, a_ptr, limit, N, HAS_LIMIT, HAS_GS, BM, BN)

    @gluon.jit(do_not_specialize=("nblocks", "zrows", "M"))
    def gemm1_fp8_probe_kernel(
        xq_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, acc_ptr,
        nblocks, limit, zrows, M,
        K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr, UP_FIRST: gl.constexpr,
        HAS_LIMIT: gl.constexpr, HAS_GS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
        BK: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr,
        code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr, x_l: gl.constexpr, mma_h: gl.constexpr,
        a_l_h: gl.constexpr, HALF: gl.constexpr, ZERO_ACC: gl.constexpr,
    ):
        """A drop-in for ``gluon_kernels.gemm1_gluon_kernel`` (its signature; the zeroing of GEMM2's
        accumulator is not done: the probe times the default plans, where the prologue does it)."""
        gl.static_assert(ZERO_ACC == 0)
        pid_m, pid_n, e = _block_tile(blk_expert_ptr, N, BN)
        if e < 0:
            return
        nrow = gl.load(blk_rows_ptr + pid_m)
        if HALF:
            if nrow <= BM // 2:
                _block8(pid_m, pid_n, e, nrow, xq_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, K, N, TOPK,
                        UP_FIRST, HAS_LIMIT, HAS_GS, BM, BM // 2, BN, BK, STAGES, code_l, p7, s5_l)
            else:
                _block8(pid_m, pid_n, e, nrow, xq_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, K, N, TOPK,
                        UP_FIRST, HAS_LIMIT, HAS_GS, BM, BM, BN, BK, STAGES, code_l, p7, s5_l)
        else:
            _block8(pid_m, pid_n, e, nrow, xq_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, K, N, TOPK,
                    UP_FIRST, HAS_LIMIT, HAS_GS, BM, BM, BN, BK, STAGES, code_l, p7, s5_l)


    @gluon.jit
    def _block8_2(pid_m, pid_n, e, nrow, a_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr, K: gl.constexpr,
                  N: gl.constexpr, TOPK: gl.constexpr, HAS_GS: gl.constexpr, ATOMIC: gl.constexpr,
                  BLK: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                  code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr):
        """``gluon_kernels._gemm2_block`` on the probe's main loop (the activations' bytes as e4m3)."""
        NS: gl.constexpr = N // 32
        NQ: gl.constexpr = (N // 2 + 31) // 32
        x_l: gl.constexpr = _x8(BN, BK)
        offs_r = gl.arange(0, BM, layout=gl.SliceLayout(1, x_l))
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, x_l))
        a8 = a_ptr.to(gl.pointer_type(gl.float8e4nv))
        x_rows = a8 + (pid_m * BLK + offs_r).to(gl.int64)[:, None] * (2 * N) + offs_k[None, :]
        g_c, q_c, l_c, b_c, g_s, q_s, l_s, s_s, h_s = _tile_index(BN, BK, code_l, s5_l)
        w_g = w_ptr + e.to(gl.int64) * (K * NQ * 32) + (pid_n * BN // 16 + g_c) * (NQ * 512)
        r_s = (pid_n * BN + 16 * g_s)[:, None, None, None, None] + 8 * h_s[None, None, None, None, :] \
            + (l_s // 4)[None, None, :, None, None]
        s_row = s_ptr + e.to(gl.int64) * (K * NS) + r_s * NS
        acc = _mainloop8(w_g, (pid_n * BN + 16 * g_c) < K, s_row, r_s < K, x_rows, offs_r < nrow, N, BN, BM, BK,
                         STAGES, code_l, p7, s5_l)
        _gemm2_epilogue(acc, pid_m * BLK, pid_n, e, nrow, sorted_ptr, gs_ptr, wts_ptr, dst_ptr, K, TOPK, HAS_GS, ATOMIC,
                        BM, BN)

    @gluon.jit(do_not_specialize=("nblocks",))
    def gemm2_fp8_probe_kernel(
        a_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr,
        nblocks,
        K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr, HAS_GS: gl.constexpr, ATOMIC: gl.constexpr,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr,
        mma: gl.constexpr, a_l: gl.constexpr, code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr,
        x_l: gl.constexpr, mma_h: gl.constexpr, a_l_h: gl.constexpr, HALF: gl.constexpr,
    ):
        """A drop-in for ``gluon_kernels.gemm2_gluon_kernel`` (its signature)."""
        pid_m, pid_n, e = _block_tile(blk_expert_ptr, K, BN)
        if e < 0:
            return
        nrow = gl.load(blk_rows_ptr + pid_m)
        if HALF:
            if nrow <= BM // 2:
                _block8_2(pid_m, pid_n, e, nrow, a_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr, K, N, TOPK,
                          HAS_GS, ATOMIC, BM, BM // 2, BN, BK, STAGES, code_l, p7, s5_l)
            else:
                _block8_2(pid_m, pid_n, e, nrow, a_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr, K, N, TOPK,
                          HAS_GS, ATOMIC, BM, BM, BN, BK, STAGES, code_l, p7, s5_l)
        else:
            _block8_2(pid_m, pid_n, e, nrow, a_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr, K, N, TOPK,
                      HAS_GS, ATOMIC, BM, BM, BN, BK, STAGES, code_l, p7, s5_l)


    # (the code word as the four bf16 pairs, each its own register: one instruction a pair where the
    # decode takes about three and a quarter)
    _UNDECODED = gl.constexpr("xor.b32 $0, $4, 1;\nxor.b32 $1, $4, 2;\nxor.b32 $2, $4, 3;\nxor.b32 $3, $4, 4;")

    @gluon.jit
    def _undecoded_operands(codes, sb, G: gl.constexpr, Q: gl.constexpr, R: gl.constexpr, BKH: gl.constexpr,
                            FOLD: gl.constexpr, a_l: gl.constexpr, p7: gl.constexpr):
        """A stand-in for ``gluon_kernels._decode_operands`` (the ``bf16 undecoded`` form): each code word's
        bits as the bf16 operands, no decode and no scales (values garbage)."""
        t = _to_operand(codes, G, Q, R, BKH)
        we, wo = gl.inline_asm_elementwise(_UNDECODED, "=r,=r,=r,=r,r", [t], dtype=(gl.bfloat16, gl.bfloat16),
                                           is_pure=True, pack=4)
        return gl.convert_layout(we, a_l, assert_trivial=True), gl.convert_layout(wo, a_l, assert_trivial=True)


def _forget_compiled():
    """Make every Gluon function of ``gluon_kernels`` hash its callees again and drop its compiled kernels:
    a JIT function keeps the hash of its dependencies (and its kernels) from its first compile, so a
    swapped ``_decode_operands`` would otherwise go unseen by kernels compiled before the swap."""
    for v in vars(GK).values():
        if hasattr(v, "device_caches") and hasattr(v, "hash"):
            v.hash = None
            v.device_caches.clear()


def use(gemm1, gemm2, decode=None):
    """Make the plans launch ``gemm1`` and ``gemm2`` wherever they would launch the Gluon GEMMs (and the
    package's kernels decode with ``decode`` instead of ``_decode_operands``, if given); returns the undo."""
    original = GK.gemm1_gluon_kernel, GK.gemm2_gluon_kernel, GK._decode_operands
    GK.gemm1_gluon_kernel, GK.gemm2_gluon_kernel = gemm1, gemm2
    if decode is not None:
        GK._decode_operands = decode
        _forget_compiled()

    def undo():
        GK.gemm1_gluon_kernel, GK.gemm2_gluon_kernel, GK._decode_operands = original
        if decode is not None:
            _forget_compiled()

    return undo


def main():
    import torch

    from b12x_ops.backends.triton import _ALL, _launch_all
    from b12x_ops.backends.triton import plan as P
    from bench_moe import experiment_points, time_events, warm_graph

    names = sys.argv[1].split(",")
    sizes = [int(m) for m in sys.argv[2].split(",")]
    forms = (("package", GK.gemm1_gluon_kernel, GK.gemm2_gluon_kernel, None),
             ("fp8 probe", gemm1_fp8_probe_kernel, gemm2_fp8_probe_kernel, None))
    if os.environ.get("FP8_PROBE_BF16_UNDECODED") == "1":  # (the package's kernels without their decode too)
        forms += (("bf16 undecoded", GK.gemm1_gluon_kernel, GK.gemm2_gluon_kernel, _undecoded_operands),)
    parts = (("gemm1",), ("gemm2",), _ALL)
    for name, hs, M, (xs, idss, wss, outs) in experiment_points(names, sizes):
        gp = hs[0]._state.plans
        cfg = gp.with_gluon(P.default_config(M, gp.geometry), M)
        print(f"{name} M={M} bm={cfg.bm} GEMM1 {'Gluon' if cfg.gluon else 'tl.dot'} {(cfg.bn1, cfg.bk1, cfg.stages1)} "
              f"GEMM2 {'Gluon' if cfg.gluon2 else 'tl.dot'} {(cfg.bn2, cfg.bk2, cfg.stages2)} "
              f"decode={'on' if DECODE else 'off'}", flush=True)
        if not (cfg.gluon and cfg.gluon2):
            print("  skipped: not a plan with both Gluon GEMMs", flush=True)
            continue
        gp.reserve(M, cfg)
        rows = list(zip(hs, xs, idss, wss, outs))
        for h, x, i, w, o in rows:  # (fills the arenas: block tables, x, a)
            _launch_all(h._state, cfg, x, i, w, o)
        graphs, info = {}, {}

        def forget():
            for k in [k for k in gp.launches if k[0] in ("gemm1_gluon", "gemm2_gluon")]:
                del gp.launches[k]

        for label, k1, k2, dec in forms:
            undo = use(k1, k2, dec)
            forget()
            try:
                for st in parts:
                    calls = [lambda h=h, x=x, i=i, w=w, o=o, st=st: _launch_all(h._state, cfg, x, i, w, o, stages=st)
                             for h, x, i, w, o in rows]
                    graphs[label, st] = warm_graph(calls)
                info[label] = "; ".join(
                    f"{which}: {getattr(ck, 'n_regs', '?')} regs, {getattr(ck, 'n_spills', '?')} spills"
                    for which, ck in (("gemm1", gp.stages(cfg, M)[1].compiled), ("gemm2", gp.stages(cfg, M)[2].compiled)))
            except Exception as ex:  # (a form that fails to compile or launch: say so, go on)
                print(f"  {label}: FAILED {type(ex).__name__}: {str(ex)[-600:]}", flush=True)
            finally:
                undo()
                forget()
        times = {k: [] for k in graphs}
        for _ in range(ROUNDS):
            for k, g in graphs.items():
                times[k].append(time_events(g.replay, REPS) / len(hs) * 1e6)
        med = {k: sorted(t)[ROUNDS // 2] for k, t in times.items()}
        for label, _, _, _ in forms:
            if (label, _ALL) not in med:
                continue
            cols = []
            for st in parts:
                t, b = med[label, st], med["package", st]
                cols.append(f"{'whole op' if st is _ALL else st[0]} {t:8.1f} us ({t / b:5.3f}x)")
            print(f"  {label:>10}: " + ", ".join(cols) + f"; {info[label]}", flush=True)
        del graphs
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
