"""The b12x backend: b12x's own fused W4A8 MoE on SM120/SM121 (RTX PRO 6000, RTX 5090, DGX Spark).

Only this module imports the b12x library (as ``b12x_next`` when present, else ``b12x``), lazily,
at prepare; ``unavailable_reason`` only looks for it. It follows b12x's canonical lifecycle
(``b12x.moe.fused_moe``):

1. ``plan_weights``: MXFP4 E8M0 K32 source in the handle's W13 layout, A8 activations (in-kernel
   MXFP8) with SiLU and the swiglu limit, the layer's geometry;
2. ``prepare_weights``: the checkpoint bytes are repacked IN PLACE into b12x's QMMA layout (the
   caller's ``w13``/``w2``/scale tensors become the prepared storage; prepare refuses when b12x
   would allocate a second copy);
3. ``plan_execution``: one declaration per planned token count (its capacity);
4. a ``PreparationSession`` per geometry prepares every capacity, autotunes the exact decode
   counts and persists its choices in b12x-ops' own cache directory, then is frozen (b12x refuses
   to resolve kernels afterwards, so no op call can compile);
5. at run time the op binds the live tensors to the capacity's prepared plan and runs it.

Every layer of one geometry (experts, sizes, top-k, layout, limit, determinism, options) shares
the plan set and one scratch arena: the first layer's prepare pays for planning, tuning and
warm-up; later layers only repack their weights.

Options (``prepare_experts(..., **options)`` with ``backend="b12x"``, or ``"auto"`` on SM12x):

* ``graph_batch_sizes=()`` and ``rows_per_request=(1,)``: the batch sizes an engine captures in
  CUDA graphs and the rows each request brings (e.g. ``(B, B + 1)`` draft/verify rows of
  speculative decoding); every product is an exact decode capacity, like ``decode_token_counts``.
* ``prefill_ladder=None``: the larger capacities, each <= ``max_tokens``; ``max_tokens`` is always
  added. Default: powers of two up to ``max_tokens`` (from 1, or from 128 when exact decode counts
  are given). A batch runs on the smallest capacity >= its rows.
* ``plan_table=None``: per-capacity b12x plan pins, ``"lo-hi[@k<top_k>]=<planner>:<mac|none>:<tile_m>"``
  (a dynamic, grouped-route ``MoeDecodeConfig``) or ``"lo-hi=heur"`` (b12x's own choice), comma
  separated, first match wins. The default pins ``1-8=triton:48:16`` on compact N64 geometries
  (N % 128 == 64) and nothing elsewhere. Under ``deterministic=True`` a ``triton`` planner becomes
  ``internal``.
* ``autotune="decode"``: race the exact decode capacities (``True``: every unpinned capacity,
  ``False``: none; b12x's cached or heuristic choice elsewhere). Nothing is raced under
  ``deterministic=True``.
* ``cache_dir=None``: where the selections persist; default ``$B12X_OPS_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/b12x-ops`` (``~/.cache/b12x-ops``), subdirectory ``b12x-preparation``. b12x's
  own default directory is refused.
* ``cache_only=False``: take selections from the cache only, never race.
* ``compile_workers=None``: b12x's compiler processes (None: b12x's default, 0: in-process).
* ``warmup=True``: run every plan once at prepare.
* ``freeze=True``: freeze the geometry's session after preparation. b12x's freeze is process-wide
  (any b12x kernel resolution then fails); this module lifts its own freezes while it prepares a
  new geometry. Pass ``False`` when other b12x users in the process still need to compile.
* ``direct_ids=True``: at ``expert_offset == 0`` (EP = 1, where every id is local) int32 ids and
  float32 weights go to b12x as they are: its kernels skip ids outside ``[0, E)``, so padding (-1)
  needs no rewrite. Otherwise (EP > 1, other dtypes, deterministic output) the package's EP remap
  kernel maps global ids to local ones first.

Capacities above b12x's per-launch token limit for the geometry are dropped with a warning; the
top remaining capacity becomes the handle's ``max_tokens``, the chunk size for larger batches.

Refused at prepare, with the reason: non-unit global scales (b12x's W4A8 takes none), scale bytes
above 247 (b12x clamps them), geometries b12x cannot repack in place, non-contiguous weights, a b12x
version or API this module was not written for. ``x`` must be bfloat16.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch

from . import _b12x_plans as plans

NAME = "b12x"
INSTALL_HINT = "pip install b12x-ops[b12x]"
_MODULES = ("b12x_next", "b12x")

OPTIONS: dict[str, Any] = {
    "graph_batch_sizes": (),
    "rows_per_request": (1,),
    "prefill_ladder": None,
    "plan_table": None,
    "autotune": "decode",
    "cache_dir": None,
    "cache_only": False,
    "compile_workers": None,
    "warmup": True,
    "freeze": True,
    "direct_ids": True,
}


# ================================================================================== availability
def _cuda_identity(index: int | None) -> tuple[tuple[int, int] | None, str | None]:
    """``(capability, name)`` of a CUDA device (``None`` index: the current one), or Nones."""
    if not torch.cuda.is_available():
        return None, None
    try:
        return _cuda_identity_of(torch.cuda.current_device() if index is None else index)
    except (RuntimeError, AssertionError, ValueError):
        return None, None


@functools.lru_cache(maxsize=None)
def _cuda_identity_of(index: int) -> tuple[tuple[int, int], str]:
    return tuple(torch.cuda.get_device_capability(index)), torch.cuda.get_device_name(index)


def library_module() -> str | None:
    """The importable b12x module's name (``b12x_next`` first), found without importing it."""
    for name in _MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def library():
    """The b12x library module itself (``b12x_next`` first), or None: for version reports."""
    name = library_module()
    return importlib.import_module(name) if name is not None else None


def unavailable_reason(device: torch.device) -> str | None:
    device = torch.device(device)
    if device.type != "cuda":
        return plans.device_reason(device.type)
    capability, name = _cuda_identity(device.index)
    reason = plans.device_reason("cuda", capability, name)
    if reason is not None:
        return reason
    if library_module() is None:
        return f"the b12x library is not installed ({INSTALL_HINT})"
    return None


# ================================================================================== the b12x API
@dataclasses.dataclass(frozen=True)
class Api:
    """The loaded b12x modules this backend calls, after the version and API checks."""

    module: str
    version: str
    fm: Any  # <module>.moe.fused_moe
    prep: Any  # <module>.preparation
    default_cache_dir: Path  # where b12x itself persists selections (refused as ours)


def _dataclass_fields(obj) -> set[str]:
    try:
        return {f.name for f in dataclasses.fields(obj)}
    except TypeError:
        return set()


def _params(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


# What this backend calls, by name: drift in any of it is refused at prepare with the list.
_NEEDS_FM = {
    "plan_weights": ("source", "activation", "geometry"),
    "prepare_weights": (),
    "plan_execution": (),
    "bind": ("plan",),
    "run": ("binding",),
}
_NEEDS_FM_TYPES = {
    "PackedSource": ("format", "w13_layout"),
    "ActivationSpec": ("mode", "nonlinearity", "io_dtype", "swiglu_limit"),
    "MoEGeometry": ("num_experts", "hidden_size", "intermediate_size"),
    "PackedWeights": ("w13", "w2", "w13_block_scales", "w2_block_scales", "w13_global_scales", "w2_global_scales"),
    "ExecutionCapacity": ("max_tokens", "top_k"),
    "RoutingSpec": ("deterministic_output",),
    "MoeDecodeConfig": ("backend", "route_planner", "max_active_clusters", "dynamic_tile_m", "dynamic_route_mode"),
}
_NEEDS_ENUMS = {
    "PackedSourceFormat": ("MXFP4_E8M0_K32",),
    "W13Layout": ("W13", "W31"),
    "ActivationMode": ("A8",),
}
_NEEDS_SESSION = ("device", "autotune", "cache_dir", "namespace", "compile_workers", "cache_only")
_NEEDS_PREPARED_CALL = ("run", "output", "produce", "owners")


def api_drift(fm, prep) -> list[str]:
    """What this backend needs from ``fused_moe`` and ``preparation`` but does not find there."""
    missing = []
    for name, params in _NEEDS_FM.items():
        fn = getattr(fm, name, None)
        if not callable(fn):
            missing.append(f"fused_moe.{name}")
            continue
        got = _params(fn)
        missing += [f"fused_moe.{name}({p}=)" for p in params if p not in got and "kwargs" not in got]
    for name, fields in _NEEDS_FM_TYPES.items():
        typ = getattr(fm, name, None)
        got = _dataclass_fields(typ) if typ is not None else set()
        if typ is None:
            missing.append(f"fused_moe.{name}")
        else:
            missing += [f"fused_moe.{name}.{f}" for f in fields if f not in got]
    for name, members in _NEEDS_ENUMS.items():
        enum = getattr(fm, name, None)
        if enum is None:
            missing.append(f"fused_moe.{name}")
        else:
            missing += [f"fused_moe.{name}.{m}" for m in members if not hasattr(enum, m)]
    session = getattr(prep, "PreparationSession", None)
    if session is None:
        missing.append("preparation.PreparationSession")
    else:
        got = _params(session)
        missing += [f"PreparationSession({p}=)" for p in _NEEDS_SESSION if p not in got]
        missing += [f"PreparationSession.{m}" for m in ("prepare", "freeze", "close") if not callable(getattr(session, m, None))]
    call = getattr(prep, "PreparedCall", None)
    if call is None:
        missing.append("preparation.PreparedCall")
    else:
        got = _dataclass_fields(call)
        missing += [f"PreparedCall.{f}" for f in _NEEDS_PREPARED_CALL if f not in got]
    return missing


def _version_of(name: str, pkg) -> str:
    from importlib import metadata

    for dist in (name, name.replace("_", "-")):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    version = getattr(pkg, "__version__", None)
    if version:
        return str(version)
    try:  # a source checkout (the seeds' b12x_next) records its commit instead
        return "commit " + (Path(pkg.__file__).parent / "SOURCE_COMMIT").read_text().strip()[:12]
    except OSError:
        return "unknown"


def _b12x_default_cache(name: str) -> Path:
    compiler = importlib.import_module(f"{name}._lib.compiler")
    return Path(compiler._cute_compile_cache_dir()) / "preparation"


_API: list[Api] = []


def load_api() -> Api:
    """Import b12x (``b12x_next`` first), check its version and API; refuse with the reason."""
    if _API:
        return _API[0]
    name = library_module()
    if name is None:
        raise RuntimeError(f"backend 'b12x': the b12x library is not installed ({INSTALL_HINT})")
    try:
        pkg = importlib.import_module(name)
        fm = importlib.import_module(f"{name}.moe.fused_moe")
        prep = importlib.import_module(f"{name}.preparation")
    except Exception as exc:
        raise RuntimeError(f"backend 'b12x': cannot import {name}'s fused MoE API ({exc!r})") from exc
    version = _version_of(name, pkg)
    reason = plans.version_reason(name, version)
    if reason is not None:
        raise RuntimeError(f"backend 'b12x': {reason} ({INSTALL_HINT})")
    missing = api_drift(fm, prep)
    if missing:
        raise RuntimeError(
            f"backend 'b12x': {name} {version} lacks the API this backend was written for "
            f"(missing: {', '.join(missing)}); install a supported version ({INSTALL_HINT})"
        )
    try:
        default_cache = _b12x_default_cache(name)
    except Exception as exc:  # noqa: BLE001 - any failure here is drift
        raise RuntimeError(f"backend 'b12x': cannot find {name}'s default cache directory ({exc!r})") from exc
    api = Api(module=name, version=version, fm=fm, prep=prep, default_cache_dir=default_cache)
    _API.append(api)
    return api


# ================================================================================== options
@dataclasses.dataclass(frozen=True)
class Options:
    exact: tuple[int, ...]
    capacities: tuple[int, ...]
    rules: tuple[plans.PlanRule, ...]
    tuned: tuple[int, ...]
    cache_dir: Path
    cache_only: bool
    compile_workers: int | None
    warmup: bool
    freeze: bool
    direct_ids: bool


def _bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"prepare_experts: {name}: expected True or False, got {value!r}")
    return value


def parse_options(spec, default_cache_dir: Path, env=None) -> Options:
    """Validate the b12x options of ``prepare_experts`` and decide the capacity set."""
    unknown = sorted(set(spec.options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"prepare_experts: backend 'b12x' takes the options {sorted(OPTIONS)}, got unknown {unknown}")
    o = {**OPTIONS, **spec.options}
    g = spec.geometry
    exact = plans.exact_decode_capacities(
        getattr(spec, "decode_token_counts", ()), o["graph_batch_sizes"], o["rows_per_request"])
    over = [c for c in exact if c > spec.max_tokens]
    if over:
        raise ValueError(f"prepare_experts: graph_batch_sizes x rows_per_request: expected counts <= max_tokens ({spec.max_tokens}), got {over}")
    if o["prefill_ladder"] is None:
        ladder = plans.prefill_ladder(spec.max_tokens, plans.LADDER_START if exact else 1)
    else:
        ladder = tuple(o["prefill_ladder"])
    capacities = plans.planned_capacities(spec.max_tokens, exact, ladder)
    rules = plans.plan_table_for(g.intermediate_size, o["plan_table"])
    pinned = [c for c in capacities if plans.match_plan(rules, c, g.top_k, g.deterministic) is not None]
    tuned = plans.autotuned_capacities(o["autotune"], exact, capacities, pinned, g.deterministic)
    workers = o["compile_workers"]
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise ValueError(f"prepare_experts: compile_workers: expected None or an int >= 0, got {workers!r}")
    return Options(
        exact=exact, capacities=capacities, rules=rules, tuned=tuned,
        cache_dir=plans.resolve_cache_dir(o["cache_dir"], default_cache_dir, env),
        cache_only=_bool("cache_only", o["cache_only"]), compile_workers=workers,
        warmup=_bool("warmup", o["warmup"]), freeze=_bool("freeze", o["freeze"]),
        direct_ids=_bool("direct_ids", o["direct_ids"]),
    )


# ================================================================================== checks
def check_weights(spec) -> None:
    """What b12x needs of the checkpoint bytes beyond the package's own checks; raises ValueError."""
    g = spec.geometry
    reason = plans.in_place_reason(g.hidden_size, g.intermediate_size)
    if reason is not None:
        raise ValueError(f"prepare_experts: w13: expected sizes b12x repacks in place, got {reason}")
    for name in ("w13", "w13_scale", "w2", "w2_scale"):
        t = getattr(spec, name)
        if not t.is_contiguous():
            raise ValueError(f"prepare_experts: {name}: expected a contiguous tensor (b12x repacks it in place), got strides {list(t.stride())}")
    for name in ("w13_global_scale", "w2_global_scale"):
        t = getattr(spec, name)
        if t is not None and not bool((t == 1.0).all()):
            raise ValueError(f"prepare_experts: {name}: expected None or all ones (b12x's W4A8 MXFP4 takes no global scales), got other values")
    for name in ("w13_scale", "w2_scale"):
        sb = getattr(spec, name)
        bad = sb > plans.MAX_SCALE_BYTE
        if bool(bad.any()):
            where = bad.nonzero()[0].tolist()
            raise ValueError(
                f"prepare_experts: {name}: expected E8M0 bytes <= {plans.MAX_SCALE_BYTE} (b12x clamps larger "
                f"ones), got {int(sb[tuple(where)])} at index {where}"
            )


# ================================================================================== weights
def plan_weights(api: Api, geometry):
    """b12x's weight plan for a handle geometry: MXFP4 E8M0 K32, A8 SiLU with the swiglu limit."""
    fm = api.fm
    return fm.plan_weights(
        source=fm.PackedSource(format=fm.PackedSourceFormat.MXFP4_E8M0_K32, w13_layout=fm.W13Layout(geometry.w13_layout)),
        activation=fm.ActivationSpec(
            mode=fm.ActivationMode.A8, nonlinearity=geometry.activation, io_dtype=torch.bfloat16,
            swiglu_limit=geometry.swiglu_limit,
        ),
        geometry=fm.MoEGeometry(
            num_experts=geometry.num_experts, hidden_size=geometry.hidden_size,
            intermediate_size=geometry.intermediate_size,
        ),
    )


def _storages(*tensors) -> tuple[int, ...]:
    return tuple(t.untyped_storage().data_ptr() for t in tensors)


def prepared_representation(experts):
    """The W4A8 tensors b12x prepared: ``(w13, w2, w13 scales, w2 scales)``."""
    rep = experts._impl.representation_for("w4a8_mx")
    return rep.w13_rp, rep.w2_rp, rep.w13_sfb, rep.w2_sfb


def repack_in_place(api: Api, weight_plan, w13, w13_scale, w2, w2_scale):
    """``prepare_weights`` on the checkpoint bytes; refuses unless the result lives in them."""
    before = _storages(w13, w2, w13_scale, w2_scale)
    ones = torch.ones(w13.shape[0], dtype=torch.float32, device=w13.device)
    experts = api.fm.prepare_weights(plan=weight_plan, weights=api.fm.PackedWeights(
        w13=w13, w2=w2, w13_block_scales=w13_scale, w2_block_scales=w2_scale,
        w13_global_scales=ones, w2_global_scales=ones,
    ))
    try:
        after = _storages(*prepared_representation(experts))
    except Exception as exc:  # noqa: BLE001 - an unreadable representation is drift
        raise RuntimeError(f"backend 'b12x': cannot inspect {api.module}'s prepared W4A8 weights ({exc!r})") from exc
    if after != before:
        E, two_n, k_half = w13.shape
        raise RuntimeError(
            f"backend 'b12x': {api.module} did not repack E={E} K={2 * k_half} N={two_n // 2} in place "
            f"(a second copy of the experts would double their memory); refusing"
        )
    return experts


def decode_config(api: Api, pin: plans.PlanPin):
    return api.fm.MoeDecodeConfig(
        backend="dynamic", route_planner=pin.planner, max_active_clusters=pin.max_active_clusters,
        dynamic_tile_m=pin.tile_m, dynamic_route_mode="grouped",
    )


def declare_plans(api: Api, experts, capacities, top_k: int, rules, deterministic: bool) -> dict:
    """One ``plan_execution`` declaration per capacity: ``{capacity: (plan, pin or None)}``."""
    fm = api.fm
    routing = fm.RoutingSpec(deterministic_output=True) if deterministic else None
    out = {}
    for cap in capacities:
        pin = plans.match_plan(rules, cap, top_k, deterministic)
        out[cap] = (
            fm.plan_execution(
                experts=experts, capacity=fm.ExecutionCapacity(max_tokens=cap, top_k=top_k), routing=routing,
                override=None if pin is None else decode_config(api, pin),
            ),
            pin,
        )
    return out


# ================================================================================== plan sets
_ALIGN = 256


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclasses.dataclass
class _Entry:
    capacity: int
    plan: Any
    state: Any  # b12x's prepared state for the first layer's experts
    pin: plans.PlanPin | None
    tuned: bool
    source: str
    config: str
    launch_limit: int
    scratch: tuple = ()


class PlanSet:
    """One geometry's prepared plans, their session and one scratch arena, shared by its layers."""

    def __init__(self, api: Api, spec, opts: Options, key):
        self.api = api
        self.key = key
        self.geometry = spec.geometry
        self.device = spec.geometry.device
        self.opts = opts
        self.entries: dict[int, _Entry] = {}
        self.capacities: tuple[int, ...] = ()
        self.dropped: tuple[int, ...] = ()
        self.index: list[int] = []
        self.arena: torch.Tensor | None = None
        self.session = None
        self.report: dict[str, Any] = {}
        self.layers = 0

    # ---- build
    def build(self, experts) -> None:
        api, g, opts = self.api, self.geometry, self.opts
        t0 = time.perf_counter()
        self.session = api.prep.PreparationSession(
            device=self.device, autotune=bool(opts.tuned), cache_dir=str(opts.cache_dir),
            namespace={"client": "b12x-ops"}, compile_workers=opts.compile_workers, cache_only=opts.cache_only,
        )
        weakref.finalize(self, _close_session, self.session)
        declared = declare_plans(api, experts, opts.capacities, g.top_k, opts.rules, g.deterministic)
        with _freezes_lifted():
            for cap, (plan, pin) in declared.items():
                self._prepare_one(cap, plan, pin)
        prepared_s = time.perf_counter() - t0
        limits = {cap: e.launch_limit for cap, e in self.entries.items()}
        self.capacities, self.dropped = plans.split_by_launch_limit(limits)
        if self.dropped:
            warnings.warn(
                f"b12x_ops: E={g.num_experts} K={g.hidden_size} N={g.intermediate_size} top_k={g.top_k}: "
                f"capacities {list(self.dropped)} exceed b12x's per-launch token limit "
                f"({min(limits[c] for c in self.dropped)}) and are dropped; larger batches run in chunks "
                f"of {self.capacities[-1]}",
                RuntimeWarning, stacklevel=4,
            )
            for cap in self.dropped:
                del self.entries[cap]
        self._allocate_arena()
        self.index = plans.capacity_index(self.capacities, self.capacities[-1])
        if opts.warmup:
            self._warm(experts)
        if opts.freeze:
            self.session.freeze()
            _FROZEN.add(self.session)
        self.report = {
            "b12x": f"{api.module} {api.version}",
            "geometry": dict(E=g.num_experts, K=g.hidden_size, N=g.intermediate_size, top_k=g.top_k,
                             layout=g.w13_layout, swiglu_limit=g.swiglu_limit, deterministic=g.deterministic),
            "capacities": list(self.capacities), "chunk": self.capacities[-1], "dropped": list(self.dropped),
            "launch_limits": {c: limits[c] for c in sorted(limits)},
            "tuned": [c for c in self.capacities if self.entries[c].tuned],
            "pins": {c: str(e.pin) for c, e in self.entries.items() if e.pin is not None},
            "sources": {c: self.entries[c].source for c in self.capacities},
            "cache_dir": str(opts.cache_dir), "frozen": opts.freeze, "warmed": opts.warmup,
            "scratch_bytes": int(self.arena.numel()),
            "prepare_s": round(prepared_s, 2), "total_s": round(time.perf_counter() - t0, 2),
        }

    def _prepare_one(self, cap: int, plan, pin) -> None:
        api, g = self.api, self.geometry
        race = _race_call(api, cap, g) if cap in self.opts.tuned else None
        request = plan.request(
            name=f"b12x_ops.moe.E{g.num_experts}.K{g.hidden_size}.N{g.intermediate_size}.k{g.top_k}.M{cap}",
            prepare_call=_no_prime(api), benchmark_call=race,
        )
        try:
            self.session.prepare((request,), autotune=race is not None)
        except Exception as exc:
            raise RuntimeError(
                f"backend 'b12x': {api.module} could not prepare the capacity-{cap} plan for E={g.num_experts} "
                f"K={g.hidden_size} N={g.intermediate_size} top_k={g.top_k}"
                f"{' with deterministic output' if g.deterministic else ''}"
                f"{f' pinned to {pin}' if pin else ''}: {exc}"
            ) from exc
        prepared = plan.prepared
        state = getattr(prepared, "state", None)
        if state is None or "experts" not in _dataclass_fields(state) or not callable(getattr(state, "bind", None)):
            raise RuntimeError(f"backend 'b12x': {api.module}'s prepared MoE state changed shape (no experts/bind); refusing")
        selection = prepared.selection
        launch_plan = getattr(getattr(state, "scratch", None), "launch_plan", None)
        limit = getattr(launch_plan, "max_tokens_per_launch", None)
        self.entries[cap] = _Entry(
            capacity=cap, plan=plan, state=state, pin=pin, tuned=race is not None,
            source=str(getattr(selection, "source", "")), config=str(getattr(selection, "config", "")),
            launch_limit=int(limit) if limit else cap,
        )

    def _allocate_arena(self) -> None:
        """One arena for the geometry: every plan's scratch is carved from its start (plans of one
        device run in stream order, never at the same time)."""
        specs = {cap: tuple(self.entries[cap].plan.scratch_specs()) for cap in self.capacities}
        need = max(sum(_aligned(s.nbytes) for s in ss) for ss in specs.values())
        self.arena = torch.empty(max(need, _ALIGN), dtype=torch.uint8, device=self.device)
        for cap, ss in specs.items():
            views, off = [], 0
            for s in ss:
                views.append(self.arena[off:off + s.nbytes].view(s.dtype).view(tuple(s.shape)))
                off += _aligned(s.nbytes)
            self.entries[cap].scratch = tuple(views)

    def _warm(self, experts) -> None:
        g, dev = self.geometry, self.device
        top = self.capacities[-1]
        x = torch.zeros(top, g.hidden_size, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(x)
        ids = torch.zeros(top, g.top_k, dtype=torch.int32, device=dev)
        w = torch.zeros(top, g.top_k, dtype=torch.float32, device=dev)
        for cap in self.capacities:
            e = self.entries[cap]
            binding = dataclasses.replace(
                e.state.bind(scratch=e.scratch, a=x[:cap], topk_ids=ids[:cap], topk_weights=w[:cap], output=out[:cap]),
                plan=e.plan,
            )
            self.api.fm.run(binding=binding)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


def _no_prime(api: Api):
    def factory(state):
        return api.prep.PreparedCall(run=lambda: None)

    return factory


def _race_call(api: Api, cap: int, g):
    """A benchmark call for b12x's autotuner: ``cap`` rows of random activations, each routed to
    distinct experts with softmax weights, on scratch of its own."""
    dev, K, E, k = g.device, g.hidden_size, g.num_experts, g.top_k

    def factory(state):
        gen = torch.Generator(device=dev)
        gen.manual_seed(20_000 + cap)
        scratch = tuple(torch.empty(tuple(s.shape), dtype=s.dtype, device=dev) for s in state.scratch.scratch_specs())
        x = torch.randn(cap, K, generator=gen, device=dev).to(torch.bfloat16)
        pristine = x.clone()
        if E >= k:
            ids = torch.rand(cap, E, generator=gen, device=dev).argsort(dim=1)[:, :k]
        else:
            ids = torch.randint(0, E, (cap, k), generator=gen, device=dev)
        ids = ids.to(torch.int32).contiguous()
        w = torch.softmax(torch.randn(cap, k, generator=gen, device=dev), dim=1).contiguous()
        out = torch.empty(cap, K, dtype=torch.bfloat16, device=dev)
        binding = state.bind(scratch=scratch, a=x, topk_ids=ids, topk_weights=w, output=out)
        return api.prep.PreparedCall(
            run=lambda: state.run(binding), output=out, produce=lambda: x.copy_(pristine),
            owners=(scratch, x, pristine, ids, w, out, binding),
        )

    return factory


def _close_session(session) -> None:
    try:
        _FROZEN.discard(session)
        session.close()
    except Exception:  # noqa: BLE001 - finalizers must not raise (e.g. on another thread at exit)
        pass


_PLAN_SETS: "weakref.WeakValueDictionary[Any, PlanSet]" = weakref.WeakValueDictionary()
_FROZEN: "weakref.WeakSet[Any]" = weakref.WeakSet()


@contextlib.contextmanager
def _freezes_lifted():
    """b12x's freeze is a process-wide guard against kernel resolution. While a new geometry
    prepares, lift the guards of the sessions this module froze, and restore them after."""
    lifted = []
    try:
        for session in list(_FROZEN):
            guard = getattr(session, "_guard", None)
            if guard is None and not hasattr(session, "_guard"):
                raise RuntimeError(
                    "backend 'b12x': cannot prepare a new geometry after an earlier one froze b12x "
                    "(its PreparationSession changed); pass freeze=False"
                )
            if guard is not None:
                guard.__exit__(None, None, None)
                session._guard = None
                lifted.append(session)
        yield
    finally:
        for session in lifted:
            session.freeze()


# ================================================================================== per layer
@dataclasses.dataclass
class LayerState:
    """What one handle's op call reads: its plan set and this layer's binding per capacity."""

    plan_set: PlanSet
    experts: Any  # this layer's b12x PreparedExperts (owns the repacked checkpoint storage)
    launches: tuple  # per capacity position: (b12x state bound to this layer's experts, plan, scratch)
    index: list
    num_experts: int
    expert_offset: int
    direct: bool
    remap: Any
    launch: Any  # fused_moe.run
    weight_bytes: int


def _remap_kernel(device: torch.device):
    """The package's EP remap: the Triton kernel on a GPU (the op's own), else its torch twin."""
    if device.type == "cuda":
        try:
            from .triton.remap import ep_remap
        except ImportError:
            pass
        else:
            return ep_remap
    from .reference import ep_remap

    return ep_remap


def _plan_set_key(spec, opts: Options):
    g = dataclasses.replace(spec.geometry, has_global_scales=False)  # unit global scales only
    return (g, opts.capacities, opts.rules, opts.tuned, str(opts.cache_dir), opts.cache_only, opts.compile_workers)


def prepare(spec) -> LayerState:
    api = load_api()
    opts = parse_options(spec, api.default_cache_dir)
    check_weights(spec)
    g = spec.geometry
    weight_plan = plan_weights(api, g)
    experts = repack_in_place(api, weight_plan, spec.w13, spec.w13_scale, spec.w2, spec.w2_scale)
    key = _plan_set_key(spec, opts)
    plan_set = _PLAN_SETS.get(key)
    if plan_set is None:
        plan_set = PlanSet(api, spec, opts, key)
        plan_set.build(experts)
        _PLAN_SETS[key] = plan_set
    plan_set.layers += 1
    launches = []
    for cap in plan_set.capacities:
        e = plan_set.entries[cap]
        # The plans were prepared on the first layer's experts; a layer binds its own through a copy
        # of the prepared state (same programs and scratch plan, this layer's weights).
        state = e.state if e.state.experts is experts else dataclasses.replace(e.state, experts=experts)
        launches.append((state, e.plan, e.scratch))
    direct = opts.direct_ids and spec.expert_offset == 0 and not g.deterministic
    layer = LayerState(
        plan_set=plan_set, experts=experts, launches=tuple(launches), index=plan_set.index,
        num_experts=g.num_experts, expert_offset=spec.expert_offset, direct=direct, remap=_remap_kernel(g.device),
        launch=api.fm.run,
        weight_bytes=sum(t.numel() * t.element_size() for t in (spec.w13, spec.w13_scale, spec.w2, spec.w2_scale)),
    )
    if opts.warmup:  # compile the remap kernel now, not inside the first (maybe captured) call
        ids = torch.zeros(1, g.top_k, dtype=torch.int32, device=g.device)
        layer.remap(ids, torch.zeros(1, g.top_k, dtype=torch.float32, device=g.device), spec.expert_offset, g.num_experts)
    return layer


def planned_capacities(layer: LayerState) -> tuple[int, ...]:
    """The token counts this handle has plans for; the last is its chunk size."""
    return layer.plan_set.capacities


def run(layer: LayerState, x, topk_ids, topk_weights, out) -> None:
    m = x.shape[0]
    if m == 0:
        return
    if x.dtype is not torch.bfloat16:
        raise ValueError(f"b12x::moe_w4a8: x: expected bfloat16 (the b12x backend plans bf16 activations), got {x.dtype}")
    state, plan, scratch = layer.launches[layer.index[m]]
    if (layer.direct and topk_ids.dtype is torch.int32 and topk_weights.dtype is torch.float32
            and topk_ids.is_contiguous() and topk_weights.is_contiguous()):
        ids, w = topk_ids, topk_weights
    else:
        ids, w = layer.remap(topk_ids, topk_weights, layer.expert_offset, layer.num_experts)
    a = x if x.is_contiguous() else x.contiguous()
    dst = out if out.is_contiguous() else torch.empty_like(a)
    binding = dataclasses.replace(state.bind(scratch=scratch, a=a, topk_ids=ids, topk_weights=w, output=dst), plan=plan)
    layer.launch(binding=binding)
    if dst is not out:
        out.copy_(dst)


def memory_report(layer: LayerState) -> dict[str, int]:
    """Bytes on the device: the experts (repacked in the checkpoint's own storage, so no more than
    the checkpoint) and the geometry's scratch arena, shared by every layer of the geometry."""
    return {
        "device_bytes": layer.weight_bytes,
        "checkpoint_bytes": layer.weight_bytes,
        "shared_scratch_bytes": int(layer.plan_set.arena.numel()),
        "planned_capacities": len(layer.plan_set.capacities),
    }


def report(handle) -> dict[str, Any]:
    """The geometry report of a b12x handle: capacities, chunk, dropped capacities, launch limits,
    autotuned capacities, pins, selection sources, cache directory, timings, scratch bytes."""
    if getattr(handle, "backend", None) != NAME:
        raise ValueError(f"report: expected a handle of the b12x backend, got {getattr(handle, 'backend', handle)!r}")
    layer = handle._state
    return {**layer.plan_set.report, "layers": layer.plan_set.layers, "direct_ids": layer.direct,
            "expert_offset": layer.expert_offset}
