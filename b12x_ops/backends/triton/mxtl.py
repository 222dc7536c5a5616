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


@triton.jit
def e2m1_bits_bf16(nib):
    """bf16 bit pattern (int32) of the E2M1 code ``nib`` (0..15).

    A code ``s e1 e0 m`` with exponent field ``em >> 1 > 0`` is ``2^(e-1) * (1 + m/2)``: bf16
    exponent ``126 + e``, top mantissa bit ``m``, i.e. ``(em << 6) + (126 << 7)``. Code 1 is 0.5, 0 is 0.
    """
    em = nib & 7
    bits = tl.where(em >= 2, (em << 6) + (126 << 7), tl.where(em == 1, 0x3F00, 0))
    return bits | ((nib & 8) << 12)


@triton.jit
def _scaled_bits(nib, base):
    """bf16 bits of E2M1 ``nib`` times ``2^(byte - 127)``, the scale folded into the exponent.

    ``base = (byte << 7) - 128``. For a code with exponent field ``E = em >> 1 > 0`` the bf16
    exponent is ``E - 1 + byte`` and the mantissa's top bit ``m``: ``(em << 6) + base``; code 1
    (0.5) has exponent ``byte - 1`` and no mantissa, 64 less; code 0 is 0. Exact for bytes in
    [2, 252] (the exponent stays normal), which prepare checks before choosing this path.
    """
    em = nib & 7
    mag = (em << 6) + base - tl.where(em == 1, 64, 0)
    mag = tl.where(em == 0, 0, mag)
    return mag | ((nib & 8) << 12)


@triton.jit
def decode_mxfp4_pair(codes, scale_bytes, BR: tl.constexpr, BKH: tl.constexpr, OUT_DTYPE: tl.constexpr,
                      FAST: tl.constexpr):
    """Decode a ``[BR, BKH]`` tile of MXFP4 bytes into its even and odd elements.

    ``scale_bytes`` is the ``[BR, BKH // 16]`` E8M0 bytes of the tile (one per 16 bytes = 32
    elements). Returns ``(even, odd)``, each ``[BR, BKH]`` in ``OUT_DTYPE``: ``even[:, i]`` is
    element ``2i`` of the tile (the low nibble of byte ``i``), ``odd[:, i]`` element ``2i + 1``.
    ``FAST`` folds the scale into the bf16 exponent with integer ops (scale bytes in [2, 252]);
    otherwise the decoded value is multiplied by the scale in fp32.
    """
    c = codes.to(tl.int32)
    if FAST:
        base = (scale_bytes.to(tl.int32) << 7) - 128
        base = tl.reshape(tl.broadcast_to(base[:, :, None], (BR, BKH // 16, 16)), (BR, BKH))
        even = _scaled_bits(c & 15, base).to(tl.int16).to(tl.bfloat16, bitcast=True).to(OUT_DTYPE)
        odd = _scaled_bits(c >> 4, base).to(tl.int16).to(tl.bfloat16, bitcast=True).to(OUT_DTYPE)
    else:
        lo = e2m1_bits_bf16(c & 15).to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = e2m1_bits_bf16(c >> 4).to(tl.int16).to(tl.bfloat16, bitcast=True)
        # 2^(byte - 127) on its bits (byte 0 gives 0 instead of 2^-127: below any useful weight).
        sc = (scale_bytes.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BR, BKH // 16, 16)), (BR, BKH))
        even = (lo.to(tl.float32) * sc).to(OUT_DTYPE)
        odd = (hi.to(tl.float32) * sc).to(OUT_DTYPE)
    return even, odd


# Inline PTX decode of MXFP4 to bf16 for the tensor-core GEMMs (GPU only; the interpreter and
# checkpoints with scale bytes outside [2, 252] take ``decode_mxfp4_pair``). One instance takes 2
# code bytes (the low half of a 32-bit register: the two bytes a thread holds side by side in the
# MMA operand layout, so no bytes are gathered from other registers) and their two scales as a
# bf16 pair, and returns two bf16 pairs: the bytes' low nibbles' values (``even``) and their high
# nibbles' (``odd``):
#  * ``prmt`` spreads the two code bytes 16 bits apart (bytes 0, 1 -> bits 0 and 16);
#  * even pair: two shifts place the low nibble's magnitude bits ``e1 e0 m`` at bf16 bits 8..6 and
#    its sign at bit 15, in both halves at once, and one ``lop3`` keeps exactly those bits
#    ((a | b) & mask: each shifted copy is zero where the other one's bits are kept);
#  * odd pair: the high nibbles are shifted down and masked to 4 bits each; one multiply by
#    2^6 + 2^12 then makes both shifted copies at once (they do not overlap, so the sum is their
#    union) and an ``and`` with the same mask keeps the bits;
#  * the bf16 read that way is the E2M1 value times 2^-126 (exponent field e1 e0; e1 e0 = 0 is a
#    subnormal, which bf16 arithmetic keeps); ``fma.rn.bf16x2`` by 2^126 gives the E2M1 value
#    exactly, a second one by the scale ``2^(byte - 127)`` the weight, exactly for bytes in
#    [2, 252] (every product stays a normal bf16).
# With ``fold`` (scale bytes in [2, 128], the usual checkpoint) the 2^126 is folded into the scale,
# ``2^(byte - 1)`` (exponent field byte + 126, still a normal bf16), so each pair takes one fma:
# 10 instructions for 4 weights. The scales are made from their bytes once per 32-element block
# outside the asm (``_ptx_scales``). ``tests/test_ptx_decode.py`` runs both strings on an emulator
# of these instructions against the package's dequantizer on the CPU.
def _decode_ptx_source(fold: bool = False) -> str:
    """The asm described above: the spread code bytes, then the even and the odd pair (one fma
    each by the scale pair ``$3``, two without ``fold``)."""
    bias = [] if fold else ["fma.rn.bf16x2 t, t, bias, nz;"]
    return "\n".join([
        "",
        "{",
        ".reg .b32 r, t, u, msk, nz;" if fold else ".reg .b32 r, t, u, msk, bias, nz;",
        "mov.b32 msk, 0x81C081C0;",
        *([] if fold else ["mov.b32 bias, 0x7E807E80;"]),
        "mov.b32 nz, 0x80008000;",
        "prmt.b32 r, $2, 0, 0x4140;",
        # even: the low nibbles
        "shl.b32 t, r, 6;",
        "shl.b32 u, r, 12;",
        "lop3.b32 t, t, u, msk, 0xA8;",
        *bias,
        "fma.rn.bf16x2 $0, t, $3, nz;",
        # odd: the high nibbles, isolated; (t << 6) | (t << 12) as one multiply
        "shr.b32 t, r, 4;",
        "and.b32 t, t, 0x000F000F;",
        "mul.lo.u32 t, t, 0x1040;",
        "and.b32 t, t, msk;",
        *bias,
        "fma.rn.bf16x2 $1, t, $3, nz;",
        "}",
        "",
    ])


_DECODE_PTX = tl.constexpr(_decode_ptx_source())
_DECODE_PTX_FOLD = tl.constexpr(_decode_ptx_source(fold=True))


@triton.jit
def _ptx_scales(scale_bytes, FOLD: tl.constexpr):
    """The bf16 scales the PTX decode multiplies by: ``2^(byte - 127)``, or ``2^(byte - 1)`` with
    ``FOLD`` (the byte, or byte + 126, as the exponent field)."""
    b = scale_bytes.to(tl.int32)
    if FOLD:
        b = b + 126
    return (b << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def decode_mxfp4_pair_ptx(codes, scale_bytes, BR: tl.constexpr, BKH: tl.constexpr, FOLD: tl.constexpr = False):
    """``decode_mxfp4_pair`` (bf16, scale bytes in [2, 252], or [2, 128] with ``FOLD``) in inline
    PTX: same ``(even, odd)``."""
    sb = _ptx_scales(scale_bytes, FOLD)
    sc = tl.reshape(tl.broadcast_to(sb[:, :, None], (BR, BKH // 16, 16)), (BR, BKH))
    asm: tl.constexpr = _DECODE_PTX_FOLD if FOLD else _DECODE_PTX
    even, odd = tl.inline_asm_elementwise(asm, constraints="=r,=r,r,r", args=[codes, sc],
                                          dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
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


@triton.jit
def e2m1_nibble_pair_f32_2m14(words, t: tl.constexpr):
    """Nibbles ``t`` and ``t + 4`` (``t`` in 0..3) of int32 ``words`` as E2M1 values times ``2^-14``,
    in fp32, exactly, for all 16 codes.

    A code ``s e1 e0 m`` placed at bits 15 and 11..9 of an fp16 is the fp16 of exponent field
    ``E = em >> 1`` and top mantissa bit ``m``: ``2^(E-15) * (1 + m/2)`` for ``E >= 1`` and the
    fp16 subnormal ``m * 2^-15`` for ``E = 0``, i.e. the E2M1 value times ``2^-14``. fp16
    subnormals convert to fp32 exactly (no flush to zero anywhere) and the fp32 results are normal;
    callers fold ``2^14`` into their per-32-block scale multiply. Nibbles ``t`` and ``t + 4`` are 16
    bits apart, so one shift and mask place both magnitudes and one more both signs: two fp16 in one
    register, four integer ops for two values (then one fp16-to-fp32 conversion each).
    """
    if 4 * t >= 9:
        mag = (words >> (4 * t - 9)) & 0x0E000E00
    else:
        mag = (words << (9 - 4 * t)) & 0x0E000E00
    sgn = (words << (12 - 4 * t)) & -2147450880  # 0x80008000 (t <= 3: a left shift)
    both = mag | sgn
    lo = both.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (both >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def quant_mxfp8_bytes(v, BR: tl.constexpr, BC: tl.constexpr):
    """MXFP8 quantization of an fp32 ``[BR, BC]`` tile per 32 along its columns, as bytes: the E4M3
    payloads ``[BR, BC]`` and the E8M0 scale bytes ``[BR, BC // 32]`` (uint8), the same numbers
    ``quant_dequant_mxfp8_tile`` multiplies back together."""
    blocks = tl.reshape(v, (BR, BC // 32, 32))
    pow2, inv = mxfp8_block_scale(tl.max(tl.abs(blocks), axis=2))
    payload = mxfp8_payload(blocks, inv[:, :, None])
    bits = payload.to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # exact: the payload is an E4M3 value
    byte = ((pow2.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
    return tl.reshape(bits, (BR, BC)), byte


@triton.jit
def _e2m1_e4m3_bits(nib):
    """E4M3 bits (int32) of the E2M1 code ``nib``: exponent field ``e1 e0`` + 6, mantissa ``m``
    (0.5 and 0 by hand); exact for all 16 codes."""
    em = nib & 7
    mag = tl.where(em >= 2, (em << 2) + 48, tl.where(em == 1, 48, 0))
    return mag | ((nib & 8) << 4)


@triton.jit
def decode_mxfp4_e4m3(codes, BR: tl.constexpr, BKH: tl.constexpr):
    """``[BR, BKH]`` MXFP4 code bytes as ``[BR, 2 * BKH]`` E4M3 in element order (low nibble first):
    the E2M1 values exactly, without their block scales (the fp8 GEMMs apply those to K = 32 sums)."""
    c = codes.to(tl.int32)
    both = tl.reshape(tl.join(_e2m1_e4m3_bits(c & 15), _e2m1_e4m3_bits(c >> 4)), (BR, 2 * BKH))
    return both.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
