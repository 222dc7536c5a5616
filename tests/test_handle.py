"""The PreparedExperts handle: value-type opaque semantics, what it records, backend choice."""

import gc

import pytest
import torch
from torch._library.opaque_object import is_opaque_type

import b12x_ops
from b12x_ops.handle import HANDLE_TYPE, PreparedExperts, plan_capacities, token_ladder
from _samples import make_layer


def test_value_type_protocol():
    layer = make_layer()
    a, b = layer.prepare(), layer.prepare()
    assert is_opaque_type(PreparedExperts)
    assert HANDLE_TYPE == "b12x_ops.handle.PreparedExperts"
    assert a == a and a != b and hash(a) != hash(b)
    text, names = a.__fx_repr__()
    assert eval(text, names) is a  # the graph rebuilds the very object from its key


def test_lookup_after_collection_is_a_clear_error():
    key = make_layer().prepare().key
    gc.collect()
    with pytest.raises(RuntimeError, match=f"#{key} no longer exists"):
        PreparedExperts._lookup(key)


def test_records_geometry_and_plans():
    layer = make_layer(E=3, K=96, N=64, top_k=2, layout="w31", limit=7.0, offset=6)
    h = layer.prepare(max_tokens=100, decode_token_counts=(3, 6))
    assert (h.backend, h.device, h.num_experts, h.expert_offset) == ("reference", torch.device("cpu"), 3, 6)
    assert (h.hidden_size, h.intermediate_size, h.top_k, h.w13_layout, h.swiglu_limit) == (96, 64, 2, "w31", 7.0)
    assert h.max_tokens == 100 and h.capacities == (1, 2, 3, 4, 6, 8, 16, 32, 64, 100)
    assert h.memory["device_bytes"] == h.memory["checkpoint_bytes"]  # no copy of the checkpoint
    assert "experts=3@6" in repr(h)


def test_reference_keeps_the_checkpoint_bytes_without_copying():
    layer = make_layer()
    h = layer.prepare()
    assert h._state.w13.data_ptr() == layer.w13.data_ptr()
    assert h._state.w2.data_ptr() == layer.w2.data_ptr()


def test_token_ladder():
    assert token_ladder(1) == (1,)
    assert token_ladder(8) == (1, 2, 4, 8)
    assert token_ladder(8192)[-3:] == (2048, 4096, 8192)
    assert plan_capacities(12, (5, 5, 12)) == (1, 2, 4, 5, 8, 12)


def test_available_backends_on_cpu():
    st = b12x_ops.available_backends("cpu")
    assert [s.name for s in st] == ["b12x", "triton", "reference"]
    by = {s.name: s for s in st}
    assert by["reference"].available and by["reference"].reason == ""
    assert not by["b12x"].available and "SM120" in by["b12x"].reason
    assert not by["triton"].available and "CUDA" in by["triton"].reason
    assert make_layer().prepare(backend="auto").backend == "reference"


def test_e8m0_scale_dtype_accepted():
    layer = make_layer(scale_dtype=torch.float8_e8m0fnu)
    assert layer.w13_scale.dtype == torch.float8_e8m0fnu
    assert layer.prepare().backend == "reference"


def test_import_is_light():
    import subprocess
    import sys

    code = "import sys, b12x_ops; print(sorted(m for m in ('b12x', 'b12x_next', 'triton') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_copies_are_the_handle_itself():
    import copy

    h = make_layer().prepare()
    assert copy.copy(h) is h and copy.deepcopy(h) is h
    assert copy.deepcopy({"layer": h})["layer"] is h
