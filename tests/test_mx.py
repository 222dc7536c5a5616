"""MX numerics: the MXFP8 quant-dequant is bit-exact with b12x's oracle; MXFP4 encode/decode."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import b12x_ops
from b12x_ops.mx import dequantize_mxfp4, quant_dequant_mxfp8, quantize_mxfp4

from _samples import _b12x_reference


def _b12x_qdq():
    _b12x_reference()  # skip/raise exactly like the oracle when b12x is absent
    from b12x._lib.intrinsics import quant_dequant_mxfp8_torch

    return quant_dequant_mxfp8_torch


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    blocks=st.integers(1, 4),
    log_scale=st.integers(-140, 120),
    zero_block=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_mxfp8_bit_exact_with_b12x(rows, blocks, log_scale, zero_block, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(rows, blocks * 32, generator=g) * (2.0 ** log_scale)
    if zero_block:
        v[0, :32] = 0
    want = _b12x_qdq()(v)
    got = quant_dequant_mxfp8(v)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_mxfp8_edge_values():
    v = torch.tensor([[448.0, -448.0, 449.0, 1e-40, 3.4e38, 0.0] + [1.0] * 26])
    assert torch.equal(quant_dequant_mxfp8(v).view(torch.int32), _b12x_qdq()(v).view(torch.int32))
    z = torch.zeros(2, 64)
    assert torch.equal(quant_dequant_mxfp8(z), z)


def test_mxfp8_rejects_ragged_last_dim():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_dequant_mxfp8(torch.ones(2, 33))


def test_dequantize_mxfp4_nibble_order_and_scale():
    # byte 0x21: element 0 = code 1 (0.5), element 1 = code 2 (1.0); scale byte 128 = 2.0
    codes = torch.full((1, 16), 0x21, dtype=torch.uint8)
    scales = torch.tensor([[128]], dtype=torch.uint8)
    vals = dequantize_mxfp4(codes, scales)
    assert vals.shape == (1, 32)
    assert torch.equal(vals[0, 0::2], torch.full((16,), 1.0))
    assert torch.equal(vals[0, 1::2], torch.full((16,), 2.0))
    neg = dequantize_mxfp4(torch.full((1, 16), 0xF8, dtype=torch.uint8), torch.tensor([[127]], dtype=torch.uint8))
    assert torch.equal(neg[0, 1::2], torch.full((16,), -6.0))  # 0xF = -6
    assert torch.equal(neg[0, 0::2].abs(), torch.zeros(16))  # 0x8 = -0


def test_dequantize_accepts_e8m0_dtype():
    codes = torch.randint(0, 256, (3, 32), dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 2), dtype=torch.uint8)
    assert torch.equal(dequantize_mxfp4(codes, scales), dequantize_mxfp4(codes, scales.view(torch.float8_e8m0fnu)))


@settings(max_examples=30, deadline=None)
@given(
    shape=st.sampled_from([(1, 32), (3, 64), (2, 2, 96), (5, 128)]),
    log_scale=st.integers(-20, 20),
    seed=st.integers(0, 2**16),
)
def test_quantize_mxfp4_error_bound_and_round_trip(shape, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * 2.0 ** log_scale).to(torch.bfloat16)
    codes, scales = quantize_mxfp4(w)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert codes.shape == (*shape[:-1], shape[-1] // 2) and scales.shape == (*shape[:-1], shape[-1] // 32)
    deq = dequantize_mxfp4(codes, scales)
    # error bound: at most the block's scale (half the widest E2M1 step)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    assert bool(((deq - w.float()).abs() <= step).all())
    # relative error of a Gaussian block: well under a quarter
    assert float((deq - w.float()).norm() / w.float().norm()) < 0.25
    # values that are already MXFP4 round-trip exactly
    codes2, scales2 = quantize_mxfp4(deq)
    assert torch.equal(dequantize_mxfp4(codes2, scales2), deq)


def test_quantize_mxfp4_round_trips_every_code():
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    scales = torch.full((16, 1), 120, dtype=torch.uint8)
    deq = dequantize_mxfp4(codes, scales)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(deq)), deq)


def test_quantize_mxfp4_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.ones(4, 48))
    with pytest.raises(TypeError, match="floating"):
        quantize_mxfp4(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="non-finite"):
        quantize_mxfp4(torch.full((1, 32), float("nan")))


def test_public_names():
    assert b12x_ops.quantize_mxfp4 is quantize_mxfp4 and b12x_ops.dequantize_mxfp4 is dequantize_mxfp4
