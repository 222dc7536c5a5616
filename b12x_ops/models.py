"""Small MoE models built on ``torch.ops.b12x.moe_w4a8``: the CLI demo and the compile tests use them.

``MoELayer`` is the pattern the contract documents: the layer holds its ``PreparedExperts`` handle
as a plain attribute and calls the op in ``forward``, so ``torch.compile(model, fullgraph=True)``
of the whole model bakes each layer's handle into the graph as a constant, one ``b12x`` node per
layer, and dynamic token counts do not recompile.

``TinyMoE`` stacks a few such layers with random bf16 experts quantized by
``b12x_ops.quantize_mxfp4``. The weights depend only on ``seed`` (drawn and quantized on the CPU,
then moved), so two models built with the same seed on different backends hold identical bytes and
their outputs can be compared directly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .handle import PreparedExperts, prepare_experts
from .mx import quantize_mxfp4


class MoELayer(nn.Module):
    """``x + moe(x)``: a router (linear, top-k, softmax over the top-k logits) and the b12x op.

    Args:
        experts: the layer's prepared experts (``prepare_experts``); its ``top_k`` is the router's.
        router_weight: ``[E_global, K]`` router weight. With expert parallelism ``E_global`` counts
            every rank's experts; ids outside the handle's range contribute nothing here.
    """

    def __init__(self, experts: PreparedExperts, router_weight: torch.Tensor):
        super().__init__()
        if router_weight.dim() != 2 or router_weight.shape[1] != experts.hidden_size:
            raise ValueError(
                f"MoELayer: router_weight: expected shape [E, {experts.hidden_size}], got {list(router_weight.shape)}"
            )
        if router_weight.device != experts.device:
            raise ValueError(f"MoELayer: router_weight: expected device {experts.device} (the handle's), got {router_weight.device}")
        self.router = nn.Linear(router_weight.shape[1], router_weight.shape[0], bias=False,
                                device=router_weight.device, dtype=router_weight.dtype)
        with torch.no_grad():
            self.router.weight.copy_(router_weight)
        self.experts = experts  # not a Module nor a Tensor: torch.compile treats it as a constant
        self.top_k = experts.top_k

    @classmethod
    def from_float(cls, w13: torch.Tensor, w2: torch.Tensor, router_weight: torch.Tensor, *, top_k: int,
                   device: torch.device | str | None = None, **prepare_kwargs: Any) -> "MoELayer":
        """Quantize float experts (``w13 [E, 2N, K]``, ``w2 [E, K, N]``) to MXFP4 and prepare them.

        Quantization runs where the weights are; the bytes then move to ``device`` (default: the
        weights' device), where the handle and router live. ``prepare_kwargs`` go to
        ``prepare_experts`` (``backend``, ``max_tokens``, ...).
        """
        device = torch.device(device) if device is not None else w13.device
        w13_q, w13_s = quantize_mxfp4(w13)
        w2_q, w2_s = quantize_mxfp4(w2)
        experts = prepare_experts(w13_q.to(device), w13_s.to(device), w2_q.to(device), w2_s.to(device),
                                  top_k=top_k, **prepare_kwargs)
        return cls(experts, router_weight.to(device))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_ids int64 [M, top_k], topk_weights float32 [M, top_k])``."""
        logits = self.router(x).float()
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        return x + torch.ops.b12x.moe_w4a8.default(x, ids, weights, self.experts)


class TinyMoE(nn.Module):
    """``num_layers`` ``MoELayer``s with random bf16 experts, for demos and tests.

    Args:
        num_layers, hidden_size (K), intermediate_size (N), num_experts (E), top_k: the shape.
        device: where the handles and routers live.
        seed: fixes every weight; equal seeds give equal bytes on every backend and device.
        **prepare_kwargs: for ``prepare_experts`` (``backend``, ``max_tokens``, ...).
    """

    def __init__(self, num_layers: int = 2, hidden_size: int = 128, intermediate_size: int = 128,
                 num_experts: int = 8, top_k: int = 2, *, device: torch.device | str = "cpu", seed: int = 0,
                 **prepare_kwargs: Any):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        K, N, E = hidden_size, intermediate_size, num_experts

        def randn(*shape, std):
            return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

        layers = []
        for _ in range(num_layers):
            w13 = randn(E, 2 * N, K, std=K ** -0.5)
            w2 = randn(E, K, N, std=N ** -0.5)
            router = randn(E, K, std=K ** -0.5)
            layers.append(MoELayer.from_float(w13, w2, router, top_k=top_k, device=device, **prepare_kwargs))
        self.layers = nn.ModuleList(layers)
        self.hidden_size = K

    @property
    def handles(self) -> list[PreparedExperts]:
        return [layer.experts for layer in self.layers]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
