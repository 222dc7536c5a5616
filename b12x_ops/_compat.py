"""Torch-version gates, in one place.

The package supports torch 2.11 and newer. Everything that differs between releases is decided here
once, at import, so the rest of the code never branches on versions.
"""

from __future__ import annotations

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
MIN_TORCH = (2, 11)

if TORCH_VERSION < MIN_TORCH:  # pragma: no cover - guarded by pyproject too
    raise ImportError(f"b12x_ops needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, found {torch.__version__}")

try:
    from torch._library.opaque_object import register_opaque_type, get_opaque_type_name
except ImportError as exc:  # pragma: no cover
    raise ImportError(
        f"b12x_ops needs torch's opaque-object support (torch._library.opaque_object), "
        f"missing in torch {torch.__version__}"
    ) from exc

# torch 2.11 requires an opaque class to subclass torch._opaque_base.OpaqueBase (its metaclass lets
# FakeScriptObject pass isinstance checks while tracing); newer torch accepts it too.
try:
    from torch._opaque_base import OpaqueBase
except ImportError:  # pragma: no cover
    OpaqueBase = object

# float8_e8m0fnu exists from torch 2.7 on; a scale tensor may arrive in either dtype.
E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)


def triton_version() -> str | None:
    try:
        import triton
    except Exception:
        return None
    return getattr(triton, "__version__", "unknown")
