"""The inline-PTX MXFP4 decode (``mxtl._decode_ptx_source``) run on this CPU.

A small emulator executes the asm's instructions (mov, prmt, shl, shr, and, mad.lo, mul.lo, lop3
and fma.rn.bf16x2) on every code byte with every scale byte its variant accepts, and compares the
bf16 results bit for bit with the package's dequantizer. On a GPU, ``test_triton_gpu.py`` checks
the same strings compiled by ptxas.
"""

from __future__ import annotations

import re

import pytest
import torch

from b12x_ops.backends.triton.mxtl import _decode_ptx_source
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


@pytest.mark.parametrize("fold, scales", [(False, range(2, 253)), (True, range(2, 129))])
def test_ptx_decode_is_exact_on_the_emulator(fold, scales):
    src = _decode_ptx_source(fold)
    assert len(re.findall(r"^fma", src, re.M)) == (2 if fold else 4)
    assert len([ln for ln in src.splitlines() if re.match(r"[a-z]", ln) and not ln.startswith("mov")]) == (10 if fold else 12)
    codes = torch.arange(256, dtype=torch.uint8)
    for s in scales:
        want = dequantize_mxfp4(codes.view(1, 256), torch.full((1, 16), s, dtype=torch.uint8)).to(torch.bfloat16)[0]
        for i in range(0, 256, 2):
            # two code bytes and their scale bytes in the low halves; the high halves hold garbage
            word = i | ((i + 1) << 8) | (0xA5C3 << 16)
            out = run_asm(src, {"$2": word, "$3": ptx_scale_pair(s, s, fold)})
            got = torch.tensor([out["$0"] & 0xFFFF, out["$0"] >> 16, out["$1"] & 0xFFFF, out["$1"] >> 16],
                               dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
            el = want[2 * i: 2 * i + 4]  # elements 2j (low nibble of byte j) and 2j + 1
            expect = torch.stack([el[0], el[2], el[1], el[3]])
            assert torch.equal(got.view(torch.int16), expect.view(torch.int16)), (fold, s, i)


def test_ptx_decode_scales_per_byte():
    """Each code byte takes its own scale byte."""
    src = _decode_ptx_source(True)
    out = run_asm(src, {"$2": 0x2202, "$3": ptx_scale_pair(0x7C, 0x7F, True)})  # codes 2 (1.0) and 0x22
    assert _bf16_halves(out["$0"]).tolist() == [2.0 ** -3, 1.0]
    assert _bf16_halves(out["$1"]).tolist() == [0.0, 1.0]


def test_ptx_decode_fold_range_is_tight():
    """Folding 2^126 into the scale needs scale bytes <= 128: at 129 the largest code overflows
    bf16's exponent (the emulator sees the difference, so the tests above can fail)."""
    src = _decode_ptx_source(True)
    out = run_asm(src, {"$2": 0x0707, "$3": ptx_scale_pair(129, 129, True)})  # code 7 (6.0), scale byte 129
    assert _bf16_halves(out["$0"]).tolist() != [6.0 * 4.0, 6.0 * 4.0]


@pytest.mark.parametrize("fold", [False, True])
def test_repacked_layout_decode_is_exact_on_the_emulator(fold):
    """``benchmarks/experiments/repacked.py``: its packer and its one-word asm reproduce the
    dequantizer at every position of a 16-row, 32-byte chunk (seven chunks of shifted code bytes,
    each row with its own scale byte)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        from experiments import repacked as R
    finally:
        sys.path.pop(0)
    src = R._decode_ptx4_source(fold)
    assert len(re.findall(r"^fma", src, re.M)) == (4 if fold else 8)
    ops = [ln for ln in src.splitlines() if re.match(r"[a-z]", ln) and not ln.startswith("mov")]
    assert len(ops) == (15 if fold else 19)  # 8 weights (10 for 4 in _decode_ptx_source)
    top = 128 if fold else 252
    for shift in range(0, 256, 37):  # every code byte meets every position over the shifts
        codes = ((torch.arange(16 * 32) * 7 + shift) % 256).to(torch.uint8).view(1, 16, 32)
        sbytes = torch.tensor([2 + (r * 41 + shift) % (top - 1) for r in range(16)], dtype=torch.uint8)
        want = dequantize_mxfp4(codes[0], sbytes[:, None].expand(16, 2).contiguous()).to(torch.bfloat16)  # [16, 64]
        packed = R.repack_codes(codes)[0, 0, 0]  # [32 lanes, 16 bytes]
        for lane in range(32):
            r0, c = lane // 4, lane % 4
            for wi in range(4):
                s, kh = wi // 2, wi % 2
                word = int.from_bytes(bytes(packed[lane, 4 * wi: 4 * wi + 4].tolist()), "little")
                out = run_asm(src, {"$4": word, "$5": ptx_scale_pair(int(sbytes[r0]), int(sbytes[r0]), fold),
                                    "$6": ptx_scale_pair(int(sbytes[r0 + 8]), int(sbytes[r0 + 8]), fold)})
                h = 16 * s + 8 * kh + 2 * c  # the word's first K byte; weights 2h .. 2h + 3
                for reg, row, odd in (("$0", r0, 0), ("$1", r0 + 8, 0), ("$2", r0, 1), ("$3", r0 + 8, 1)):
                    got = _bf16_halves(out[reg])
                    expect = torch.stack([want[row, 2 * h + odd], want[row, 2 * h + 2 + odd]]).double()
                    assert torch.equal(got, expect), (fold, shift, lane, wi, reg)
