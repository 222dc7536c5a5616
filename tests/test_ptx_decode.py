"""The inline-PTX MXFP4 decode of the repacked layout (``mxtl._decode_repacked_ptx_source``) run on
this CPU.

A small emulator executes the asm's instructions (mov, prmt, shl, shr, and, mad.lo, mul.lo, lop3
and fma.rn.bf16x2) on words ``layout.repack_codes`` made, with the scale bytes its variant
accepts, and compares the bf16 results bit for bit with the package's dequantizer. On a GPU,
``test_triton_gpu.py`` checks the same strings compiled by ptxas.
"""

from __future__ import annotations

import re

import pytest
import torch

from b12x_ops.backends.triton.layout import repack_codes
from b12x_ops.backends.triton.mxtl import _decode_repacked_ptx_source, _scale_pairs_ptx_source
from b12x_ops.mx import dequantize_mxfp4

M32 = 0xFFFFFFFF


def _bf16_halves(word: int) -> torch.Tensor:
    pair = torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16)
    return pair.view(torch.bfloat16).double()


def _bf16_bits(v: torch.Tensor) -> int:
    lo, hi = (int(b) & 0xFFFF for b in v.to(torch.bfloat16).view(torch.int16))
    return lo | (hi << 16)


def _prmt(a: int, b: int, sel: int) -> int:
    pool = (a & M32) | ((b & M32) << 32)
    out = 0
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = (pool >> (8 * (s & 7))) & 0xFF
        if s & 8:  # sign replication mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def run_asm(src: str, inputs: dict[str, int]) -> dict[str, int]:
    """Execute ``src`` (the subset the decode uses) with ``$n`` operands from ``inputs``."""
    regs = dict(inputs)

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 0) & M32

    for line in src.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = [t.strip() for t in rest.split(",")]
        d, xs = args[0], [val(t) for t in args[1:]]
        if op == "mov.b32":
            r = xs[0]
        elif op == "prmt.b32":
            r = _prmt(*xs)
        elif op == "shl.b32":
            r = (xs[0] << xs[1]) & M32
        elif op == "shr.b32":
            r = xs[0] >> xs[1]
        elif op == "shf.r.wrap.b32":  # funnel shift right of (hi xs[1] : lo xs[0]) by xs[2] mod 32
            r = (((xs[1] << 32) | xs[0]) >> (xs[2] & 31)) & M32
        elif op == "and.b32":
            r = xs[0] & xs[1]
        elif op == "mad.lo.u32":
            r = (xs[0] * xs[1] + xs[2]) & M32
        elif op == "mul.lo.u32":
            r = (xs[0] * xs[1]) & M32
        elif op == "lop3.b32":
            r = _lop3(*xs)
        elif op == "fma.rn.bf16x2":  # each half: a * b + c rounded once (exact here: checked)
            a, b, c = (_bf16_halves(x) for x in xs)
            r = _bf16_bits(a * b + c)
        else:
            raise AssertionError(f"instruction not emulated: {op}")
        regs[d] = r
    return regs


def ptx_scale_pair(b0: int, b1: int, fold: bool) -> int:
    """The bf16 scale pair ``mxtl._ptx_scales`` makes of two scale bytes (its arithmetic, here)."""
    e0, e1 = (b + 126 if fold else b for b in (b0, b1))
    return ((e0 << 7) & 0xFFFF) | (((e1 << 7) & 0xFFFF) << 16)


def _decode_chunk(codes, sbytes, fold, src):
    """The asm over every word of one repacked 16-row, 32-byte chunk: ``[16, 64]`` bf16 weights."""
    packed = repack_codes(codes.view(1, 16, 32))[0, 0, 0]  # [32 lanes, 16 bytes]
    got = torch.empty(16, 64, dtype=torch.float64)
    for lane in range(32):
        r0, c = lane // 4, lane % 4
        for wi in range(4):
            s, kh = wi // 2, wi % 2
            word = int.from_bytes(bytes(packed[lane, 4 * wi: 4 * wi + 4].tolist()), "little")
            out = run_asm(src, {"$4": word, "$5": ptx_scale_pair(int(sbytes[r0]), int(sbytes[r0]), fold),
                                "$6": ptx_scale_pair(int(sbytes[r0 + 8]), int(sbytes[r0 + 8]), fold)})
            h = 16 * s + 8 * kh + 2 * c  # the word's first K byte; weights 2h .. 2h + 3
            for reg, row, odd in (("$0", r0, 0), ("$1", r0 + 8, 0), ("$2", r0, 1), ("$3", r0 + 8, 1)):
                got[row, 2 * h + odd], got[row, 2 * h + 2 + odd] = _bf16_halves(out[reg])
    return got


@pytest.mark.parametrize("fold", [False, True])
def test_repacked_decode_is_exact_on_the_emulator(fold):
    """The packer and the one-word asm reproduce the dequantizer at every position of a chunk
    (seven chunks of shifted code bytes, each row with its own scale byte, over the variant's
    whole scale range)."""
    src = _decode_repacked_ptx_source(fold)
    assert len(re.findall(r"^fma", src, re.M)) == (4 if fold else 8)
    ops = [ln for ln in src.splitlines() if re.match(r"[a-z]", ln) and not ln.startswith("mov")]
    assert len(ops) == (13 if fold else 17)  # 8 weights
    top = 128 if fold else 252
    for shift in range(0, 256, 37):  # every code byte meets every position over the shifts
        codes = ((torch.arange(16 * 32) * 7 + shift) % 256).to(torch.uint8).view(16, 32)
        sbytes = torch.tensor([2 + (r * 41 + shift) % (top - 1) for r in range(16)], dtype=torch.uint8)
        sbytes[shift % 16] = top  # (and both ends of the range)
        sbytes[(shift + 1) % 16] = 2
        want = dequantize_mxfp4(codes, sbytes[:, None].expand(16, 2).contiguous()).to(torch.bfloat16)  # [16, 64]
        got = _decode_chunk(codes, sbytes, fold, src)
        assert torch.equal(got, want.double()), (fold, shift)


def test_repacked_decode_fold_range_is_tight():
    """Folding 2^126 into the scale needs scale bytes <= 128: at 129 the largest code overflows
    bf16's exponent (the emulator sees the difference, so the test above can fail)."""
    src = _decode_repacked_ptx_source(True)
    codes = torch.full((16, 32), 0x77, dtype=torch.uint8)  # code 7 (6.0) everywhere
    got = _decode_chunk(codes, torch.full((16,), 129, dtype=torch.uint8), True, src)
    assert not torch.equal(got, torch.full((16, 64), 6.0 * 4.0, dtype=torch.float64))
    ok = _decode_chunk(codes, torch.full((16,), 128, dtype=torch.uint8), True, src)
    assert torch.equal(ok, torch.full((16, 64), 6.0 * 2.0, dtype=torch.float64))


@pytest.mark.parametrize("fold", [False, True])
def test_scale_pairs_match_the_decode_scales_on_the_emulator(fold):
    """``gluon_kernels._scale_pairs``' asm: a lane's scale bytes loaded two at a time (rows r0 and r0 + 8,
    a chunk's blocks s0 and s1: one register ``[r0 s0, r0 s1, r8 s0, r8 s1]``) give, for each block,
    the two rows' bf16 scales ``mxtl._ptx_scales`` makes of single bytes, over the variant's whole
    range and 0 (a masked load), every byte in every position."""
    src = _scale_pairs_ptx_source(fold)
    assert len([ln for ln in src.splitlines() if re.match(r"[a-z]", ln)]) == 4
    top = 128 if fold else 252
    values = [0] + list(range(2, top + 1))
    for i, b in enumerate(values):
        others = [values[(i * k + 7) % len(values)] for k in (3, 5, 11)]
        for pos in range(4):
            bs = others[:pos] + [b] + others[pos:]  # [r0 s0, r0 s1, r8 s0, r8 s1]
            word = bs[0] | (bs[1] << 8) | (bs[2] << 16) | (bs[3] << 24)
            out = run_asm(src, {"$2": word})
            assert out["$0"] == ptx_scale_pair(bs[0], bs[2], fold), (fold, bs)
            assert out["$1"] == ptx_scale_pair(bs[1], bs[3], fold), (fold, bs)
