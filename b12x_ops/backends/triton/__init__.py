"""The Triton backend: our own W4A8 MX MoE kernels for CUDA GPUs of sm_80 and newer.

Options (``prepare_experts(..., backend="triton", **options)``):

* ``tune`` (bool, default True on a GPU): time a few configurations per planned token count once
  per geometry and GPU; results are cached on disk (``cache_dir``, else ``$B12X_OPS_CACHE_DIR``,
  else ``~/.cache/b12x_ops``) and reused by later processes. ``False`` uses the built-in defaults.
* ``cache_dir`` (str): where the tuning cache lives.
* ``gemv`` (bool or None, default None): the small-M GEMV path (one routed slot a program, no
  routing pass) serves token counts of at most ``plan.GEMV_MAX_TOKENS`` tokens and
  ``plan.GEMV_MAX_SLOTS`` slots (``tokens * top_k``; ``GEMV_MMA_MAX_TOKENS`` and ``GEMV_MMA_MAX_SLOTS``
  where it runs on mma.sync), the blocked tensor-core path the rest (the
  tuner may pick either below the bound); ``True`` uses GEMV for every planned count, ``False``
  never (benchmarks compare the two this way).
* ``ptx`` (bool or None, default None): on sm_90 the kernels decode MXFP4 with inline PTX
  (``mxtl.decode_repacked``) when the checkpoint's scale bytes allow it (in [2, 252]; in [2, 128],
  the usual case, its cheaper one-fma form); ``False`` uses the Triton-ops decode (a benchmark and
  debugging switch), which other GPUs' tl.dot kernels always take (``plan.ptx_status``: the asm's
  register order is the wgmma operand's); ``True`` on another GPU is refused. The mma.sync GEMV
  (``gluon_gemv``, sm_80 and newer: ``plan.gemv_mma_status``) lays out its own operands and decodes
  with the asm on every such GPU, under the same scale bytes, unless ``ptx`` is ``False``.
* ``frozen`` (bool, default True): after prepare, a call that would need a kernel not compiled at
  prepare raises instead of compiling (by construction every planned count is compiled).

The handle keeps the MXFP4 codes in the layout of ``layout.py`` (made at prepare, in place of the
checkpoint's: the same bytes but for K padded to a multiple of 64) and the scale bytes as they are.
The per-call path (``run``) is four precompiled launches (two or three on the small-M GEMV path; see
``kernels.py``) and no host sync; an eager call's launches go out by one C call (``chain.py``).
Under ``TRITON_INTERPRET=1`` the backend also runs on the CPU, with fp32 operands (the CPU
interpreter gets bf16 ``tl.dot`` wrong), which is how CI tests the kernels' logic.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import weakref

import torch

from . import chain as _CH

NAME = "triton"
_CH_MOD = _P = _KNOBS = None  # (the chain's C module, the plan module and triton's runtime knobs, once a chain is
# built: ``_build_chain``)
_OPTIONS = ("tune", "cache_dir", "frozen", "gemv", "ptx")
_SHARED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable_reason(device: torch.device) -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    device = torch.device(device)
    if device.type == "cpu" and _interpret():
        return None  # the CPU interpreter (tests)
    if device.type != "cuda":
        return f"needs a CUDA device (got {device.type}; TRITON_INTERPRET=1 runs it on the CPU, slowly)"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    cc = torch.cuda.get_device_capability(device)
    if cc < (8, 0):
        return f"needs compute capability 8.0 or newer, the device has {cc[0]}.{cc[1]}"
    return None


@dataclasses.dataclass(eq=False)  # (by identity: the plans keep their handles' states in a weak set)
class State:
    plans: object  # plan.GeometryPlans, shared by the geometry's handles
    w13: torch.Tensor  # codes in the repacked layout (layout.py)
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    g13: torch.Tensor
    g2: torch.Tensor
    expert_offset: int
    limit: float
    checkpoint_bytes: int
    # (``_operands``) the handle's tensors and its arena's buffers by name, as tensors and as
    # addresses, made for the arena version it names
    operands: tuple = dataclasses.field(default=(-1, {}, {}), repr=False)
    # (``_chain``) runners' chains for this handle (``chain.build``), by ``id(runner)``: ``(runner, arena
    # version, chain or None)`` (the runner kept, so that its id stays its own)
    chains: dict = dataclasses.field(default_factory=dict, repr=False)
    # (``run``) the chains of the calls that take one whatever the capture state, by token count (up to
    # ``FAST_MAX_TOKENS``), with the blocked path's sizes at that count (``_blocked_sizes``; none on the GEMV
    # path): ``(chain, sizes)``, filled by such calls, emptied whenever the shared plans or their arena change
    # (``GeometryPlans.changed``)
    fast: dict = dataclasses.field(default_factory=dict, repr=False)


def prepare(spec) -> State:
    from . import plan as P
    from .layout import repack_codes

    unknown = sorted(set(spec.options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"prepare_experts: backend 'triton' options: expected some of {_OPTIONS}, got {unknown}")
    g = spec.geometry
    on_gpu = g.device.type == "cuda"
    tune = bool(spec.options.get("tune", on_gpu)) and on_gpu and not P.INTERPRET
    frozen = bool(spec.options.get("frozen", True))
    gemv = spec.options.get("gemv", None)
    ptx = spec.options.get("ptx", None)
    for opt, val in (("gemv", gemv), ("ptx", ptx)):
        if val is not None and not isinstance(val, bool):
            raise ValueError(f"prepare_experts: backend 'triton' option {opt}: expected None, True or False, got {val!r}")
    P.check_ptx_option(g.device, ptx)

    # Scale bytes in [2, 252] take the integer decode (the scale folded into the exponent); a
    # checkpoint with others gets kernels of its own (the geometry key includes the choice).
    lo = min(int(t.min()) for t in (spec.w13_scale, spec.w2_scale))
    hi = max(int(t.max()) for t in (spec.w13_scale, spec.w2_scale))
    fast = lo >= 2 and hi <= 252
    fold = lo >= 2 and hi <= 128  # (the usual case: weight scales of at most 2)
    key = (g, fast, fold, gemv, ptx)
    shared = _SHARED.get(key)
    if shared is None:
        shared = P.GeometryPlans(g, fast, gemv, ptx, fold=fold)
        _SHARED[key] = shared
    ones = torch.ones(g.num_experts, dtype=torch.float32, device=g.device)

    def dense(t):  # (16-byte aligned too: the Gluon kernels load a row's scale bytes two at a time)
        return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)

    state = State(
        plans=shared, w13=repack_codes(spec.w13), w13_scale=dense(spec.w13_scale), w2=repack_codes(spec.w2),
        w2_scale=dense(spec.w2_scale),
        g13=spec.w13_global_scale if spec.w13_global_scale is not None else ones,
        g2=spec.w2_global_scale if spec.w2_global_scale is not None else ones,
        expert_offset=spec.expert_offset, limit=float(g.swiglu_limit or 0.0),
        checkpoint_bytes=sum(t.numel() * t.element_size() for t in (spec.w13, spec.w13_scale, spec.w2, spec.w2_scale)),
    )
    shared.handles.add(state)  # (its fast path emptied whenever the plans change)
    missing = [c for c in spec.capacities if c not in shared.configs]
    if missing:
        chosen = _choose_configs(state, missing, tune, spec.options.get("cache_dir"))
        for cap in missing:
            shared.add(cap, chosen[cap])
        if not P.INTERPRET:
            progress = P.Progress("compiling and warming the triton kernels", len(missing))
            for cap in missing:
                _warm(state, cap)
                progress.step(f"{cap} tokens")
            torch.cuda.synchronize(g.device)
    if _CH.ENABLED and not P.INTERPRET:  # (each plan's chain for this handle: compiled, warmed above)
        for cap in spec.capacities:
            for rn in (shared.runners[cap], shared.eager_runners.get(cap)):
                if rn is not None:
                    _chain(state, rn)
    if frozen and not P.INTERPRET:
        for ln in shared.launches.values():
            ln.frozen = True
    return state


def _synthetic_batch(state, m, seed=0):
    g = state.plans.geometry
    gen = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.rand(m, g.num_experts, generator=gen)
    ids = scores.topk(g.top_k, dim=1).indices.to(torch.int32) + state.expert_offset
    w = torch.rand(m, g.top_k, generator=gen)
    x = torch.randn(m, g.hidden_size, generator=gen).to(torch.bfloat16)
    dev = g.device
    return x.to(dev), ids.to(dev), w.to(dev)


def _warm(state, cap):
    x, ids, w = _synthetic_batch(state, cap)
    out = torch.empty_like(x)
    gp = state.plans
    eager = gp.eager_runners.get(cap)
    if eager is None:
        run(state, x, ids, w, out)
        return
    # Both forms compiled and warmed; the eager form kept only where eager calls of it are faster
    # here: it saves a launch's host time, which pays only while the host, not the GPU, sets the
    # pace (H200: Qwen3 and DSv4 at one token; gpt-oss's GPU time exceeds two launches' host time).
    forms = [gp.runners[cap], eager]
    for rn in forms:
        _launch(state, rn, x, ids, w, out, _ALL)
    two, one = (_eager_seconds(lambda rn=rn: _issue(state, rn, x, ids, w, out)) for rn in forms)
    if one >= two:
        del gp.eager_runners[cap]
        gp.changed()


def _issue(state, rn, x, ids, w, out):
    """One call of runner ``rn`` (``run``'s, unless it goes in slot chunks; prepare's timing of the eager
    forms): by its chain where it has one (returns ``(chain, sizes)``, ``_chained``), else launch by
    launch (None)."""
    if _CH.ENABLED:
        fast = _chained(state, rn, x, ids, w, out)
        if fast is not None:
            return fast
    _launch(state, rn, x, ids, w, out, _ALL)
    return None


def _eager_seconds(fn, calls=20, reps=3) -> float:
    """Best of ``reps`` wall times of ``calls`` back-to-back eager ``fn()`` calls, synchronized."""
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def _choose_configs(state, caps, tune, cache_dir_opt):
    from . import plan as P

    g = state.plans.geometry
    mode = state.plans.gemv
    if not tune:
        return {c: state.plans.default(c) for c in caps}
    path = P.cache_path(g, P.cache_dir(cache_dir_opt), mode, state.plans.ptx, state.plans.gluon,
                        state.plans.mma, state.plans.gluon_sync)
    cached = P.load_cache(path)
    todo = [c for c in caps if c not in cached]
    if todo:
        progress = P.Progress(f"tuning triton MoE kernels (E={g.num_experts}, K={g.hidden_size}, "
                              f"N={g.intermediate_size})", len(todo))
        for cap in todo:
            cached[cap] = _tune_one(state, cap)
            c = cached[cap]
            progress.step(f"{cap} tokens -> {'gemv' if c.gemv else f'bm={c.bm}'}")
        P.save_cache(path, P.load_cache(path) | cached, g)
    return {c: cached[c] for c in caps}


def _time_ms(fn, flush, reps=15):
    """Median GPU milliseconds of one ``fn()`` with its weights in HBM, not in L2: ``fn`` replayed
    from a CUDA graph (so the host's launch cost, tens of us a launch, does not hide the difference
    between fast kernels), each replay after a write of twice the L2's size. A model's layers
    each bring their own weights, so a call rarely finds its weights in L2; a tuner timing one
    layer's calls back to back would time them L2-resident at small M, where that decides.
    Plain launches if the capture fails. ``flush``: ``_l2_flush_buffer``'s buffer on ``fn``'s device."""
    fn()  # compiles on the first call
    torch.cuda.synchronize()
    run = fn
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        run = graph.replay
    except Exception as exc:  # noqa: BLE001 - timing still works without a graph
        from .plan import log
        log.info("tuning without CUDA graphs: %s", exc)
        torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        flush.add_(1)
        start.record()
        run()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end))
    return sorted(ts)[len(ts) // 2]


def _l2_flush_buffer(device: torch.device) -> torch.Tensor | None:
    """A buffer of twice the L2's size on CUDA ``device``, for one tuning step (it goes back to the
    caching allocator after): writing it evicts the L2. None on other devices."""
    if device.type != "cuda":
        return None
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)
    return torch.zeros(2 * l2 // 4, dtype=torch.int32, device=device)


def _tune_one(state, cap):
    """Per block size (and the GEMV path), the fastest GEMM1 and GEMM2 configs, each stage timed alone;
    then each block size's pair timed as the whole call, and the fastest call kept. (A sum of stage
    times would count a graph replay's fixed cost once a stage: three times for a blocked path, whose
    routing prologue and finalize the GEMV path does not have, twice for GEMV.)"""
    from . import plan as P

    gp = state.plans
    g = gp.geometry
    x, ids, w = _synthetic_batch(state, cap, seed=1)
    out = torch.empty_like(x)
    cands = P.candidate_configs(cap, g, gp.gemv, gp.gluon, gp.mma, gp.ptx, gp.gluon_sync)
    flush = _l2_flush_buffer(g.device)
    best = None
    for bm, gemv, mma in sorted({(c.bm, c.gemv, c.mma) for c in cands}):
        group = [c for c in cands if (c.bm, c.gemv, c.mma) == (bm, gemv, mma)]
        for c in group:  # (scratch for every candidate: a split's partial sums and counters too)
            gp.reserve(cap, c)
        # routing for this block size, once (the GEMV path has none; its x quantization, where a
        # candidate has one, is timed with its gemv1)
        _launch_all(state, group[0], x, ids, w, out, stages=("prologue",))
        st1 = ("prologue", "gemm1") if gemv else ("gemm1",)
        t1 = {}
        t2 = {}
        for c in group:
            # (a Gluon GEMM and tl.dot's of one tile differ, and so do its wgmma and mma.sync forms)
            k1, k2 = (c.tiles1(), c.gluon, c.gluon and c.sync), (c.tiles2(), c.gluon2, c.gluon2 and c.sync)
            try:
                if k1 not in t1:
                    t1[k1] = _time_ms(lambda: _launch_all(state, c, x, ids, w, out, stages=st1), flush)
                if k2 not in t2:
                    t2[k2] = _time_ms(lambda: _launch_all(state, c, x, ids, w, out, stages=("gemm2",)), flush)
            except Exception as exc:  # a config the GPU cannot run (shared memory, registers)
                P.log.info("config %s failed: %s", c, exc)
                t1.setdefault(k1, float("inf"))
                t2.setdefault(k2, float("inf"))
        b1 = min(t1, key=t1.get)
        b2 = min(t2, key=t2.get)
        if math.isinf(t1[b1]) or math.isinf(t2[b2]):
            continue
        # (the group's loads in flight a program, ``Config.window``: one for all its mma.sync candidates)
        pick = dataclasses.replace(P.Config.of(bm, b1[0], b2[0], group[0].atomic, gemv=gemv), gluon=b1[1],
                                   gluon2=b2[1], sync=b1[2] or b2[2], mma=mma, window=group[0].window)
        gp.reserve(cap, pick)
        total = _time_ms(lambda: _launch_all(state, pick, x, ids, w, out), flush)
        if best is None or total < best[0]:
            best = (total, pick)
    if best is None:
        raise RuntimeError(f"b12x_ops triton backend: no configuration ran at {cap} tokens "
                           f"(E={g.num_experts}, K={g.hidden_size}, N={g.intermediate_size})")
    return best[1]


def run(state, x, topk_ids, topk_weights, out) -> None:
    m = x.shape[0]
    fast = state.fast.get(m)
    if fast is not None and _CH.ENABLED and not _hooked() and _launch_chain(fast, x, topk_ids, topk_weights, out):
        return  # (straight to the chain: the host time of a few-token eager call is most of its time)
    if m == 0:
        return
    gp = state.plans
    rn = gp.runner_for(m, _capturing if x.is_cuda else _never)
    cfg = rn.cfg
    if not cfg.atomic and not cfg.gemv and m > gp.slot_chunk:
        step = gp.slot_chunk
        for s in range(0, m, step):
            e = min(s + step, m)
            _launch(state, rn, x[s:e], topk_ids[s:e], topk_weights[s:e], out[s:e], _ALL)
        return
    fast = _issue(state, rn, x, topk_ids, topk_weights, out)
    if fast is not None and m <= FAST_MAX_TOKENS and gp.eager_runners.get(gp.cap_for(m)) is None:
        state.fast[m] = fast  # (the same launches captured or not: the next call goes straight)


# The fast path keeps calls of at most this many tokens: where the host's time is most of a call's or
# of its start, and so that a handle keeps a few hundred entries, not one for every count an engine
# calls eagerly (larger calls still go by their chain, through ``_issue``)
FAST_MAX_TOKENS = 256


def _chained(state, rn, x, topk_ids, topk_weights, out):
    """Launch runner ``rn``'s kernels for this call by its chain (``chain.py``: one C call) and return
    ``(chain, sizes)`` (the blocked path's sizes at this token count, ``_blocked_sizes``; none on the GEMV
    path), what the fast path keeps; None (nothing launched) where there is none: not built (kernels not
    yet compiled, which under the interpreter they never are; no C module; a kernel it cannot pass) or
    launch hooks to call (a profiler: triton's launcher calls them)."""
    blob = _chain(state, rn)
    if blob is None or blob is _NOT_YET or _hooked():
        return None
    fast = (blob, () if rn.cfg.gemv else _blocked_sizes(rn, x.shape[0], state.plans.geometry.top_k))
    return fast if _launch_chain(fast, x, topk_ids, topk_weights, out) else None


def _hooked() -> bool:
    """Whether triton has launch hooks to call (a profiler), which its launcher calls and a chain would not."""
    k = _KNOBS
    return k is not None and (_P._active(k.launch_enter_hook) is not None
                              or _P._active(k.launch_exit_hook) is not None)


def _launch_chain(fast, x, ids, w, out) -> bool:
    """The call's launches by ``fast = (chain, sizes)``: its values (``chain.VALUES``) from the call's tensors
    (the routing as ``_raw_routing``'s words), then ``sizes`` (``chain.SIZES``, the blocked path's). False
    (nothing launched) where the thread has no CUDA context yet (triton's launcher makes one)."""
    ids, (si0, si1), w, (sw0, sw1), w_kind = _raw_routing(ids, w)
    P = _P
    return _CH_MOD.launch(fast[0], P._raw_stream(P._current_device()), x.data_ptr(), ids.data_ptr(), w.data_ptr(),
                          out.data_ptr(), x.shape[0], x.stride()[0], si0, si1, sw0, sw1, w_kind, out.stride()[0],
                          1 if x.dtype is _F16 else 0, 1 if out.dtype is _F16 else 0, *fast[1])


def _chain(state, rn):
    """Runner ``rn``'s chain for ``state`` at the arena's current version: made at prepare, made again only
    after a later prepare grew the arena (``_build_chain``)."""
    ver = state.plans.arena.version
    ch = state.chains.get(id(rn))
    if ch is not None and ch[1] == ver:
        return ch[2]
    blob = _build_chain(state, rn)
    if blob is not _NOT_YET:
        state.chains[id(rn)] = (rn, ver, blob)
    return blob


def _build_chain(state, rn):
    """Runner ``rn``'s chain for ``state`` (``chain.build``), None where it has none, ``_NOT_YET`` while its
    kernels are not all compiled (the first, compiling calls go through ``_launch``)."""
    global _CH_MOD, _P, _KNOBS
    from . import plan as P

    _P, _KNOBS = P, P._RUNTIME_KNOBS
    cfg = rn.cfg
    if cfg.fused:  # (one launch already: triton's launcher; its grid is not linear in M)
        return None
    if cfg.gemv:
        used = [rn.gemm1, rn.gemm2] + ([rn.prologue] if cfg.xq else [])
    else:
        used = [rn.prologue, rn.gemm1, rn.gemm2, rn.finalize] + rn.edges
    if any(ln is None or ln.compiled is None for ln in used):
        return _NOT_YET
    _CH_MOD = _CH.module()
    if _CH_MOD is None:
        return None
    tens, addr = _operands(state)
    v = _CH.placeholders()  # (VALUES: x, ids, w, out, m, sx, si0, si1, sw0, sw1, w_kind, so, x_fp16, out_fp16)
    args = (state, rn, tens, addr, *(v[n] for n in _CH.VALUES))
    if cfg.gemv:
        return _CH.build(_gemv_launches(*args))
    return _CH.build(_blocked_launches(*args, sizes=tuple(v[n] for n in _CH.SIZES)))


_ALL = ("prologue", "gemm1", "gemm2", "finalize")
_NOT_YET = object()
_capturing = torch.cuda.is_current_stream_capturing


def _never() -> bool:  # (no CUDA graph captures a CPU tensor's call: the interpreter takes the eager form)
    return False
_W_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _raw_routing(topk_ids, topk_weights):
    """The caller's routing as the 32/16-bit words the kernels read, so that one compiled kernel serves
    every dtype the op accepts (int32/int64 ids: the low word of an int64): ``(ids, (si0, si1), w,
    (sw0, sw1), w_kind)``, the strides in those words (``_as`` gives a launch the words' view)."""
    si0, si1 = topk_ids.stride()
    if topk_ids.dtype is _I64:  # (dtypes are singletons: ``is`` is the cheap test; this runs every call)
        if si1 != 1:
            topk_ids = topk_ids.contiguous()
            si0, si1 = topk_ids.stride()
        si0, si1 = 2 * si0, 2 * si1
    sw0, sw1 = topk_weights.stride()
    wdt = topk_weights.dtype
    if wdt is _F32:
        if sw1 != 1:
            topk_weights = topk_weights.contiguous()
            sw0, sw1 = topk_weights.stride()
        sw0, sw1 = 2 * sw0, 2 * sw1
    return topk_ids, (si0, si1), topk_weights, (sw0, sw1), _W_KIND[wdt]


def _args(ln, tens, addr, x, ids, w, out):
    """What launch ``ln`` takes: the handle's and arena's operands (``_operands``) and the call's
    x, ids, weights and out. Until ``ln`` is compiled, the tensors, and the call's as the 16/32-bit
    words the kernels read (the compile specializes on the pointer's element type); then the
    addresses and the call's tensors themselves: a compiled launch reads only a tensor's address
    (triton's launcher calls ``data_ptr()``), which a dtype view shares, and a view costs about 1.5 us
    of host time a call."""
    if ln.compiled is not None:
        return addr, x, ids, w, out
    return tens, x.view(_I16), ids.view(_I32), w.view(_I16), out.view(_I16)


def _ops(ln, tens, addr):
    """The handle's and arena's operands as launch ``ln`` takes them (``_args``), for a launch that
    takes none of the call's x, ids and weights."""
    return addr if ln.compiled is not None else tens


_I16, _I32, _I64, _F16, _F32 = torch.int16, torch.int32, torch.int64, torch.float16, torch.float32


def _launch_all(state, cfg, x, topk_ids, topk_weights, out, stages=_ALL):
    """Launch ``stages`` of ``cfg`` (tests, the tuner and the benchmark's diagnosis; calls go
    through ``run``)."""
    _launch(state, state.plans.runner(cfg), x, topk_ids, topk_weights, out, stages)


_HANDLE_OPERANDS = ("w13", "w13_scale", "g13", "w2", "w2_scale", "g2")


def _operands(state) -> tuple[dict, dict]:
    """The handle's weights, scales and per-expert scales and its geometry's scratch buffers, by
    name: ``(tensors, addresses)``. A compiled launch takes the address (triton's launcher takes an
    int as is; given a tensor it calls ``data_ptr()`` and asks the driver about the pointer); the
    first, compiling call of a launch takes the tensor (the compile specializes on its element type).
    Made once per arena version: a prepare that grows the arena replaces buffers (``Arena.need``)."""
    version, tens, addr = state.operands
    arena = state.plans.arena
    if version != arena.version:
        tens = dict(arena.buffers)
        for name in _HANDLE_OPERANDS:
            tens[name] = getattr(state, name)
        addr = {name: t.data_ptr() for name, t in tens.items()}
        state.operands = (arena.version, tens, addr)
    return tens, addr


def _gemv_launches(state, rn, tens, addr, x, ids, w, out, m, sx, si0, si1, sw0, sw1, w_kind, so, x_fp16, out_fp16,
                   stages=_ALL) -> list:
    """The GEMV path's launches of ``stages`` as ``(launch, grid, args)``: one (fused), two, or three with x
    quantized first; no routing pass (``kernels.gemv1_kernel``). ``ids`` and ``w`` are the routing's words
    (``_raw_routing``). ``_launch`` runs them; ``chain.build`` writes them down with the call's own values as
    ``chain.Var`` placeholders (so both take their arguments from here)."""
    cfg = rn.cfg
    top_k = state.plans.geometry.top_k
    S = m * top_k
    out_l = []
    if cfg.fused:  # one launch (kernels.gemv_fused_kernel)
        if "gemm1" in stages:
            ln = rn.gemm1
            o, X, I, W, Y = _args(ln, tens, addr, x, ids, w, out)
            out_l.append((ln, (rn.fused_programs(m, top_k), 1, 1),
                          (X, I, W, o["w13"], o["w13_scale"], o["g13"], o["w2"], o["w2_scale"], o["g2"], o["act"], Y,
                           o["part1"], o["cnt1"], o["part2"], o["cnt2"], o["sync"], m, sx, si0, si1, sw0, sw1,
                           state.expert_offset, x_fp16, w_kind, so, out_fp16, state.limit)))
        return out_l
    if cfg.xq and "prologue" in stages:
        ln = rn.prologue
        o, X, I, W, Y = _args(ln, tens, addr, x, ids, w, out)
        out_l.append((ln, (m, rn.xquant_tiles, 1), (X, o["xq"], m, sx, x_fp16)))
    if "gemm1" in stages:
        ln = rn.gemm1
        o, X, I, W, Y = _args(ln, tens, addr, x, ids, w, out)
        if cfg.mma:  # (gluon_gemv: x's quantized row from xq)
            args = (o["xq"], I, o["w13"], o["w13_scale"], o["g13"], o["act"], o["part1"], o["cnt1"], S, si0, si1,
                    state.expert_offset, state.limit)
        else:
            args = (X, o["xq"], I, o["w13"], o["w13_scale"], o["g13"], o["act"], o["part1"], o["cnt1"], S, sx, si0, si1,
                    state.expert_offset, x_fp16, state.limit)
        out_l.append((ln, (S * rn.n_tiles1, 1, 1), args))
    if "gemm2" in stages:
        ln = rn.gemm2
        o, X, I, W, Y = _args(ln, tens, addr, x, ids, w, out)
        out_l.append((ln, (m * rn.n_tiles2, 1, 1),
                      (o["act"], I, W, o["w2"], o["w2_scale"], o["g2"], Y, o["part2"], o["cnt2"], m, si0, si1, sw0, sw1,
                       state.expert_offset, w_kind, so, out_fp16)))
    return out_l


def _launch(state, rn, x, topk_ids, topk_weights, out, stages):
    tens, addr = _operands(state)
    m = x.shape[0]
    sx = x.stride()[0]
    x_fp16 = 1 if x.dtype is _F16 else 0
    so, out_fp16 = out.stride()[0], 1 if out.dtype is _F16 else 0
    if rn.cfg.gemv or "prologue" in stages:  # (the routing as the kernels' words: read by the GEMV kernels and
        # the prologue alone)
        ids, (si0, si1), w, (sw0, sw1), w_kind = _raw_routing(topk_ids, topk_weights)
    else:
        ids, w, si0, si1, sw0, sw1, w_kind = topk_ids, topk_weights, 0, 0, 0, 0, 0
    make = _gemv_launches if rn.cfg.gemv else _blocked_launches
    for ln, grid, args in make(state, rn, tens, addr, x, ids, w, out, m, sx, si0, si1, sw0, sw1, w_kind, so, x_fp16,
                               out_fp16, stages):
        ln(grid, *args)


def _blocked_sizes(rn, m: int, top_k: int) -> tuple:
    """A blocked-path call's sizes at ``m`` tokens (``chain.SIZES``): its block count, the prologue's,
    GEMM1's and GEMM2's grids, the accumulator rows a Gluon GEMM1 program zeroes where it does, the finalize's
    grid (its first dimension)."""
    nb = rn.blocks(m * top_k)
    p1 = nb * rn.n_tiles1
    return nb, rn.prologue_programs(m, top_k), p1, nb * rn.n_tiles2, -(-m // p1), -(-m // rn.finalize_rows)


def _blocked_launches(state, rn, tens, addr, x, ids, w, out, m, sx, si0, si1, sw0, sw1, w_kind, so, x_fp16,
                      out_fp16, stages=_ALL, sizes=None) -> list:
    """The blocked path's launches of ``stages`` (routing prologue, GEMM1, GEMM2, finalize) as ``(launch, grid,
    args)``, as ``_gemv_launches``; ``sizes``: ``_blocked_sizes`` at the call's token count (made from ``m``
    where not given; a chain gives them as ``chain.Var`` placeholders, the grids not being linear in M)."""
    cfg = rn.cfg
    top_k = state.plans.geometry.top_k
    nb, g_pro, g1, g2, zrows, g_fin = _blocked_sizes(rn, m, top_k) if sizes is None else sizes
    dst = "acc" if cfg.atomic else "slots"
    out_l = []
    if "prologue" in stages:
        ln = rn.prologue
        o, X, I, W, Y = _args(ln, tens, addr, x, ids, w, out)
        out_l.append((ln, (g_pro, 1, 1),
                      (I, W, X, o["xq"], o["acc"], o["lid"], o["wts"], o["sorted"], o["blk_expert"], o["blk_rows"],
                       o["route_cnt"], o["route_key"], o["route_off"], m, si0, si1, sw0, sw1, sx, state.expert_offset,
                       nb, w_kind, x_fp16)))
    # (a Gluon GEMM's last column tile may run in a narrower launch of its own: one program a block,
    # its main launch's arguments; plan.GeometryPlans.edge)
    if "gemm1" in stages:
        for ln, grid in ((rn.gemm1, g1), (rn.edge1, nb)):
            if ln is None:
                continue
            o = _ops(ln, tens, addr)
            ops = (o["xq"], o["sorted"], o["blk_expert"], o["blk_rows"], o["w13"], o["w13_scale"], o["g13"], o["act"])
            # (the Gluon GEMM1 also takes the accumulator and each program's rows of it to zero, if asked:
            # plan.acc_zero_mode)
            out_l.append((ln, (grid, 1, 1), ops + ((o["acc"], nb, state.limit, zrows, m) if cfg.gluon
                                                   else (nb, state.limit))))
    if "gemm2" in stages:
        for ln, grid in ((rn.gemm2, g2), (rn.edge2, nb)):
            if ln is None:
                continue
            o = _ops(ln, tens, addr)
            out_l.append((ln, (grid, 1, 1),
                          (o["act"], o["sorted"], o["blk_expert"], o["blk_rows"], o["w2"], o["w2_scale"], o["g2"],
                           o["wts"], o[dst], nb)))
    if "finalize" in stages:
        ln = rn.finalize
        o = _ops(ln, tens, addr)
        out_l.append((ln, (g_fin, rn.n_tiles_fin, 1),
                      (o[dst], o["lid"], out if ln.compiled is not None else out.view(_I16), m, so, out_fp16)))
    return out_l


def scratch_estimate(geometry, capacities, gemv=None) -> int:
    """Bytes of the scratch arena that handles of ``geometry`` planned for ``capacities`` share,
    with the default configurations, computed without allocating (``b12x-ops info --geometry``)."""
    from . import plan as P

    gp = P.GeometryPlans(geometry, True, gemv, dry=True)
    for cap in capacities:
        gp.reserve(cap, P.default_config(cap, geometry, gemv))
    return gp.arena.nbytes()


def memory_report(state) -> dict[str, int]:
    held = sum(t.numel() * t.element_size() for t in (state.w13, state.w13_scale, state.w2, state.w2_scale))
    return {
        "device_bytes": held,  # the MXFP4 bytes only, repacked in place of the checkpoint's (no bf16 copy)
        "checkpoint_bytes": state.checkpoint_bytes,
        "shared_scratch_bytes": state.plans.arena.nbytes(),  # one arena per geometry, shared by its layers
    }
