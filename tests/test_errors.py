"""Every case of the contract's Errors section: the message names the argument, what was expected
and what came; it is raised before any compute, and ``out`` is left untouched."""

import re

import pytest
import torch

import b12x_ops
from _samples import make_batch, make_layer

LAYER = make_layer(E=4, K=64, N=64, top_k=2)
HANDLE = LAYER.prepare()


def _good():
    x, ids, w = make_batch(LAYER, 5)
    return dict(x=x, topk_ids=ids, topk_weights=w)


BAD_CALLS = {
    "x dtype": (dict(x=lambda a: a.float()), "x", "bfloat16 or float16"),
    "x rank": (dict(x=lambda a: a.unsqueeze(0)), "x", "2 dims"),
    "x hidden size": (dict(x=lambda a: torch.cat([a, a], 1)), "x", "hidden size K = 64"),
    "x last dim strided": (dict(x=lambda a: torch.cat([a, a], 1)[:, ::2]), "x", "contiguous last dim"),
    "ids dtype": (dict(topk_ids=lambda a: a.to(torch.int16)), "topk_ids", "int32 or int64"),
    "ids rank": (dict(topk_ids=lambda a: a.flatten()), "topk_ids", "2 dims"),
    "ids rows": (dict(topk_ids=lambda a: a[:3], topk_weights=lambda a: a[:3]), "topk_ids", "5 rows"),
    "top_k not planned": (dict(topk_ids=lambda a: torch.cat([a, a], 1), topk_weights=lambda a: torch.cat([a, a], 1)),
                          "topk_ids", "top_k = 2"),
    "weights dtype": (dict(topk_weights=lambda a: a.double()), "topk_weights", "float32, bfloat16 or float16"),
    "weights shape": (dict(topk_weights=lambda a: a[:, :1]), "topk_weights", "shape"),
    "ids on another device": (dict(topk_ids=lambda a: a.to("meta"), topk_weights=lambda a: a.to("meta")),
                              "topk_ids", "device cpu"),
}


@pytest.mark.parametrize("which", sorted(BAD_CALLS))
@pytest.mark.parametrize("op", ["moe_w4a8", "moe_w4a8_out"])
def test_bad_call(which, op):
    changes, arg, expected = BAD_CALLS[which]
    args = _good()
    for k, f in changes.items():
        args[k] = f(args[k])
    sentinel = torch.full((5, 64), 7.0, dtype=torch.bfloat16)
    out = sentinel.clone()
    with pytest.raises(ValueError) as exc:
        if op == "moe_w4a8":
            torch.ops.b12x.moe_w4a8(args["x"], args["topk_ids"], args["topk_weights"], HANDLE)
        else:
            torch.ops.b12x.moe_w4a8_out(args["x"], args["topk_ids"], args["topk_weights"], HANDLE, out)
    msg = str(exc.value)
    assert msg.startswith(f"b12x::{op}: {arg}: expected"), msg
    assert expected in msg and "got" in msg, msg
    assert torch.equal(out, sentinel)


BAD_OUTS = {
    "dtype": (lambda x: torch.empty(x.shape, dtype=torch.float32), "dtype torch.bfloat16"),
    "shape": (lambda x: torch.empty(x.shape[0] + 1, x.shape[1], dtype=x.dtype), "shape [5, 64]"),
    "device": (lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta"), "device cpu"),
    "strided last dim": (lambda x: torch.empty(x.shape[0], 2 * x.shape[1], dtype=x.dtype)[:, ::2], "contiguous last dim"),
}


@pytest.mark.parametrize("which", sorted(BAD_OUTS))
def test_bad_out(which):
    make, expected = BAD_OUTS[which]
    a = _good()
    out = make(a["x"])
    if out.device.type == "cpu":
        out.fill_(3.0)
    before = out.clone()
    with pytest.raises(ValueError, match=r"b12x::moe_w4a8_out: out: expected .*" + re.escape(expected)):
        torch.ops.b12x.moe_w4a8_out(a["x"], a["topk_ids"], a["topk_weights"], HANDLE, out)
    if out.device.type == "cpu":
        assert torch.equal(out, before)


def test_handle_from_another_device():
    meta = make_layer(E=4, K=64, N=64, top_k=2, device="meta").prepare()
    a = _good()
    with pytest.raises(ValueError, match=r"experts: expected a handle on x's device cpu, got a handle on meta"):
        torch.ops.b12x.moe_w4a8(a["x"], a["topk_ids"], a["topk_weights"], meta)


def test_not_a_handle():
    a = _good()
    with pytest.raises(Exception, match="experts"):
        b12x_ops.moe_w4a8(a["x"], a["topk_ids"], a["topk_weights"], object())


def test_backend_that_cannot_run_here():
    with pytest.raises(RuntimeError, match=r"backend='b12x' cannot run on cpu: .*SM120"):
        LAYER.prepare(backend="b12x")
    with pytest.raises(RuntimeError, match=r"backend='triton' cannot run on cpu: .*CUDA"):
        LAYER.prepare(backend="triton")
    with pytest.raises(ValueError, match=r"backend: expected one of .*got 'cutlass'"):
        LAYER.prepare(backend="cutlass")


def _prep(**over):
    L = make_layer(E=2, K=64, N=64, top_k=2)
    args = dict(w13=L.w13, w13_scale=L.w13_scale, w2=L.w2, w2_scale=L.w2_scale)
    kw = dict(top_k=2, backend="reference")
    for k, v in over.items():
        if k in args:
            args[k] = v(args[k]) if callable(v) else v
        else:
            kw[k] = v
    return b12x_ops.prepare_experts(args["w13"], args["w13_scale"], args["w2"], args["w2_scale"], **kw)


def _nan_byte(t):
    t = t.clone()
    t[1, 3, 0] = 255
    return t


BAD_PREPARES = {
    "w13 rank": (dict(w13=lambda t: t[0]), "w13", "3-dim"),
    "w13 dtype": (dict(w13=lambda t: t.float()), "w13", "torch.uint8 or torch.int8"),
    "K not multiple of 32": (dict(w13=lambda t: t[:, :, :8]), "w13", "multiple of 32"),
    "N not multiple of 32": (dict(w13=lambda t: t[:, :96]), "w13", "multiple of 32"),
    "w2 experts differ": (dict(w2=lambda t: t[:1]), "w2", "shape [2, 64, 32]"),
    "w2 hidden differs": (dict(w2=lambda t: t[:, :32]), "w2", "shape [2, 64, 32]"),
    "w13_scale shape": (dict(w13_scale=lambda t: t[:, :, :1]), "w13_scale", "shape [2, 128, 2]"),
    "w13_scale dtype": (dict(w13_scale=lambda t: t.float()), "w13_scale", "torch.uint8"),
    "w2_scale shape": (dict(w2_scale=lambda t: t[:, :, :1].expand(2, 64, 3).contiguous()), "w2_scale", "shape [2, 64, 2]"),
    "NaN scale byte in w13": (dict(w13_scale=_nan_byte), "w13_scale", "255 encodes NaN"),
    "NaN scale byte in w2": (dict(w2_scale=_nan_byte), "w2_scale", "255 encodes NaN"),
    "w2 on another device": (dict(w2=lambda t: t.to("meta")), "w2", "device cpu"),
    "top_k": (dict(top_k=0), "top_k", "a positive int"),
    "layout": (dict(w13_layout="gate_up"), "w13_layout", "one of"),
    "activation": (dict(activation="gelu"), "activation", "one of"),
    "swiglu_limit": (dict(swiglu_limit=-1.0), "swiglu_limit", "finite float > 0"),
    "expert_offset": (dict(expert_offset=-2), "expert_offset", "int >= 0"),
    "max_tokens": (dict(max_tokens=0), "max_tokens", "a positive int"),
    "decode_token_counts": (dict(decode_token_counts=(4, 0)), "decode_token_counts", "positive ints"),
    "decode count above max": (dict(decode_token_counts=(9,), max_tokens=8), "decode_token_counts", "<= max_tokens"),
    "global scale shape": (dict(w13_global_scale=torch.ones(3)), "w13_global_scale", "2 per-expert scales"),
    "global scale inf": (dict(w2_global_scale=torch.tensor([1.0, float("inf")])), "w2_global_scale", "finite"),
}


@pytest.mark.parametrize("which", sorted(BAD_PREPARES))
def test_bad_prepare(which):
    over, arg, expected = BAD_PREPARES[which]
    with pytest.raises(ValueError) as exc:
        _prep(**over)
    msg = str(exc.value)
    assert msg.startswith(f"prepare_experts: {arg}: expected"), msg
    assert expected in msg and "got" in msg, msg


def test_reference_rejects_unknown_options():
    with pytest.raises(ValueError, match="takes no options"):
        _prep(tile_m=64)


def test_ep_remap_errors():
    ids = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"b12x::ep_remap: topk_weights: expected shape \[3, 2\]"):
        b12x_ops.ep_remap(ids, torch.zeros(3, 3), 0, 4)
    with pytest.raises(ValueError, match=r"b12x::ep_remap: topk_ids: expected int32 or int64"):
        b12x_ops.ep_remap(ids.float(), torch.zeros(3, 2), 0, 4)
    with pytest.raises(ValueError, match=r"num_local_experts: expected an int >= 1"):
        b12x_ops.ep_remap(ids, torch.zeros(3, 2), 0, 0)
