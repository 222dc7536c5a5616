"""The Triton backend on a CUDA GPU: numerics against the reference, determinism, CUDA graphs.

The reference is the package's exact fp32 reference (the CPU reference's code, run on the GPU so
that the real-size geometries check in seconds; it is checked against the b12x oracle elsewhere).
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

import b12x_ops
from _samples import CASES, case, make_batch, make_layer, rel_l2

pytestmark = pytest.mark.gpu

# name -> make_layer kwargs; the three benchmark geometries and small odd ones
GEOMETRIES = {
    "gpt-oss-120b": dict(E=128, K=2880, N=2880, top_k=4, limit=7.0),
    "dsv4-tp4": dict(E=384, K=5120, N=576, top_k=6, limit=10.0, layout="w31"),
    "qwen3-30b-a3b": dict(E=128, K=2048, N=768, top_k=8),
    "odd-3x96": dict(E=3, K=96, N=96, top_k=3),
    "odd-ep": dict(E=5, K=160, N=64, top_k=2, offset=7, limit=3.0, layout="w31", global_scales=True),
}
SIZES = {
    "gpt-oss-120b": (1, 2, 5, 8, 16, 64, 333, 2048, 8192),
    "dsv4-tp4": (1, 3, 16, 64, 512, 8192),
    "qwen3-30b-a3b": (1, 7, 32, 128, 1000, 8192),
    "odd-3x96": (1, 2, 17, 300, 4100),
    "odd-ep": (1, 9, 100, 1500),
}
_LAYERS: dict = {}


def _layer(name, deterministic=False):
    key = (name, deterministic)
    if key not in _LAYERS:
        _LAYERS.clear() if len(_LAYERS) > 3 else None
        layer = make_layer(seed=sum(map(ord, name)), device="cuda", **GEOMETRIES[name])
        h = layer.prepare(backend="triton", tune=False, deterministic=deterministic, decode_token_counts=(3, 5))
        _LAYERS[key] = (layer, h, layer.prepare(backend="reference"))
    return _LAYERS[key]


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_gpu_matches_reference(name):
    layer, h, ref = _layer(name)
    assert h.backend == "triton"
    worst = 0.0
    for i, M in enumerate(SIZES[name]):
        x, ids, w = make_batch(layer, M, seed=i, device="cuda", padding_rows=min(2, M // 4),
                               strided=(i % 3 == 1), id_dtype=torch.int64 if i % 2 else torch.int32,
                               w_dtype=(torch.float32, torch.bfloat16, torch.float16)[i % 3])
        got = b12x_ops.moe_w4a8(x, ids, w, h)
        want = b12x_ops.moe_w4a8(x, ids, w, ref)
        err = rel_l2(got, want)
        worst = max(worst, err)
        assert err <= 1e-2, (name, M, err)
        assert torch.isfinite(got).all()
    print(f"{name}: worst rel L2 {worst:.2e}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_sample_cases(name):
    layer, (x, ids, w) = case(name, device="cuda")
    for det in (False, True):
        h = layer.prepare(backend="triton", tune=False, max_tokens=64, deterministic=det)
        got = b12x_ops.moe_w4a8(x, ids, w, h)
        want = b12x_ops.moe_w4a8(x, ids, w, layer.prepare(backend="reference"))
        assert rel_l2(got, want) <= 1e-2


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "odd-ep"])
def test_gpu_compiled_launches_reach_the_driver_either_way_with_the_same_bits(name):
    """After prepare every launch a call takes is compiled and gets the handle's operands as
    addresses; on the triton versions ``plan._direct_launch`` was checked against it calls the
    launcher's C function, elsewhere (or with the knob off) the launcher object. Both write the same
    bits (deterministic mode) on the GEMV path's one and three launches and the blocked path's four."""
    import triton

    from b12x_ops.backends.triton import chain
    from b12x_ops.backends.triton import plan as P

    layer, h, ref = _layer(name, deterministic=True)
    gp = h._state.plans
    direct = P.DIRECT_LAUNCH and triton.__version__.startswith(P.DIRECT_LAUNCH_VERSIONS)
    chain.ENABLED = False  # (eager calls by their chain go through neither: this tests the launches)
    try:
        _either_way(layer, h, ref, gp, direct)
    finally:
        chain.ENABLED = True


def _either_way(layer, h, ref, gp, direct):
    for M in (1, 3, 16, 100):
        x, ids, w = make_batch(layer, M, seed=M, device="cuda", padding_rows=1)
        rn = gp.runner_for(M, lambda: False)
        used = [ln for ln in (rn.prologue, rn.gemm1, rn.gemm2, rn.finalize) if ln is not None]
        assert all(ln.compiled is not None and (ln._direct is not None) == direct for ln in used), M
        first = b12x_ops.moe_w4a8(x, ids, w, h)
        saved = [(ln, ln._direct) for ln in used]
        try:
            for ln, _ in saved:
                ln._direct = None
            second = b12x_ops.moe_w4a8(x, ids, w, h)
        finally:
            for ln, d in saved:
                ln._direct = d
        assert torch.equal(first, second), M
        assert rel_l2(first, b12x_ops.moe_w4a8(x, ids, w, ref)) <= 1e-2, M


def _boom(run):
    """A launcher that fails the test (``_launchers``)."""
    def boom(*args, **kwargs):
        raise AssertionError("launched through triton's launcher")
    return boom


def _counting(calls):
    """Triton's launcher, each launch noted in ``calls`` (``_launchers``)."""
    return lambda run: (lambda *a: (calls.append(1), run(*a))[1])


@contextlib.contextmanager
def _launchers(used, wrap, chains=True):
    """Within: each launch of ``used`` goes to ``wrap(its launcher)`` (its direct C call off), and with
    ``chains`` False chains are off (the fast path too); both as they were after."""
    from b12x_ops.backends.triton import chain

    saved = [(ln, ln._direct, ln._run) for ln in used]
    chain.ENABLED = chains
    try:
        for ln, _, r in saved:
            ln._direct, ln._run = None, wrap(r)
        yield
    finally:
        chain.ENABLED = True
        for ln, d, r in saved:
            ln._direct, ln._run = d, r


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "dsv4-tp4", "gpt-oss-120b", "odd-ep"])
def test_gpu_eager_blocked_calls_launch_by_their_chain_with_the_launches_bits(name):
    """An eager call on the blocked path launches its four kernels by one C call (its runner's chain, with the
    token count's sizes as values, ``_blocked_sizes``), not through triton's launcher (made to fail here), and
    leaves the chain in the handle's fast path (up to ``FAST_MAX_TOKENS`` tokens), by which the next call goes;
    in deterministic mode both write the bits the launches write (chains off) and a captured call's replay
    writes; the atomic default matches the reference. Token counts of 16- to 128-row blocks (the tl.dot and the Gluon GEMMs), int32/int64 ids,
    fp32/bf16/fp16 weights, strided routing, fp16 x, padding and foreign ids."""
    from b12x_ops.backends.triton import FAST_MAX_TOKENS, _blocked_sizes, chain

    assert chain.ENABLED and chain.module() is not None
    ran = 0
    for det in (True, False):
        layer, h, ref = _layer(name, deterministic=det)
        state = h._state
        gp = state.plans
        for i, M in enumerate((9, 16, 77, 600, 2048)):
            rn = gp.runner_for(M, lambda: False)
            if rn.cfg.gemv or (not rn.cfg.atomic and M > gp.slot_chunk):
                continue
            x, ids, w = make_batch(layer, M, seed=60 + M, device="cuda", padding_rows=min(2, M // 4),
                                   strided=(i % 3 == 1), id_dtype=torch.int64 if i % 2 else torch.int32,
                                   w_dtype=(torch.float32, torch.bfloat16, torch.float16)[i % 3],
                                   x_dtype=torch.float16 if i % 4 == 3 else torch.bfloat16)
            used = [rn.prologue, rn.gemm1, rn.gemm2, rn.finalize]
            with _launchers(used, _boom):
                state.fast.pop(M, None)
                chained = b12x_ops.moe_w4a8(x, ids, w, h)
                blob = state.chains[id(rn)][2]
                kept = (blob, _blocked_sizes(rn, M, layer.top_k)) if M <= FAST_MAX_TOKENS else None
                assert blob is not None and state.fast.get(M) == kept, (name, M)  # (the fast path up to its bound)
                again = b12x_ops.moe_w4a8(x, ids, w, h)  # (straight to the chain)
            assert rel_l2(chained.float(), b12x_ops.moe_w4a8(x, ids, w, ref).float()) <= 1e-2, (name, M, det)
            if not det:  # (atomic adds: equal to rounding, in any order)
                assert rel_l2(again.float(), chained.float()) <= 1e-3, (name, M)
                ran += 1
                continue
            assert torch.equal(again, chained), (name, M)
            calls = []
            with _launchers(used, _counting(calls), chains=False):  # (each kernel through triton's launcher)
                launched = b12x_ops.moe_w4a8(x, ids, w, h)
            assert len(calls) == 4, (name, M)
            assert torch.equal(chained, launched), (name, M)
            out = torch.full_like(x, float("nan"))
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                b12x_ops.moe_w4a8_out(x, ids, w, h, out)
            g.replay()
            torch.cuda.synchronize()
            if gp.runner_for(M, lambda: True) is rn:  # (the same form captured: the same bits)
                assert torch.equal(out, chained), (name, M)
            ran += 1
    assert ran >= 4, name


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "dsv4-tp4", "odd-ep"])
def test_gpu_eager_gemv_calls_launch_by_their_chain_with_the_launches_bits(name):
    """An eager call on the GEMV path (but its one-launch form) launches its kernels by one C call
    (``chain.py``), not through triton's launcher (made to fail here), and leaves the chain in the
    handle's fast path, by which the next call goes, with the same bits; they are the bits the
    launches write (chains off, which the fast path obeys) and a captured call's replay writes;
    int32/int64 ids, fp32/bf16/fp16 weights, strided routing, fp16 x, padding and foreign ids. (The
    one-launch eager form, where prepare keeps it, is not chained: it goes through triton's launcher.)"""
    from b12x_ops.backends.triton import chain

    layer, h, ref = _layer(name)
    state = h._state
    gp = state.plans
    assert chain.ENABLED and chain.module() is not None
    ran = 0
    for i, M in enumerate(range(1, 9)):
        rn = gp.runner_for(M, lambda: False)
        if not rn.cfg.gemv:
            continue
        x, ids, w = make_batch(layer, M, seed=40 + M, device="cuda", padding_rows=min(1, M // 2),
                               strided=(i % 3 == 1), id_dtype=torch.int64 if i % 2 else torch.int32,
                               w_dtype=(torch.float32, torch.bfloat16, torch.float16)[i % 3],
                               x_dtype=torch.float16 if i % 4 == 3 else torch.bfloat16)
        used = [ln for ln in (rn.prologue, rn.gemm1, rn.gemm2) if ln is not None]
        with _launchers(used, _boom):
            if rn.cfg.fused:  # (one launch, where prepare timed it faster: no chain; it goes through the launcher)
                with pytest.raises(AssertionError, match="triton's launcher"):
                    b12x_ops.moe_w4a8(x, ids, w, h)
                ran += 1
                continue
            chained = b12x_ops.moe_w4a8(x, ids, w, h)
            assert state.fast.get(M) == (state.chains[id(rn)][2], ()) and state.fast[M][0] is not None, M  # (left in
            # the fast path)
            again = b12x_ops.moe_w4a8(x, ids, w, h)  # (straight to the chain)
        assert torch.equal(again, chained), M
        calls = []
        with _launchers(used, _counting(calls), chains=False):  # (each kernel through triton's launcher)
            launched = b12x_ops.moe_w4a8(x, ids, w, h)
        assert len(calls) == len(used), M
        assert torch.equal(chained, launched), M
        assert rel_l2(chained.float(), b12x_ops.moe_w4a8(x, ids, w, ref).float()) <= 1e-2, M
        out = torch.full_like(x, float("nan"))
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            b12x_ops.moe_w4a8_out(x, ids, w, h, out)
        g.replay()
        torch.cuda.synchronize()
        if gp.runner_for(M, lambda: True) is rn:  # (the same form captured: the same bits)
            assert torch.equal(out, chained), M
        ran += 1
    assert ran >= 2, name


def test_gpu_auto_picks_triton_on_non_sm120():
    if torch.cuda.get_device_capability()[0] == 12:
        pytest.skip("SM120: auto picks b12x there")
    layer = make_layer(device="cuda")
    assert layer.prepare(backend="auto", max_tokens=8, tune=False).backend == "triton"


def test_gpu_ep_remap_kernel_matches_twin():
    from b12x_ops.backends.reference import ep_remap as twin
    for name in ("padding", "foreign_ep", "strided", "int64_bf16w"):
        layer, (x, ids, w) = case(name, device="cuda")
        got = b12x_ops.ep_remap(ids, w, layer.offset, layer.E)
        want = twin(ids.cpu(), w.cpu(), layer.offset, layer.E)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("M", [1, 64, 2048])
def test_gpu_deterministic_is_bit_identical(M):
    layer, h, _ = _layer("qwen3-30b-a3b", deterministic=True)
    x, ids, w = make_batch(layer, M, seed=5, device="cuda", foreign=False)
    first = b12x_ops.moe_w4a8(x, ids, w, h)
    for _ in range(100):
        assert torch.equal(b12x_ops.moe_w4a8(x, ids, w, h), first)


def test_gpu_cuda_graph_capture_replays_new_inputs():
    layer, h, ref = _layer("gpt-oss-120b")
    M = 16
    x, ids, w = make_batch(layer, M, seed=7, device="cuda", padding_rows=3)
    out = torch.empty_like(x)
    b12x_ops.moe_w4a8_out(x, ids, w, h, out)  # warm (nothing compiles: prepare did)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        b12x_ops.moe_w4a8_out(x, ids, w, h, out)
    for seed in (8, 9, 10):
        x2, ids2, w2 = make_batch(layer, M, seed=seed, device="cuda", padding_rows=seed % 4)
        x.copy_(x2)
        ids.copy_(ids2)
        w.copy_(w2)
        out.fill_(float("nan"))
        g.replay()
        want = b12x_ops.moe_w4a8(x2, ids2, w2, ref)
        assert rel_l2(out, want) <= 1e-2


@pytest.mark.parametrize("cc, sync", [((8, 9), False), ((8, 9), True), ((12, 0), True)])
def test_gpu_plans_of_other_gpus_match_the_reference_on_this_one(cc, sync, monkeypatch):
    """The launches a prepare on an sm_89 GPU (no programmatic dependent launch) or an sm_120 one forced onto
    ``backend="triton"`` (with it) takes, run on this GPU standing in (``plan._capability`` answers ``cc``, as
    ``bench_moe.py --as-sm``): the GEMV on mma.sync with the asm decode at every token count it serves, and
    above it the tl.dot GEMMs with the Triton-operations decode (``B12X_OPS_TRITON_GLUON_SYNC=0``) or with
    ``sync`` (the default) the Gluon GEMMs on mma.sync (``plan.GLUON_SYNC_FORMS``, blocks of at
    most ``GLUON_SYNC_MAX_BM`` rows, their half tiles among them). Against the reference at 1-8 tokens and
    three blocked counts, eager (three launches: no one-launch form off sm_90) and captured in a CUDA graph
    replaying new inputs, with the same bits either way (``tests/test_compile_off_hopper.py`` compiles them
    for that GPU)."""
    from b12x_ops.backends.triton import plan as P

    from b12x_ops.backends import triton as TB

    real = P._capability
    monkeypatch.setattr(P, "_capability", lambda device: None if real(device) is None else cc)
    if sync:  # (the default)
        monkeypatch.delenv("B12X_OPS_TRITON_GLUON_SYNC", raising=False)
    else:
        monkeypatch.setenv("B12X_OPS_TRITON_GLUON_SYNC", "0")
    monkeypatch.setattr(TB, "_SHARED", {})  # (plans of their own, not a live handle's of this GPU)
    if not P.gemv_mma_status(torch.device("cuda"))[0]:
        pytest.skip(P.gemv_mma_status(torch.device("cuda"))[1])
    for name in ("qwen3-30b-a3b", "odd-ep"):
        layer = make_layer(seed=sum(map(ord, name)), device="cuda", **GEOMETRIES[name])
        ref = layer.prepare(backend="reference")
        h = layer.prepare(backend="triton", tune=False, max_tokens=512, decode_token_counts=tuple(range(1, 9)))
        gp = h._state.plans
        top_k = gp.geometry.top_k
        assert gp.mma and not gp.ptx and gp.mma_pdl == (cc >= (9, 0) and P.K_.HAS_GDC), name
        assert gp.gluon == gp.gluon_sync == sync, name
        assert not gp.eager_runners  # (no one-launch GEMV off sm_90, and the blocked plans have none)
        for M in (1, 2, 3, 4, 5, 6, 7, 8, 13, 64, 300):
            cap, cfg = gp.plan_for(M)
            serves = M <= P.GEMV_MMA_MAX_TOKENS and M * top_k <= P.GEMV_MMA_MAX_SLOTS
            assert cfg.gemv == cfg.mma == serves, (name, M, cfg)
            if sync:
                assert serves or (cfg.gluon and cfg.gluon2 and cfg.bm <= P.GLUON_SYNC_MAX_BM), (name, M, cfg)
            else:
                assert not (cfg.gluon or cfg.gluon2), (name, M, cfg)
            _assert_eager_and_captured_right(layer, ref, h, M, 70 + M, min(1, M // 4),
                                             M <= 8 or gp.geometry.deterministic, (name, cc))


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-120b", "odd-ep"])
def test_gpu_sync16_plans_on_sm90_match_the_reference(name, monkeypatch):
    """With ``B12X_OPS_TRITON_GLUON_SYNC16=1`` an sm_90 GPU's untuned plans of 16-row blocks run both GEMMs in
    Gluon on mma.sync (``plan.gluon_sync16_on``, ``GLUON_SYNC_FORMS``), the others as before (wgmma from 32
    rows): against the reference at 9-128 tokens, eager and captured in a CUDA graph replaying new inputs,
    with the same bits either way where the reduction is deterministic."""
    from b12x_ops.backends import triton as TB
    from b12x_ops.backends.triton import plan as P

    if not (P.gluon_status(torch.device("cuda"))[0] and P._capability(torch.device("cuda")) == (9, 0)):
        pytest.skip("needs an sm_90 GPU that runs the Gluon GEMMs")
    monkeypatch.setenv("B12X_OPS_TRITON_GLUON_SYNC16", "1")
    monkeypatch.setattr(TB, "_SHARED", {})  # (plans of their own, not a live handle's without it)
    layer = make_layer(seed=sum(map(ord, name)), device="cuda", **GEOMETRIES[name])
    ref = layer.prepare(backend="reference")
    h = layer.prepare(backend="triton", tune=False, max_tokens=128)
    gp = h._state.plans
    assert gp.sync16 and not gp.gluon_sync, name
    seen = set()
    for M in (9, 13, 16, 40, 64, 128):
        cap, cfg = gp.plan_for(M)
        if cfg.gemv:
            continue
        assert cfg.sync == (cfg.bm == 16) and (cfg.gluon and cfg.gluon2 if cfg.sync else True), (name, M, cfg)
        seen.add(cfg.sync)
        _assert_eager_and_captured_right(layer, ref, h, M, 90 + M, M % 3, gp.geometry.deterministic, (name,))
    assert True in seen, name  # (some count ran the 16-row plans on mma.sync)


@pytest.mark.parametrize("name", ["gpt-oss-120b", "dsv4-tp4", "qwen3-30b-a3b"])
def test_gpu_gemv_path_serves_up_to_eight_tokens_eager_and_captured(name):
    """Where the GEMV runs on mma.sync, untuned plans of 5-8 tokens take the GEMV path up to 48 slots
    (``plan.GEMV_MMA_MAX_SLOTS``, ``GEMV_MMA_MAX_TOKENS``; gpt-oss and DSv4 to 8 tokens, Qwen3 to 6) and the
    blocked path above: against the reference, and an eager call (the one-launch form where prepare
    timed it faster) writes the bits a captured call's replay writes."""
    from b12x_ops.backends.triton import plan as P

    layer, h, ref = _layer(name)
    gp = h._state.plans
    if not gp.mma:
        pytest.skip(f"the GEMV path serves 5-8 tokens where it runs on mma.sync: {P.gemv_mma_status('cuda')[1]}")
    for M in (5, 6, 7, 8):
        cap, cfg = gp.plan_for(M)
        want = cap * gp.geometry.top_k <= P.GEMV_MMA_MAX_SLOTS == 48 and cap <= P.GEMV_MMA_MAX_TOKENS == 8
        assert cfg.gemv == cfg.mma == want, (M, cap, cfg)
        x, ids, w = make_batch(layer, M, seed=30 + M, device="cuda", padding_rows=1)
        eager = b12x_ops.moe_w4a8(x, ids, w, h)
        assert rel_l2(eager, b12x_ops.moe_w4a8(x, ids, w, ref)) <= 1e-2, M
        if not want:
            continue
        out = torch.full_like(x, float("nan"))
        b12x_ops.moe_w4a8_out(x, ids, w, h, out)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            b12x_ops.moe_w4a8_out(x, ids, w, h, out)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), M


def test_gpu_reduce_overhead_records_and_replays_cuda_graphs():
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    layer = make_layer(E=8, K=256, N=128, top_k=2, device="cuda")
    handles = [layer.prepare(backend="triton", tune=False, max_tokens=64) for _ in range(3)]
    ref = layer.prepare(backend="reference")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.handles = handles

        def forward(self, x, ids, w):
            for h in self.handles:
                x = x + b12x_ops.moe_w4a8(x, ids, w, h)
            return x

    model = Model()
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for seed in range(5):
        x, ids, w = make_batch(layer, 8, seed=seed, device="cuda", x_scale=0.1)
        got = fn(x, ids, w).clone()
        want = x
        for _ in handles:
            want = want + b12x_ops.moe_w4a8(want, ids, w, ref)
        assert rel_l2(got, want) <= 2e-2
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and len(manager.roots) > 0, "inductor recorded no CUDA graph"
    recorded = next(manager.graph_counter)
    assert recorded >= 1


@pytest.mark.parametrize("name", ["gpt-oss-120b", "dsv4-tp4", "qwen3-30b-a3b", "odd-ep"])
def test_gpu_routing_matches_twin_in_graph_replays(name):
    """The prologue alone (no weights needed) at token counts on either side of the one-program
    bound (``PROLOGUE["RT"]`` slots) and at 8192 tokens, replayed from a CUDA graph with new
    routing each time (foreign and padding ids, one replay with every slot on one expert): the
    block table exact, each block's slots as a set, and the counters left at zero."""
    from b12x_ops.backends import triton as TB
    from b12x_ops.backends.triton import _launch
    from b12x_ops.backends.triton import kernels as K_
    from b12x_ops.backends.triton import plan as P
    from b12x_ops.handle import Geometry

    geo = dict(GEOMETRIES[name])
    E, K, k, off = geo["E"], geo["K"], geo["top_k"], geo.get("offset", 0)
    g = Geometry(num_experts=E, hidden_size=K, intermediate_size=geo["N"], top_k=k, w13_layout="w13",
                 activation="silu", swiglu_limit=None, has_global_scales=False, deterministic=False,
                 device=torch.device("cuda"))
    rt = P.PROLOGUE["RT"]
    layer = make_layer(E=E, K=32, N=32, top_k=k, offset=off)  # (make_batch's shapes only)
    for M in sorted({1, 16, rt // k, rt // k + 1, 2048, 8192}):
        gp = P.GeometryPlans(g, True, gemv=False)
        cfg = P.default_config(M, g, gemv=False)
        gp.reserve(M, cfg)
        st = types.SimpleNamespace(plans=gp, expert_offset=off, operands=(-1, {}, {}),  # (as a State has)
                                   **{n: torch.empty(0, device="cuda") for n in TB._HANDLE_OPERANDS})
        batches = [make_batch(layer, M, seed=s, padding_rows=M // 5) for s in range(3)]
        batches[2][1][:, :] = off + E - 1
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        ids = batches[0][1].to(torch.int32).cuda()
        w = batches[0][2].cuda()
        out = torch.empty_like(x)
        _launch(st, gp.runner(cfg, M), x, ids, w, out, ("prologue",))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _launch(st, gp.runner(cfg, M), x, ids, w, out, ("prologue",))
        a = gp.arena.buffers
        S, bm = M * k, cfg.bm
        nb = K_.num_blocks(S, E, bm)
        for _, ids_c, w_c in batches:
            ids.copy_(ids_c)
            w.copy_(w_c)
            graph.replay()
            torch.cuda.synchronize()
            lid, wts, srt, be, br = K_.route_torch(ids_c, w_c, off, E, bm)
            assert torch.equal(a["lid"][:S].cpu(), lid) and torch.equal(a["wts"][:S].cpu(), wts), M
            assert torch.equal(a["blk_expert"][:nb].cpu(), be) and torch.equal(a["blk_rows"][:nb].cpu(), br), M
            assert torch.equal(K_.routed_pairs(a["sorted"].cpu(), be, br, bm), K_.routed_pairs(srt, be, br, bm)), M
            assert not a["route_cnt"].any(), M


def test_gpu_prepare_shares_plans_and_scratch():
    layer = make_layer(E=8, K=256, N=128, top_k=2, device="cuda")
    a = layer.prepare(backend="triton", tune=False, max_tokens=128)
    b = layer.prepare(backend="triton", tune=False, max_tokens=128)
    assert a._state.plans is b._state.plans
    assert a.memory["device_bytes"] == a.memory["checkpoint_bytes"]


def test_gpu_tuning_cache_roundtrip(tmp_path):
    layer = make_layer(E=8, K=256, N=128, top_k=2, device="cuda", seed=11)
    h = layer.prepare(backend="triton", tune=True, cache_dir=str(tmp_path), max_tokens=32, deterministic=True)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"
    x, ids, w = make_batch(layer, 20, device="cuda")
    assert rel_l2(b12x_ops.moe_w4a8(x, ids, w, h), b12x_ops.moe_w4a8(x, ids, w, layer.prepare(backend="reference"))) <= 1e-2


def test_gpu_tuner_times_the_gluon_gemms(tmp_path):
    """On sm_90 the tuner times the Gluon GEMMs too (``plan.candidate_configs(..., gluon=True)``) at
    the counts whose blocks are large enough: what it picks is one of those candidates, comes back
    from the cache unchanged, and matches the reference."""
    from b12x_ops.backends.triton import plan as P

    layer = make_layer(E=8, K=512, N=256, top_k=2, device="cuda", seed=12)
    h = layer.prepare(backend="triton", tune=True, cache_dir=str(tmp_path), max_tokens=1024)
    gp = h._state.plans
    if not gp.gluon:
        pytest.skip(f"the Gluon GEMMs do not run here: {P.gluon_status(gp.geometry.device)[1]}")
    cands = P.candidate_configs(1024, gp.geometry, gp.gemv, True)
    assert any(c.gluon or c.gluon2 for c in cands)
    assert gp.configs[1024] in cands or any(  # (the tuner pairs the best GEMM1 and GEMM2 of a block size)
        gp.configs[1024].tiles1() == c.tiles1() and gp.configs[1024].gluon == c.gluon for c in cands)
    (path,) = tmp_path.iterdir()
    assert P.load_cache(str(path))[1024] == gp.configs[1024]
    ref = layer.prepare(backend="reference")
    for M in (300, 1024):
        x, ids, w = make_batch(layer, M, seed=M, device="cuda")
        assert rel_l2(b12x_ops.moe_w4a8(x, ids, w, h), b12x_ops.moe_w4a8(x, ids, w, ref)) <= 1e-2, M


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gpt-oss-120b", "dsv4-tp4", "qwen3-30b-a3b", "odd-ep"])
def test_gpu_gemv_path_matches_reference_and_blocked(name):
    """The small-M GEMV kernels (forced with gemv=True, so atomic mode runs too at 64 tokens)
    against the reference and the blocked path (gemv=False); slot mode bit-identical across runs."""
    layer = make_layer(seed=sum(map(ord, name)), device="cuda", **GEOMETRIES[name])
    ref = layer.prepare(backend="reference")
    hs = {mode: layer.prepare(backend="triton", tune=False, gemv=mode, max_tokens=64, decode_token_counts=(3,))
          for mode in (True, False)}
    det = layer.prepare(backend="triton", tune=False, gemv=True, max_tokens=8, deterministic=True)
    assert all(c.gemv for c in hs[True]._state.plans.configs.values())
    assert not any(c.gemv for c in hs[False]._state.plans.configs.values())
    for i, M in enumerate((1, 2, 3, 5, 16, 64)):
        x, ids, w = make_batch(layer, M, seed=20 + i, device="cuda", padding_rows=min(2, M // 4),
                               strided=(i % 2 == 1), id_dtype=torch.int64 if i % 2 else torch.int32,
                               w_dtype=(torch.float32, torch.bfloat16, torch.float16)[i % 3])
        want = b12x_ops.moe_w4a8(x, ids, w, ref)
        got = b12x_ops.moe_w4a8(x, ids, w, hs[True])
        blocked = b12x_ops.moe_w4a8(x, ids, w, hs[False])
        assert torch.isfinite(got).all()
        assert rel_l2(got, want) <= 1e-2, (name, M, rel_l2(got, want))
        assert rel_l2(got, blocked) <= 1e-2, (name, M, rel_l2(got, blocked))
        if M <= 8:
            first = b12x_ops.moe_w4a8(x, ids, w, det)
            assert rel_l2(first, want) <= 1e-2
            for _ in range(10):
                assert torch.equal(b12x_ops.moe_w4a8(x, ids, w, det), first)
    # CUDA-graph capture of the GEMV path replays new inputs
    M = 4
    x, ids, w = make_batch(layer, M, seed=30, device="cuda", padding_rows=1)
    out = torch.empty_like(x)
    b12x_ops.moe_w4a8_out(x, ids, w, hs[True], out)
    torch.cuda.synchronize()
    _assert_graph_replays_new_inputs(lambda: b12x_ops.moe_w4a8_out(x, ids, w, hs[True], out), layer, ref, x, ids, w,
                                     out, (31, 32))


def _assert_eager_and_captured_right(layer, ref, h, M, seed, padding_rows, same_bits, what):
    """An eager call of ``M`` tokens on handle ``h`` (batch ``seed``) matches the reference, a CUDA graph of it
    replays a new batch (``seed + 100``) right, and where ``same_bits`` an eager call on that batch writes the
    replay's bits."""
    x, ids, w = make_batch(layer, M, seed=seed, device="cuda", padding_rows=padding_rows)
    want = b12x_ops.moe_w4a8(x, ids, w, ref)
    out = torch.empty_like(x)
    b12x_ops.moe_w4a8_out(x, ids, w, h, out)
    assert rel_l2(out, want) <= 1e-2, (*what, M, rel_l2(out, want))
    torch.cuda.synchronize()
    # (the replay leaves its new batch in x, ids, w and its output in out)
    _assert_graph_replays_new_inputs(lambda: b12x_ops.moe_w4a8_out(x, ids, w, h, out), layer, ref, x, ids, w, out,
                                     (seed + 100,))
    torch.cuda.synchronize()
    if same_bits:
        assert torch.equal(out, b12x_ops.moe_w4a8(x, ids, w, h)), (*what, M)  # (eager: the same bits)


def _assert_graph_replays_new_inputs(run, layer, ref, x, ids, w, out, seeds):
    """Capture ``run()`` (which writes ``out`` from ``x, ids, w``) in a CUDA graph, then replay it
    on new batches copied into those tensors: each replay matches the reference."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for seed in seeds:
        x2, ids2, w2 = make_batch(layer, x.shape[0], seed=seed, device="cuda", padding_rows=seed % 3)
        x.copy_(x2)
        ids.copy_(ids2)
        w.copy_(w2)
        out.fill_(float("nan"))
        graph.replay()
        assert rel_l2(out, b12x_ops.moe_w4a8(x2, ids2, w2, ref)) <= 1e-2


@pytest.mark.parametrize("name", ["gpt-oss-120b", "dsv4-tp4", "odd-ep"])
def test_gpu_gemv_split_matches_reference_and_is_deterministic(name):
    """The GEMV kernels with their K steps (gemv1) split between 2, 3 and 5 programs, and their
    slots (gemv2) between 2 and 3, or each slot's N steps between 2 (``2 * top_k``): against the
    reference, bit-identical over 20 runs, the counts back at zero after each call, and under
    CUDA-graph replay."""
    import dataclasses

    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P

    layer = make_layer(seed=sum(map(ord, name)), device="cuda", **GEOMETRIES[name])
    ref = layer.prepare(backend="reference")
    h = layer.prepare(backend="triton", tune=False, gemv=True, max_tokens=4, deterministic=True)
    st = h._state
    g = st.plans.geometry
    for split1, split2 in ((2, 2), (3, 3), (5, 2 * g.top_k)):
        for i, M in enumerate((1, 3, 4)):
            cfg = dataclasses.replace(P.default_config(M, g, gemv=True), split1=split1, split2=split2)
            st.plans.reserve(M, cfg)
            x, ids, w = make_batch(layer, M, seed=40 + i, device="cuda", padding_rows=min(1, M // 3))
            want = b12x_ops.moe_w4a8(x, ids, w, ref)
            out = torch.full_like(x, float("nan"))
            _launch_all(st, cfg, x, ids, w, out)
            assert rel_l2(out, want) <= 1e-2, (name, split1, split2, M, rel_l2(out, want))
            first = out.clone()
            for _ in range(20):
                _launch_all(st, cfg, x, ids, w, out)
                assert torch.equal(out, first)
            a = st.plans.arena.buffers
            assert not a["cnt1"].any() and not a["cnt2"].any()
        out = torch.empty_like(x)
        _assert_graph_replays_new_inputs(lambda: _launch_all(st, cfg, x, ids, w, out), layer, ref, x, ids, w, out,
                                         (51, 52))


@pytest.mark.parametrize("name", ["gpt-oss-120b", "qwen3-30b-a3b", "dsv4-tp4", "odd-3x96", "odd-ep"])
def test_gpu_gemv_mma_matches_reference_and_tl_dot(name):
    """The GEMV on mma.sync (``gluon_gemv``; sm_90), its programs of 1, 2 and 4 chunks (K and N tails of
    half a chunk in the odd layers), 1-4 tokens with padding, other ranks' ids, both W13 layouts, the
    limit and the global scales: against the reference and the tl.dot GEMV with x quantized first
    (the same products; the fp32 sums split at other points), bit-identical over 20 runs, the counts
    back at zero after each call, and under CUDA-graph replay with new inputs; the untuned plans of
    every token count the GEMV path serves run it. Programs that keep fewer chunks' loads in flight
    than they multiply (``Config.window``) write the bits of the same programs with every load first."""
    import dataclasses

    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P

    if not P.gemv_mma_status(torch.device("cuda"))[0]:
        pytest.skip(f"the mma.sync GEMV does not run here: {P.gemv_mma_status(torch.device('cuda'))[1]}")
    layer = make_layer(seed=sum(map(ord, name)), device="cuda", **GEOMETRIES[name])
    ref = layer.prepare(backend="reference")
    h = layer.prepare(backend="triton", tune=False, gemv=True, max_tokens=4, deterministic=True, frozen=False)
    st = h._state
    g = st.plans.geometry
    assert st.plans.mma and all(c.mma for M, c in st.plans.configs.items() if M <= P.GEMV_MMA_MAX_TOKENS)
    assert st.plans.mma_pdl or torch.cuda.get_device_capability()[0] < 9  # (PDL from sm_90 on)
    forms = [(2, 4, 0), (4, 6, 0), (1, 1, 0), (4, 6, 3), (3, 4, 1)]
    for M in range(1, P.GEMV_MMA_MAX_TOKENS + 1):  # (the untuned plans')
        if P.gemv_mma_form(M, g) + (P.GEMV_MMA_WINDOW,) not in forms:
            forms += [P.gemv_mma_form(M, g) + (P.GEMV_MMA_WINDOW,)]
    for q1, q2, window in forms:
        for i, M in enumerate((1, 2, 4)):
            base = P.default_config(M, g, gemv=True)
            one = P.mma_config(base, g, q1, q2, 0)  # (every load first)
            cfg = dataclasses.replace(one, window=window)
            tl_cfg = dataclasses.replace(base, xq=True)
            for c in (cfg, tl_cfg, one):
                st.plans.reserve(M, c)
            x, ids, w = make_batch(layer, M, seed=60 + i, device="cuda", padding_rows=min(1, M // 2))
            want = b12x_ops.moe_w4a8(x, ids, w, ref)
            dot = torch.empty_like(x)
            _launch_all(st, tl_cfg, x, ids, w, dot)
            out = torch.full_like(x, float("nan"))
            _launch_all(st, cfg, x, ids, w, out)
            what = (name, q1, q2, window, M)
            assert rel_l2(out, want) <= 1e-2, (what, rel_l2(out, want))
            assert rel_l2(out, dot) <= 1e-3, (what, rel_l2(out, dot))
            if window:
                by_one = torch.empty_like(x)
                _launch_all(st, one, x, ids, w, by_one)
                assert torch.equal(out, by_one), what
            first = out.clone()
            for _ in range(20):
                _launch_all(st, cfg, x, ids, w, out)
                assert torch.equal(out, first), what
            a = st.plans.arena.buffers
            assert not a["cnt1"].any() and not a["cnt2"].any(), what
    out = torch.empty_like(x)
    _assert_graph_replays_new_inputs(lambda: _launch_all(st, cfg, x, ids, w, out), layer, ref, x, ids, w, out,
                                     (61, 62))


@pytest.mark.parametrize("name", ["gpt-oss-120b", "dsv4-tp4", "qwen3-30b-a3b", "odd-ep"])
def test_gpu_gemv_fused_matches_two_launches(name):
    """The one-launch GEMV (``kernels.gemv_fused_kernel``, gemv2's programs waiting on their token's
    gemv1 programs inside one grid; what eager calls launch at 1-2 tokens) writes the same bits as
    the two launches (what graph capture records), the default splits and others, every one of 50
    runs (a missed wait would read unfinished activations), its tickets and counts back at zero,
    and under CUDA-graph replay."""
    import dataclasses

    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P

    layer = make_layer(seed=sum(map(ord, name)), device="cuda", **GEOMETRIES[name])
    ref = layer.prepare(backend="reference")
    h = layer.prepare(backend="triton", tune=False, gemv=True, max_tokens=4, frozen=False)
    st = h._state
    g = st.plans.geometry
    for M in (1, 2, 3, 4):
        base = P.default_config(M, g, gemv=True)
        assert base.xq == P.gemv_quantizes_x_first(M, g)
        for split1, split2 in ((base.split1, base.split2), (1, 1), (3, 2 * g.top_k)):
            two = dataclasses.replace(base, split1=split1, split2=split2, fused=False)
            one = dataclasses.replace(two, fused=True, xq=False)  # (x quantized on the fly)
            st.plans.reserve(M, two)
            st.plans.reserve(M, one)
            x, ids, w = make_batch(layer, M, seed=60 + M, device="cuda", padding_rows=M // 2)
            want = torch.full_like(x, float("nan"))
            _launch_all(st, two, x, ids, w, want)
            assert rel_l2(want, b12x_ops.moe_w4a8(x, ids, w, ref)) <= 1e-2
            out = torch.full_like(x, float("nan"))
            for _ in range(50):
                _launch_all(st, one, x, ids, w, out)
                assert torch.equal(out, want), (name, M, split1, split2)
            a = st.plans.arena.buffers
            assert not a["sync"].any() and not a["cnt1"].any() and not a["cnt2"].any()
        out = torch.empty_like(x)
        _assert_graph_replays_new_inputs(lambda: _launch_all(st, one, x, ids, w, out), layer, ref, x, ids, w, out,
                                         (61, 62))
    # through the op: an eager call takes the one launch, a captured call the two, with the same bits
    gp = st.plans
    for M in (1, 2, 3, 4):
        cap = gp.cap_for(M)  # (prepare keeps the eager form only where it timed faster: here, always)
        gp.eager_runners[cap] = gp.runner(P.eager_form(gp.runners[cap].cfg, gp.geometry), cap)
        assert gp.runner_for(M, torch.cuda.is_current_stream_capturing).cfg.fused
        x, ids, w = make_batch(layer, M, seed=70 + M, device="cuda")
        eager = b12x_ops.moe_w4a8(x, ids, w, h)
        out = torch.full_like(x, float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            b12x_ops.moe_w4a8_out(x, ids, w, h, out)
        graph.replay()
        assert torch.equal(out, eager), (name, M)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "odd-ep"])
def test_gpu_tl_dot_kernels_sum_right_in_the_tiles_the_ptx_decode_takes(name):
    """The ``tl.dot`` kernels with the inline-PTX decode, in each tile (columns, warps) that
    ``plan.DOT_PTX_TILES`` lets them take: the blocked GEMM1 and GEMM2 at 16-row blocks with K steps of
    64 and 128, gemv1 and gemv2 at their own, against the reference; tiles outside it (32 columns, 2
    warps: wrong sums on an H100, ``results/dot_tiles.md``) are refused before anything launches, with
    ``out`` untouched."""
    import dataclasses

    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P

    if torch.cuda.get_device_capability() != P.PTX_CAPABILITY:
        pytest.skip("the inline-PTX decode runs on sm_90 only (plan.ptx_status)")
    layer = make_layer(seed=sum(map(ord, name)), device="cuda", **GEOMETRIES[name])
    ref = layer.prepare(backend="reference")
    h = layer.prepare(backend="triton", tune=False, max_tokens=64, frozen=False)
    st = h._state
    assert st.plans.ptx
    for M, gemv, bks in ((37, False, (64, 128)), (2, True, (None,))):
        x, ids, w = make_batch(layer, M, seed=90 + M, device="cuda", padding_rows=1)
        want = b12x_ops.moe_w4a8(x, ids, w, ref)
        base = dataclasses.replace(P.default_config(M, st.plans.geometry, gemv=gemv), gluon=False, gluon2=False)
        if not gemv:
            base = dataclasses.replace(base, bm=16)
        for bn, warps in P.DOT_PTX_TILES:
            for bk in bks:
                both = dict(bn1=bn, warps1=warps, bn2=bn, warps2=warps)
                if bk:
                    both.update(bk1=bk, bk2=bk)
                cfg = dataclasses.replace(base, **both)
                st.plans.reserve(M, cfg)
                out = torch.full_like(x, float("nan"))
                _launch_all(st, cfg, x, ids, w, out)
                assert rel_l2(out, want) <= 1e-2, (name, M, bn, warps, bk, rel_l2(out, want))
        for bad in (dict(bn1=32, bn2=32), dict(warps1=2, warps2=2)):
            cfg = dataclasses.replace(base, **bad)
            out = torch.full_like(x, float("nan"))
            with pytest.raises(ValueError, match="with the inline-PTX decode"):
                st.plans.reserve(M, cfg)
                _launch_all(st, cfg, x, ids, w, out)
            assert torch.isnan(out).all()


@pytest.mark.parametrize("name", ["gpt-oss-120b", "dsv4-tp4", "qwen3-30b-a3b", "odd-3x96", "odd-ep"])
def test_gpu_gluon_gemms_match_tl_gemms(name):
    """The GEMMs in Gluon (``gluon_kernels``: asynchronous MMAs under the next step's decode; sm_90)
    write the same bits as the ``tl.dot`` GEMMs of the same block size and K step (GEMM1's
    intermediate activations, GEMM2's per-slot rows of the deterministic form), for blocks of 16, 64
    and 128 rows, both tile heights, 16 or 32 weight rows a warp (the latter up to 32-row blocks),
    several K steps and pipeline depths, tails of K and N, padding,
    both W13 layouts, the limit and the global scales; and the whole op with both stays within the reference's bound.
    (One routing pass serves each comparison: with several routing programs the order of a block's
    rows depends on their atomics.)"""
    import dataclasses

    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import gluon_kernels as GK
    from b12x_ops.backends.triton import plan as P

    if torch.cuda.get_device_capability() != (9, 0) or not GK.HAS_GLUON:
        pytest.skip("the Gluon GEMMs need sm_90 (wgmma) and triton's Gluon")
    layer = make_layer(seed=sum(map(ord, name)), device="cuda", **GEOMETRIES[name])
    ref = layer.prepare(backend="reference")
    h = layer.prepare(backend="triton", tune=False, gemv=False, max_tokens=700, frozen=False)
    st = h._state
    g = st.plans.geometry
    for i, M in enumerate((37, 700)):
        x, ids, w = make_batch(layer, M, seed=80 + i, device="cuda", padding_rows=3)
        out = torch.empty_like(x)
        for bm in (16, 32, 64, 128):  # (every block size; 16, of 8-64 tokens, runs tl.dot by default)
            base = dataclasses.replace(P.default_config(M, g, gemv=False), bm=bm, atomic=False)
            st.plans.reserve(M, base)
            _launch_all(st, base, x, ids, w, out, stages=("prologue",))

            def written(cfg, stage, buf):  # (the stage's output buffer, after one launch over sevens)
                t = st.plans.arena.buffers[buf]
                t.fill_(7)
                _launch_all(st, cfg, x, ids, w, out, stages=(stage,))
                return t.clone()

            # (Gluon warps: 16 weight rows a warp, or 32 where the block is small enough for its registers)
            for bn1, bk, stages, rpw in ((64, 128, 4, 16), (64, 64, 4, 16), (64, 64, 6, 32), (128, 64, 4, 16),
                                         (128, 64, 4, 32), (128, 64, 6, 16), (64, 64, 6, 16)):
                if rpw == 32 and bm > 32:
                    continue
                tl1 = dataclasses.replace(base, bn1=bn1, bk1=bk, warps1=4 * bn1 // 64, stages1=2)
                want = written(tl1, "gemm1", "act")
                act = written(dataclasses.replace(tl1, gluon=True, stages1=stages, warps1=2 * bn1 // rpw), "gemm1",
                              "act")
                assert torch.equal(act.view(torch.int16), want.view(torch.int16)), ("gemm1", name, M, bm, bn1, bk, rpw)
            for bn2, bk, stages, rpw in ((128, 64, 4, 16), (128, 64, 6, 32), (256, 64, 4, 16), (256, 64, 4, 32),
                                         (128, 128, 4, 16), (256, 64, 6, 16)):
                if rpw == 32 and bm > 32:
                    continue
                tl2 = dataclasses.replace(base, bn2=bn2, bk2=bk, warps2=4 * bn2 // 128, stages2=2)
                want = written(tl2, "gemm2", "slots")
                slots = written(dataclasses.replace(tl2, gluon2=True, stages2=stages, warps2=bn2 // rpw), "gemm2",
                                "slots")
                assert torch.equal(slots, want), ("gemm2", name, M, bm, bn2, bk, rpw)
            for atomic in (False, True):
                both = dataclasses.replace(base, gluon=True, bn1=128, bk1=64, stages1=4, warps1=16, gluon2=True,
                                           bn2=256, bk2=64, stages2=4, warps2=16, atomic=atomic)
                st.plans.reserve(M, both)
                _launch_all(st, both, x, ids, w, out)
                assert rel_l2(out, b12x_ops.moe_w4a8(x, ids, w, ref)) <= 1e-2, (name, M, bm, atomic)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-120b", "odd-ep"])
def test_gpu_gluon_gemm1_zeroes_the_accumulator(name, monkeypatch):
    """Atomic plans with the Gluon GEMM1 zero GEMM2's fp32 accumulator there, not in the prologue
    (``plan.acc_zero_in_gemm1``, sm_90): over an accumulator of sevens the prologue leaves it, GEMM1
    zeroes its first M rows and nothing past them (before its main loop or after its epilogue, both
    places), at 37 and 700 tokens and 32-, 64- and 128-row blocks, and 16-row ones where GEMM1 takes
    Gluon there (programs of one row to several),
    the padding blocks' programs too; the whole op then stays within the reference's bound
    and within the atomics' reordering of the output with the zeros in the prologue
    (``B12X_OPS_TRITON_ACC_ZERO=prologue``)."""
    import dataclasses

    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import gluon_kernels as GK
    from b12x_ops.backends.triton import plan as P

    if torch.cuda.get_device_capability() != (9, 0) or not GK.HAS_GLUON:
        pytest.skip("the Gluon GEMMs need sm_90 (wgmma) and triton's Gluon")
    layer = make_layer(seed=sum(map(ord, name)) + 5, device="cuda", **GEOMETRIES[name])
    ref = layer.prepare(backend="reference")
    h = layer.prepare(backend="triton", tune=False, gemv=False, max_tokens=700, frozen=False)
    st, gp = h._state, h._state.plans
    K = gp.geometry.hidden_size
    for i, M in enumerate((37, 700)):
        x, ids, w = make_batch(layer, M, seed=120 + i, device="cuda", padding_rows=3)
        want = b12x_ops.moe_w4a8(x, ids, w, ref)
        bms = (32, 64, 128) + ((16,) if P.gluon_forms(16, gp.geometry, M)[0] else ())  # (16: GEMM1 of a short N)
        for bm, where in [(bm, where) for bm in bms for where in ("gemm1", "gemm1_last")]:
            monkeypatch.setenv("B12X_OPS_TRITON_ACC_ZERO", where)
            cfg = gp.with_gluon(dataclasses.replace(P.default_config(M, gp.geometry, gemv=False), bm=bm, atomic=True),
                                M)
            assert cfg.gluon and P.acc_zero_in_gemm1(cfg), (name, M, bm)
            gp.reserve(M, cfg)
            acc = gp.arena.buffers["acc"]
            acc.fill_(7)
            out = torch.empty_like(x)
            _launch_all(st, cfg, x, ids, w, out, stages=("prologue",))
            assert bool((acc == 7).all()), (name, M, bm, "the prologue wrote the accumulator")
            _launch_all(st, cfg, x, ids, w, out, stages=("gemm1",))
            # (past M: the arena's room for 700 tokens, untouched)
            assert bool((acc[:M * K] == 0).all()) and bool((acc[M * K:] == 7).all()), (name, M, bm, where)
            _launch_all(st, cfg, x, ids, w, out, stages=("gemm2", "finalize"))
            assert rel_l2(out, want) <= 1e-2, (name, M, bm, rel_l2(out, want))
            monkeypatch.setenv("B12X_OPS_TRITON_ACC_ZERO", "prologue")
            before = torch.empty_like(x)
            _launch_all(st, cfg, x, ids, w, before)
            assert rel_l2(out, before) <= 1e-3, (name, M, bm, where, rel_l2(out, before))


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "dsv4-tp4", "odd-ep"])
def test_gpu_half_tiles_write_what_full_tiles_write(name, monkeypatch):
    """A block of at most half its rows runs the half tile (``plan.half_tiles``), and from 64-row blocks
    one of at most a quarter the quarter tile (``plan.quarter_tiles``), in the tl.dot and the Gluon GEMMs
    (sm_90): the activations and per-slot rows are the full tile's, byte for byte, at 32-, 64- and
    128-row blocks, with blocks on both sides of half and of a quarter."""
    import dataclasses

    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import kernels as K_
    from b12x_ops.backends.triton import plan as P

    layer = make_layer(seed=sum(map(ord, name)), device="cuda", **GEOMETRIES[name])
    h = layer.prepare(backend="triton", tune=False, gemv=False, max_tokens=700, frozen=False, deterministic=True)
    st, gp = h._state, h._state.plans
    x, ids0, w = make_batch(layer, 700, seed=91, device="cuda", padding_rows=3)
    monkeypatch.setattr(P, "HALF_MIN_BM", 32)  # (the kernels' half path from 32-row blocks, the default's 64)
    lo, hi = layer.offset, layer.offset + layer.E
    local = ((ids0 >= lo) & (ids0 < hi)).flatten().nonzero().squeeze(1)
    for bm in (32, 64, 128):
        # the batch's local slots moved so that experts 0, 1, 2 hold a full block and a last block of
        # at most a quarter, of a quarter to half, and of more than half of bm rows (the rest of the
        # slots spread over the other experts)
        counts = (bm + max(1, bm // 8), bm + 3 * bm // 8, 2 * bm - 3)
        assert local.numel() >= sum(counts), (name, bm, local.numel())
        new = lo + torch.arange(local.numel(), device="cuda") % max(1, layer.E - 3) + min(3, layer.E - 1)
        at = 0
        for j, c in enumerate(counts):
            new[at:at + c] = lo + j
            at += c
        ids = ids0.flatten().clone()
        ids[local] = new.to(ids.dtype)
        ids = ids.view_as(ids0)
        base = dataclasses.replace(P.default_config(700, gp.geometry, gemv=False), bm=bm, atomic=False)
        for cfg in dict.fromkeys((base, gp.with_gluon(base))):  # (tl.dot, then the Gluon forms on sm_90)
            written = {}
            # one routing pass for all (with several routing programs the order of a block's rows
            # depends on their atomics), then each setting's GEMMs over buffers of sevens
            gp.reserve(700, cfg)
            _launch_all(st, cfg, x, ids, w, torch.empty_like(x), stages=("prologue",))
            for tail, half, quarter in ((2, "1", "1"), (1, "1", "0"), (0, "0", "1")):
                monkeypatch.setenv("B12X_OPS_TRITON_HALF", half)
                monkeypatch.setenv("B12X_OPS_TRITON_QUARTER", quarter)
                gp.reserve(700, cfg)
                assert gp.runner(cfg).gemm1.constexprs["HALF"] == (min(tail, 1) if bm < P.QUARTER_MIN_BM else tail)
                out = torch.empty_like(x)
                a = gp.arena.buffers
                a["act"].fill_(7)
                a["slots"].fill_(7)
                _launch_all(st, cfg, x, ids, w, out, stages=("gemm1", "gemm2", "finalize"))
                written[tail] = [t.clone().view(torch.uint8) for t in (out, a["act"], a["slots"])]
            rows = gp.arena.buffers["blk_rows"][:K_.num_blocks(ids.numel(), layer.E, bm)]
            assert ((rows > 0) & (rows <= bm // 2)).any() and (rows > bm // 2).any(), (name, bm)
            if bm >= P.QUARTER_MIN_BM:
                assert ((rows > 0) & (rows <= bm // 4)).any() and ((rows > bm // 4) & (rows <= bm // 2)).any(), \
                    (name, bm, rows.tolist())
            for tail in (2, 1):
                for what, got, want in zip(("out", "act", "slots"), written[tail], written[0]):
                    assert torch.equal(got, want), (name, bm, cfg.gluon, cfg.gluon2, tail, what)


@pytest.mark.parametrize("name, M", [("gpt-oss-120b", 4096), ("dsv4-tp4", 2048)])
def test_gpu_edge_tiles_write_what_whole_launches_write(name, M, monkeypatch):
    """The Gluon GEMMs' part-empty last column tile in a narrower launch of its own (``plan.edge_split``:
    gpt-oss's GEMM1 and GEMM2, DSv4's GEMM1, at 128-row blocks) writes the activations, per-slot rows
    and output of the one wide launch, byte for byte, with full, half and quarter tiles of rows; atomic
    plans match the reference both ways. (One launch of each stage, so at most the per-slot rows' buffer
    of tokens, ``slot_chunk``: DSv4's local ids drawn from 96 experts for about 128 rows an expert.)"""
    import dataclasses

    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P

    layer = make_layer(seed=sum(map(ord, name)), device="cuda", **GEOMETRIES[name])
    ref = layer.prepare(backend="reference")
    h = layer.prepare(backend="triton", tune=False, gemv=False, max_tokens=M, frozen=False, deterministic=True)
    st, gp = h._state, h._state.plans
    if not gp.gluon:
        pytest.skip("the Gluon GEMMs run on sm_90 only")
    assert M <= gp.slot_chunk, (name, M, gp.slot_chunk)
    x, ids, w = make_batch(layer, M, seed=17, device="cuda", padding_rows=5)
    lo, keep = layer.offset, max(layer.top_k, min(layer.E, M * layer.top_k // 128))
    local = (ids >= lo) & (ids < lo + layer.E)
    fold = torch.rand(M, keep, device="cuda", generator=torch.Generator("cuda").manual_seed(5)).argsort(dim=1)
    ids = torch.where(local, (lo + fold[:, :layer.top_k]).to(ids.dtype), ids)  # (distinct in a token still)
    want = b12x_ops.moe_w4a8(x, ids, w, ref)
    base = gp.with_gluon(P.default_config(8192, gp.geometry, gemv=False), 8192)
    assert base.bm == 128 and base.gluon and base.gluon2
    for atomic in (False, True):
        cfg = dataclasses.replace(base, atomic=atomic)
        gp.reserve(M, cfg)
        _launch_all(st, cfg, x, ids, w, torch.empty_like(x), stages=("prologue",))  # (one routing for all)
        written = {}
        for edge in ("1", "0"):
            monkeypatch.setenv("B12X_OPS_TRITON_EDGE", edge)
            rn = gp.runner(cfg)
            assert (rn.edge1 is not None, rn.edge2 is not None) == ((edge == "1", edge == "1" and name == "gpt-oss-120b"))
            a = gp.arena.buffers
            a["act"].fill_(7)
            a["slots"].fill_(7)
            if atomic:
                a["acc"].zero_()
            out = torch.empty_like(x)
            _launch_all(st, cfg, x, ids, w, out, stages=("gemm1", "gemm2", "finalize"))
            torch.cuda.synchronize()
            assert rel_l2(out, want) <= 1e-2, (name, atomic, edge)
            written[edge] = [t.clone().view(torch.uint8) for t in (out, a["act"], a["slots"])]
        rows = gp.arena.buffers["blk_rows"][:gp.runner(cfg).blocks(ids.numel())]
        assert (rows == 128).any() and ((rows > 64) & (rows < 128)).any() and ((rows > 0) & (rows <= 32)).any(), \
            rows.tolist()
        for what, got, same in zip(("out", "act", "slots"), written["1"], written["0"]):
            if atomic and what != "act":  # (the atomic sums' order varies: the reference above)
                continue
            assert torch.equal(got, same), (name, atomic, what)


@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "dsv4-tp4", "odd-ep"])
def test_gpu_pdl_matches_reference_eager_and_captured(name, pdl, monkeypatch):
    """``B12X_OPS_TRITON_PDL=1`` (the default on sm_90 and newer): every stage kernel launches as a
    programmatic dependent launch and waits for the previous one first; ``0``: none does. The GEMV
    path, the blocked path at 16-, 64- and 128-row blocks (the Gluon GEMMs on sm_90) match the
    reference, eager and replayed from a CUDA graph with new inputs. (The Gluon GEMMs once launched
    early without waiting: relative L2 0.3-0.4 at 2048 tokens.)"""
    from b12x_ops.backends import triton as TB
    from b12x_ops.backends.triton import plan as P

    monkeypatch.setenv("B12X_OPS_TRITON_PDL", pdl)
    monkeypatch.setattr(TB, "_SHARED", {})  # (plans of their own, made with PDL on or off)
    layer = make_layer(seed=sum(map(ord, name)), device="cuda", **GEOMETRIES[name])
    ref = layer.prepare(backend="reference")
    h = layer.prepare(backend="triton", tune=False, max_tokens=2048)
    gp = h._state.plans
    if pdl == "1" and not P.pdl_status(torch.device("cuda"))[0]:
        pytest.skip(P.pdl_status(torch.device("cuda"))[1])
    assert gp.pdl == (pdl == "1")
    for i, M in enumerate((1, 5, 64, 700, 2048)):
        x, ids, w = make_batch(layer, M, seed=40 + i, device="cuda", padding_rows=min(2, M // 4))
        for _ in range(2):  # (the second call's kernels queue behind the first's)
            got = b12x_ops.moe_w4a8(x, ids, w, h)
        assert rel_l2(got, b12x_ops.moe_w4a8(x, ids, w, ref)) <= 1e-2, (name, M, "eager")
        out = torch.empty_like(x)
        b12x_ops.moe_w4a8_out(x, ids, w, h, out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            b12x_ops.moe_w4a8_out(x, ids, w, h, out)
        x2, ids2, w2 = make_batch(layer, M, seed=50 + i, device="cuda", padding_rows=min(2, M // 4))
        x.copy_(x2)
        ids.copy_(ids2)
        w.copy_(w2)
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        assert rel_l2(out, b12x_ops.moe_w4a8(x2, ids2, w2, ref)) <= 1e-2, (name, M, "graph")
        if M == 2048:
            cfg = gp.plan_for(M)[1]
            assert not cfg.gemv and cfg.bm >= 64, (M, cfg)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-120b", "dsv4-tp4", "odd-ep"])
def test_gpu_every_tile_candidate_matches_reference(name):
    """Every configuration the tuner may pick (GEMV and blocked tiles, 4- and 8-warp programs)
    against the reference, each run 5 times, with the intermediate activations checked finite:
    the decode's register grouping must hold in every tile shape, whatever a clamp might hide."""
    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P

    layer = make_layer(seed=sum(map(ord, name)), device="cuda", **GEOMETRIES[name])
    ref = layer.prepare(backend="reference")
    h = layer.prepare(backend="triton", tune=False, max_tokens=64, frozen=False)
    st = h._state
    g = st.plans.geometry
    bad = []
    for M in (2, 64):
        x, ids, w = make_batch(layer, M, seed=M, device="cuda", padding_rows=1)
        want = b12x_ops.moe_w4a8(x, ids, w, ref)
        for cfg in P.candidate_configs(M, g):
            st.plans.reserve(64, cfg)
            act = st.plans.arena.buffers["act"]
            for _ in range(5):
                act.zero_()
                out = torch.full_like(x, float("nan"))
                _launch_all(st, cfg, x, ids, w, out)
                err = rel_l2(out, want)
                if not (torch.isfinite(act).all() and err <= 1e-2):
                    bad.append((M, cfg, err, int((~torch.isfinite(act)).sum())))
                    break
    assert not bad, bad


@pytest.mark.parametrize("fold, top", [(False, 252), (True, 128)])
def test_gpu_ptx_decode_is_exact_for_every_code_and_scale(fold, top):
    """The inline-PTX MXFP4 decode of the repacked layout against the package's dequantizer, bit for
    bit: every code byte (both nibbles, signed zeros included) at every column with every scale byte
    of its range ([2, 252], or [2, 128] with the bias folded into the scale). The decoded tile goes
    through an MMA with the identity, as in the kernels (the asm relies on the MMA operand's
    register order)."""
    import triton
    import triton.language as tl

    from b12x_ops.backends.triton.layout import repack_codes
    from b12x_ops.backends.triton.mxtl import decode_repacked, load_repacked
    from b12x_ops.mx import dequantize_mxfp4

    @triton.jit
    def _decode(w_ptr, s_ptr, e_ptr, o_ptr, R: tl.constexpr, BKH: tl.constexpr, FOLD: tl.constexpr):
        pid = tl.program_id(0)  # a tile of 64 rows
        r = tl.arange(0, 64)
        h = tl.arange(0, BKH)
        s = tl.arange(0, BKH // 16)
        sc = tl.load(s_ptr + (pid * 64 + r)[:, None] * (BKH // 16) + s[None, :])
        NQ: tl.constexpr = BKH // 32
        ev, od = decode_repacked(load_repacked(w_ptr + pid * 4 * NQ * 512, tl.arange(0, 4) < 4, 0, NQ, 64, BKH), sc, 64,
                                 BKH, tl.bfloat16, True, FOLD)
        eye = (h[:, None] == h[None, :]).to(tl.bfloat16)
        rows = (pid * 64 + r)[:, None] * BKH + h[None, :]
        tl.store(e_ptr + rows, tl.dot(ev, eye))
        tl.store(o_ptr + rows, tl.dot(od, eye))

    R, BKH = 256, 128
    codes = torch.stack([torch.arange(256, dtype=torch.uint8).roll(i)[:BKH] for i in range(R)])  # every byte, every column
    scales = (2 + torch.arange(R * BKH // 16) % (top - 1)).to(torch.uint8).view(R, BKH // 16)  # 2..top
    ev = torch.empty(R, BKH, dtype=torch.float32, device="cuda")
    od = torch.empty_like(ev)
    _decode[(R // 64,)](repack_codes(codes[None].cuda()), scales.cuda(), ev, od, R=R, BKH=BKH, FOLD=fold, num_warps=4)
    want = dequantize_mxfp4(codes, scales).to(torch.bfloat16).float()
    assert torch.equal(ev.cpu(), want[:, 0::2]) and torch.equal(od.cpu(), want[:, 1::2])


@pytest.mark.parametrize("name, scale_range", [("gpt-oss-120b", (118, 125)), ("odd-ep", (118, 125)),
                                               ("odd-ep", (100, 200))])
def test_gpu_ptx_and_triton_decodes_agree(name, scale_range):
    from b12x_ops.backends.triton import plan as P

    if torch.cuda.get_device_capability() != P.PTX_CAPABILITY:
        pytest.skip("the inline-PTX decode runs on sm_90 only (plan.ptx_status)")
    layer = make_layer(seed=sum(map(ord, name)), device="cuda", scale_range=scale_range, **GEOMETRIES[name])
    ref = layer.prepare(backend="reference")
    hs = {p: layer.prepare(backend="triton", tune=False, gemv=False, ptx=p, max_tokens=512) for p in (True, False)}
    assert hs[True]._state.plans.ptx and not hs[False]._state.plans.ptx
    # scale bytes up to 128 take the decode with the bias folded into the scale, larger ones not
    assert hs[True]._state.plans.fold == (scale_range[1] <= 128)
    for i, M in enumerate((3, 100, 512)):
        x, ids, w = make_batch(layer, M, seed=60 + i, device="cuda", padding_rows=1)
        want = b12x_ops.moe_w4a8(x, ids, w, ref)
        got = {p: b12x_ops.moe_w4a8(x, ids, w, h) for p, h in hs.items()}
        assert rel_l2(got[True], want) <= 1e-2 and rel_l2(got[False], want) <= 1e-2
        assert rel_l2(got[True], got[False]) <= 1e-3  # the same weights; only the order of fp32 sums


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "dsv4-tp4"])
def test_gpu_short_k_steps_are_not_pipelined_deep(name):
    """GEMM2's 128-row tile of 64-element K steps at 3 stages gave wrong sums about once in 50
    calls on these shapes (H200): such launches get 2 stages, and 150 calls are all right."""
    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P

    layer = make_layer(seed=7, device="cuda", **{k: v for k, v in GEOMETRIES[name].items() if k != "limit"})
    ref = layer.prepare(backend="reference")
    h = layer.prepare(backend="triton", tune=False, deterministic=True, max_tokens=64, frozen=False, gemv=False)
    st = h._state
    x, ids, w = make_batch(layer, 32, seed=5, device="cuda", foreign=False)
    want = b12x_ops.moe_w4a8(x, ids, w, ref)
    cfg = P.Config.of(16, (64, 128, 4, 3), (128, 64, 4, 3), False)
    st.plans.reserve(64, cfg)
    assert st.plans.stages(cfg)[2].num_stages == 2
    bad = 0
    for _ in range(150):
        out = torch.empty_like(x)
        _launch_all(st, cfg, x, ids, w, out)
        bad += int(not (torch.isfinite(out).all() and rel_l2(out, want) <= 1e-2))
    assert bad == 0


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "dsv4-tp4"])
def test_gpu_128_row_gemm2_tile_is_right_every_call(name):
    """The 128-row plans' GEMM2 tile (128-element K steps at 3 stages, ``plan._REGIMES``) over full
    128-row blocks (the slots on few experts): 150 deterministic calls write the same bytes, and
    they are the reference's sums (the 64-element steps at 3 stages went wrong about once in 50)."""
    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P

    layer = make_layer(seed=8, device="cuda", **{k: v for k, v in GEOMETRIES[name].items() if k != "limit"})
    ref = layer.prepare(backend="reference")
    h = layer.prepare(backend="triton", tune=False, deterministic=True, max_tokens=256, frozen=False, gemv=False)
    st = h._state
    x, ids, w = make_batch(layer, 256, seed=6, device="cuda", foreign=False)
    # slot j of every token on local expert j: top_k experts of 256 rows, two full 128-row blocks each
    ids = layer.offset + torch.arange(layer.top_k, device="cuda", dtype=ids.dtype).expand(256, -1).contiguous()
    want = b12x_ops.moe_w4a8(x, ids, w, ref)
    cfg = P.default_config(8192, st.plans.geometry, gemv=False)
    cfg = P.Config.of(128, cfg.tiles1(), cfg.tiles2(), False)
    assert cfg.tiles2()[:4] == (128, 128, 4, 3)
    st.plans.reserve(256, cfg)
    assert st.plans.stages(cfg)[2].num_stages == 3
    first = None
    for _ in range(150):
        out = torch.empty_like(x)
        _launch_all(st, cfg, x, ids, w, out)
        first = out.clone() if first is None else first
        assert torch.equal(out.view(torch.int16), first.view(torch.int16))
    assert torch.isfinite(first).all() and rel_l2(first, want) <= 1e-2
