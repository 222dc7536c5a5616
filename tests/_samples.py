"""One sample-input generator for every suite: numerics, opcheck, compile, errors, backends.

``make_layer`` builds random MXFP4 experts (the bytes a checkpoint would hold), ``make_batch`` a
routed batch with the awkward cases switched on by name; ``CASES`` lists the named cases the suites
share; ``oracle`` is the b12x library's own pure-torch reference.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import b12x_ops


@dataclasses.dataclass
class Layer:
    E: int
    K: int
    N: int
    top_k: int
    layout: str
    limit: float | None
    offset: int
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w13_global_scale: torch.Tensor | None
    w2_global_scale: torch.Tensor | None

    def prepare(self, **kw) -> b12x_ops.PreparedExperts:
        kw.setdefault("backend", "reference")
        return b12x_ops.prepare_experts(
            self.w13, self.w13_scale, self.w2, self.w2_scale, top_k=self.top_k, w13_layout=self.layout,
            swiglu_limit=self.limit, expert_offset=self.offset, w13_global_scale=self.w13_global_scale,
            w2_global_scale=self.w2_global_scale, **kw)


def make_layer(E=4, K=64, N=64, top_k=2, *, seed=0, layout="w13", limit=None, offset=0,
               global_scales=False, scale_range=(118, 125), scale_dtype=torch.uint8, device="cpu") -> Layer:
    g = torch.Generator().manual_seed(seed)

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    def scales(*shape):
        s = torch.randint(scale_range[0], scale_range[1] + 1, shape, generator=g, dtype=torch.uint8)
        return s if scale_dtype == torch.uint8 else s.view(scale_dtype)

    g13 = g2 = None
    if global_scales:
        g13 = torch.rand(E, generator=g) * 1.5 + 0.25
        g2 = torch.rand(E, generator=g) * 1.5 + 0.25
    t = [codes(E, 2 * N, K // 2), scales(E, 2 * N, K // 32), codes(E, K, N // 2), scales(E, K, N // 32)]
    t = [a.to(device) for a in t]
    g13 = None if g13 is None else g13.to(device)
    g2 = None if g2 is None else g2.to(device)
    return Layer(E, K, N, top_k, layout, limit, offset, *t, g13, g2)


def make_batch(layer: Layer, M: int, *, seed=0, id_dtype=torch.int32, w_dtype=torch.float32,
               x_dtype=torch.bfloat16, padding_rows=0, foreign=True, strided=False, x_scale=1.0,
               device="cpu"):
    """``(x, topk_ids, topk_weights)``. ``foreign`` mixes in ids of other EP ranks; the last
    ``padding_rows`` rows are CUDA-graph padding (all ids -1); ``strided`` makes x and the routing
    non-contiguous row views (last dim contiguous)."""
    g = torch.Generator().manual_seed(1000 + seed)
    K, E, k = layer.K, layer.E, layer.top_k
    x = (torch.randn(M, K * (2 if strided else 1), generator=g) * x_scale).to(x_dtype)
    if strided:
        x = x[:, :K]
    lo, hi = layer.offset, layer.offset + E
    if foreign:
        ids = torch.randint(max(0, lo - 3), hi + 3, (M, k), generator=g)
        ids[torch.rand(M, k, generator=g) < 0.1] = -1
    else:
        ids = torch.randint(lo, hi, (M, k), generator=g)
    if padding_rows:
        ids[M - padding_rows:] = -1
    w = torch.rand(M, k, generator=g)
    if strided:
        ids = torch.cat([ids, ids], dim=1)[:, :k]  # row stride 2k
        w = torch.cat([w, w], dim=1)[:, :k]
    return x.to(device), ids.to(id_dtype).to(device), w.to(w_dtype).to(device)


# name -> (layer kwargs, batch kwargs); compact, strided, zero tokens, odd sizes, padding, foreign ids
CASES = {
    "compact": (dict(), dict(M=8, foreign=False)),
    "strided": (dict(), dict(M=6, strided=True)),
    "zero_tokens": (dict(), dict(M=0)),
    "odd_sizes": (dict(E=3, K=96, N=96, top_k=3), dict(M=7)),
    "padding": (dict(), dict(M=9, padding_rows=4)),
    "foreign_ep": (dict(E=4, offset=5), dict(M=10)),
    "int64_bf16w": (dict(limit=7.0, layout="w31"), dict(M=5, id_dtype=torch.int64, w_dtype=torch.bfloat16)),
    "global_scales": (dict(global_scales=True), dict(M=4)),
}


def case(name: str, device="cpu", seed=0):
    layer_kw, batch_kw = CASES[name]
    layer = make_layer(seed=seed, device=device, **layer_kw)
    batch_kw = dict(batch_kw)
    M = batch_kw.pop("M")
    return layer, make_batch(layer, M, seed=seed, device=device, **batch_kw)


def _b12x_reference():
    try:
        from b12x.moe._shared.kernels.reference import moe_reference_w4a8_mx
    except ImportError:
        if os.environ.get("CI"):
            raise  # CI installs the b12x extra: a missing oracle is a failure there, never a skip
        pytest.skip("the b12x library (the oracle) is not installed: pip install -e .[b12x]")
    return moe_reference_w4a8_mx


def oracle(layer: Layer, x, topk_ids, topk_weights) -> torch.Tensor:
    """The b12x library's pure-torch W4A8 MX MoE (fp32 out), fed local ids."""
    ref = _b12x_reference()
    ones = torch.ones(layer.E, device=x.device)
    g13 = ones if layer.w13_global_scale is None else layer.w13_global_scale
    g2 = ones if layer.w2_global_scale is None else layer.w2_global_scale
    local = topk_ids.to(torch.int64) - layer.offset
    local = torch.where(topk_ids < 0, torch.full_like(local, -1), local)  # padding never matches
    return ref(x.cpu(), layer.w13.cpu(), layer.w13_scale.view(torch.uint8).cpu(), None, g13.cpu(),
               layer.w2.cpu(), layer.w2_scale.view(torch.uint8).cpu(), None, g2.cpu(), local.cpu(),
               topk_weights.cpu(), layer.E, layer.K, layer.N, activation="silu",
               swiglu_limit=layer.limit, w13_layout=layer.layout)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    denom = want.norm()
    if denom == 0:
        return float(got.norm())
    return float((got - want).norm() / denom)
