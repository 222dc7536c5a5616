"""The GEMV path's two kernels on ``mma.sync`` in Gluon (sm_80 and newer): a few tokens, both operands in registers.

``kernels.gemv1_kernel`` and ``gemv2_kernel`` multiply by ``tl.dot``, on Hopper's wgmma. The wgmma's second operand
(the token's row as column 0 of a 16-column tile) must be in shared memory, so every K step stores it
there and meets barriers. sm_80's ``mma.sync.m16n8k16``, which sm_90 runs too, takes both operands from
registers. Here:

* **a program's loads stream**: the codes (16 contiguous bytes a lane of a 64-element chunk,
  ``mxtl.load_repacked``'s layout) and scale bytes of its first ``W`` chunks (``L``; all ``Q`` without
  it), then the row's B fragments; as it multiplies chunk q it issues chunk q + W's (``_window``). Its
  loads stay in flight through a long run of chunks, where loading every chunk first left them idle
  through the multiply and the split-K handshake (``benchmarks/results/gemv_window.md``);
* **the decode writes the A fragments in place**. The decode's asm (``mxtl``) leaves each lane's
  words where ``m16n8k16`` wants them: rows r0 and r0 + 8, two K pairs. ``convert_layout(...,
  assert_trivial=True)`` fails the compilation unless no data moves. Two MMAs a chunk, even
  elements then odd;
* **x (or the activations) is loaded straight into the B fragments**, column 0 only. The other 7
  columns are zeros, so a row's sum is its accumulator row's sum (adding zeros: exact), and no
  barrier runs before the epilogue;
* **the first ``W`` chunks' weight loads come before the wait for the previous kernel** (programmatic
  dependent launch, sm_90 and newer). The weights read nothing a kernel of this op writes: the codes and scale
  bytes are constants, and the caller wrote the ids and router weights before x's quantizing launch,
  which does not let gemv1 start before it has itself waited for the caller's kernels (gemv2 follows
  gemv1 the same way). x's quantized row (gemv1) and the activations (gemv2) are read after the wait,
  and every write comes after it. So a kernel's HBM reads overlap its predecessor's tail;
* **the parts are added in part order** by the last of a tile's programs to finish, as in the
  package's split-K handshake (``kernels._last_of_split``); gemv2 adds in (slot, run) order.

gemv1 wrote the tl.dot gemv1's activations bit for bit in every form measured (H200, 1-4 tokens, three
geometries; ``benchmarks/results/gemv_mma.md``), but its fp32 sums are not ordered as the wgmma's in
general. gemv2's sums split the reduction at other points, so its output may differ from the tl.dot
gemv2's in the last bit of a few values. (``tests/test_triton_gpu.py`` bounds both against the reference
and the tl.dot GEMV.)

Plans take these kernels on every GPU from sm_80 (``plan.gemv_mma_status``; the decode's asm is right wherever
the layouts above compile, unlike the ``tl.dot`` kernels', whose operand order is triton's, ``plan.ptx_status``)
where ``plan.gemv_mma_form`` says so (``Config.mma``). x is then
quantized by its own launch first (``kernels.xquant_kernel``).
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    HAS_GLUON_MMA = True
except ImportError:  # pragma: no cover - a triton without Gluon
    HAS_GLUON_MMA = False

from .kernels import _swiglu, f32_to_half_bits, gemv_program, half_bits_to_f32, local_expert, split_col
from .mxtl import mxfp8_apply, mxfp8_block_scale

if HAS_GLUON_MMA:
    from .gluon_kernels import _barrier, _decode_operands, _gdc, _load_scales, _tile_index

    def layouts(nw: int, gemv1: bool) -> dict:
        """A program of ``nw`` warps: ``mma`` the ``m16n8k16`` accumulator (a warp a 16-row group: groups
        ``w, w + nw, ...``), ``a_l``/``b_l`` its operands, ``code_l`` a loaded ``[G, 1, 32, 16]`` chunk
        of codes, ``p7`` that chunk split ``[g, q, lane, s, kh, rh, kk]`` and ``s5_l`` its scale bytes
        ``[g, q, lane, s, rh]`` (as ``gluon_kernels.layouts``); the epilogue's ``q_l`` (gemv1:
        ``[BN / 32, 32]``, a row a 32-element block) or ``o_l`` (gemv2: ``[BN]``)."""
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[nw, 1], instr_shape=[16, 8])
        p7 = gl.BlockedLayout([1, 1, 1, 2, 2, 2, 2], [1, 1, 32, 1, 1, 1, 1], [nw, 1, 1, 1, 1, 1, 1],
                              [6, 5, 4, 3, 2, 1, 0])
        out = dict(mma=mma, a_l=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
                   b_l=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
                   code_l=gl.BlockedLayout([1, 1, 1, 16], [1, 1, 32, 1], [nw, 1, 1, 1], [3, 2, 1, 0]), p7=p7,
                   s5_l=gl.SliceLayout(4, gl.SliceLayout(6, p7)))
        if gemv1:
            return dict(out, q_l=gl.BlockedLayout([1, 1], [1, 32], [nw, 1], [1, 0]))
        return dict(out, o_l=gl.BlockedLayout([1], [32], [nw], [0]))

    @gluon.jit
    def _row_operands(w_e, s_e, grow_c, gok_c, grow_s, gok_s, R: gl.constexpr, RED: gl.constexpr,
                      code_l: gl.constexpr, s5_l: gl.constexpr):
        """Pointers and masks of chunk 0 of the ``R / 16`` row groups whose first rows are ``grow_c``
        (``gok_c``: which exist; ``grow_s``/``gok_s`` the same in the scale bytes' layout) of a matrix with
        ``RED`` columns: ``[G, 1, 32, 16]`` codes, and ``[G, 1, 32, 2, 2]`` scale bytes of each lane's rows
        (r0 = lane // 4 and r0 + 8) for the chunk's two 32-element blocks; and the blocks' index ``s_s``."""
        NQ: gl.constexpr = (RED // 2 + 31) // 32
        KS: gl.constexpr = RED // 32
        _, _, l_c, b_c, _, _, l_s, s_s, h_s = _tile_index(R, 64, code_l, s5_l)
        c_src = (w_e + (grow_c // 16).to(gl.int64)[:, None, None, None] * (NQ * 512)
                 + (l_c * 16)[None, None, :, None] + b_c[None, None, None, :])
        c_ok = gok_c[:, None, None, None] & (l_c >= 0)[None, None, :, None] & (b_c >= 0)[None, None, None, :]
        srow = (grow_s[:, None, None, None, None] + (l_s // 4)[None, None, :, None, None]
                + 8 * h_s[None, None, None, None, :])
        s_src = s_e + srow * KS + s_s[None, None, None, :, None]
        s_ok = gok_s[:, None, None, None, None] & (s_s >= 0)[None, None, None, :, None] & (
            h_s >= 0)[None, None, None, None, :] & (l_s >= 0)[None, None, :, None, None]
        return c_src, c_ok, s_src, s_ok, s_s

    @gluon.jit
    def _load_codes(c_src, c_ok, s_src, s_ok, s_s, q0, RED: gl.constexpr, Q: gl.constexpr):
        """The codes and scale bytes of chunks ``q0 .. q0 + Q - 1``, every load issued before any is
        used. Chunks past the reduction load nothing (zero codes); so do blocks past it (scale byte 0)."""
        NQ: gl.constexpr = (RED // 2 + 31) // 32
        KS: gl.constexpr = RED // 32
        codes = ()
        scales = ()
        for q in gl.static_range(Q):
            qq = q0 + q
            codes = codes + (gl.load(c_src + qq * 512, mask=c_ok & (qq < NQ)),)
            sm = s_ok & ((2 * qq + s_s) < KS)[None, None, None, :, None]
            scales = scales + (_load_scales(s_src + 2 * qq, sm, KS % 2 == 0),)
        return codes, scales

    @gluon.jit
    def _load_row(row, q0, RED: gl.constexpr, Q: gl.constexpr, b_l: gl.constexpr):
        """The B fragments ``(even, odd)`` of chunks ``q0 ..`` of a split-order row (``kernels.split_col``):
        byte column i of a chunk meets elements 32 (i // 16) + i % 16 and 16 further; column 0 only
        (the other columns zeros), elements past the row zeros."""
        KS: gl.constexpr = RED // 32
        i_b = gl.arange(0, 32, layout=gl.SliceLayout(1, b_l))
        n_b = gl.arange(0, 8, layout=gl.SliceLayout(0, b_l))
        src = row + (32 * (i_b // 16) + i_b % 16)[:, None] + 0 * n_b[None, :]
        xs = ()
        for q in gl.static_range(Q):
            qq = q0 + q
            xm = ((2 * qq + i_b // 16) < KS)[:, None] & (n_b == 0)[None, :]
            xs = xs + ((gl.load(src + 64 * qq, mask=xm, other=0.0).to(gl.bfloat16),
                        gl.load(src + 64 * qq + 16, mask=xm, other=0.0).to(gl.bfloat16)),)
        return xs

    @gluon.jit
    def _window(codes, scales, xs, c_src, c_ok, s_src, s_ok, s_s, row, q0, q: gl.constexpr, RED: gl.constexpr,
                Q: gl.constexpr, W: gl.constexpr, b_l: gl.constexpr):
        """Before chunk ``q``'s MMAs, with ``W`` < ``Q`` chunks in flight: chunk ``q + W``'s codes, scale bytes
        and row loads issued (appended to the tuples), so a program's loads stream through its reduction
        instead of all coming first (``W`` = ``Q``: nothing to do)."""
        if q + W < Q:
            c, s = _load_codes(c_src, c_ok, s_src, s_ok, s_s, q0 + q + W, RED, 1)
            codes = codes + c
            scales = scales + s
            xs = xs + _load_row(row, q0 + q + W, RED, 1, b_l)
        return codes, scales, xs

    @gluon.jit
    def _chunk_mma(codes, scales, xe, xo, acc, R: gl.constexpr, FOLD: gl.constexpr, a_l: gl.constexpr,
                   p7: gl.constexpr):
        """One 64-element chunk: its ``[G, 1, 32, 16]`` codes decoded with their scale bytes into the A
        fragments in place (``gluon_kernels._decode_operands``), then its two MMAs (even elements, odd
        elements) into ``acc``."""
        we, wo = _decode_operands(codes, scales, R // 16, 1, R, 32, FOLD, a_l, p7)
        return mma_v2(wo, xo, mma_v2(we, xe, acc))

    @gluon.jit(do_not_specialize=("S", "stride_im", "stride_ik", "expert_offset"),
               do_not_specialize_on_alignment=("ids_ptr",))
    def gemv1_mma_kernel(
        xq_ptr, ids_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, part_ptr, cnt_ptr, S, stride_im, stride_ik, expert_offset,
        limit,
        K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr, E: gl.constexpr, UP_FIRST: gl.constexpr,
        HAS_LIMIT: gl.constexpr, HAS_GS: gl.constexpr, BN: gl.constexpr, Q: gl.constexpr, SPLIT: gl.constexpr,
        FOLD: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr, code_l: gl.constexpr,
        p7: gl.constexpr, s5_l: gl.constexpr, q_l: gl.constexpr, L: gl.constexpr = 0, PDL: gl.constexpr = False,
    ):
        """Program (slot b, tile of BN columns, part of Q 64-element chunks of K; ``BN / 16`` row groups
        of up, then as many of gate, ``layouts(nw, True)``): ``kernels.gemv1_kernel``'s activations of the
        tile, x's row read from ``xq``. Every part stores its sums at its place in the tile's ``part``
        rows (``SPLIT`` of ``2 BN``) and counts itself in at ``cnt`` (zero between calls; unused for
        one part); the last adds them in part order, applies SwiGLU and MXFP8 and writes row b of ``a``."""
        b, part, pid_n = gemv_program(gl.program_id(0), S, SPLIT)
        m = b // TOPK
        gid = gl.load(ids_ptr + m.to(gl.int64) * stride_im + (b - m * TOPK) * stride_ik).to(gl.int64)
        e, ours = local_expert(gid, expert_offset, E)
        if ours:  # (padding and other ranks' slots: no work, no wait)
            R: gl.constexpr = 2 * BN
            GH: gl.constexpr = BN // 16
            KS: gl.constexpr = K // 32
            NQ: gl.constexpr = (K // 2 + 31) // 32
            UP0: gl.constexpr = 0 if UP_FIRST else N
            GATE0: gl.constexpr = N if UP_FIRST else 0
            q0 = part * Q
            g_c, _, _, _, g_s, _, _, _, _ = _tile_index(R, 64, code_l, s5_l)
            row0_c = pid_n * BN + 16 * (g_c % GH)  # (the group's first column)
            row0_s = pid_n * BN + 16 * (g_s % GH)
            c_src, c_ok, s_src, s_ok, s_s = _row_operands(
                w_ptr + e * (2 * N * NQ * 32), s_ptr + e * (2 * N * KS), gl.where(g_c < GH, UP0, GATE0) + row0_c,
                row0_c < N, gl.where(g_s < GH, UP0, GATE0) + row0_s, row0_s < N, R, K, code_l, s5_l)
            W: gl.constexpr = L if L > 0 and L < Q else Q  # (chunks in flight: see _window)
            codes, scales = _load_codes(c_src, c_ok, s_src, s_ok, s_s, q0, K, W)
            _gdc(PDL)
            x_row = xq_ptr + m.to(gl.int64) * K
            xs = _load_row(x_row, q0, K, W, b_l)
            acc = gl.zeros([R, 8], gl.float32, layout=mma)
            for q in gl.static_range(Q):
                codes, scales, xs = _window(codes, scales, xs, c_src, c_ok, s_src, s_ok, s_s, x_row, q0, q, K, Q, W,
                                            b_l)
                acc = _chunk_mma(codes[q], scales[q], xs[q][0], xs[q][1], acc, R, FOLD, a_l, p7)
            v = gl.sum(acc, axis=1)  # (columns 1.. are zeros)
            NT: gl.constexpr = (N + BN - 1) // BN
            tile = b.to(gl.int64) * NT + pid_n
            prow = part_ptr + tile * (SPLIT * R)
            gl.store(prow + part * R + gl.arange(0, R, layout=gl.SliceLayout(1, mma)), v)
            _barrier()  # (every thread's sums stored before the count; the release covers them)
            last = True
            if SPLIT > 1:
                last = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT - 1
            if last:
                BQ: gl.constexpr = BN // 32
                rq = gl.arange(0, BQ, layout=gl.SliceLayout(1, q_l))
                cq = gl.arange(0, 32, layout=gl.SliceLayout(0, q_l))
                o = 32 * rq[:, None] + cq[None, :]
                up = gl.zeros([BQ, 32], gl.float32, layout=q_l)
                gate = gl.zeros([BQ, 32], gl.float32, layout=q_l)
                for p in gl.static_range(SPLIT):  # (L2 reads: other programs wrote these)
                    up += gl.load(prow + p * R + o, cache_modifier=".cg")
                    gate += gl.load(prow + p * R + BN + o, cache_modifier=".cg")
                if SPLIT > 1:
                    gl.store(cnt_ptr + tile, 0)
                act = _swiglu(up, gate, gs_ptr, e, limit, HAS_GS, HAS_LIMIT)
                pow2, inv = mxfp8_block_scale(gl.max(gl.abs(act), axis=1))  # (a row: one 32-element block)
                act = mxfp8_apply(act, pow2[:, None], inv[:, None])
                offs_n = pid_n * BN + o
                gl.store(a_ptr + b.to(gl.int64) * N + split_col(offs_n), act.to(a_ptr.dtype.element_ty),
                         mask=offs_n < N)

    @gluon.jit(do_not_specialize=("M", "stride_im", "stride_ik", "stride_wm", "stride_wk", "expert_offset", "w_kind",
                                  "stride_om", "out_fp16"),
               do_not_specialize_on_alignment=("ids_ptr", "wts_ptr", "out_ptr"))
    def gemv2_mma_kernel(
        a_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr,
        M, stride_im, stride_ik, stride_wm, stride_wk, expert_offset, w_kind, stride_om, out_fp16,
        K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr, E: gl.constexpr, HAS_GS: gl.constexpr,
        BN: gl.constexpr, Q: gl.constexpr, KP: gl.constexpr, FOLD: gl.constexpr, mma: gl.constexpr,
        a_l: gl.constexpr, b_l: gl.constexpr, code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr,
        o_l: gl.constexpr, L: gl.constexpr = 0, PDL: gl.constexpr = False,
    ):
        """Program (token m, tile of BN outputs, slot j and run ``part % KP`` of Q chunks of its activation
        row): ``wts * dq8(a) @ W2[e_j]^T`` over the run (zeros for a slot not ours), stored at its place
        in the tile's ``TOPK * KP`` parts; the last to count itself in adds them in (slot, run) order and
        writes the token's output row (``kernels.gemv2_kernel``'s sum; the router weights and ``out``
        as its 16-bit words, ``w_kind`` and ``out_fp16`` as there)."""
        SPLIT: gl.constexpr = TOPK * KP
        NQ: gl.constexpr = (N // 2 + 31) // 32
        NS: gl.constexpr = N // 32
        NT: gl.constexpr = (K + BN - 1) // BN
        m, part, pid_n = gemv_program(gl.program_id(0), M, SPLIT)
        j = part // KP
        m64 = m.to(gl.int64)
        gid = gl.load(ids_ptr + m64 * stride_im + j * stride_ik).to(gl.int64)
        e, ours = local_expert(gid, expert_offset, E)
        # the first chunks' weight loads (nothing for a slot not ours), before the wait: see the module's docstring
        g_c, _, _, _, g_s, _, _, _, _ = _tile_index(BN, 64, code_l, s5_l)
        row0_c = pid_n * BN + 16 * g_c
        row0_s = pid_n * BN + 16 * g_s
        c_src, c_ok, s_src, s_ok, s_s = _row_operands(w_ptr + e * (K * NQ * 32), s_ptr + e * (K * NS), row0_c,
                                                      (row0_c < K) & ours, row0_s, (row0_s < K) & ours, BN, N, code_l,
                                                      s5_l)
        W: gl.constexpr = L if L > 0 and L < Q else Q  # (chunks in flight: see _window)
        q0 = (part % KP) * Q
        codes, scales = _load_codes(c_src, c_ok, s_src, s_ok, s_s, q0, N, W)
        # the router weight: ``kernels.load_weight_raw``'s arithmetic (its ``tl.zeros_like`` mask, which
        # the interpreter needs, has no layout in Gluon)
        w_lo = gl.load(wts_ptr + m64 * stride_wm + j * stride_wk)
        w_hi = gl.load(wts_ptr + m64 * stride_wm + j * stride_wk + 1, mask=w_kind == 0, other=0)
        w32 = ((w_hi.to(gl.int32) << 16) | (w_lo.to(gl.int32) & 0xFFFF)).to(gl.float32, bitcast=True)
        wt = gl.where(w_kind == 0, w32, half_bits_to_f32(w_lo, w_kind == 2))
        _gdc(PDL)
        v = gl.zeros([BN], gl.float32, layout=gl.SliceLayout(1, mma))
        if ours:
            a_row = a_ptr + (m64 * TOPK + j) * N
            xs = _load_row(a_row, q0, N, W, b_l)
            acc = gl.zeros([BN, 8], gl.float32, layout=mma)
            cw, sw = codes, scales  # (grown here: an if may not change a tuple's length)
            for q in gl.static_range(Q):
                cw, sw, xs = _window(cw, sw, xs, c_src, c_ok, s_src, s_ok, s_s, a_row, q0, q, N, Q, W, b_l)
                acc = _chunk_mma(cw[q], sw[q], xs[q][0], xs[q][1], acc, BN, FOLD, a_l, p7)
            y = gl.sum(acc, axis=1)  # (columns 1.. are zeros)
            if HAS_GS:
                y = y * gl.load(gs_ptr + e)
            v = y * wt
        tile = m64 * NT + pid_n
        prow = part_ptr + tile * (SPLIT * BN)
        gl.store(prow + part * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma)), v)
        _barrier()  # (every thread's sums stored before the count; the release covers them)
        if gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
            o = gl.arange(0, BN, layout=o_l)
            total = gl.zeros([BN], gl.float32, layout=o_l)
            for p in gl.static_range(SPLIT):  # (L2 reads: other programs wrote these)
                total += gl.load(prow + p * BN + o, cache_modifier=".cg")
            gl.store(cnt_ptr + tile, 0)
            offs_o = pid_n * BN + o
            gl.store(out_ptr + m64 * stride_om + offs_o, f32_to_half_bits(total, out_fp16), mask=offs_o < K)
