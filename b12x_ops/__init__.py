"""b12x-ops: a quantized Mixture-of-Experts layer (MXFP4 weights, MXFP8 activations) as ONE PyTorch op.

Importing the package registers ``torch.ops.b12x.moe_w4a8``, ``moe_w4a8_out`` and ``ep_remap``.
Nothing heavy happens at import: backends (Triton, the b12x library) load when a handle is prepared.
"""

from ._compat import TORCH_VERSION  # noqa: F401  (version gate runs first)
from .handle import PreparedExperts, prepare_experts, token_ladder
from .mx import dequantize_mxfp4, quant_dequant_mxfp8, quantize_mxfp4
from .backends import available_backends, BackendStatus
from .ops import ep_remap, moe_w4a8, moe_w4a8_out, SCHEMAS

__version__ = "0.1.0"

__all__ = [
    "PreparedExperts",
    "prepare_experts",
    "available_backends",
    "BackendStatus",
    "moe_w4a8",
    "moe_w4a8_out",
    "ep_remap",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "quant_dequant_mxfp8",
    "token_ladder",
    "SCHEMAS",
]
