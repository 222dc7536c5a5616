"""Experimental GEMV kernels: the current ``gemv1_kernel``/``gemv2_kernel`` with the nibble products
formed on one ``[rows, blocks, 4, 8]`` tile instead of eight per-nibble slices.

Not used by the package. Triton gives each of the eight slices ``_split8`` makes of the activation
tile its own layout conversion into the lane-broadcast layout the weights need (TTGIR; two
barriers each); here the decoded nibble pairs are joined in registers into the activation tile's
own element order, so the tile is converted once a step. gemv1 also loads the chunk of x it
quantizes as ``[blocks, 32]``, so a block's maximum is taken within a warp. Compiled for sm_90
(triton 3.6, the default tiles at gpt-oss M = 1): gemv2 16 -> 4 barriers a step, 78 -> 64
registers, 415 -> 427 instructions; gemv1 11 -> 5 barriers a step, 144 -> 123 registers (4
programs an SM instead of 3), 707 -> 689 instructions.

Same signatures as the package's kernels, so

    python benchmarks/sweep_gemv.py --variant experiments.joined_gemv

times them in their place (``tests/test_triton_interp.py`` checks them against the package's under
the interpreter). Not yet timed on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from b12x_ops.backends.triton.kernels import (_jit, _swiglu, _up_gate_rows, f32_to_half_bits, half_bits_to_f32,
                                              load_weight_raw, local_expert)
from b12x_ops.backends.triton.mxtl import (e2m1_nibble_pair_f32_2m14, e8m0_f32, mxfp8_apply, mxfp8_block_scale,
                                           quant_dequant_mxfp8_tile)


@triton.jit
def _decode_words(words):
    """``[.., 4]`` int32 code words as ``[.., 4, 2, 2, 2]`` fp32 weights times 2^-14, indexed
    ``[word, h, t1, t0]`` = nibble ``4h + 2 t1 + t0``: a word's natural element order."""
    a0, b0 = e2m1_nibble_pair_f32_2m14(words, 0)
    a1, b1 = e2m1_nibble_pair_f32_2m14(words, 1)
    a2, b2 = e2m1_nibble_pair_f32_2m14(words, 2)
    a3, b3 = e2m1_nibble_pair_f32_2m14(words, 3)
    return tl.join(tl.join(tl.join(a0, b0), tl.join(a2, b2)), tl.join(tl.join(a1, b1), tl.join(a3, b3)))


@_jit(dns=("S", "stride_xm", "stride_im", "stride_ik", "expert_offset", "x_fp16"), dnsa=("x_ptr", "ids_ptr"))
def gemv1_kernel(
    x_ptr, ids_ptr, w_ptr, s_ptr, gs_ptr, a_ptr,
    S, stride_xm, stride_im, stride_ik, expert_offset, x_fp16, limit,
    K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr, UP_FIRST: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_GS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """Program (slot b, N tile): ``dq8(silu(gate) * up)`` of slot ``b``, ``[BN]``, into ``a[b]``.
    ``x`` and the ids come as raw 16-/32-bit views (see ``prologue_kernel``)."""
    pid = tl.program_id(0)
    b = pid % S
    pid_n = pid // S
    m = b // TOPK
    gid = tl.load(ids_ptr + m.to(tl.int64) * stride_im + (b - m * TOPK) * stride_ik).to(tl.int64)
    e, ours = local_expert(gid, expert_offset, E)
    if ours == 0:  # padding or another rank's expert: no work
        return
    offs_n = pid_n * BN + tl.arange(0, BN)
    nvalid = offs_n < N
    up_rows, gate_rows = _up_gate_rows(offs_n, N, UP_FIRST)
    KH: tl.constexpr = K // 2
    KW: tl.constexpr = K // 8  # int32 words of codes a row
    KS: tl.constexpr = K // 32
    NB: tl.constexpr = BK // 32
    w_e = (w_ptr + e * (2 * N * KH)).to(tl.pointer_type(tl.int32))
    s_e = s_ptr + e * (2 * N * KS)
    j = tl.arange(0, NB)  # 32-element block within the chunk
    q = tl.arange(0, 4)  # word within the block
    word_off = j[:, None] * 4 + q[None, :]  # [NB, 4]
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    r32 = tl.arange(0, 32)
    acc_u = tl.zeros((BN, NB), dtype=tl.float32)
    acc_g = tl.zeros((BN, NB), dtype=tl.float32)
    up_w = w_e + up_rows[:, None, None] * KW + word_off[None, :, :]
    gate_w = w_e + gate_rows[:, None, None] * KW + word_off[None, :, :]
    up_s = s_e + up_rows[:, None] * KS + j[None, :]
    gate_s = s_e + gate_rows[:, None] * KS + j[None, :]
    # Register double buffering: each step loads the NEXT chunk's codes and scales before decoding
    # this one, so a program keeps two chunks of HBM reads in flight (few programs at small M).
    # Masks are constant along a block's 4 words, so the code loads stay 16-byte vectors.
    bnext = j < KS
    cu = tl.load(up_w, mask=nvalid[:, None, None] & bnext[None, :, None], other=0)
    cg = tl.load(gate_w, mask=nvalid[:, None, None] & bnext[None, :, None], other=0)
    su = tl.load(up_s, mask=nvalid[:, None] & bnext[None, :], other=0)
    sg = tl.load(gate_s, mask=nvalid[:, None] & bnext[None, :], other=0)
    for k0 in range(0, K, BK):
        bvalid = (k0 // 32 + j) < KS  # [NB]
        bnext = (k0 // 32 + NB + j) < KS
        wm = nvalid[:, None, None] & bnext[None, :, None]
        sm = nvalid[:, None] & bnext[None, :]
        cu_next = tl.load(up_w + (k0 + BK) // 8, mask=wm, other=0)
        cg_next = tl.load(gate_w + (k0 + BK) // 8, mask=wm, other=0)
        su_next = tl.load(up_s + (k0 + BK) // 32, mask=sm, other=0)
        sg_next = tl.load(gate_s + (k0 + BK) // 32, mask=sm, other=0)
        # this chunk of x, quantized to MXFP8 on the fly: one vector load of 8 values a code word,
        # then split into the 8 tiles the nibbles meet (x is shared by the program's BN rows)
        # x as [blocks, 32]: a block's maximum stays within a warp (no shared memory)
        raw = tl.load(x_row + k0 + 32 * j[:, None] + r32[None, :], mask=bvalid[:, None], other=0)
        xv = half_bits_to_f32(raw, x_fp16)
        pow2, inv = mxfp8_block_scale(tl.max(tl.abs(xv), axis=1))
        xv = mxfp8_apply(xv, pow2[:, None], inv[:, None])
        xv = tl.reshape(xv, (NB, 4, 2, 2, 2))[None, :, :, :, :, :]  # element 4h + 2 t1 + t0: (h, t1, t0)
        pu = tl.sum(tl.reshape(_decode_words(cu) * xv, (BN, NB, 32)), axis=2)
        pg = tl.sum(tl.reshape(_decode_words(cg) * xv, (BN, NB, 32)), axis=2)
        acc_u += (pu * 16384.0) * e8m0_f32(su)
        acc_g += (pg * 16384.0) * e8m0_f32(sg)
        cu, cg, su, sg = cu_next, cg_next, su_next, sg_next
    act = _swiglu(tl.sum(acc_u, axis=1), tl.sum(acc_g, axis=1), gs_ptr, e, limit, HAS_GS, HAS_LIMIT)
    act = tl.reshape(quant_dequant_mxfp8_tile(tl.reshape(act, (1, BN)), 1, BN), (BN,))
    tl.store(a_ptr + b.to(tl.int64) * N + offs_n, act, mask=nvalid)


@triton.jit
def _gemv2_slot(a_row, w_e, s_e, offs_o, ovalid, N: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``dq8(a) @ W2[e]^T`` for one slot's activation row and ``BN`` output rows, fp32 ``[BN]``."""
    NW: tl.constexpr = N // 8  # int32 words of codes a row
    NS: tl.constexpr = N // 32
    NB: tl.constexpr = BK // 32
    j = tl.arange(0, NB)
    q = tl.arange(0, 4)
    word_off = j[:, None] * 4 + q[None, :]  # [NB, 4]
    r8 = tl.arange(0, 8)
    acc = tl.zeros((BN, NB), dtype=tl.float32)
    row_w = w_e + offs_o[:, None, None] * NW + word_off[None, :, :]
    row_s = s_e + offs_o[:, None] * NS + j[None, :]
    # register double buffering of the codes and scales, as in gemv1
    bnext = j < NS
    c = tl.load(row_w, mask=ovalid[:, None, None] & bnext[None, :, None], other=0)
    sc = tl.load(row_s, mask=ovalid[:, None] & bnext[None, :], other=0)
    for n0 in range(0, N, BK):
        bvalid = (n0 // 32 + j) < NS
        bnext = (n0 // 32 + NB + j) < NS
        c_next = tl.load(row_w + (n0 + BK) // 8, mask=ovalid[:, None, None] & bnext[None, :, None], other=0)
        sc_next = tl.load(row_s + (n0 + BK) // 32, mask=ovalid[:, None] & bnext[None, :], other=0)
        av = tl.load(a_row + n0 + 8 * word_off[:, :, None] + r8[None, None, :], mask=bvalid[:, None, None],
                     other=0.0).to(tl.float32)
        av = tl.reshape(av, (NB, 4, 2, 2, 2))[None, :, :, :, :, :]
        p = tl.sum(tl.reshape(_decode_words(c) * av, (BN, NB, 32)), axis=2)
        acc += (p * 16384.0) * e8m0_f32(sc)
        c, sc = c_next, sc_next
    return tl.sum(acc, axis=1)


@_jit(dns=("M", "stride_im", "stride_ik", "stride_wm", "stride_wk", "expert_offset", "w_kind", "stride_om",
           "out_fp16"),
      dnsa=("ids_ptr", "wts_ptr", "out_ptr"))
def gemv2_kernel(
    a_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, gs_ptr, out_ptr,
    M, stride_im, stride_ik, stride_wm, stride_wk, expert_offset, w_kind, stride_om, out_fp16,
    K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr, HAS_GS: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr,
):
    """Program (token m, K tile of BN outputs): ``sum_j wts[m, j] * dq8(a[m, j]) @ W2[e_j]^T`` over
    the token's local slots in slot order, rounded once to the output dtype."""
    pid = tl.program_id(0)
    m = pid % M
    pid_n = pid // M
    offs_o = pid_n * BN + tl.arange(0, BN)
    ovalid = offs_o < K
    NH: tl.constexpr = N // 2
    NS: tl.constexpr = N // 32
    m64 = m.to(tl.int64)
    total = tl.zeros((BN,), dtype=tl.float32)
    for jj in tl.static_range(TOPK):  # slot order: the sum is the same every run
        gid = tl.load(ids_ptr + m64 * stride_im + jj * stride_ik).to(tl.int64)
        e, ours = local_expert(gid, expert_offset, E)
        if ours:
            w_e = (w_ptr + e * (K * NH)).to(tl.pointer_type(tl.int32))
            s_e = s_ptr + e * (K * NS)
            y = _gemv2_slot(a_ptr + (m64 * TOPK + jj) * N, w_e, s_e, offs_o, ovalid, N, BN, BK)
            if HAS_GS:
                y = y * tl.load(gs_ptr + e)
            total += y * load_weight_raw(wts_ptr + m64 * stride_wm + jj * stride_wk, True, w_kind)
    tl.store(out_ptr + m64 * stride_om + offs_o, f32_to_half_bits(total, out_fp16), mask=ovalid)
