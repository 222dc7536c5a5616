"""The benchmark's peers: a bf16 MoE on dequantized weights, and OpenAI's triton_kernels
``matmul_ogs`` MXFP4 MoE the way vLLM runs it on Hopper (bf16 activations, swizzled MXFP4
weights, fused SwiGLU, router weights on the second GEMM). Neither is part of the package.

triton_kernels is never committed: pass the folder that holds the ``triton_kernels`` package (for
triton 3.6, the copy vendored in a vLLM wheel built on torch 2.11 at
``vllm/third_party/triton_kernels``) with ``--triton-kernels``.
"""

from __future__ import annotations

import sys

import torch


class Bf16MoE:
    """A bf16 MoE on dequantized weights through ``torch._grouped_mm``: sort slots by expert,
    two grouped GEMMs, SwiGLU between, weighted scatter-add. Sync-free, graph-capturable."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, top_k: int, limit: float | None):
        self.w13 = w13.transpose(1, 2)  # [E, K, 2N], K-major as _grouped_mm wants
        self.w2 = w2.transpose(1, 2)  # [E, N, K]
        self.E = w13.shape[0]
        self.N = w13.shape[1] // 2
        self.top_k = top_k
        self.limit = limit

    def __call__(self, x, ids, w):
        M, K = x.shape
        flat = ids.reshape(-1).to(torch.int64)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        rows = order // self.top_k
        xs = x[rows]
        h = torch._grouped_mm(xs, self.w13, offs=offs)
        up, gate = h[:, : self.N].float(), h[:, self.N:].float()
        if self.limit is not None:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(-self.limit, self.limit)
        a = (gate * torch.sigmoid(gate) * up).to(torch.bfloat16)
        y = torch._grouped_mm(a, self.w2, offs=offs)
        y = y.float() * w.reshape(-1)[order].float()[:, None]
        out = torch.zeros(M, K, dtype=torch.float32, device=x.device)
        out.index_add_(0, rows, y)
        return out.to(x.dtype)


class TritonKernelsMoE:
    """triton_kernels' matmul_ogs MXFP4 MoE (w4a16), set up as vLLM's gpt-oss path does on Hopper."""

    def __init__(self, path: str, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                 w2_scale: torch.Tensor, top_k: int, limit: float | None):
        if path not in sys.path:
            sys.path.insert(0, path)
        import triton_kernels.swiglu
        import triton_kernels.matmul_ogs_details.opt_flags as opt_flags
        from triton_kernels.matmul_ogs import FlexCtx, FnSpecs, FusedActivation, PrecisionConfig, matmul_ogs
        from triton_kernels.numerics import InFlexData
        from triton_kernels.routing import routing
        from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
        from triton_kernels.tensor_details import layout

        if torch.cuda.get_device_capability()[0] == 9:
            opt_flags.update_opt_flags_constraints({"split_k": 1})
        self._matmul_ogs = matmul_ogs
        self._routing = routing
        self.top_k = top_k
        self.E = w13.shape[0]
        self.N2 = w13.shape[1]

        def swizzle(q, s):
            vl, vo = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
            sl, so = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
            q = convert_layout(wrap_torch_tensor(q.transpose(-2, -1), dtype=FP4), vl, **vo)
            s = convert_layout(wrap_torch_tensor(s.transpose(-2, -1)), sl, **so)
            return q, s

        self.w1, s1 = swizzle(w13, w13_scale)
        self.w2, s2 = swizzle(w2, w2_scale)
        self.pc1 = PrecisionConfig(weight_scale=s1, flex_ctx=FlexCtx(rhs_data=InFlexData()))
        self.pc2 = PrecisionConfig(weight_scale=s2, flex_ctx=FlexCtx(rhs_data=InFlexData()))
        self.act = FusedActivation(FnSpecs("swiglu", triton_kernels.swiglu.swiglu_fn, ("alpha", "limit")),
                                   (1.702, limit if limit is not None else 7.0), 2)

    def route(self, logits):
        return self._routing(logits, self.top_k, sm_first=False)

    def __call__(self, x, routing_data, gather, scatter, inter, out):
        M = x.shape[0]
        self._matmul_ogs(x, self.w1, None, routing_data, gather_indx=gather, precision_config=self.pc1,
                         fused_activation=self.act, y=inter)
        self._matmul_ogs(inter.view(M * self.top_k, self.N2 // 2), self.w2, None, routing_data,
                         scatter_indx=scatter, precision_config=self.pc2, gammas=routing_data.gate_scal,
                         y=out)
        return out
