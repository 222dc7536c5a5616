"""The reference backend against the b12x library's oracle, and ep_remap's semantics."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import b12x_ops
from _samples import CASES, case, make_batch, make_layer, oracle, rel_l2

TOL = 5e-3


@pytest.mark.parametrize("name", sorted(CASES))
def test_cases_match_oracle(name):
    layer, (x, ids, w) = case(name)
    got = torch.ops.b12x.moe_w4a8(x, ids, w, layer.prepare())
    assert got.dtype == x.dtype and got.shape == x.shape
    want = oracle(layer, x, ids, w)
    assert rel_l2(got, want) <= TOL


@settings(max_examples=25, deadline=None)
@given(
    E=st.integers(1, 6),
    K=st.sampled_from([32, 64, 160]),
    N=st.sampled_from([32, 64, 96]),
    top_k=st.integers(1, 4),
    M=st.integers(0, 24),
    layout=st.sampled_from(["w13", "w31"]),
    limit=st.sampled_from([None, 0.5, 7.0]),
    offset=st.sampled_from([0, 3, 17]),
    padding_rows=st.integers(0, 3),
    global_scales=st.booleans(),
    x_scale=st.sampled_from([1e-3, 1.0, 30.0]),
    scale_lo=st.integers(110, 124),
    seed=st.integers(0, 2**16),
    id_dtype=st.sampled_from([torch.int32, torch.int64]),
    w_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_matches_oracle_everywhere(E, K, N, top_k, M, layout, limit, offset, padding_rows, global_scales,
                                   x_scale, scale_lo, seed, id_dtype, w_dtype):
    layer = make_layer(E, K, N, top_k, seed=seed, layout=layout, limit=limit, offset=offset,
                       global_scales=global_scales, scale_range=(scale_lo, scale_lo + 4))
    x, ids, w = make_batch(layer, M, seed=seed, id_dtype=id_dtype, w_dtype=w_dtype,
                           padding_rows=min(padding_rows, M), x_scale=x_scale)
    got = torch.ops.b12x.moe_w4a8(x, ids, w, layer.prepare())
    want = oracle(layer, x, ids, w)
    assert rel_l2(got, want) <= TOL


def test_fp16_activations():
    layer = make_layer()
    x, ids, w = make_batch(layer, 6, x_dtype=torch.float16)
    got = torch.ops.b12x.moe_w4a8(x, ids, w, layer.prepare())
    assert got.dtype == torch.float16
    assert rel_l2(got, oracle(layer, x, ids, w)) <= TOL


def test_padding_and_foreign_slots_contribute_nothing():
    layer = make_layer(E=4, offset=8)
    x, _, w = make_batch(layer, 5)
    ids = torch.tensor([[-1, -1], [0, 3], [12, 40], [7, -1], [8, 20]], dtype=torch.int32)  # local: 8..11
    got = torch.ops.b12x.moe_w4a8(x, ids, w, layer.prepare())
    assert torch.equal(got[:4], torch.zeros_like(got[:4]))
    only_local = torch.ops.b12x.moe_w4a8(x[4:], torch.tensor([[8, 8]], dtype=torch.int32),
                                         torch.tensor([[w[4, 0].item(), 0.0]]), layer.prepare())
    assert torch.equal(got[4:], only_local)


def test_out_variant_writes_callers_buffer():
    layer, (x, ids, w) = case("foreign_ep")
    h = layer.prepare()
    out = torch.full_like(x, float("nan"))
    ptr = out.data_ptr()
    assert torch.ops.b12x.moe_w4a8_out(x, ids, w, h, out) is None
    assert out.data_ptr() == ptr
    assert torch.equal(out, torch.ops.b12x.moe_w4a8(x, ids, w, h))


def test_chunking_above_max_tokens_is_exact():
    layer = make_layer()
    x, ids, w = make_batch(layer, 21)
    whole = torch.ops.b12x.moe_w4a8(x, ids, w, layer.prepare())
    chunked = torch.ops.b12x.moe_w4a8(x, ids, w, layer.prepare(max_tokens=4))
    assert torch.equal(whole, chunked)


def test_bf16_checkpoint_served_through_quantize_mxfp4():
    g = torch.Generator().manual_seed(3)
    E, K, N = 3, 64, 64
    w13_bf16 = (torch.randn(E, 2 * N, K, generator=g) * 0.05).bfloat16()
    w2_bf16 = (torch.randn(E, K, N, generator=g) * 0.05).bfloat16()
    w13, s13 = b12x_ops.quantize_mxfp4(w13_bf16)
    w2, s2 = b12x_ops.quantize_mxfp4(w2_bf16)
    h = b12x_ops.prepare_experts(w13, s13, w2, s2, top_k=2, backend="reference")
    x = torch.randn(9, K, generator=g).bfloat16()
    ids = torch.randint(0, E, (9, 2), generator=g, dtype=torch.int32)
    tw = torch.rand(9, 2, generator=g)
    got = torch.ops.b12x.moe_w4a8(x, ids, tw, h).float()
    # against the unquantized bf16 layer (exact SwiGLU in fp32): MXFP4 + MXFP8 error only
    want = torch.zeros(9, K)
    for m in range(9):
        for j in range(2):
            e = int(ids[m, j])
            hh = x[m].float() @ w13_bf16[e].float().T
            a = torch.nn.functional.silu(hh[N:]) * hh[:N]
            want[m] += tw[m, j] * (a @ w2_bf16[e].float().T)
    assert rel_l2(got, want) < 0.25


# ------------------------------------------------------------------------------------- ep_remap
def _remap_by_rows(ids, w, offset, E):
    """ep_remap spelled out slot by slot: the contract's words as a loop."""
    M, k = ids.shape
    local = [[int(i) - offset if 0 <= int(i) - offset < E and int(i) >= 0 else None for i in row] for row in ids]
    batch = [l for row in local for l in row if l is not None]
    batch_fill = min(batch) if batch else 0
    out_ids = torch.zeros(M, k, dtype=torch.int32)
    out_w = torch.zeros(M, k, dtype=torch.float32)
    for m in range(M):
        row = [l for l in local[m] if l is not None]
        fill = min(row) if row else batch_fill
        for j in range(k):
            if local[m][j] is None:
                out_ids[m, j] = fill
            else:
                out_ids[m, j] = local[m][j]
                out_w[m, j] = float(w[m, j].float())
    return out_ids, out_w


@settings(max_examples=40, deadline=None)
@given(
    M=st.integers(0, 12), k=st.integers(1, 6), E=st.integers(1, 8), offset=st.integers(0, 20),
    seed=st.integers(0, 2**16), id_dtype=st.sampled_from([torch.int32, torch.int64]),
    w_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), strided=st.booleans(),
)
def test_ep_remap_semantics(M, k, E, offset, seed, id_dtype, w_dtype, strided):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, offset + E + 4, (M, 2 * k if strided else k), generator=g).to(id_dtype)
    w = torch.rand(ids.shape, generator=g).to(w_dtype)
    if strided:
        ids, w = ids[:, ::2], w[:, ::2]
    got_ids, got_w = torch.ops.b12x.ep_remap(ids, w, offset, E)
    want_ids, want_w = _remap_by_rows(ids, w, offset, E)
    assert got_ids.dtype == torch.int32 and got_w.dtype == torch.float32
    assert got_ids.is_contiguous() and got_w.is_contiguous()
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)


def test_ep_remap_fills_with_an_expert_the_batch_reads():
    ids = torch.tensor([[-1, 5], [9, 3], [-1, -1]])
    w = torch.ones(3, 2)
    got_ids, got_w = b12x_ops.ep_remap(ids, w, 2, 4)  # local experts 2..5
    assert got_ids.tolist() == [[3, 3], [1, 1], [1, 1]]
    assert got_w.tolist() == [[0, 1], [0, 1], [0, 0]]
