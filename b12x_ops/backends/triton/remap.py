"""``b12x::ep_remap`` on CUDA: global top-k ids to local ones in one launch, no host sync.

Its pure-torch twin is ``b12x_ops.backends.reference.ep_remap``. One program walks the batch twice:
first for the batch's lowest local id, then row by row writing ids and weights, so the fill rule
(the row's lowest local id, else the batch's lowest, else 0) needs no second launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import ep_remap as ep_remap_torch  # noqa: F401  (the twin, re-exported for tests)
from .kernels import local_expert


@triton.jit
def _local_rows(ids_ptr, r0, M, stride_im, stride_ik, expert_offset, cols, cm, E: tl.constexpr, BR: tl.constexpr):
    """Rows ``r0 ..`` of the batch: ``(rows, mask, local ids (int32, 2^31 - 1 where not ours), ours)``."""
    rows = (r0 + tl.arange(0, BR)).to(tl.int64)
    msk = (rows < M)[:, None] & cm[None, :]
    gid = tl.load(ids_ptr + rows[:, None] * stride_im + cols[None, :] * stride_ik, mask=msk, other=-1).to(tl.int64)
    lid, ours = local_expert(gid, expert_offset, E)
    ok = msk & ours
    return rows, msk, tl.where(ok, lid, 2147483647).to(tl.int32), ok


@triton.jit
def ep_remap_kernel(
    ids_ptr, w_ptr, ids_out, w_out, M, stride_im, stride_ik, stride_wm, stride_wk, expert_offset,
    E: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BR: tl.constexpr,
):
    cols = tl.arange(0, TOPK_PAD)
    cm = cols < TOPK
    best = tl.full((BR, TOPK_PAD), 2147483647, tl.int32)
    for r0 in range(0, M, BR):
        _, _, lid32, _ = _local_rows(ids_ptr, r0, M, stride_im, stride_ik, expert_offset, cols, cm, E, BR)
        best = tl.minimum(best, lid32)
    batch_min = tl.min(tl.min(best, axis=1), axis=0)
    batch_fill = tl.where(batch_min < E, batch_min, 0)
    for r0 in range(0, M, BR):
        rows, msk, lid32, ok = _local_rows(ids_ptr, r0, M, stride_im, stride_ik, expert_offset, cols, cm, E, BR)
        row_min = tl.min(lid32, axis=1)
        fill = tl.where(row_min < E, row_min, batch_fill)
        ids = tl.where(ok, lid32, fill[:, None])
        w = tl.load(w_ptr + rows[:, None] * stride_wm + cols[None, :] * stride_wk, mask=msk, other=0.0).to(tl.float32)
        w = tl.where(ok, w, 0.0)
        dst = rows[:, None] * TOPK + cols[None, :]
        tl.store(ids_out + dst, ids, mask=msk)
        tl.store(w_out + dst, w, mask=msk)


def ep_remap(topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_offset: int, num_local_experts: int):
    """``(ids int32 [M, top_k], weights float32 [M, top_k])``, contiguous; see the op's docstring."""
    m, top_k = topk_ids.shape
    ids = torch.empty((m, top_k), dtype=torch.int32, device=topk_ids.device)
    w = torch.empty((m, top_k), dtype=torch.float32, device=topk_ids.device)
    if m == 0:
        return ids, w
    ep_remap_kernel[(1,)](
        topk_ids, topk_weights, ids, w, m, topk_ids.stride(0), topk_ids.stride(1), topk_weights.stride(0),
        topk_weights.stride(1), expert_offset, E=num_local_experts, TOPK=top_k,
        TOPK_PAD=triton.next_power_of_2(top_k), BR=max(1, 1024 // triton.next_power_of_2(top_k)),
    )
    return ids, w
