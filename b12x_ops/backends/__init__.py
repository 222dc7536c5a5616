"""Backends as an ordered list of candidates.

Each backend is one module in this package with the same four names:

* ``NAME``: its name, as ``prepare_experts(backend=...)`` spells it;
* ``unavailable_reason(device) -> str | None``: ``None`` when it can run on ``device``, else why not;
* ``prepare(spec) -> state``: everything that costs time (repacking, planning, compilation, scratch);
* ``run(state, x, topk_ids, topk_weights, out)``: the per-call path, launches only, writes ``out``.

``auto`` takes the first candidate that can run. Adding a backend is adding one module and its name
to ``CANDIDATES``.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch

# Fastest first.
CANDIDATES = ("b12x", "triton", "reference")


class BackendStatus(NamedTuple):
    name: str
    available: bool
    reason: str  # why it cannot run here; "" when it can


def load(name: str):
    if name not in CANDIDATES:
        raise ValueError(f"backend: expected one of {('auto',) + CANDIDATES}, got {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


def status(name: str, device: torch.device) -> BackendStatus:
    try:
        module = load(name)
    except ImportError as exc:  # a backend whose own dependencies are missing
        return BackendStatus(name, False, f"cannot import its module: {exc}")
    try:
        reason = module.unavailable_reason(device)
    except Exception as exc:  # a broken probe must not take `auto` or `info` down with it
        reason = f"its availability check failed: {type(exc).__name__}: {exc}"
    return BackendStatus(name, reason is None, reason or "")


def available_backends(device: torch.device | str | None = None) -> list[BackendStatus]:
    """Every backend, fastest first, with whether it can run on ``device`` and if not, why.

    ``device`` defaults to the current CUDA device when there is one, else the CPU.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return [status(name, device) for name in CANDIDATES]


def select(requested: str, device: torch.device):
    """The backend module to use: the requested one if it can run, else raise saying why."""
    if requested == "auto":
        statuses = available_backends(device)
        for st in statuses:
            if st.available:
                return load(st.name)
        reasons = "; ".join(f"{s.name}: {s.reason}" for s in statuses)
        raise RuntimeError(f"backend='auto': no backend can run on {device} ({reasons})")
    st = status(requested, device)  # raises ValueError on an unknown name
    if not st.available:
        raise RuntimeError(f"backend={requested!r} cannot run on {device}: {st.reason}")
    return load(requested)
