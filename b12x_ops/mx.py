"""MX block formats in plain torch: MXFP4 weights (E2M1 + E8M0 per 32) and MXFP8 activations.

These functions define the package's numerics; every backend's kernels are tested against them.

* MXFP4: two E2M1 codes a byte, element ``2i`` in the low nibble; one E8M0 scale byte per 32
  consecutive elements along the last dim, value ``2**(byte - 127)``.
* MXFP8 quantize-dequantize (``quant_dequant_mxfp8``): per 32 along the last dim the fp32 block
  scale ``amax * (1/448)`` is rounded UP to a power of two (the E8M0 byte, 0 for an all-zero
  block), the payload ``v * 2**(127 - byte)`` is clamped to +-448 and rounded to E4M3 (nearest
  even). Bit-exact with the b12x kernels' in-register quantization.
"""

from __future__ import annotations

import torch

from ._compat import E8M0_DTYPE

BLOCK = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0

# The 16 E2M1 values by code: sign bit 3, exponent bits 2..1, mantissa bit 0.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_LUT_CACHE: dict[torch.device, torch.Tensor] = {}


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 value of each of the 16 E2M1 codes (cached per device)."""
    device = torch.device(device)
    lut = _LUT_CACHE.get(device)
    if lut is None:
        lut = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=device)
        _LUT_CACHE[device] = lut
    return lut


def scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    """View E8M0 scales (uint8 or float8_e8m0fnu) as their uint8 bytes."""
    if scales.dtype == torch.uint8:
        return scales
    if E8M0_DTYPE is not None and scales.dtype == E8M0_DTYPE:
        return scales.view(torch.uint8)
    raise TypeError(f"E8M0 scales must be uint8 or float8_e8m0fnu, got {scales.dtype}")


def e8m0_to_float(byte: torch.Tensor) -> torch.Tensor:
    """2**(byte - 127) as fp32, exact for every byte but 255 (NaN, rejected at prepare)."""
    return torch.exp2(byte.to(torch.float32) - 127.0)


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Decode MXFP4 ``codes [..., K//2]`` and ``scales [..., K//32]`` to fp32 ``[..., K]``."""
    sb = scale_bytes(scales)
    lut = e2m1_table(codes.device)
    c = codes.view(torch.uint8) if codes.dtype == torch.int8 else codes
    lo = lut[(c & 0x0F).long()]
    hi = lut[(c >> 4).long()]
    vals = torch.stack((lo, hi), dim=-1).flatten(-2)
    k = vals.shape[-1]
    blocks = vals.unflatten(-1, (k // BLOCK, BLOCK))
    return (blocks * e8m0_to_float(sb).unsqueeze(-1)).flatten(-2)


# Midpoints between consecutive non-negative E2M1 magnitudes; a tie goes to the even code.
_E2M1_MAG = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _round_to_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values already scaled into [-6, 6] to E2M1 codes (nearest, ties to even code)."""
    mag = v.abs().clamp(max=E2M1_MAX)
    mags = torch.tensor(_E2M1_MAG, dtype=torch.float32, device=v.device)
    dist = (mag.unsqueeze(-1) - mags).abs()
    # Nearest magnitude; on an exact tie argmin takes the first (lower) index, so we break ties to
    # the even code by nudging odd codes' distance up by a hair.
    odd = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1], dtype=torch.float32, device=v.device)
    code = torch.argmin(dist + odd * 1e-7, dim=-1).to(torch.uint8)
    neg = (v < 0) & (code != 0)
    return code | (neg.to(torch.uint8) << 3)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float weight ``[..., K]`` (K a multiple of 32) to MXFP4.

    Returns ``(codes uint8 [..., K//2], scales uint8 [..., K//32])``. Each block's scale is the
    smallest power of two that brings its largest magnitude within E2M1's range (6), so nothing
    clips; every element is then rounded to the nearest E2M1 value. The error of an element is at
    most its block's scale (half the widest E2M1 step, 4 to 6), and values that are already MXFP4
    round-trip exactly.
    """
    if not w.is_floating_point():
        raise TypeError(f"quantize_mxfp4: w must be a floating tensor, got {w.dtype}")
    if w.dim() < 1 or w.shape[-1] % BLOCK != 0:
        raise ValueError(f"quantize_mxfp4: w's last dim must be a multiple of {BLOCK}, got shape {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("quantize_mxfp4: w has non-finite values")
    wf = w.detach().to(torch.float32)
    blocks = wf.unflatten(-1, (wf.shape[-1] // BLOCK, BLOCK))
    amax = blocks.abs().amax(dim=-1)
    # exponent e with amax / 2**e <= 6; an all-zero block takes the smallest scale byte.
    e = torch.ceil(torch.log2(amax / E2M1_MAX))
    e = torch.where(amax > 0, e, torch.full_like(e, -127.0)).clamp(-127.0, 127.0)
    sbytes = (e + 127.0).to(torch.uint8)
    scaled = blocks / torch.exp2(e).unsqueeze(-1)
    codes = _round_to_e2m1_codes(scaled).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), sbytes.contiguous()


def quant_dequant_mxfp8(v: torch.Tensor) -> torch.Tensor:
    """MXFP8 quantize-dequantize per 32 along the last dim; fp32 in, fp32 out (see module doc)."""
    k = v.shape[-1]
    if k % BLOCK != 0:
        raise ValueError(f"quant_dequant_mxfp8: last dim must be a multiple of {BLOCK}, got {k}")
    blocks = v.to(torch.float32).unflatten(-1, (k // BLOCK, BLOCK))
    scale = blocks.abs().amax(dim=-1, keepdim=True) * (1.0 / E4M3_MAX)
    # Round the positive fp32 scale up to a power of two on its bits: any mantissa bumps the
    # exponent. The exponent field is the E8M0 byte.
    bits = scale.contiguous().view(torch.int32)
    up = torch.where((bits & 0x7FFFFF) != 0, (bits + 0x800000) & 0x7F800000, bits)
    byte = (up >> 23) & 0xFF
    pow2 = up.view(torch.float32)
    # 2**(127 - byte) built on its bits; bytes 0 and >= 254 give 0, as in the kernels.
    inv = ((254 - byte).clamp(min=0) << 23).view(torch.float32)
    inv = torch.where(byte == 0, torch.zeros_like(inv), inv)
    payload = (blocks * inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return (payload * pow2).flatten(-2)
