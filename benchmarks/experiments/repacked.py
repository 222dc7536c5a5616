"""Experimental blocked GEMMs on a code layout repacked at prepare (not used by the package).

The package's GEMMs copy each ``[BN, BK / 2]`` code tile to shared memory and read it back into
the MMA operand layout two bytes at a time (the bytes of a weight row's two adjacent K pairs), 40
two-byte loads a K step at bm = 16, then decode every byte pair with 10 instructions for 4
weights. Here the codes are stored so that:

* **a thread's operand bytes are contiguous.** Rows come in groups of 16 (one MMA row tile) and
  K in chunks of 32 bytes; a (group, chunk) is 512 bytes, 16 for each lane of a warp, so a step
  loads (or copies) 16 bytes a lane a chunk, and ``tl.reshape``/``tl.permute`` map the loaded
  ``[groups, chunks, 32 lanes, 16 bytes]`` tile onto the ``[BN, BK / 2]`` operand tile with no
  data movement (Triton's layouts for the two are the same registers: no conversion appears in
  the TTGIR). Lane ``l`` holds rows ``r0 = l // 4`` and ``r0 + 8`` of its group, and in byte
  ``b = 8 s + 4 kh + 2 rh + kk`` of a chunk the code byte of row ``r0 + 8 rh``, K byte
  ``16 s + 8 kh + 2 (l % 4) + kk``: the MMA operand's element order.
* **each 32-bit word decodes in 15 instructions for 8 weights** (10 for 4 before): its 4 code
  bytes (rows r0 and r0 + 8, two K bytes each; 8 nibbles) are re-laid bit by bit so that three of
  its four bf16 pairs are ``(w << s) & 0x81C081C0`` for s = 0, 3, 6 (sign at bit 15, ``e1 e0 m`` at
  bits 8..6 of each half: the E2M1 value times 2^-126 as a bf16) and the fourth takes three shifts
  and three logic ops; each pair then takes one ``fma.rn.bf16x2`` by its row's folded scale, as in
  ``mxtl._decode_ptx_source``. (triton_kernels' Hopper layout uses the same two ideas.)

``repack_codes`` makes the layout from the checkpoint's ``[E, rows, K / 2]`` bytes (rows and K / 2
multiples of 16 and 32; K steps multiples of 64); ``gemm1_kernel`` and ``gemm2_kernel`` take it in
place of the package's kernels of the same names and arguments (their ``w_ptr`` pointing at the
repacked bytes, which ``repack_handle`` swaps into a handle); their bodies are the package's but
for the code tile's load and decode (``_load_decode``), so adopting the layout would replace the
package's two kernels, not add to them. Time it with

    python benchmarks/bench_moe.py --variant experiments.repacked --no-tune --layers 4 --reps 10

(every M on the blocked path) beside the same command without ``--variant`` (both on the
blocked path from M = 8 up), and re-tune its tiles with ``benchmarks/sweep_blocked.py --variant
experiments.repacked`` (K steps must stay multiples of 64). Under the interpreter the decode runs as Triton
operations on the words (``_decode_words_ops``), so CI checks the index and bit logic against
the package's kernels (bit for bit); ``tests/test_ptx_decode.py`` runs the asm on its emulator
against the dequantizer. sm_90 SASS of the K loops at the default tiles (triton 3.6, gpt-oss):
GEMM1 540 -> 421 instructions at bm = 16 (633 -> 494 at bm = 128), GEMM2 296 -> 236 (322 -> 257),
no two-byte shared-memory loads left (``tests/test_compile_sm90.py`` checks both, with triton's
ptxas on the CPU). Not yet timed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from b12x_ops.backends.triton.kernels import _block_slots, _block_tile, _gemm1_tile, _jit, _reduce_rows, _store_act
from b12x_ops.backends.triton.mxtl import _ptx_scales

# source bit of each target bit, per bf16 pair of a word: (sign, e1, e0, m) of the low half; the
# high half's are 16 higher
_SPEC = (
    (15, 8, 7, 6),  # pair 0: w & mask
    (12, 5, 4, 3),  # pair 1: (w << 3) & mask
    (9, 2, 1, 0),  # pair 2: (w << 6) & mask
    (14, 13, 11, 10),  # pair 3: sign << 1, e1 >> 5, e0 and m >> 4
)


def repack_codes(codes: torch.Tensor) -> torch.Tensor:
    """``[E, R, KH]`` MXFP4 code bytes (byte h of a row: weights 2h, low nibble, and 2h + 1) in
    the layout above, ``[E, R / 16, KH / 32, 32, 16]`` bytes. Pairs 0 and 1 of a word hold the
    even weights of rows r0 and r0 + 8, pairs 2 and 3 the odd ones; a pair's low half the word's
    first K byte, its high half the second."""
    E, R, KH = codes.shape
    assert R % 16 == 0 and KH % 32 == 0, (R, KH)
    c = codes.to(torch.int64).view(E, R // 16, 2, 8, KH // 32, 2, 2, 4, 2)  # e, g, rh, r0, q, s, kh, c, kk
    word = torch.zeros(E, R // 16, 8, KH // 32, 2, 2, 4, dtype=torch.int64, device=codes.device)
    for rh in range(2):
        for kk in range(2):
            for odd in range(2):
                nib = (c[:, :, rh, :, :, :, :, :, kk] >> (4 * odd)) & 15
                spec = _SPEC[2 * odd + rh]
                for bit, src in zip((3, 2, 1, 0), spec):
                    word |= ((nib >> bit) & 1) << (src + 16 * kk)
    # -> [e, g, q, r0, c, s, kh]: lane (r0, c), word (s, kh); little-endian bytes
    word = word.permute(0, 1, 3, 2, 6, 4, 5).contiguous()
    b = torch.stack([(word >> (8 * i)) & 255 for i in range(4)], dim=-1).to(torch.uint8)
    return b.view(E, R // 16, KH // 32, 32, 16)


def repack_handle(h) -> None:
    """Swap a Triton handle's w13 and w2 codes for their repacked bytes (same size). Only the
    blocked GEMMs read the new layout: the handle must not take the GEMV path after this."""
    st = h._state
    st.w13 = repack_codes(st.w13)
    st.w2 = repack_codes(st.w2)


# (benchmarks/bench_moe.py --variant experiments.repacked: handles prepared with these options, then this)
PREPARE_OPTIONS = dict(gemv=False)  # the new layout suits the blocked GEMMs only
on_prepare = repack_handle


def _decode_ptx4_source(fold: bool) -> str:
    """A word (``$4``) to its four bf16 pairs times their rows' scales (``$5``: rows r0, ``$6``:
    r0 + 8): ``$0``/``$1`` the even weights of rows r0/r0 + 8, ``$2``/``$3`` the odd ones."""
    bias = [] if fold else ["fma.rn.bf16x2 t, t, bias, nz;"]
    lines = ["", "{", ".reg .b32 t, u, v, msk, nz;" if fold else ".reg .b32 t, u, v, msk, bias, nz;",
             "mov.b32 msk, 0x81C081C0;", *([] if fold else ["mov.b32 bias, 0x7E807E80;"]), "mov.b32 nz, 0x80008000;"]
    for out, shift, scale in (("$0", 0, "$5"), ("$1", 3, "$6"), ("$2", 6, "$5")):
        lines += ["and.b32 t, $4, msk;" if shift == 0 else f"shl.b32 t, $4, {shift};",
                  *([] if shift == 0 else ["and.b32 t, t, msk;"]), *bias, f"fma.rn.bf16x2 {out}, t, {scale}, nz;"]
    lines += [
        "shl.b32 t, $4, 1;",
        "and.b32 t, t, 0x80008000;",  # signs
        "shr.b32 u, $4, 5;",
        "lop3.b32 t, t, u, 0x01000100, 0xF8;",  # t | (u & e1 bits)
        "shr.b32 v, $4, 4;",
        "lop3.b32 t, t, v, 0x00C000C0, 0xF8;",  # t | (v & e0, m bits)
        *bias,
        "fma.rn.bf16x2 $3, t, $6, nz;",
        "}",
        "",
    ]
    return "\n".join(lines)


_DECODE4 = tl.constexpr(_decode_ptx4_source(False))
_DECODE4_FOLD = tl.constexpr(_decode_ptx4_source(True))


@triton.jit
def _to_operand(t, BN: tl.constexpr, BKH: tl.constexpr):
    """A loaded ``[BN / 16, BKH / 32, 32, 16]`` tile (or its decoded twin) as ``[BN, BKH]``."""
    G: tl.constexpr = BN // 16
    Q: tl.constexpr = BKH // 32
    t = tl.reshape(t, (G, Q, 8, 4, 2, 2, 2, 2))  # g, q, r0, c, s, kh, rh, kk
    t = tl.permute(t, (0, 6, 2, 1, 4, 5, 3, 7))  # g, rh, r0, q, s, kh, c, kk
    return tl.reshape(t, (BN, BKH))


@triton.jit
def _pair_values(bits):
    """The two halves of bf16-pair bit patterns (E2M1 values times 2^-126) as fp32 E2M1 values."""
    # (a bf16's bits are the high half of its fp32's; e1 e0 = 0 gives an fp32 subnormal, kept)
    lo = (bits << 16).to(tl.float32, bitcast=True)
    hi = (bits & -65536).to(tl.float32, bitcast=True)
    big = 8.507059173023462e37  # 2^126
    return lo * big, hi * big


@triton.jit
def _decode_words_ops(t, BN: tl.constexpr, BKH: tl.constexpr):
    """The asm's arithmetic in Triton operations (the interpreter's path): the loaded tile's
    ``(even, odd)`` E2M1 values, fp32 ``[BN, BKH]``, before scaling."""
    G: tl.constexpr = BN // 16
    Q: tl.constexpr = BKH // 32
    v = tl.reshape(t.to(tl.int32), (G, Q, 32, 4, 4))
    b0, b1 = tl.split(tl.reshape(v, (G, Q, 32, 4, 2, 2)))
    b00, b01 = tl.split(b0)
    b10, b11 = tl.split(b1)
    # (the first split takes bit 0 of the byte index, the second bit 1: b01 is byte 2, b10 byte 1)
    w = b00 | (b10 << 8) | (b01 << 16) | (b11 << 24)  # [G, Q, 32, 4] words
    msk = -2118090304  # 0x81C081C0
    p0 = w & msk
    p1 = (w << 3) & msk
    p2 = (w << 6) & msk
    p3 = ((w << 1) & -2147450880) | ((w >> 5) & 0x01000100) | ((w >> 4) & 0x00C000C0)
    e00, e01 = _pair_values(p0)  # even, row r0, kk 0 / 1
    e10, e11 = _pair_values(p1)  # even, row r0 + 8
    o00, o01 = _pair_values(p2)
    o10, o11 = _pair_values(p3)
    # (tl.join adds its dim last: the inner joins make rh, the outer kk) -> [G, Q, 32, 4, rh, kk]
    even = tl.join(tl.join(e00, e10), tl.join(e01, e11))
    odd = tl.join(tl.join(o00, o10), tl.join(o01, o11))
    return _to_operand(even, BN, BKH), _to_operand(odd, BN, BKH)


@triton.jit
def _load_decode(w_g, gvalid, q0, NQ: tl.constexpr, scale_bytes, BN: tl.constexpr, BKH: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, PTX: tl.constexpr, FOLD: tl.constexpr):
    """Load and decode one step's ``[BN, BKH]`` code tile: groups from ``w_g`` (the tile's first
    group), K chunks from ``q0``; ``(even, odd)`` in DOT_DTYPE."""
    G: tl.constexpr = BN // 16
    Q: tl.constexpr = BKH // 32
    g = tl.arange(0, G)
    q = tl.arange(0, Q)
    lb = tl.arange(0, 512)
    off = (g[:, None, None] * NQ + q0 + q[None, :, None]) * 512 + lb[None, None, :]
    m = gvalid[:, None, None] & ((q0 + q) < NQ)[None, :, None]
    t = tl.reshape(tl.load(w_g + off, mask=m, other=0), (G, Q, 32, 16))
    sb = _ptx_scales(scale_bytes, FOLD) if PTX else (scale_bytes.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    sc = tl.reshape(tl.broadcast_to(sb[:, :, None], (BN, BKH // 16, 16)), (BN, BKH))
    if PTX:
        asm: tl.constexpr = _DECODE4_FOLD if FOLD else _DECODE4
        even, odd = tl.inline_asm_elementwise(asm, constraints="=r,=r,=r,=r,r,r,r", args=[_to_operand(t, BN, BKH), sc],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        ev, od = _decode_words_ops(t, BN, BKH)
        even = (ev * sc).to(DOT_DTYPE)
        odd = (od * sc).to(DOT_DTYPE)
    return even, odd


@_jit(dns=("nblocks",))
def gemm1_kernel(
    xq_ptr, xs_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, as_ptr,
    nblocks, limit,
    K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, UP_FIRST: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, DOT_DTYPE: tl.constexpr, FAST: tl.constexpr,
    PTX: tl.constexpr = False, FOLD: tl.constexpr = False,
):
    """``kernels.gemm1_kernel`` with the codes in the repacked layout (``w_ptr``)."""
    pid_m, pid_n, e = _block_tile(blk_expert_ptr, N, BN)
    if e < 0:
        return
    rows, rvalid, tok, offs_n, nvalid, up_rows, gate_rows = _gemm1_tile(pid_m, pid_n, blk_rows_ptr, sorted_ptr, N,
                                                                        TOPK, UP_FIRST, BM, BN)
    KH: tl.constexpr = K // 2
    KS: tl.constexpr = K // 32
    BKH: tl.constexpr = BK // 2
    NQ: tl.constexpr = KH // 32  # 32-byte K chunks a row group
    w_e = w_ptr + e.to(tl.int64) * (2 * N * KH)
    s_e = s_ptr + e.to(tl.int64) * (2 * N * KS)
    gvalid = (pid_n * BN + 16 * tl.arange(0, BN // 16)) < N
    UP0: tl.constexpr = 0 if UP_FIRST else N  # the first W13 row of up, and of gate
    GATE0: tl.constexpr = N if UP_FIRST else 0
    up_g = w_e + ((pid_n * BN + UP0) // 16) * (NQ * 512)  # the tiles' first row groups
    gate_g = w_e + ((pid_n * BN + GATE0) // 16) * (NQ * 512)
    offs_h = tl.arange(0, BKH)
    offs_s = tl.arange(0, BK // 32)
    xT = xq_ptr + tok[None, :] * K + (32 * (offs_h // 16) + offs_h % 16)[:, None]  # [BKH, BM]
    acc_u = tl.zeros((BN, BM), dtype=tl.float32)
    acc_g = tl.zeros((BN, BM), dtype=tl.float32)
    up_s = s_e + up_rows[:, None] * KS + offs_s[None, :]
    gate_s = s_e + gate_rows[:, None] * KS + offs_s[None, :]
    sm = nvalid[:, None] & (offs_s < KS)[None, :]
    su = tl.load(up_s, mask=sm, other=0)
    sg = tl.load(gate_s, mask=sm, other=0)
    for k0 in range(0, K, BK):
        hmask = (k0 // 2 + offs_h) < KH
        xm = hmask[:, None] & rvalid[None, :]
        xe = tl.load(xT + k0, mask=xm, other=0.0).to(DOT_DTYPE)
        xo = tl.load(xT + k0 + 16, mask=xm, other=0.0).to(DOT_DTYPE)
        sm = nvalid[:, None] & ((k0 // 32 + BK // 32 + offs_s) < KS)[None, :]
        su_next = tl.load(up_s + (k0 + BK) // 32, mask=sm, other=0)
        sg_next = tl.load(gate_s + (k0 + BK) // 32, mask=sm, other=0)
        ue, uo = _load_decode(up_g, gvalid, k0 // 64, NQ, su, BN, BKH, DOT_DTYPE, PTX, FOLD)
        acc_u = tl.dot(ue, xe, acc_u)
        acc_u = tl.dot(uo, xo, acc_u)
        ge, go = _load_decode(gate_g, gvalid, k0 // 64, NQ, sg, BN, BKH, DOT_DTYPE, PTX, FOLD)
        acc_g = tl.dot(ge, xe, acc_g)
        acc_g = tl.dot(go, xo, acc_g)
        su, sg = su_next, sg_next
    _store_act(acc_u, acc_g, gs_ptr, e, limit, a_ptr, rows, rvalid, offs_n, nvalid, N, HAS_GS, HAS_LIMIT)


@_jit(dns=("nblocks",))
def gemm2_kernel(
    a_ptr, as_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr,
    nblocks,
    K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, HAS_GS: tl.constexpr, ATOMIC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr, FAST: tl.constexpr,
    PTX: tl.constexpr = False, FOLD: tl.constexpr = False,
):
    """``kernels.gemm2_kernel`` with the codes in the repacked layout (``w_ptr``)."""
    pid_m, pid_n, e = _block_tile(blk_expert_ptr, K, BN)
    if e < 0:
        return
    rows, rvalid, slot = _block_slots(pid_m, blk_rows_ptr, sorted_ptr, BM)
    offs_o = pid_n * BN + tl.arange(0, BN)
    ovalid = offs_o < K
    NH: tl.constexpr = N // 2
    NS: tl.constexpr = N // 32
    BKH: tl.constexpr = BK // 2
    NQ: tl.constexpr = NH // 32
    w_e = w_ptr + e.to(tl.int64) * (K * NH)
    s_e = s_ptr + e.to(tl.int64) * (K * NS)
    gvalid = (pid_n * BN + 16 * tl.arange(0, BN // 16)) < K
    w_g = w_e + (pid_n * BN // 16) * (NQ * 512)
    offs_h = tl.arange(0, BKH)
    offs_s = tl.arange(0, BK // 32)
    aT = a_ptr + rows[None, :] * N + (32 * (offs_h // 16) + offs_h % 16)[:, None]
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    row_s = s_e + offs_o[:, None] * NS + offs_s[None, :]
    s = tl.load(row_s, mask=ovalid[:, None] & (offs_s < NS)[None, :], other=0)
    for n0 in range(0, N, BK):
        hmask = (n0 // 2 + offs_h) < NH
        am = hmask[:, None] & rvalid[None, :]
        ae = tl.load(aT + n0, mask=am, other=0.0).to(DOT_DTYPE)
        ao = tl.load(aT + n0 + 16, mask=am, other=0.0).to(DOT_DTYPE)
        sm = ovalid[:, None] & ((n0 // 32 + BK // 32 + offs_s) < NS)[None, :]
        s_next = tl.load(row_s + (n0 + BK) // 32, mask=sm, other=0)
        we, wo = _load_decode(w_g, gvalid, n0 // 64, NQ, s, BN, BKH, DOT_DTYPE, PTX, FOLD)
        acc = tl.dot(we, ae, acc)
        acc = tl.dot(wo, ao, acc)
        s = s_next
    _reduce_rows(acc, e, gs_ptr, wts_ptr, slot, rvalid, offs_o, ovalid, dst_ptr, K, TOPK, HAS_GS, ATOMIC)
