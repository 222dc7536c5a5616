"""The b12x backend's real kernels against the reference backend, on SM120/SM121 hardware.

Marked ``sm12x``: skipped on any other machine (``tests/conftest.py``). An owner of an RTX PRO 6000,
RTX 5090 or DGX Spark verifies the backend with one command from the repository root:

    pip install -e ".[b12x,test]" && pytest -m sm12x tests/test_b12x_sm12x.py -v

b12x repacks the checkpoint bytes in place, so each case prepares the reference handle on its own
copy of the weights. Autotuning is off except where a test asks for it; its selections go to a
temporary cache directory, never the user's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import b12x_ops
from b12x_ops.backends import b12x as B

import _samples

pytestmark = pytest.mark.sm12x

TOL = 1e-2  # the contract's bound for GPU kernels (relative L2 against the oracle)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    if B.library_module() is None:
        pytest.fail('the b12x library is not installed: pip install -e ".[b12x]"')
    return str(tmp_path_factory.mktemp("b12x-preparation"))


def _pair(cache_dir, layer_kw, **prepare_kw):
    """``(layer, reference handle, b12x handle)`` on the GPU, the b12x one on a copy of the bytes."""
    layer = _samples.make_layer(device="cuda", **layer_kw)
    ref = layer.prepare(backend="reference")
    copy = dataclasses.replace(layer, w13=layer.w13.clone(), w13_scale=layer.w13_scale.clone(),
                               w2=layer.w2.clone(), w2_scale=layer.w2_scale.clone())
    prepare_kw.setdefault("autotune", False)
    fast = copy.prepare(backend="b12x", cache_dir=cache_dir, **prepare_kw)
    assert fast.backend == "b12x"
    return layer, ref, fast


# name -> (layer kwargs, prepare kwargs); every size is one b12x repacks in place
SHAPES = {
    "n256": (dict(E=8, K=512, N=256, top_k=2), dict(max_tokens=256)),
    "compact_n64": (dict(E=8, K=512, N=192, top_k=4), dict(max_tokens=256, decode_token_counts=(1, 2, 3, 4, 6, 8))),
    "w31_limit": (dict(E=6, K=256, N=128, top_k=2, layout="w31", limit=7.0), dict(max_tokens=128)),
    "ep_offset": (dict(E=4, K=256, N=256, top_k=3, offset=4), dict(max_tokens=128)),
    "wide": (dict(E=16, K=1024, N=576, top_k=6), dict(max_tokens=512, decode_token_counts=(1, 5, 6, 10, 12))),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("M", [1, 5, 8, 37, 256])
def test_matches_reference(cache_dir, shape, M):
    layer_kw, prep_kw = SHAPES[shape]
    layer, ref, fast = _pair(cache_dir, layer_kw, **prep_kw)
    x, ids, w = _samples.make_batch(layer, M, device="cuda", padding_rows=min(2, M - 1))
    want = b12x_ops.moe_w4a8(x, ids, w, ref)
    got = b12x_ops.moe_w4a8(x, ids, w, fast)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert _samples.rel_l2(got, want) <= TOL
    if M > 2:
        assert not got[-2:].any()  # CUDA-graph padding rows contribute nothing


@pytest.mark.parametrize("id_dtype, w_dtype, strided", [
    (torch.int32, torch.float32, False),  # direct ids at offset 0
    (torch.int64, torch.bfloat16, False),  # remapped and cast
    (torch.int32, torch.float32, True),  # strided rows
])
def test_routing_variants(cache_dir, id_dtype, w_dtype, strided):
    layer, ref, fast = _pair(cache_dir, dict(E=8, K=512, N=256, top_k=2), max_tokens=64)
    x, ids, w = _samples.make_batch(layer, 24, device="cuda", id_dtype=id_dtype, w_dtype=w_dtype, strided=strided)
    assert _samples.rel_l2(b12x_ops.moe_w4a8(x, ids, w, fast), b12x_ops.moe_w4a8(x, ids, w, ref)) <= TOL


def test_against_the_oracle(cache_dir):
    layer, _, fast = _pair(cache_dir, dict(E=8, K=512, N=256, top_k=2, limit=6.0), max_tokens=64)
    x, ids, w = _samples.make_batch(layer, 16, device="cuda")
    assert _samples.rel_l2(b12x_ops.moe_w4a8(x, ids, w, fast), _samples.oracle(layer, x, ids, w)) <= TOL


def test_chunks_above_the_top_capacity(cache_dir):
    layer, ref, fast = _pair(cache_dir, dict(E=8, K=512, N=256, top_k=2), max_tokens=32)
    assert fast.max_tokens == fast.capacities[-1] <= 32
    x, ids, w = _samples.make_batch(layer, 150, device="cuda")
    out = torch.full_like(x, float("nan"))
    b12x_ops.moe_w4a8_out(x, ids, w, fast, out)
    assert _samples.rel_l2(out, b12x_ops.moe_w4a8(x, ids, w, ref)) <= TOL


def test_zero_tokens(cache_dir):
    layer, _, fast = _pair(cache_dir, dict(E=4, K=256, N=256, top_k=2), max_tokens=16)
    x, ids, w = _samples.make_batch(layer, 0, device="cuda")
    assert b12x_ops.moe_w4a8(x, ids, w, fast).shape == (0, 256)


def test_deterministic_is_bit_stable(cache_dir):
    layer, ref, fast = _pair(cache_dir, dict(E=8, K=512, N=192, top_k=4), max_tokens=64, deterministic=True)
    x, ids, w = _samples.make_batch(layer, 48, device="cuda")
    first = b12x_ops.moe_w4a8(x, ids, w, fast)
    for _ in range(3):
        assert torch.equal(b12x_ops.moe_w4a8(x, ids, w, fast), first)
    assert _samples.rel_l2(first, b12x_ops.moe_w4a8(x, ids, w, ref)) <= TOL


def test_layers_share_plans_and_scratch(cache_dir):
    kw = dict(E=8, K=512, N=256, top_k=2)
    a, ref_a, fast_a = _pair(cache_dir, dict(kw, seed=1), max_tokens=64)
    b, ref_b, fast_b = _pair(cache_dir, dict(kw, seed=2), max_tokens=64)
    assert fast_a._state.plan_set is fast_b._state.plan_set
    x, ids, w = _samples.make_batch(a, 20, device="cuda")
    assert _samples.rel_l2(b12x_ops.moe_w4a8(x, ids, w, fast_a), b12x_ops.moe_w4a8(x, ids, w, ref_a)) <= TOL
    assert _samples.rel_l2(b12x_ops.moe_w4a8(x, ids, w, fast_b), b12x_ops.moe_w4a8(x, ids, w, ref_b)) <= TOL
    assert fast_a.memory["shared_scratch_bytes"] > 0


def test_autotune_persists_in_its_cache_dir(tmp_path):
    layer, ref, fast = _pair(str(tmp_path), dict(E=8, K=512, N=256, top_k=2), max_tokens=64,
                             decode_token_counts=(1, 2), autotune="decode")
    report = B.report(fast)
    assert report["tuned"] == [1, 2] and report["cache_dir"] == str(tmp_path) and report["frozen"]
    assert any(tmp_path.rglob("*")), "the autotuner's selections were not persisted"
    x, ids, w = _samples.make_batch(layer, 2, device="cuda")
    assert _samples.rel_l2(b12x_ops.moe_w4a8(x, ids, w, fast), b12x_ops.moe_w4a8(x, ids, w, ref)) <= TOL


def test_cuda_graph_capture_and_replay(cache_dir):
    layer, ref, fast = _pair(cache_dir, dict(E=8, K=512, N=256, top_k=2, offset=8), max_tokens=64,
                             decode_token_counts=(4,))
    x, ids, w = _samples.make_batch(layer, 4, device="cuda", seed=1)
    out = torch.empty_like(x)
    b12x_ops.moe_w4a8_out(x, ids, w, fast, out)  # eager once, as engines do before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        b12x_ops.moe_w4a8_out(x, ids, w, fast, out)
    for seed in (2, 3):
        x2, ids2, w2 = _samples.make_batch(layer, 4, device="cuda", seed=seed)
        x.copy_(x2), ids.copy_(ids2), w.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        assert _samples.rel_l2(out, b12x_ops.moe_w4a8(x2, ids2, w2, ref)) <= TOL
