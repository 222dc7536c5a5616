"""Every op of the package on one screen: schema, fake kernel, public wrapper, the dispatch point.

    b12x::moe_w4a8(x, topk_ids, topk_weights, experts) -> Tensor
    b12x::moe_w4a8_out(x, topk_ids, topk_weights, experts, out!) -> ()
    b12x::ep_remap(topk_ids, topk_weights, expert_offset, num_local_experts) -> (Tensor, Tensor)

The ops are registered with ``torch.library.Library.define`` plus ``impl`` (a cheaper per-call path
than ``torch.library.custom_op``). The b12x library registers its own private ops in the same
``b12x`` namespace; defining a name twice fails loudly (see ``_define``).

The CPU and CUDA kernels of ``moe_w4a8`` are one function: it checks the arguments and calls the
handle, whose backend was fixed by ``prepare_experts``. Fakes look only at tensors.
"""

from __future__ import annotations

import torch

from .handle import HANDLE_TYPE, PreparedExperts
from .backends import reference as _reference

LIB = torch.library.Library("b12x", "FRAGMENT")

SCHEMAS = {
    "moe_w4a8": f"moe_w4a8(Tensor x, Tensor topk_ids, Tensor topk_weights, {HANDLE_TYPE} experts) -> Tensor",
    "moe_w4a8_out": (
        f"moe_w4a8_out(Tensor x, Tensor topk_ids, Tensor topk_weights, {HANDLE_TYPE} experts, "
        "Tensor(a!) out) -> ()"
    ),
    "ep_remap": (
        "ep_remap(Tensor topk_ids, Tensor topk_weights, int expert_offset, int num_local_experts) "
        "-> (Tensor, Tensor)"
    ),
}


def _define(name: str) -> None:
    qualified = f"b12x::{name}"
    if torch._C._dispatch_has_kernel(qualified) or _has_schema(qualified):
        raise RuntimeError(
            f"b12x_ops: the op {qualified} is already registered by another package (the b12x library "
            f"shares the 'b12x' namespace); refusing to shadow it"
        )
    LIB.define(SCHEMAS[name])


def _has_schema(qualified: str) -> bool:
    try:
        torch._C._get_schema(qualified, "")
        return True
    except RuntimeError:
        return False


for _name in SCHEMAS:
    _define(_name)

_X_DTYPES = (torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int32, torch.int64)
_W_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bad(op: str, arg: str, expected: str, got) -> ValueError:
    return ValueError(f"b12x::{op}: {arg}: expected {expected}, got {got}")


def _check_routing(op: str, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    if topk_ids.dtype not in _ID_DTYPES:
        raise _bad(op, "topk_ids", "int32 or int64", topk_ids.dtype)
    if topk_ids.dim() != 2:
        raise _bad(op, "topk_ids", "2 dims [M, top_k]", f"shape {list(topk_ids.shape)}")
    if topk_weights.dtype not in _W_DTYPES:
        raise _bad(op, "topk_weights", "float32, bfloat16 or float16", topk_weights.dtype)
    if topk_weights.shape != topk_ids.shape:
        raise _bad(op, "topk_weights", f"shape {list(topk_ids.shape)} (topk_ids')", f"shape {list(topk_weights.shape)}")
    if topk_weights.device != topk_ids.device:
        raise _bad(op, "topk_weights", f"device {topk_ids.device} (topk_ids')", topk_weights.device)


def check_moe_args(op, x, topk_ids, topk_weights, experts, out=None) -> None:
    """Everything the contract's Errors section names, before any kernel runs. Cheap: no sync.

    One fast test of the common, valid call (a handful of attribute reads; ``is_contiguous()`` first,
    as it costs a third of ``stride(1)``); anything off falls to ``_explain_bad_args``, which finds
    the first bad argument and raises a message naming it.
    """
    if type(experts) is PreparedExperts:
        xs = x.shape
        ids_shape = topk_ids.shape
        dev = x.device
        if (
            len(xs) == 2
            and xs[1] == experts.hidden_size
            and ids_shape == (xs[0], experts.top_k)
            and topk_weights.shape == ids_shape
            and x.dtype in _X_DTYPES
            and topk_ids.dtype in _ID_DTYPES
            and topk_weights.dtype in _W_DTYPES
            and dev == experts.device
            and topk_ids.device == dev
            and topk_weights.device == dev
            and (x.is_contiguous() or x.stride(1) == 1 or xs[1] == 1)
            and (out is None or (out.shape == xs and out.dtype == x.dtype and out.device == dev
                                 and (out.is_contiguous() or out.stride(1) == 1 or xs[1] == 1)))
        ):
            return
    _explain_bad_args(op, x, topk_ids, topk_weights, experts, out)


def _explain_bad_args(op, x, topk_ids, topk_weights, experts, out) -> None:
    if not isinstance(experts, PreparedExperts):
        raise _bad(op, "experts", "a PreparedExperts from b12x_ops.prepare_experts", type(experts).__name__)
    if x.dtype not in _X_DTYPES:
        raise _bad(op, "x", "bfloat16 or float16", x.dtype)
    if x.dim() != 2:
        raise _bad(op, "x", "2 dims [M, K]", f"shape {list(x.shape)}")
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise _bad(op, "x", "a contiguous last dim (stride 1)", f"strides {list(x.stride())}")
    if x.shape[1] != experts.hidden_size:
        raise _bad(op, "x", f"hidden size K = {experts.hidden_size} (the handle's)", f"shape {list(x.shape)}")
    if x.device != experts.device:
        raise _bad(op, "experts", f"a handle on x's device {x.device}", f"a handle on {experts.device}")
    _check_routing(op, topk_ids, topk_weights)
    if topk_ids.shape[0] != x.shape[0]:
        raise _bad(op, "topk_ids", f"{x.shape[0]} rows (x's M)", f"shape {list(topk_ids.shape)}")
    if topk_ids.shape[1] != experts.top_k:
        raise _bad(op, "topk_ids", f"top_k = {experts.top_k} (the handle's)", f"shape {list(topk_ids.shape)}")
    if topk_ids.device != x.device:
        raise _bad(op, "topk_ids", f"device {x.device} (x's)", topk_ids.device)
    if out is not None:
        if out.dtype != x.dtype:
            raise _bad(op, "out", f"dtype {x.dtype} (x's)", out.dtype)
        if out.shape != x.shape:
            raise _bad(op, "out", f"shape {list(x.shape)} (x's)", f"shape {list(out.shape)}")
        if out.device != x.device:
            raise _bad(op, "out", f"device {x.device} (x's)", out.device)
        if out.stride(1) != 1 and out.shape[1] > 1:
            raise _bad(op, "out", "a contiguous last dim (stride 1)", f"strides {list(out.stride())}")
    # every rule passed: the call is valid after all (the fast test is only ever stricter)


# ---------------------------------------------------------------------------------------- moe_w4a8
def _moe_w4a8_kernel(x, topk_ids, topk_weights, experts):
    check_moe_args("moe_w4a8", x, topk_ids, topk_weights, experts)
    out = x.new_empty(x.shape)
    experts.run(x, topk_ids, topk_weights, out)
    return out


def _check_fake_args(op, x, topk_ids, topk_weights, out=None) -> None:
    """What a fake can check without the handle: dtypes, ranks, devices, and shape facts."""
    if x.dtype not in _X_DTYPES:
        raise _bad(op, "x", "bfloat16 or float16", x.dtype)
    if x.dim() != 2:
        raise _bad(op, "x", "2 dims [M, K]", f"shape {list(x.shape)}")
    _check_routing(op, topk_ids, topk_weights)
    for name, t in (("topk_ids", topk_ids), ("out", out)):
        if t is not None and t.device != x.device:
            raise _bad(op, name, f"device {x.device} (x's)", t.device)
    torch._check(topk_ids.shape[0] == x.shape[0], lambda: f"b12x::{op}: topk_ids: expected x's M rows")
    if out is not None:
        torch._check(out.shape[0] == x.shape[0], lambda: f"b12x::{op}: out: expected x's shape")
        torch._check(out.shape[1] == x.shape[1], lambda: f"b12x::{op}: out: expected x's shape")


@torch.library.register_fake("b12x::moe_w4a8", lib=LIB)
def _moe_w4a8_fake(x, topk_ids, topk_weights, experts):
    _check_fake_args("moe_w4a8", x, topk_ids, topk_weights)
    return x.new_empty(x.shape)


def moe_w4a8(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: PreparedExperts) -> torch.Tensor:
    """The MoE layer: ``out[m] = sum_j topk_weights[m, j] * FFN_{topk_ids[m, j] - offset}(x[m])``.

    ``x`` is ``[M, K]`` bf16/fp16; ``topk_ids`` ``[M, top_k]`` int32/int64 GLOBAL expert ids, ``-1``
    for padding; ids outside the handle's expert range belong to other ranks and contribute nothing.
    """
    return torch.ops.b12x.moe_w4a8.default(x, topk_ids, topk_weights, experts)


# ------------------------------------------------------------------------------------ moe_w4a8_out
def _moe_w4a8_out_kernel(x, topk_ids, topk_weights, experts, out):
    check_moe_args("moe_w4a8_out", x, topk_ids, topk_weights, experts, out)
    experts.run(x, topk_ids, topk_weights, out)


@torch.library.register_fake("b12x::moe_w4a8_out", lib=LIB)
def _moe_w4a8_out_fake(x, topk_ids, topk_weights, experts, out):
    _check_fake_args("moe_w4a8_out", x, topk_ids, topk_weights, out)
    return None


def moe_w4a8_out(x, topk_ids, topk_weights, experts: PreparedExperts, out: torch.Tensor) -> None:
    """``moe_w4a8`` writing into the caller's ``out`` (``[M, K]``, x's dtype)."""
    torch.ops.b12x.moe_w4a8_out.default(x, topk_ids, topk_weights, experts, out)


# ---------------------------------------------------------------------------------------- ep_remap
def _check_remap_args(topk_ids, topk_weights, expert_offset, num_local_experts):
    _check_routing("ep_remap", topk_ids, topk_weights)
    if expert_offset < 0:
        raise _bad("ep_remap", "expert_offset", "an int >= 0", expert_offset)
    if num_local_experts < 1:
        raise _bad("ep_remap", "num_local_experts", "an int >= 1", num_local_experts)


def _ep_remap_cpu(topk_ids, topk_weights, expert_offset, num_local_experts):
    _check_remap_args(topk_ids, topk_weights, expert_offset, num_local_experts)
    return _reference.ep_remap(topk_ids, topk_weights, expert_offset, num_local_experts)


_cuda_remap = []  # the one-launch Triton kernel, or the sync-free torch version without triton


def _ep_remap_cuda(topk_ids, topk_weights, expert_offset, num_local_experts):
    _check_remap_args(topk_ids, topk_weights, expert_offset, num_local_experts)
    if not _cuda_remap:  # resolved on the first call, not on every one
        try:
            from .backends.triton.remap import ep_remap as remap_kernel
        except ImportError:
            remap_kernel = _reference.ep_remap
        _cuda_remap.append(remap_kernel)
    return _cuda_remap[0](topk_ids, topk_weights, expert_offset, num_local_experts)


@torch.library.register_fake("b12x::ep_remap", lib=LIB)
def _ep_remap_fake(topk_ids, topk_weights, expert_offset, num_local_experts):
    torch._check(topk_weights.shape == topk_ids.shape, lambda: "b12x::ep_remap: shapes differ")
    shape = topk_ids.shape
    return topk_ids.new_empty(shape, dtype=torch.int32), topk_weights.new_empty(shape, dtype=torch.float32)


def ep_remap(topk_ids, topk_weights, expert_offset: int, num_local_experts: int):
    """Global top-k ids to local ones: ``(int32 ids, float32 weights)``, foreign/padding weight 0."""
    return torch.ops.b12x.ep_remap.default(topk_ids, topk_weights, expert_offset, num_local_experts)


for _key in ("CPU", "CUDA"):
    LIB.impl("moe_w4a8", _moe_w4a8_kernel, _key)
    LIB.impl("moe_w4a8_out", _moe_w4a8_out_kernel, _key)
LIB.impl("ep_remap", _ep_remap_cpu, "CPU")
# Inference ops: autograd passes straight through (a C++ fallthrough, no per-call Python cost); the
# outputs carry no grad_fn, so a backward through them fails instead of silently computing nothing.
for _name in SCHEMAS:
    LIB.impl(_name, torch.library.fallthrough_kernel, "Autograd")
LIB.impl("ep_remap", _ep_remap_cuda, "CUDA")
