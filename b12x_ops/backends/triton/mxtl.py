"""MX numerics inside Triton kernels: E2M1 decode and bit-exact MXFP8 quantize-dequantize.

These are ``@triton.jit`` helpers the stage kernels inline. Their pure-torch twins are in
``b12x_ops.mx`` (``dequantize_mxfp4``, ``quant_dequant_mxfp8``); ``tests/test_triton_interp.py``
checks them bit for bit under the CPU interpreter.

Why the values fit a bf16 ``tl.dot`` exactly: an E2M1 value times an E8M0 scale has at most 2
significant bits, an MXFP8 value (E4M3 payload times a power of two) at most 4; bf16 keeps 8.
"""

from __future__ import annotations

import triton
import triton.language as tl


# ---------------------------------------------------------------- MXFP4 decode (repacked layout)
# The weights' codes are kept in the layout of ``layout.py``: a loaded ``[groups, chunks, 32, 16]``
# tile is the MMA operand tile ``[rows, bytes]`` after a reshape and a permute
# (``repacked_to_operand``), and each 32-bit word holds 8 nibbles placed for a cheap decode.
# The asm of ``_decode_repacked_ptx_source`` (used by ``decode_repacked``) decodes a word in
# inline PTX (GPU, scale bytes in [2, 252]) into its four bf16 pairs times their rows' scales:
#  * each pair is the word's bits moved into place and masked: pair 0 ``w & 0x81C081C0`` (the sign
#    at bit 15 of each half, ``e1 e0 m`` at bits 8..6), pair 1 ``(w << 6) & 0x81C081C0``, pair 2
#    the word rotated right by 4 (``shf.r.wrap``) and masked, pair 3 its ``m`` bits shifted left by
#    2 and its other fields rotated right by 6 (``layout.PAIR_BITS``): 9 integer instructions;
#  * the bf16 read that way is the E2M1 value times 2^-126 (exponent field e1 e0; e1 e0 = 0 is a
#    subnormal, which bf16 arithmetic keeps); ``fma.rn.bf16x2`` by 2^126 gives the E2M1 value
#    exactly, a second one by the scale ``2^(byte - 127)`` the weight, exactly for bytes in
#    [2, 252] (every product stays a normal bf16);
#  * with ``fold`` (scale bytes in [2, 128], the usual checkpoint) the 2^126 is folded into the
#    scale, ``2^(byte - 1)`` (exponent field byte + 126, still a normal bf16), so each pair takes
#    one fma: 13 instructions for 8 weights, 9 of them integer (the placement before took 15, 11).
# The scales are made from their bytes once per 32-element block outside the asm
# (``_ptx_scales``). ``decode_repacked_ops`` is the same arithmetic in Triton operations (the
# interpreter, and checkpoints with other scale bytes). ``tests/test_ptx_decode.py`` runs the asm
# on an emulator of these instructions against the package's dequantizer on the CPU.
def _decode_repacked_ptx_source(fold: bool = False) -> str:
    """The asm: a word (``$4``) to its four bf16 pairs times their rows' scales (``$5``: row r0,
    ``$6``: r0 + 8): ``$0``/``$1`` the even weights of rows r0/r0 + 8, ``$2``/``$3`` the odd ones."""
    bias = [] if fold else ["fma.rn.bf16x2 t, t, bias, nz;"]
    lines = ["", "{", ".reg .b32 t, u, msk, nz;" if fold else ".reg .b32 t, u, msk, bias, nz;",
             "mov.b32 msk, 0x81C081C0;", *([] if fold else ["mov.b32 bias, 0x7E807E80;"]), "mov.b32 nz, 0x80008000;"]
    lines += ["and.b32 t, $4, msk;", *bias, "fma.rn.bf16x2 $0, t, $5, nz;",
              "shl.b32 t, $4, 6;", "and.b32 t, t, msk;", *bias, "fma.rn.bf16x2 $1, t, $6, nz;",
              "shf.r.wrap.b32 t, $4, $4, 4;", "and.b32 t, t, msk;", *bias, "fma.rn.bf16x2 $2, t, $5, nz;"]
    lines += [
        "shl.b32 t, $4, 2;",
        "and.b32 t, t, 0x00400040;",  # m
        "shf.r.wrap.b32 u, $4, $4, 6;",
        "lop3.b32 t, t, u, 0x81808180, 0xF8;",  # t | (u & sign, e1, e0 bits)
        *bias,
        "fma.rn.bf16x2 $3, t, $6, nz;",
        "}",
        "",
    ]
    return "\n".join(lines)


_DECODE_PTX = tl.constexpr(_decode_repacked_ptx_source())
_DECODE_PTX_FOLD = tl.constexpr(_decode_repacked_ptx_source(fold=True))


def _scale_pairs_ptx_source(fold: bool) -> str:
    """The asm of ``gluon_kernels._scale_pairs``: ``$2`` holds the scale bytes ``[r0 s0, r0 s1, r8 s0,
    r8 s1]`` (rows r0 and r0 + 8 of a lane, a chunk's blocks s0 and s1); ``$0`` gets the bf16 pair
    (r0, r8) of block s0 and ``$1`` of block s1, each ``byte << 7`` plus ``126 << 7`` with ``fold``
    (``_ptx_scales``'s values, two at a time: a mask or a byte permute, then one multiply-add)."""
    bias = "0x3F003F00" if fold else "0"
    return "\n".join(["{", ".reg .b32 t;", "and.b32 t, $2, 0x00FF00FF;", f"mad.lo.u32 $0, t, 128, {bias};",
                      "prmt.b32 t, $2, 0, 0x4341;", f"mad.lo.u32 $1, t, 128, {bias};", "}"])


_SCALE_PAIRS_PTX = tl.constexpr(_scale_pairs_ptx_source(False))
_SCALE_PAIRS_PTX_FOLD = tl.constexpr(_scale_pairs_ptx_source(True))


@triton.jit
def _ptx_scales(scale_bytes, FOLD: tl.constexpr):
    """The bf16 scales the PTX decode multiplies by: ``2^(byte - 127)``, or ``2^(byte - 1)`` with
    ``FOLD`` (the byte, or byte + 126, as the exponent field)."""
    b = scale_bytes.to(tl.int32)
    if FOLD:
        b = b + 126
    return (b << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def repacked_to_operand(t, BN: tl.constexpr, BKH: tl.constexpr):
    """A loaded ``[BN / 16, BKH / 32, 32, 16]`` repacked tile (or its decoded twin) as the
    ``[BN, BKH]`` operand tile: rows, then row bytes (a reshape and a permute: no data moves)."""
    G: tl.constexpr = BN // 16
    Q: tl.constexpr = BKH // 32
    t = tl.reshape(t, (G, Q, 8, 4, 2, 2, 2, 2))  # g, q, r0, c, s, kh, rh, kk
    t = tl.permute(t, (0, 6, 2, 1, 4, 5, 3, 7))  # g, rh, r0, q, s, kh, c, kk
    return tl.reshape(t, (BN, BKH))


@triton.jit
def _f16_halves(bits):
    """The two fp16 halves of int32 ``bits`` as fp32 (exact, fp16 subnormals included)."""
    lo = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _rotr(w, N: tl.constexpr):
    """int32 ``w`` rotated right by ``N`` bits."""
    return ((w >> N) & ((1 << (32 - N)) - 1)) | (w << (32 - N))


@triton.jit
def _bf16_to_f16_fields(t):
    """A pair with the sign at bit 15 of each half and ``e1 e0 m`` at bits 8..6 (as the asm makes
    it) as two fp16 halves with ``e1 e0 m`` at bits 11..9: the fp16 of exponent field ``E = e1 e0``
    and top mantissa bit ``m``, ``2^(E - 15) (1 + m / 2)`` for ``E >= 1`` and the subnormal
    ``m 2^-15`` for ``E = 0``, i.e. the E2M1 value times 2^-14, which ``_f16_halves`` makes an
    exact, normal fp32."""
    return ((t << 3) & 0x0E000E00) | (t & -2147450880)  # (0x80008000)


@triton.jit
def decode_repacked_ops(t, BN: tl.constexpr, BKH: tl.constexpr):
    """The repacked tile ``t`` (``[BN / 16, BKH / 32, 32, 16]`` bytes) decoded with Triton
    operations: ``(even, odd)`` fp32 ``[BN, BKH]`` operand tiles of the E2M1 values times 2^-14
    (through fp16 bits, so no fp32 subnormal is ever formed), unscaled."""
    G: tl.constexpr = BN // 16
    Q: tl.constexpr = BKH // 32
    v = tl.reshape(t.to(tl.int32), (G, Q, 32, 4, 4))
    b0, b1 = tl.split(tl.reshape(v, (G, Q, 32, 4, 2, 2)))
    b00, b01 = tl.split(b0)
    b10, b11 = tl.split(b1)
    # (the first split takes bit 0 of the byte index, the second bit 1: b01 is byte 2, b10 byte 1)
    w = b00 | (b10 << 8) | (b01 << 16) | (b11 << 24)  # [G, Q, 32, 4] words
    msk = -2118090304  # (0x81C081C0: the asm's pairs, ``layout.PAIR_BITS``)
    p3 = ((w << 2) & 0x00400040) | (_rotr(w, 6) & -2122284672)  # (0x81808180)
    e00, e01 = _f16_halves(_bf16_to_f16_fields(w & msk))  # even, row r0, byte kk 0 / 1
    e10, e11 = _f16_halves(_bf16_to_f16_fields((w << 6) & msk))  # even, row r0 + 8
    o00, o01 = _f16_halves(_bf16_to_f16_fields(_rotr(w, 4) & msk))
    o10, o11 = _f16_halves(_bf16_to_f16_fields(p3))
    # (tl.join adds its dim last: the inner joins make rh, the outer kk) -> [G, Q, 32, 4, rh, kk]
    even = tl.join(tl.join(e00, e10), tl.join(e01, e11))
    odd = tl.join(tl.join(o00, o10), tl.join(o01, o11))
    return repacked_to_operand(even, BN, BKH), repacked_to_operand(odd, BN, BKH)


@triton.jit
def load_repacked(w_g, gvalid, q0, NQ: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr):
    """One K step's ``[BN / 16, BKH / 32, 32, 16]`` repacked code tile: row groups from ``w_g``
    (the tile's first group; ``gvalid`` masks groups past the matrix), row-byte chunks ``q0 ..``
    of ``NQ`` (chunks past the row read as zero codes)."""
    G: tl.constexpr = BN // 16
    Q: tl.constexpr = BKH // 32
    g = tl.arange(0, G)
    q = tl.arange(0, Q)
    lb = tl.arange(0, 512)
    off = (g[:, None, None] * NQ + q0 + q[None, :, None]) * 512 + lb[None, None, :]
    m = gvalid[:, None, None] & ((q0 + q) < NQ)[None, :, None]
    return tl.reshape(tl.load(w_g + off, mask=m, other=0), (G, Q, 32, 16))


@triton.jit
def decode_repacked(t, scale_bytes, BN: tl.constexpr, BKH: tl.constexpr, DOT_DTYPE: tl.constexpr,
                    PTX: tl.constexpr, FOLD: tl.constexpr):
    """A loaded repacked tile ``t`` (``load_repacked``) decoded with its ``[BN, BKH / 16]`` E8M0
    ``scale_bytes``: the MMA operands ``(even, odd)`` ``[BN, BKH]`` in ``DOT_DTYPE``. ``even[:, i]``
    is element ``2i`` of the step (the low nibble of row byte ``i``), ``odd[:, i]`` element
    ``2i + 1``. ``PTX`` decodes in inline PTX (``FOLD``: the one-fma form); else Triton operations,
    scaled in fp32 (byte 0 gives 0 for 2^-127, as before)."""
    if PTX:
        sb = _ptx_scales(scale_bytes, FOLD)
        sc = tl.reshape(tl.broadcast_to(sb[:, :, None], (BN, BKH // 16, 16)), (BN, BKH))
        asm: tl.constexpr = _DECODE_PTX_FOLD if FOLD else _DECODE_PTX
        even, odd = tl.inline_asm_elementwise(asm, constraints="=r,=r,=r,=r,r,r,r",
                                              args=[repacked_to_operand(t, BN, BKH), sc],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        sc = tl.reshape(tl.broadcast_to(e8m0_f32(scale_bytes)[:, :, None], (BN, BKH // 16, 16)), (BN, BKH))
        ev, od = decode_repacked_ops(t, BN, BKH)
        even = ((ev * 16384.0) * sc).to(DOT_DTYPE)  # (2^14 undoes the decode's 2^-14: exact)
        odd = ((od * 16384.0) * sc).to(DOT_DTYPE)
    return even, odd


@triton.jit
def round_e4m3(v):
    """Round fp32 ``v`` with ``|v| <= 448`` to the nearest E4M3 value, ties to even (as fp32)."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    # normal range (|v| >= 2^-6): keep 3 mantissa bits, round half to even on the bit pattern
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)  # -1048576 = 0xFFF00000
    # subnormal range: multiples of 2^-9; adding 2^14 (whose ulp is 2^-9) rounds half to even
    sub = (a + 16384.0) - 16384.0
    r = tl.where(a >= 0.015625, normal, sub)
    return tl.where(v < 0, -r, r)


@triton.jit
def mxfp8_block_scale(amax):
    """The MXFP8 block scale of blocks with absolute maximum ``amax`` (fp32): ``(pow2, inv)``, the
    scale ``amax * (1/448)`` rounded up to a power of two on its bits, and the payload multiplier
    ``2^(127 - byte)`` (0 for byte 0 or >= 254)."""
    scale = amax * 0.002232142857142857  # fp32(1/448)
    bits = scale.to(tl.int32, bitcast=True)
    up = tl.where((bits & 0x7FFFFF) != 0, (bits + 0x800000) & 0x7F800000, bits)
    byte = (up >> 23) & 0xFF
    pow2 = up.to(tl.float32, bitcast=True)
    inv = (tl.maximum(254 - byte, 0) << 23).to(tl.float32, bitcast=True)
    inv = tl.where(byte == 0, 0.0, inv)
    return pow2, inv


@triton.jit
def mxfp8_payload(v, inv):
    """The E4M3 payload (an fp32 holding an E4M3 value) of fp32 ``v`` in a block with multiplier ``inv``."""
    return round_e4m3(tl.minimum(tl.maximum(v * inv, -448.0), 448.0))


@triton.jit
def mxfp8_apply(v, pow2, inv):
    """MXFP8 quantize-dequantize of fp32 ``v`` with its block's ``(pow2, inv)`` (broadcast)."""
    return mxfp8_payload(v, inv) * pow2


@triton.jit
def quant_dequant_mxfp8_tile(v, BR: tl.constexpr, BC: tl.constexpr):
    """MXFP8 quantize-dequantize of an fp32 ``[BR, BC]`` tile per 32 along its columns.

    Bit-exact with ``b12x_ops.mx.quant_dequant_mxfp8`` (see ``mxfp8_block_scale``)."""
    blocks = tl.reshape(v, (BR, BC // 32, 32))
    pow2, inv = mxfp8_block_scale(tl.max(tl.abs(blocks), axis=2))
    out = mxfp8_apply(blocks, pow2[:, :, None], inv[:, :, None])
    return tl.reshape(out, (BR, BC))


@triton.jit
def e8m0_f32(byte):
    """``2^(byte - 127)`` in fp32 from its bits (byte 0 gives 0 instead of 2^-127, as the bf16 path)."""
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)
