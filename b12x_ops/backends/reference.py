"""The exact CPU reference: runs anywhere, slowly, with the contract's numerics in fp32.

It keeps only the MXFP4 bytes and decodes just the experts a batch touches, so a real-size layer
fits in memory. Work is vectorized over tokens; the only Python loop is over the touched experts.
It reads the routing on the host (a sync on CUDA), so on a GPU it is a correctness fallback, not a
graph-capturable kernel.
"""

from __future__ import annotations

import torch

from ..mx import dequantize_mxfp4, quant_dequant_mxfp8

NAME = "reference"


def unavailable_reason(device: torch.device) -> str | None:
    return None


def prepare(spec):
    if spec.options:
        raise ValueError(f"prepare_experts: backend 'reference' takes no options, got {sorted(spec.options)}")
    return spec  # the checkpoint bytes, by reference: no copy


def memory_report(spec) -> dict[str, int]:
    held = sum(t.numel() * t.element_size() for t in (spec.w13, spec.w13_scale, spec.w2, spec.w2_scale))
    return {"device_bytes": held, "checkpoint_bytes": held}


def ep_remap(topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_offset: int, num_local_experts: int):
    """Global ids to local ones, sync-free (the twin of the GPU kernel).

    A local slot keeps its local id and weight; a padding (-1) or foreign slot gets weight 0 and the
    id of an expert the batch already reads: the row's lowest local id, else the batch's lowest,
    else 0. Returns contiguous ``(int32 ids, float32 weights)``.
    """
    lid = topk_ids.to(torch.int64) - expert_offset
    ok = (lid >= 0) & (lid < num_local_experts)  # -1 padding is below any offset >= 0
    big = torch.iinfo(torch.int64).max
    masked = torch.where(ok, lid, big)
    if lid.numel() == 0:  # fresh outputs, never views of the inputs
        return topk_ids.new_empty(topk_ids.shape, dtype=torch.int32), topk_weights.new_empty(
            topk_weights.shape, dtype=torch.float32)
    row_min = masked.amin(dim=1, keepdim=True)
    batch_min = masked.amin()
    batch_fill = torch.where(batch_min < num_local_experts, batch_min, 0)
    fill = torch.where(row_min < num_local_experts, row_min, batch_fill)
    ids = torch.where(ok, lid, fill).to(torch.int32).contiguous()
    w = torch.where(ok, topk_weights.to(torch.float32), 0.0).contiguous()
    return ids, w


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)``, or ``silu(gate) * up`` without a limit."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate) * up


def expert_ffn(spec, e: int, xq: torch.Tensor) -> torch.Tensor:
    """``FFN_e`` of already MXFP8-quantized fp32 rows ``xq [T, K]``: fp32 ``[T, K]``."""
    g = spec.geometry
    n = g.intermediate_size
    w13 = dequantize_mxfp4(spec.w13[e], spec.w13_scale[e])  # [2N, K]
    h = xq @ w13.T
    if spec.w13_global_scale is not None:
        h = h * spec.w13_global_scale[e]
    first, second = h[:, :n], h[:, n:]
    up, gate = (first, second) if g.w13_layout == "w13" else (second, first)
    a = quant_dequant_mxfp8(swiglu(gate, up, g.swiglu_limit))
    w2 = dequantize_mxfp4(spec.w2[e], spec.w2_scale[e])  # [K, N]
    y = a @ w2.T
    if spec.w2_global_scale is not None:
        y = y * spec.w2_global_scale[e]
    return y


def moe_fp32(spec, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The whole layer in fp32: ``[M, K]``."""
    m, top_k = topk_ids.shape
    acc = torch.zeros(m, spec.geometry.hidden_size, dtype=torch.float32, device=x.device)
    if m == 0:
        return acc
    lid = topk_ids.to(torch.int64) - spec.expert_offset
    ok = (lid >= 0) & (lid < spec.geometry.num_experts)
    slots = ok.flatten().nonzero().squeeze(1)  # host sync: fine for the reference
    if slots.numel() == 0:
        return acc
    experts = lid.flatten()[slots]
    tokens = slots // top_k
    weights = topk_weights.flatten()[slots].to(torch.float32)
    order = torch.argsort(experts, stable=True)
    experts, tokens, weights = experts[order], tokens[order], weights[order]
    touched, counts = torch.unique_consecutive(experts, return_counts=True)
    xq = quant_dequant_mxfp8(x.to(torch.float32))
    start = 0
    for e, c in zip(touched.tolist(), counts.tolist()):
        rows = tokens[start : start + c]
        y = expert_ffn(spec, e, xq[rows]) * weights[start : start + c, None]
        acc.index_add_(0, rows, y)
        start += c
    return acc


def run(spec, x, topk_ids, topk_weights, out) -> None:
    out.copy_(moe_fp32(spec, x, topk_ids, topk_weights))
