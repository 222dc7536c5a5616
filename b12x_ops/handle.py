"""``PreparedExperts``, the opaque handle, and ``prepare_experts``, the one way to build it.

A handle holds one layer's MXFP4 experts in the form its backend runs them, with everything decided
ahead of the op call: the backend, the geometry, the expert-parallel range and the planned token
counts. It is registered as a VALUE-type opaque object: torch.compile bakes it into the graph as a
constant (equality and hash by its key, ``__fx_repr__`` rebuilds it from the key), which is what
lets inductor record CUDA graphs around the op under ``mode="reduce-overhead"``; a reference-type
object, or a hoisted value type, becomes a graph input and silently gets no CUDA graph.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import weakref
from typing import Any, Sequence

import torch

from . import backends
from ._compat import E8M0_DTYPE, OpaqueBase, register_opaque_type, get_opaque_type_name
from .mx import BLOCK, scale_bytes

ACTIVATIONS = ("silu",)
LAYOUTS = ("w13", "w31")
_WEIGHT_DTYPES = (torch.uint8, torch.int8)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What fixes a layer's kernels and plans: handles with equal geometry share plans and scratch."""

    num_experts: int  # local experts E
    hidden_size: int  # K
    intermediate_size: int  # N (per rank)
    top_k: int
    w13_layout: str
    activation: str
    swiglu_limit: float | None
    has_global_scales: bool
    device: torch.device
    deterministic: bool


@dataclasses.dataclass
class ExpertsSpec:
    """What a backend's ``prepare`` receives: validated weights and the caller's options."""

    geometry: Geometry
    w13: torch.Tensor  # uint8 [E, 2N, K//2]
    w13_scale: torch.Tensor  # uint8 [E, 2N, K//32]
    w2: torch.Tensor  # uint8 [E, K, N//2]
    w2_scale: torch.Tensor  # uint8 [E, K, N//32]
    w13_global_scale: torch.Tensor | None  # fp32 [E]
    w2_global_scale: torch.Tensor | None  # fp32 [E]
    expert_offset: int
    max_tokens: int
    capacities: tuple[int, ...]  # sorted planned token counts; the last is the chunk size
    options: dict[str, Any]
    decode_token_counts: tuple[int, ...] = ()  # the caller's exact counts, as given


class PreparedExperts(OpaqueBase):
    """One layer's experts, prepared for one backend on one device. Build with ``prepare_experts``.

    Public, read-only attributes: ``backend``, ``device``, ``num_experts`` (local), ``expert_offset``,
    ``hidden_size``, ``intermediate_size``, ``top_k``, ``w13_layout``, ``activation``,
    ``swiglu_limit``, ``max_tokens``, ``capacities``, ``deterministic``, ``geometry``.
    """

    _registry: "weakref.WeakValueDictionary[int, PreparedExperts]" = weakref.WeakValueDictionary()
    _keys = itertools.count(1)

    def __init__(self, *, spec: ExpertsSpec, backend_name: str, run, state, memory: dict[str, int]):
        g = spec.geometry
        self.key = next(PreparedExperts._keys)
        self.backend = backend_name
        self.geometry = g
        self.device = g.device
        self.num_experts = g.num_experts
        self.expert_offset = spec.expert_offset
        self.hidden_size = g.hidden_size
        self.intermediate_size = g.intermediate_size
        self.top_k = g.top_k
        self.w13_layout = g.w13_layout
        self.activation = g.activation
        self.swiglu_limit = g.swiglu_limit
        self.deterministic = g.deterministic
        self.max_tokens = spec.max_tokens
        self.capacities = spec.capacities
        self.memory = memory
        self._run = run
        self._state = state
        PreparedExperts._registry[self.key] = self

    # value-type opaque protocol: identity is the key, the graph rebuilds the object from it
    def __eq__(self, other):
        return isinstance(other, PreparedExperts) and other.key == self.key

    def __hash__(self):
        return hash(("b12x_ops.PreparedExperts", self.key))

    # A handle is an identity, not a value to clone: copies (torch.compile deep-copies graph
    # constants) are the handle itself, so no prepared weights or plans are ever duplicated.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __fx_repr__(self):
        return f"PreparedExperts._lookup({self.key})", {"PreparedExperts": PreparedExperts}

    @classmethod
    def _lookup(cls, key: int) -> "PreparedExperts":
        try:
            return cls._registry[key]
        except KeyError:
            raise RuntimeError(f"PreparedExperts #{key} no longer exists (it was garbage collected)") from None

    def __repr__(self):
        lim = "" if self.swiglu_limit is None else f", swiglu_limit={self.swiglu_limit}"
        return (
            f"PreparedExperts(#{self.key}, backend={self.backend!r}, device={self.device}, "
            f"experts={self.num_experts}@{self.expert_offset}, K={self.hidden_size}, "
            f"N={self.intermediate_size}, top_k={self.top_k}, layout={self.w13_layout!r}{lim}, "
            f"max_tokens={self.max_tokens})"
        )

    def run(self, x, topk_ids, topk_weights, out) -> None:
        """Checked arguments in, ``out`` written. Batches above the top capacity run in chunks."""
        m = x.shape[0]
        chunk = self.max_tokens
        if m <= chunk:
            self._run(self._state, x, topk_ids, topk_weights, out)
            return
        for s in range(0, m, chunk):
            e = min(s + chunk, m)
            self._run(self._state, x[s:e], topk_ids[s:e], topk_weights[s:e], out[s:e])


_NAME = f"{PreparedExperts.__module__}.{PreparedExperts.__qualname__}"
_already_registered = getattr(torch._C, "_is_opaque_type_registered", lambda name: False)
if _already_registered(_NAME):
    raise RuntimeError(
        f"b12x_ops: the opaque type {_NAME} is already registered in this process (most likely the "
        f"schema-only csrc_stubs library was loaded first; load one or the other, not both)"
    )
register_opaque_type(PreparedExperts, typ="value")
HANDLE_TYPE = get_opaque_type_name(PreparedExperts)


def _fail(arg: str, expected: str, got) -> None:
    raise ValueError(f"prepare_experts: {arg}: expected {expected}, got {got}")


def token_ladder(max_tokens: int) -> tuple[int, ...]:
    """Powers of two below ``max_tokens``, then ``max_tokens`` itself."""
    ladder = [1 << i for i in range(max(1, max_tokens).bit_length()) if (1 << i) < max_tokens]
    return tuple(ladder + [max_tokens])


def plan_capacities(max_tokens: int, decode_token_counts: Sequence[int]) -> tuple[int, ...]:
    """Every planned token count: the exact decode counts plus the ladder up to ``max_tokens``."""
    exact = set()
    for c in decode_token_counts:
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            _fail("decode_token_counts", "positive ints", repr(c))
        if c > max_tokens:
            _fail("decode_token_counts", f"counts <= max_tokens ({max_tokens})", c)
        exact.add(c)
    return tuple(sorted(exact | set(token_ladder(max_tokens))))


def _check_weight(name: str, t, dtypes, shape) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(name, "a tensor", type(t).__name__)
    if t.dtype not in dtypes:
        _fail(name, " or ".join(str(d) for d in dtypes), t.dtype)
    if t.dim() != len(shape):
        _fail(name, f"{len(shape)} dims {list(shape)}", f"shape {list(t.shape)}")
    if list(t.shape) != list(shape):
        _fail(name, f"shape {list(shape)}", f"shape {list(t.shape)}")


def prepare_experts(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    top_k: int,
    w13_layout: str = "w13",
    activation: str = "silu",
    swiglu_limit: float | None = None,
    expert_offset: int = 0,
    w13_global_scale: torch.Tensor | None = None,
    w2_global_scale: torch.Tensor | None = None,
    max_tokens: int = 8192,
    decode_token_counts: Sequence[int] = (),
    backend: str = "auto",
    deterministic: bool = False,
    **backend_options: Any,
) -> PreparedExperts:
    """Validate, repack and plan one layer's MXFP4 experts; returns the handle the ops take.

    Args:
        w13: uint8 ``[E, 2N, K//2]`` MXFP4 codes of the fused up/gate projection (E local experts).
        w13_scale: uint8 or float8_e8m0fnu ``[E, 2N, K//32]`` E8M0 block scales.
        w2: uint8 ``[E, K, N//2]`` codes of the down projection.
        w2_scale: ``[E, K, N//32]`` its block scales.
        top_k: slots per token the op will be called with.
        w13_layout: ``"w13"`` (rows ``[0, N)`` up, ``[N, 2N)`` gate) or ``"w31"`` (the reverse).
        activation: ``"silu"`` (SwiGLU).
        swiglu_limit: ``L`` for ``silu(min(gate, L)) * clamp(up, -L, L)``; ``None`` for none.
        expert_offset: global id of local expert 0 (expert parallelism).
        w13_global_scale, w2_global_scale: optional fp32 ``[E]`` per-expert scales.
        max_tokens: the largest planned launch; larger batches run in chunks of it.
        decode_token_counts: exact token counts to plan for (e.g. CUDA-graph batch sizes).
        backend: ``"auto"``, ``"b12x"``, ``"triton"`` or ``"reference"``.
        deterministic: bit-identical output run to run (no atomics).
        **backend_options: options only one backend understands (documented there).

    Everything that costs time happens here; op calls afterwards only look up and launch.
    """
    # ---- argument checks: every message names the argument, what was expected and what came
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3:
        _fail("w13", "a 3-dim uint8 tensor [E, 2N, K//2]", getattr(w13, "shape", type(w13).__name__))
    E, two_n, k_half = w13.shape
    K = 2 * k_half
    if E < 1:
        _fail("w13", "at least one expert", f"shape {list(w13.shape)}")
    if two_n % 2 != 0 or two_n == 0:
        _fail("w13", "an even, non-zero row count 2N", two_n)
    N = two_n // 2
    if K % BLOCK != 0 or K == 0:
        _fail("w13", f"hidden size K = 2 * w13.shape[2] a multiple of {BLOCK}", K)
    if N % BLOCK != 0:
        _fail("w13", f"intermediate size N = w13.shape[1] // 2 a multiple of {BLOCK}", N)
    scale_dtypes = (torch.uint8,) + ((E8M0_DTYPE,) if E8M0_DTYPE is not None else ())
    _check_weight("w13", w13, _WEIGHT_DTYPES, (E, 2 * N, K // 2))
    _check_weight("w13_scale", w13_scale, scale_dtypes, (E, 2 * N, K // BLOCK))
    _check_weight("w2", w2, _WEIGHT_DTYPES, (E, K, N // 2))
    _check_weight("w2_scale", w2_scale, scale_dtypes, (E, K, N // BLOCK))
    device = w13.device
    for name, t in (("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if t.device != device:
            _fail(name, f"device {device} (w13's)", t.device)
    globals_ = {}
    for name, g in (("w13_global_scale", w13_global_scale), ("w2_global_scale", w2_global_scale)):
        if g is None:
            continue
        if not isinstance(g, torch.Tensor) or not g.is_floating_point() or g.numel() != E:
            _fail(name, f"a float tensor of {E} per-expert scales", getattr(g, "shape", g))
        if g.device != device:
            _fail(name, f"device {device} (w13's)", g.device)
        globals_[name] = g.reshape(E).to(torch.float32).contiguous()
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        _fail("top_k", "a positive int", repr(top_k))
    if w13_layout not in LAYOUTS:
        _fail("w13_layout", f"one of {LAYOUTS}", repr(w13_layout))
    if activation not in ACTIVATIONS:
        _fail("activation", f"one of {ACTIVATIONS}", repr(activation))
    if swiglu_limit is not None:
        if isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, (int, float)) or not (
            math.isfinite(swiglu_limit) and swiglu_limit > 0
        ):
            _fail("swiglu_limit", "None or a finite float > 0", repr(swiglu_limit))
        swiglu_limit = float(swiglu_limit)
    if isinstance(expert_offset, bool) or not isinstance(expert_offset, int) or expert_offset < 0:
        _fail("expert_offset", "an int >= 0", repr(expert_offset))
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        _fail("max_tokens", "a positive int", repr(max_tokens))
    capacities = plan_capacities(max_tokens, decode_token_counts)

    w13_sb = scale_bytes(w13_scale)
    w2_sb = scale_bytes(w2_scale)
    if device.type != "meta":  # a meta model has no bytes to check
        for name, sb in (("w13_scale", w13_sb), ("w2_scale", w2_sb)):
            if bool((sb == 255).any()):
                bad = (sb == 255).nonzero()[0].tolist()
                _fail(name, "E8M0 bytes < 255 (255 encodes NaN)", f"255 at index {bad}")
        for name, g in globals_.items():
            if not bool(torch.isfinite(g).all()):
                _fail(name, "finite values", "non-finite")

    geometry = Geometry(
        num_experts=E,
        hidden_size=K,
        intermediate_size=N,
        top_k=top_k,
        w13_layout=w13_layout,
        activation=activation,
        swiglu_limit=swiglu_limit,
        has_global_scales=bool(globals_),
        device=device,
        deterministic=bool(deterministic),
    )
    spec = ExpertsSpec(
        geometry=geometry,
        w13=w13.view(torch.uint8),
        w13_scale=w13_sb,
        w2=w2.view(torch.uint8),
        w2_scale=w2_sb,
        w13_global_scale=globals_.get("w13_global_scale"),
        w2_global_scale=globals_.get("w2_global_scale"),
        expert_offset=expert_offset,
        max_tokens=max_tokens,
        capacities=capacities,
        options=dict(backend_options),
        decode_token_counts=tuple(sorted(set(decode_token_counts))),
    )
    if device.type == "meta":
        # A model built on the meta device traces through the fake kernels; nothing runs.
        module = backends.load("reference")
    else:
        module = backends.select(backend, device)
    state = module.prepare(spec)
    if hasattr(module, "planned_capacities"):
        # A backend may plan other token counts than asked (b12x drops those above its per-launch
        # limit): the handle records what it planned, and the top count is its chunk size.
        spec.capacities = tuple(module.planned_capacities(state))
        spec.max_tokens = spec.capacities[-1]
    memory = module.memory_report(state) if hasattr(module, "memory_report") else {}
    return PreparedExperts(spec=spec, backend_name=module.NAME, run=module.run, state=state, memory=memory)
