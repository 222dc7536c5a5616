"""Expert and tensor parallelism: which weights a rank takes, its handle, and a layer that sums ranks.

The op itself knows nothing about other ranks. A rank runs ``moe_w4a8`` on ITS experts and ITS
slice of the intermediate dimension, every rank sees the same tokens and the same GLOBAL top-k ids,
and an all-reduce (sum) of the ranks' partial outputs gives the layer's output:

* Expert parallel (EP): rank ``r`` of ``world_size`` owns a contiguous range of experts
  (``expert_range``); its handle gets ``expert_offset`` = the global id of its first expert, and the
  op drops every slot whose id is another rank's. Summing over ranks sums over all slots.
* Tensor parallel (TP): rank ``r`` owns rows ``[r*n, (r+1)*n)`` (``n = N / world_size``) of BOTH
  halves of ``w13`` (up and gate, whatever the layout) and the same columns of ``w2``. The SwiGLU is
  elementwise over ``N`` and the MXFP8 quantization of the intermediate is per 32 along ``N``; with
  ``n`` a multiple of 32 a rank's blocks are exactly the single-GPU blocks, so the partials are
  exact pieces of the single-GPU sum (each is rounded once to the output dtype before the reduce).
  The per-expert global scales are the same on every TP rank.

EP and TP compose: ``shard_intermediate(**shard_experts(...), ...)`` gives an EP x TP rank's weights.
Everything here is pure indexing on tensors (CPU or GPU) except ``DistributedMoE``, which calls the op
and ``torch.distributed``'s functional all-reduce, so it traces into one graph under
``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .handle import PreparedExperts, prepare_experts
from .mx import BLOCK

__all__ = [
    "expert_range",
    "intermediate_range",
    "shard_experts",
    "shard_intermediate",
    "prepare_ep_rank",
    "prepare_tp_rank",
    "DistributedMoE",
    "all_reduce_sum",
    "count_moe_nodes",
]

_LAYOUTS = ("w13", "w31")


def _fail(fn: str, arg: str, expected: str, got) -> ValueError:
    return ValueError(f"{fn}: {arg}: expected {expected}, got {got}")


def _check_rank(fn: str, rank, world_size) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise _fail(fn, "world_size", "an int >= 1", repr(world_size))
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise _fail(fn, "rank", f"an int in [0, {world_size}) (world_size {world_size})", repr(rank))


def _geometry(fn: str, w13, w13_scale, w2, w2_scale) -> tuple[int, int, int]:
    """``(E, K, N)`` of a layer's four MXFP4 tensors, checking they agree with each other."""
    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise _fail(fn, name, "a 3-dim tensor", getattr(t, "shape", type(t).__name__))
    E, two_n, k_half = w13.shape
    if two_n % 2:
        raise _fail(fn, "w13", "an even row count 2N", two_n)
    K, N = 2 * k_half, two_n // 2
    if K % BLOCK or N % BLOCK:
        raise _fail(fn, "w13", f"K = 2 * w13.shape[2] and N = w13.shape[1] // 2 multiples of {BLOCK}", f"K={K}, N={N}")
    want = {
        "w13_scale": (E, 2 * N, K // BLOCK),
        "w2": (E, K, N // 2),
        "w2_scale": (E, K, N // BLOCK),
    }
    for name, t in (("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if tuple(t.shape) != want[name]:
            raise _fail(fn, name, f"shape {list(want[name])} (from w13 {list(w13.shape)})", f"shape {list(t.shape)}")
    return E, K, N


def _check_global(fn: str, name: str, g, E: int) -> None:
    if g is not None and (not isinstance(g, torch.Tensor) or g.numel() != E):
        raise _fail(fn, name, f"None or a tensor of {E} per-expert scales", getattr(g, "shape", g))


# ----------------------------------------------------------------------------------------- EP
def expert_range(num_experts: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(first, count)``: the contiguous global experts expert-parallel rank ``rank`` owns.

    Even split when ``world_size`` divides ``num_experts``; otherwise the first
    ``num_experts % world_size`` ranks own one expert more (the rule vLLM's linear expert placement
    uses), so ranks differ by at most one expert. Every rank must own at least one expert.
    """
    _check_rank("expert_range", rank, world_size)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < world_size:
        raise _fail(
            "expert_range", "num_experts", f"an int >= world_size ({world_size}): every rank owns an expert",
            repr(num_experts))
    base, extra = divmod(num_experts, world_size)
    first = rank * base + min(rank, extra)
    return first, base + (1 if rank < extra else 0)


def shard_experts(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    w13_global_scale: torch.Tensor | None = None,
    w2_global_scale: torch.Tensor | None = None,
    expert_offset: int = 0,
) -> dict[str, Any]:
    """The experts expert-parallel rank ``rank`` owns, as ``prepare_experts`` keyword arguments.

    Takes the layer's weights over ``E`` experts (global ids ``expert_offset .. expert_offset+E-1``)
    and returns ``{"w13", "w13_scale", "w2", "w2_scale", "w13_global_scale", "w2_global_scale",
    "expert_offset"}`` for the rank's contiguous range (``expert_range``): views along the expert
    dim, no copy. ``prepare_experts(**shard, top_k=...)`` builds the rank's handle.
    """
    fn = "shard_experts"
    _check_rank(fn, rank, world_size)
    E, _, _ = _geometry(fn, w13, w13_scale, w2, w2_scale)
    _check_global(fn, "w13_global_scale", w13_global_scale, E)
    _check_global(fn, "w2_global_scale", w2_global_scale, E)
    if E < world_size:
        raise _fail(fn, "w13", f"at least world_size = {world_size} experts (one a rank)", f"{E} experts")
    first, count = expert_range(E, rank, world_size)
    sl = slice(first, first + count)

    def part(g):
        return None if g is None else g.reshape(E)[sl]

    return {
        "w13": w13[sl],
        "w13_scale": w13_scale[sl],
        "w2": w2[sl],
        "w2_scale": w2_scale[sl],
        "w13_global_scale": part(w13_global_scale),
        "w2_global_scale": part(w2_global_scale),
        "expert_offset": expert_offset + first,
    }


# ----------------------------------------------------------------------------------------- TP
def intermediate_range(intermediate_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(first, size)``: the slice ``[first, first+size)`` of the intermediate dim ``N`` a TP rank owns.

    ``N`` must split evenly into slices that are whole MX blocks (``size % 32 == 0``): then the
    rank's MXFP8 blocks of the intermediate and its ``w2`` scale blocks are exactly the single-GPU
    ones, and the partial outputs sum to the single-GPU output.
    """
    fn = "intermediate_range"
    _check_rank(fn, rank, world_size)
    n = intermediate_size
    if n % world_size:
        raise _fail(fn, "world_size", f"a divisor of the intermediate size N = {n}", world_size)
    size = n // world_size
    if size % BLOCK:
        raise _fail(
            fn, "world_size",
            f"a split of N = {n} into slices that are multiples of {BLOCK} (one MX scale block), so "
            f"scale blocks align; world_size {world_size} gives {size} a rank", world_size)
    return rank * size, size


def shard_intermediate(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    w13_layout: str = "w13",
    w13_global_scale: torch.Tensor | None = None,
    w2_global_scale: torch.Tensor | None = None,
    expert_offset: int = 0,
) -> dict[str, Any]:
    """The slice of the intermediate dim tensor-parallel rank ``rank`` owns, as ``prepare_experts`` kwargs.

    With ``[first, first+n) = intermediate_range(N, rank, world_size)``:

    * ``w13`` ``[E, 2N, K//2]`` and ``w13_scale`` ``[E, 2N, K//32]``: rows ``[first, first+n)`` of
      the first half and ``[N+first, N+first+n)`` of the second, stacked in that order. The halves
      are up and gate (``w13_layout="w13"``) or gate and up (``"w31"``); both are sliced alike, so
      the shard keeps the layout: prepare it with the same ``w13_layout``.
    * ``w2`` ``[E, K, N//2]``: byte columns ``[first//2, (first+n)//2)`` (two codes a byte).
    * ``w2_scale`` ``[E, K, N//32]``: block columns ``[first//32, (first+n)//32)``.
    * global scales and ``expert_offset``: unchanged (every TP rank holds every expert).

    Returns contiguous copies (a column slice is not contiguous).
    """
    fn = "shard_intermediate"
    _check_rank(fn, rank, world_size)
    if w13_layout not in _LAYOUTS:
        raise _fail(fn, "w13_layout", f"one of {_LAYOUTS}", repr(w13_layout))
    E, K, N = _geometry(fn, w13, w13_scale, w2, w2_scale)
    _check_global(fn, "w13_global_scale", w13_global_scale, E)
    _check_global(fn, "w2_global_scale", w2_global_scale, E)
    try:
        first, n = intermediate_range(N, rank, world_size)
    except ValueError as exc:
        raise ValueError(str(exc).replace("intermediate_range:", f"{fn}:", 1)) from None

    def rows(t):  # both halves of the fused up/gate projection
        return torch.cat((t[:, first:first + n], t[:, N + first:N + first + n]), dim=1).contiguous()

    return {
        "w13": rows(w13),
        "w13_scale": rows(w13_scale),
        "w2": w2[:, :, first // 2:(first + n) // 2].contiguous(),
        "w2_scale": w2_scale[:, :, first // BLOCK:(first + n) // BLOCK].contiguous(),
        "w13_global_scale": w13_global_scale,
        "w2_global_scale": w2_global_scale,
        "expert_offset": expert_offset,
    }


# ------------------------------------------------------------------------------------ handles
def _to(shard: dict[str, Any], device) -> dict[str, Any]:
    if device is None:
        return shard
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in shard.items()}


def prepare_ep_rank(
    w13, w13_scale, w2, w2_scale, *, rank: int, world_size: int, top_k: int, device=None,
    w13_global_scale=None, w2_global_scale=None, **prepare_kwargs: Any,
) -> PreparedExperts:
    """The handle of expert-parallel rank ``rank``: ``shard_experts``, moved to ``device``, prepared.

    Only the rank's experts are copied to ``device`` (the full weights may stay on the CPU).
    ``prepare_kwargs`` go to ``prepare_experts`` (``w13_layout``, ``swiglu_limit``, ``backend``, ...).
    """
    shard = shard_experts(w13, w13_scale, w2, w2_scale, rank=rank, world_size=world_size,
                          w13_global_scale=w13_global_scale, w2_global_scale=w2_global_scale,
                          expert_offset=prepare_kwargs.pop("expert_offset", 0))
    return prepare_experts(**_to(shard, device), top_k=top_k, **prepare_kwargs)


def prepare_tp_rank(
    w13, w13_scale, w2, w2_scale, *, rank: int, world_size: int, top_k: int, w13_layout: str = "w13",
    device=None, w13_global_scale=None, w2_global_scale=None, **prepare_kwargs: Any,
) -> PreparedExperts:
    """The handle of tensor-parallel rank ``rank``: ``shard_intermediate``, moved to ``device``, prepared."""
    shard = shard_intermediate(w13, w13_scale, w2, w2_scale, rank=rank, world_size=world_size,
                               w13_layout=w13_layout, w13_global_scale=w13_global_scale,
                               w2_global_scale=w2_global_scale,
                               expert_offset=prepare_kwargs.pop("expert_offset", 0))
    return prepare_experts(**_to(shard, device), top_k=top_k, w13_layout=w13_layout, **prepare_kwargs)


# -------------------------------------------------------------------------------------- layer
class DistributedMoE(nn.Module):
    """Router, this rank's experts, and the all-reduce that sums the ranks: one MoE layer.

    ``forward(x [..., K]) -> [..., K]`` computes the router logits ``x @ router_weight^T`` (over all
    GLOBAL experts, replicated on every rank), takes the top-k, weights them by a softmax over the
    chosen logits (``renormalize=True``; else the softmax over all experts, gathered), runs this
    rank's handle (``moe_w4a8_out`` into a fresh buffer, or ``moe_w4a8`` with ``out_variant=False``)
    and sums the partial outputs over ``group`` with
    ``torch.distributed._functional_collectives.all_reduce``. With ``group=None`` (one GPU) there is
    no all-reduce.

    Traceable whole: under ``torch.compile(fullgraph=True)`` the graph holds one b12x node and one
    all-reduce. The handle is a constant of the graph, so compile the layer (or the model holding it)
    once per handle.
    """

    def __init__(self, experts: PreparedExperts, router_weight: torch.Tensor, *, group=None,
                 renormalize: bool = True, out_variant: bool = True):
        super().__init__()
        if not isinstance(experts, PreparedExperts):
            raise _fail("DistributedMoE", "experts", "a PreparedExperts", type(experts).__name__)
        if router_weight.dim() != 2 or router_weight.shape[1] != experts.hidden_size:
            raise _fail("DistributedMoE", "router_weight",
                        f"[num_global_experts, K={experts.hidden_size}]", f"shape {list(router_weight.shape)}")
        if router_weight.shape[0] < experts.expert_offset + experts.num_experts:
            raise _fail("DistributedMoE", "router_weight",
                        f"at least {experts.expert_offset + experts.num_experts} rows (the handle's experts "
                        f"end there)", f"{router_weight.shape[0]} rows")
        self.experts = experts
        self.router_weight = nn.Parameter(router_weight, requires_grad=False)
        self.top_k = experts.top_k
        self.group = group
        self.renormalize = renormalize
        self.out_variant = out_variant

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_ids int64 [M, top_k], topk_weights fp32 [M, top_k])`` over the global experts."""
        logits = nn.functional.linear(x, self.router_weight).float()
        if self.renormalize:
            vals, ids = torch.topk(logits, self.top_k, dim=-1)
            return ids, torch.softmax(vals, dim=-1)
        probs = torch.softmax(logits, dim=-1)
        vals, ids = torch.topk(probs, self.top_k, dim=-1)
        return ids, vals

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        ids, weights = self.route(x2)
        if self.out_variant:
            out = x2.new_empty(x2.shape)
            torch.ops.b12x.moe_w4a8_out.default(x2, ids, weights, self.experts, out)
        else:
            out = torch.ops.b12x.moe_w4a8.default(x2, ids, weights, self.experts)
        if self.group is not None:
            out = all_reduce_sum(out, self.group)
        return out.view(shape)


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum ``t`` over ``group`` with the functional all-reduce (traceable); waits in eager mode."""
    import torch.distributed._functional_collectives as funcol

    out = funcol.all_reduce(t, "sum", group)
    if isinstance(out, funcol.AsyncCollectiveTensor):  # eager: hand back a plain, complete tensor
        out = out.wait()
    return out


def count_moe_nodes(graph_module: torch.fx.GraphModule) -> dict[str, int]:
    """``{"b12x": n, "all_reduce": n}``: b12x op calls and all-reduces in a traced graph.

    A b12x call counts whether it appears as itself or wrapped by functionalization
    (``auto_functionalized``, as ``moe_w4a8_out`` appears before inductor re-inplaces it).
    """
    counts = {"b12x": 0, "all_reduce": 0}
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        name = getattr(target, "name", lambda: "")() if callable(getattr(target, "name", None)) else ""
        if "auto_functionalized" in str(target) and node.args:
            inner = node.args[0]
            name = inner.name() if callable(getattr(inner, "name", None)) else str(inner)
        if name.startswith("b12x::"):
            counts["b12x"] += 1
        elif name.startswith("_c10d_functional::all_reduce") or name.startswith("c10d::allreduce"):
            counts["all_reduce"] += 1
    return counts
