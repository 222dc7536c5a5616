"""The b12x backend's decisions that need no GPU and no b12x: pure functions, tested directly.

* which token counts get a prepared plan (exact decode counts, a prefill ladder, the top one);
* which of them survive b12x's per-launch token limit, and so which one is the chunk size;
* the per-capacity plan table (b12x ``MoeDecodeConfig`` pins) and its default;
* which capacities are autotuned;
* where the autotuner's choices are persisted;
* whether a geometry repacks in place, whether a device and a b12x version can run.

``backends/b12x.py`` turns these answers into b12x calls; nothing here imports b12x or touches a
device, so every rule is checked on the CPU.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

# b12x versions this backend was written and checked against: [MIN, BELOW).
MIN_VERSION = (1, 5)
BELOW_VERSION = (2, 0)

# The default prefill ladder starts here when the caller gives exact decode counts (see
# ``prefill_ladder``); below it the exact counts cover decode.
LADDER_START = 128

# b12x's E8M0 scale repack clamps scale bytes to this value (2**120); larger bytes would change
# the weights, so prepare refuses them.
MAX_SCALE_BYTE = 247

PLANNERS = ("internal", "triton")
TILE_M = (16, 32, 64, 128)


# ------------------------------------------------------------------------------------ capacities
def _positive_ints(name: str, values: Iterable[int]) -> tuple[int, ...]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"prepare_experts: {name}: expected positive ints, got {v!r}")
        out.append(v)
    return tuple(out)


def exact_decode_capacities(
    decode_token_counts: Sequence[int] = (),
    graph_batch_sizes: Sequence[int] = (),
    rows_per_request: Sequence[int] = (1,),
) -> tuple[int, ...]:
    """The exact token counts decode runs at: the given counts plus every batch size times every
    row count a request contributes (e.g. CUDA-graph batch sizes x (draft rows, verify rows))."""
    counts = set(_positive_ints("decode_token_counts", decode_token_counts))
    sizes = _positive_ints("graph_batch_sizes", graph_batch_sizes)
    rows = _positive_ints("rows_per_request", rows_per_request)
    counts.update(b * r for b in sizes for r in rows)
    return tuple(sorted(counts))


def prefill_ladder(max_tokens: int, start: int = 1) -> tuple[int, ...]:
    """Powers of two from ``start`` (rounded up to one) below ``max_tokens``, then ``max_tokens``."""
    p = 1
    while p < start:
        p *= 2
    ladder = []
    while p < max_tokens:
        ladder.append(p)
        p *= 2
    return tuple(ladder) + (max_tokens,)


def planned_capacities(max_tokens: int, exact: Sequence[int], ladder: Sequence[int]) -> tuple[int, ...]:
    """Sorted union of the exact counts, the ladder and ``max_tokens`` (always the top)."""
    ladder = _positive_ints("prefill_ladder", ladder)
    for name, values in (("decode capacities", exact), ("prefill_ladder", ladder)):
        over = [v for v in values if v > max_tokens]
        if over:
            raise ValueError(f"prepare_experts: {name}: expected counts <= max_tokens ({max_tokens}), got {over}")
    return tuple(sorted(set(exact) | set(ladder) | {max_tokens}))


def split_by_launch_limit(limits: Mapping[int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``limits``: {capacity: the most tokens its plan runs in one launch}.

    Returns ``(kept, dropped)``, sorted. A capacity is kept when one launch runs it; the largest
    kept one is the chunk size, so every chunk the handle issues has a plan and scratch for it.
    """
    kept = tuple(sorted(c for c, lim in limits.items() if c <= lim))
    dropped = tuple(sorted(c for c in limits if c not in kept))
    if not kept:
        raise ValueError(f"no planned capacity fits b12x's per-launch token limit (capacity: limit {dict(limits)})")
    return kept, dropped


def capacity_index(capacities: Sequence[int], table_rows: int) -> list[int]:
    """``index[m]`` = position in ``capacities`` of the smallest capacity >= m, for m in
    ``[0, table_rows]`` (m = 0 maps to the first); the op looks a plan up in O(1) with it."""
    caps = sorted(capacities)
    return [min(bisect.bisect_left(caps, m), len(caps) - 1) for m in range(table_rows + 1)]


# ------------------------------------------------------------------------------------ plan table
@dataclasses.dataclass(frozen=True)
class PlanPin:
    """A pinned b12x dynamic plan: route planner, max active clusters (None: b12x's), tile rows."""

    planner: str
    max_active_clusters: int | None
    tile_m: int

    def __str__(self):
        mac = "none" if self.max_active_clusters is None else self.max_active_clusters
        return f"{self.planner}:{mac}:{self.tile_m}"


@dataclasses.dataclass(frozen=True)
class PlanRule:
    """Capacities ``lo..hi`` (at ``top_k``, or any) run ``pin``; ``pin=None`` keeps b12x's heuristic."""

    lo: int
    hi: int
    top_k: int | None
    pin: PlanPin | None

    def __str__(self):
        k = "" if self.top_k is None else f"@k{self.top_k}"
        return f"{self.lo}-{self.hi}{k}={'heur' if self.pin is None else self.pin}"


# At <= 8 rows b12x's heuristic picks its `micro` plan, which streams one expert slice per
# (token, slot); the `dynamic` plan streams each distinct expert once. On compact N64 geometries the
# seed adapter measured the pinned dynamic plan faster at decode (its note: 523 -> 349 us a call).
DEFAULT_SMALL_PIN = PlanPin("triton", 48, 16)
DEFAULT_TABLE_TEXT = f"1-8={DEFAULT_SMALL_PIN}"

_RULE = re.compile(r"^(\d+)(?:-(\d+))?(?:@k(\d+))?=(.+)$")


def _parse_pin(text: str, item: str) -> PlanPin | None:
    if text == "heur":
        return None
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"bad plan {item!r}: expected <planner>:<mac|none>:<tile_m> or heur")
    planner, mac, tile = parts
    if planner not in PLANNERS:
        raise ValueError(f"bad plan {item!r}: planner must be one of {PLANNERS}")
    try:
        mac_v = None if mac == "none" else int(mac)
        tile_v = int(tile)
    except ValueError:
        raise ValueError(f"bad plan {item!r}: max active clusters and tile rows must be ints") from None
    if mac_v is not None and mac_v < 1:
        raise ValueError(f"bad plan {item!r}: max active clusters must be >= 1 or none")
    if tile_v not in TILE_M:
        raise ValueError(f"bad plan {item!r}: tile rows must be one of {TILE_M}")
    return PlanPin(planner, mac_v, tile_v)


def parse_plan_table(table: str | Sequence[str]) -> tuple[PlanRule, ...]:
    """``"lo-hi[@k<top_k>]=<planner>:<mac|none>:<tile_m>"`` or ``"...=heur"`` entries, comma
    separated (or a sequence of entries); a single count ``n`` means ``n-n``. First match wins."""
    items = table.split(",") if isinstance(table, str) else list(table)
    rules = []
    for raw in items:
        if not isinstance(raw, str):
            raise ValueError(f"prepare_experts: plan_table: expected strings, got {raw!r}")
        item = raw.replace(" ", "")
        if not item:
            continue
        m = _RULE.match(item)
        if m is None:
            raise ValueError(f"prepare_experts: plan_table: bad entry {raw!r} (expected lo-hi[@kK]=planner:mac:tile or =heur)")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if lo < 1 or hi < lo:
            raise ValueError(f"prepare_experts: plan_table: bad range in {raw!r}")
        try:
            pin = _parse_pin(m.group(4), raw)
        except ValueError as exc:
            raise ValueError(f"prepare_experts: plan_table: {exc}") from None
        rules.append(PlanRule(lo, hi, int(m.group(3)) if m.group(3) else None, pin))
    return tuple(rules)


def is_compact_n64(intermediate_size: int) -> bool:
    """b12x's compact N64 W4A8 geometry: N an odd multiple of 64 (e.g. 576 = 4.5 x 128)."""
    return intermediate_size % 128 == 64


def plan_table_for(intermediate_size: int, table: str | Sequence[str] | None) -> tuple[PlanRule, ...]:
    """The caller's table, or by default the seed's <= 8 row pin on compact N64 geometries only."""
    if table is not None:
        return parse_plan_table(table)
    return parse_plan_table(DEFAULT_TABLE_TEXT) if is_compact_n64(intermediate_size) else ()


def match_plan(rules: Sequence[PlanRule], capacity: int, top_k: int, deterministic: bool = False) -> PlanPin | None:
    """The pin for this capacity (first matching rule), or None for b12x's heuristic. Under
    deterministic output a ``triton`` route planner becomes ``internal`` (b12x refuses the Triton
    planner for deterministic queries)."""
    for rule in rules:
        if rule.lo <= capacity <= rule.hi and (rule.top_k is None or rule.top_k == top_k):
            pin = rule.pin
            if pin is not None and deterministic and pin.planner == "triton":
                pin = dataclasses.replace(pin, planner="internal")
            return pin
    return None


def autotuned_capacities(autotune, exact: Sequence[int], capacities: Sequence[int],
                         pinned: Iterable[int], deterministic: bool) -> tuple[int, ...]:
    """Which capacities b12x's PreparationSession races (the others take its cached or heuristic
    choice). ``autotune``: ``"decode"`` (the exact decode counts), ``True`` (all), ``False`` (none).
    Pinned capacities are never raced; nor is anything under deterministic output (b12x's race
    cannot compile the deterministic top-k sum kernel)."""
    if autotune not in ("decode", True, False):
        raise ValueError(f"prepare_experts: autotune: expected 'decode', True or False, got {autotune!r}")
    if autotune is False or deterministic:
        return ()
    pool = set(exact) if autotune == "decode" else set(capacities)
    return tuple(sorted((pool & set(capacities)) - set(pinned)))


# ------------------------------------------------------------------------------------ cache dir
CACHE_ENV = "B12X_OPS_CACHE_DIR"


def default_cache_root(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "b12x-ops"


def resolve_cache_dir(explicit: str | os.PathLike | None, b12x_default: Path,
                      env: Mapping[str, str] | None = None) -> Path:
    """Where the autotuner's selections persist: ``explicit``, else ``$B12X_OPS_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/b12x-ops`` (``~/.cache/b12x-ops``), with ``b12x-preparation`` below it.

    ``b12x_default`` is the directory b12x itself would use (shared by every program on the
    machine that runs b12x); choosing it is refused, so another program's selections never
    decide ours and ours never overwrite theirs."""
    if explicit is not None:
        path = Path(explicit)
    else:
        path = default_cache_root(env) / "b12x-preparation"
    path = path.expanduser()
    if _same_path(path, Path(b12x_default).expanduser()):
        raise ValueError(
            f"prepare_experts: cache_dir: expected a directory of b12x-ops' own, got {str(path)!r}, "
            f"b12x's shared default (set cache_dir= or ${CACHE_ENV})"
        )
    return path


def _same_path(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


# ------------------------------------------------------------------------------------ support checks
def device_reason(kind: str, capability: tuple[int, int] | None = None, name: str | None = None) -> str | None:
    """Why a device cannot run b12x's kernels (they are built for SM120/SM121), or None."""
    if kind != "cuda":
        return f"needs an SM120/SM121 GPU, found {kind}"
    if capability is None:
        return "needs an SM120/SM121 GPU, found no usable CUDA device"
    major, minor = capability
    if major == 12 and minor in (0, 1):
        return None
    label = f"sm_{major}{minor}" + (f" ({name})" if name else "")
    return f"needs an SM120/SM121 GPU, found {label}"


def parse_version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if m is None:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def version_reason(module: str, version: str | None) -> str | None:
    """Why this b12x version is refused, or None. An unknown version (a source checkout such as
    ``b12x_next``) is accepted here: the API check at prepare decides."""
    v = parse_version(version)
    if v is None:
        return None
    lo = ".".join(map(str, MIN_VERSION))
    hi = ".".join(map(str, BELOW_VERSION))
    if not (MIN_VERSION <= v[:2] < BELOW_VERSION):
        return f"{module} {version} is outside the versions b12x-ops supports (>= {lo}, < {hi})"
    return None


def in_place_reason(hidden_size: int, intermediate_size: int) -> str | None:
    """Why b12x cannot repack this geometry in place (it would allocate a second copy), or None.

    b12x's W4A8 repack is exact (in place) for compact N64 geometries (N % 128 == 64, K % 64 == 0)
    and for whole tiles (N % 128 == 0 and K % 256 == 0: W2's K rows fill 256-row tiles); other sizes
    take a ceil-tiled path that writes fresh memory."""
    k, n = hidden_size, intermediate_size
    if is_compact_n64(n):
        return None if k % 64 == 0 else f"K = {k} is not a multiple of 64 (compact N64 geometry, N = {n})"
    if n % 128 == 0:
        return None if k % 256 == 0 else f"K = {k} is not a multiple of 256 (N = {n})"
    return f"N = {n} is neither a multiple of 128 nor an odd multiple of 64"
