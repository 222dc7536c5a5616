"""The b12x backend without SM120 hardware.

* What b12x runs on the CPU runs for real here: ``plan_weights``, ``prepare_weights`` on CPU
  tensors (the repack happens in the checkpoint's own storage and still decodes to the same
  weights), one ``plan_execution`` declaration per capacity with its pins and routing.
* The capacity, chunk, plan-table, autotune, cache-directory, version and device rules are pure
  functions (``backends/_b12x_plans.py``), tested directly.
* Backend selection: never picked on the CPU or sm_90; an explicit request says why.
* The orchestration (plan set shared by layers, per-launch limit, arena, freeze, the op's bind/run
  path) is driven through ``prepare_experts`` and the op with a stand-in for the GPU-only part of
  b12x (``PreparationSession`` and the kernels), which records what the backend asked of it.

The real kernels against the reference: ``tests/test_b12x_sm12x.py`` (SM12x hardware).
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import os
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

import b12x_ops
from b12x_ops import backends
from b12x_ops.backends import _b12x_plans as plans
from b12x_ops.backends import b12x as B
from b12x_ops.mx import dequantize_mxfp4

import _samples

REPO = Path(__file__).resolve().parent.parent
_REAL_LOAD_API = B.load_api


def _api() -> B.Api:
    if B.library_module() is None:
        if os.environ.get("CI"):
            pytest.fail("CI installs the b12x extra: the b12x library must be importable")
        pytest.skip("the b12x library is not installed: pip install -e .[b12x]")
    return _REAL_LOAD_API()


# ============================================================================ pure: capacities
def test_exact_decode_capacities_are_batch_sizes_times_rows():
    # CUDA-graph batch sizes 1..4 with draft (5) and verify (6) rows, plus an explicit count
    assert plans.exact_decode_capacities((7,), (1, 2, 3, 4), (5, 6)) == (5, 6, 7, 10, 12, 15, 18, 20, 24)
    assert plans.exact_decode_capacities((3, 1, 3)) == (1, 3)
    assert plans.exact_decode_capacities((), (1, 2)) == (1, 2)  # one row per request by default
    for bad in ((0,), (-2,), (1.5,), (True,)):
        with pytest.raises(ValueError, match="graph_batch_sizes: expected positive ints"):
            plans.exact_decode_capacities((), bad)


def test_prefill_ladder():
    assert plans.prefill_ladder(4096, 128) == (128, 256, 512, 1024, 2048, 4096)
    assert plans.prefill_ladder(5000, 128) == (128, 256, 512, 1024, 2048, 4096, 5000)
    assert plans.prefill_ladder(6) == (1, 2, 4, 6)
    assert plans.prefill_ladder(100, 128) == (100,)
    assert plans.prefill_ladder(1) == (1,)
    assert plans.prefill_ladder(300, 100) == (128, 256, 300)  # the start rounds up to a power of two


def test_planned_capacities_union_and_top():
    assert plans.planned_capacities(512, (1, 2, 6), (128, 256)) == (1, 2, 6, 128, 256, 512)
    with pytest.raises(ValueError, match=r"prefill_ladder: expected counts <= max_tokens \(512\), got \[1024\]"):
        plans.planned_capacities(512, (), (128, 1024))
    with pytest.raises(ValueError, match="prefill_ladder: expected positive ints"):
        plans.planned_capacities(512, (), (0,))


def test_split_by_launch_limit_drops_above_and_picks_the_chunk():
    kept, dropped = plans.split_by_launch_limit({1: 1, 8: 8, 128: 4000, 4096: 4000, 8192: 4000})
    assert kept == (1, 8, 128) and dropped == (4096, 8192)
    assert plans.split_by_launch_limit({64: 64, 32: 32}) == ((32, 64), ())
    with pytest.raises(ValueError, match="no planned capacity fits"):
        plans.split_by_launch_limit({256: 100})


def test_capacity_index_smallest_capacity_at_or_above():
    idx = plans.capacity_index((1, 4, 6, 128), 128)
    caps = (1, 4, 6, 128)
    assert [caps[idx[m]] for m in (0, 1, 2, 4, 5, 6, 7, 128)] == [1, 1, 4, 4, 6, 6, 128, 128]
    assert len(idx) == 129


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(1, 300), min_size=1, max_size=12))
def test_capacity_index_property(caps):
    caps = tuple(sorted(caps))
    idx = plans.capacity_index(caps, caps[-1])
    for m in range(1, caps[-1] + 1):
        c = caps[idx[m]]
        assert c >= m and all(o < m for o in caps if o < c)


# ============================================================================ pure: plan table
def test_parse_plan_table_grammar():
    rules = plans.parse_plan_table("1-8=triton:48:16, 9-16@k3=internal:none:32,17=heur")
    assert rules == (
        plans.PlanRule(1, 8, None, plans.PlanPin("triton", 48, 16)),
        plans.PlanRule(9, 16, 3, plans.PlanPin("internal", None, 32)),
        plans.PlanRule(17, 17, None, None),
    )
    assert [str(r) for r in rules] == ["1-8=triton:48:16", "9-16@k3=internal:none:32", "17-17=heur"]
    assert plans.parse_plan_table(["4-4=internal:8:64"]) == (plans.PlanRule(4, 4, None, plans.PlanPin("internal", 8, 64)),)
    assert plans.parse_plan_table("") == ()


@pytest.mark.parametrize("text, why", [
    ("1-8", "bad entry"),
    ("8-1=heur", "bad range"),
    ("0-4=heur", "bad range"),
    ("1-8=cutlass:48:16", "planner must be one of"),
    ("1-8=triton:48", "expected <planner>:<mac|none>:<tile_m>"),
    ("1-8=triton:x:16", "must be ints"),
    ("1-8=triton:0:16", "max active clusters must be >= 1"),
    ("1-8=triton:48:24", "tile rows must be one of"),
])
def test_parse_plan_table_errors(text, why):
    with pytest.raises(ValueError, match=f"plan_table: .*{why}"):
        plans.parse_plan_table(text)


def test_match_plan_first_match_top_k_and_determinism():
    rules = plans.parse_plan_table("1-8@k6=heur,1-8=triton:48:16,9-96=internal:none:16")
    assert plans.match_plan(rules, 6, top_k=6) is None  # heur wins first for top-k 6
    assert plans.match_plan(rules, 6, top_k=3) == plans.PlanPin("triton", 48, 16)
    assert plans.match_plan(rules, 6, top_k=3, deterministic=True) == plans.PlanPin("internal", 48, 16)
    assert plans.match_plan(rules, 50, top_k=6) == plans.PlanPin("internal", None, 16)
    assert plans.match_plan(rules, 97, top_k=6) is None


def test_default_plan_table_pins_small_rows_on_compact_n64_only():
    n64 = plans.plan_table_for(576, None)  # DeepSeek-V4.1 at TP4/EP1: N = 576 = 4.5 x 128
    assert plans.match_plan(n64, 8, 6) == plans.DEFAULT_SMALL_PIN == plans.PlanPin("triton", 48, 16)
    assert plans.match_plan(n64, 9, 6) is None
    assert plans.plan_table_for(1152, None) == ()  # N % 128 == 0: b12x's heuristic everywhere
    assert plans.plan_table_for(576, "") == ()  # an explicit empty table removes the pin
    assert plans.plan_table_for(1152, "1-4=internal:none:16")[0].hi == 4
    assert plans.is_compact_n64(576) and plans.is_compact_n64(2880) and not plans.is_compact_n64(512)


def test_autotuned_capacities():
    caps = (1, 2, 6, 128, 256)
    assert plans.autotuned_capacities("decode", (1, 2, 6), caps, pinned=(1,), deterministic=False) == (2, 6)
    assert plans.autotuned_capacities(True, (1, 2, 6), caps, pinned=(), deterministic=False) == caps
    assert plans.autotuned_capacities(False, (1, 2, 6), caps, pinned=(), deterministic=False) == ()
    assert plans.autotuned_capacities("decode", (1, 2, 6), caps, pinned=(), deterministic=True) == ()
    with pytest.raises(ValueError, match="autotune: expected 'decode', True or False"):
        plans.autotuned_capacities("all", (), caps, (), False)


# ============================================================================ pure: cache dir, support
def test_resolve_cache_dir(tmp_path):
    b12x_default = tmp_path / "b12x" / "compile" / "preparation"
    env = {"HOME": str(tmp_path)}
    assert plans.resolve_cache_dir(tmp_path / "mine", b12x_default, env) == tmp_path / "mine"
    assert plans.resolve_cache_dir(None, b12x_default, {plans.CACHE_ENV: str(tmp_path / "env")}) == \
        tmp_path / "env" / "b12x-preparation"
    assert plans.resolve_cache_dir(None, b12x_default, {"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == \
        tmp_path / "xdg" / "b12x-ops" / "b12x-preparation"
    assert plans.resolve_cache_dir(None, b12x_default, {}) == Path.home() / ".cache" / "b12x-ops" / "b12x-preparation"
    with pytest.raises(ValueError, match="cache_dir: expected a directory of b12x-ops' own.*b12x's shared default"):
        plans.resolve_cache_dir(b12x_default, b12x_default, env)
    with pytest.raises(ValueError, match="b12x's shared default"):
        plans.resolve_cache_dir(str(b12x_default) + "/../preparation", b12x_default, env)


def test_device_reason():
    assert plans.device_reason("cpu") == "needs an SM120/SM121 GPU, found cpu"
    assert plans.device_reason("cuda", (9, 0), "NVIDIA H200") == "needs an SM120/SM121 GPU, found sm_90 (NVIDIA H200)"
    assert plans.device_reason("cuda", (10, 0), None) == "needs an SM120/SM121 GPU, found sm_100"
    assert plans.device_reason("cuda", None) == "needs an SM120/SM121 GPU, found no usable CUDA device"
    assert plans.device_reason("cuda", (12, 0), "NVIDIA RTX PRO 6000") is None
    assert plans.device_reason("cuda", (12, 1), "NVIDIA GB10") is None


def test_version_reason():
    assert plans.version_reason("b12x", "1.5.1") is None
    assert plans.version_reason("b12x", "1.9.0rc1") is None
    assert "b12x 1.4.2 is outside the versions b12x-ops supports (>= 1.5, < 2.0)" == plans.version_reason("b12x", "1.4.2")
    assert "outside" in plans.version_reason("b12x", "2.0.0")
    assert plans.version_reason("b12x_next", "commit a7d7d29b2ef8") is None  # the API check decides
    assert plans.version_reason("b12x", None) is None


def test_in_place_reason():
    assert plans.in_place_reason(5120, 576) is None  # compact N64
    assert plans.in_place_reason(2880, 2880) is None  # compact N64 (gpt-oss)
    assert plans.in_place_reason(7168, 256) is None
    assert plans.in_place_reason(256, 256) is None
    assert "K = 128 is not a multiple of 256" in plans.in_place_reason(128, 128)
    assert "K = 96 is not a multiple of 64" in plans.in_place_reason(96, 64)
    assert "N = 96 is neither" in plans.in_place_reason(256, 96)


# ============================================================================ selection
def _fake_gpu(monkeypatch, capability, name):
    monkeypatch.setattr(B, "_cuda_identity", lambda index: (capability, name))


def test_unavailable_reason_cpu_and_sm90(monkeypatch):
    assert B.unavailable_reason(torch.device("cpu")) == "needs an SM120/SM121 GPU, found cpu"
    assert B.unavailable_reason(torch.device("meta")) == "needs an SM120/SM121 GPU, found meta"
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    assert B.unavailable_reason(torch.device("cuda", 0)) == "needs an SM120/SM121 GPU, found sm_90 (NVIDIA H200)"


def test_unavailable_reason_sm120(monkeypatch):
    _fake_gpu(monkeypatch, (12, 0), "NVIDIA RTX PRO 6000 Blackwell")
    monkeypatch.setattr(B, "library_module", lambda: None)
    assert B.unavailable_reason(torch.device("cuda", 0)) == \
        "the b12x library is not installed (pip install b12x-ops[b12x])"
    monkeypatch.setattr(B, "library_module", lambda: "b12x")
    assert B.unavailable_reason(torch.device("cuda", 0)) is None


def test_library_module_prefers_b12x_next(monkeypatch):
    fake = types.ModuleType("b12x_next")
    fake.__spec__ = importlib.machinery.ModuleSpec("b12x_next", None)
    monkeypatch.setitem(sys.modules, "b12x_next", fake)
    assert B.library_module() == "b12x_next"


def test_explicit_request_says_why():
    layer = _samples.make_layer()
    with pytest.raises(RuntimeError, match=r"backend='b12x' cannot run on cpu: needs an SM120/SM121 GPU, found cpu"):
        layer.prepare(backend="b12x")


def test_auto_never_picks_b12x_on_cpu_or_sm90(monkeypatch):
    monkeypatch.setattr(backends, "CANDIDATES", ("b12x", "reference"))  # b12x first, as in the package
    assert backends.select("auto", torch.device("cpu")).NAME == "reference"
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    assert backends.select("auto", torch.device("cuda", 0)).NAME == "reference"
    st_ = backends.status("b12x", torch.device("cuda", 0))
    assert not st_.available and st_.reason == "needs an SM120/SM121 GPU, found sm_90 (NVIDIA H200)"
    _fake_gpu(monkeypatch, (12, 1), "NVIDIA GB10")
    assert backends.select("auto", torch.device("cuda", 0)).NAME == ("b12x" if B.library_module() else "reference")


def test_import_does_not_import_b12x():
    code = (
        "import sys, torch, b12x_ops\n"
        "from b12x_ops.backends import b12x as B\n"
        "B.unavailable_reason(torch.device('cpu')); B.library_module()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('b12x', 'b12x_next')]\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO)


# ============================================================================ API and drift
def test_installed_b12x_has_the_api():
    api = _api()
    assert api.module in ("b12x", "b12x_next")
    assert plans.version_reason(api.module, api.version) is None
    assert B.api_drift(api.fm, api.prep) == []
    assert api.default_cache_dir.name == "preparation"


def test_api_drift_lists_what_is_missing():
    api = _api()
    fm = types.SimpleNamespace(**{n: getattr(api.fm, n) for n in dir(api.fm) if not n.startswith("_")})
    del fm.bind
    fm.RoutingSpec = dataclasses.make_dataclass("RoutingSpec", ["deterministic"])
    fm.W13Layout = types.SimpleNamespace(W13="w13")
    missing = B.api_drift(fm, api.prep)
    assert missing == ["fused_moe.bind", "fused_moe.RoutingSpec.deterministic_output", "fused_moe.W13Layout.W31"]
    assert "preparation.PreparationSession" in B.api_drift(api.fm, types.SimpleNamespace(PreparedCall=api.prep.PreparedCall))


@pytest.fixture
def fresh_api(monkeypatch):
    monkeypatch.setattr(B, "_API", [])


def test_load_api_refuses_version_drift(fresh_api, monkeypatch):
    _api()
    B._API.clear()
    monkeypatch.setattr(B, "_version_of", lambda name, pkg: "2.1.0")
    with pytest.raises(RuntimeError, match=r"backend 'b12x': b12x(_next)? 2.1.0 is outside the versions .*pip install b12x-ops\[b12x\]"):
        B.load_api()


def test_load_api_refuses_api_drift(fresh_api, monkeypatch):
    _api()
    B._API.clear()
    monkeypatch.setattr(B, "api_drift", lambda fm, prep: ["fused_moe.bind"])
    with pytest.raises(RuntimeError, match=r"lacks the API this backend was written for \(missing: fused_moe.bind\)"):
        B.load_api()


def test_load_api_without_the_library(fresh_api, monkeypatch):
    monkeypatch.setattr(B, "library_module", lambda: None)
    with pytest.raises(RuntimeError, match=r"the b12x library is not installed \(pip install b12x-ops\[b12x\]\)"):
        B.load_api()


# ============================================================================ real b12x on the CPU
# Sizes b12x's CPU repack handles (whole 256 x 128 tiles): W2's scale tiles are non-trivial at N=256.
E, K, N = 3, 256, 256


def _layer(layout="w13", limit=7.0, seed=3):
    return _samples.make_layer(E=E, K=K, N=N, top_k=2, layout=layout, limit=limit, seed=seed, scale_range=(110, 135))


def _geometry(layer, deterministic=False):
    return b12x_ops.handle.Geometry(
        num_experts=layer.E, hidden_size=layer.K, intermediate_size=layer.N, top_k=layer.top_k,
        w13_layout=layer.layout, activation="silu", swiglu_limit=layer.limit, has_global_scales=False,
        device=torch.device("cpu"), deterministic=deterministic)


def _unrotate(rows: torch.Tensor, rotation: int) -> torch.Tensor:
    return torch.roll(rows, shifts=rotation, dims=0) if rotation else rows


def decode_w4a8_codes(rp: torch.Tensor, rows: int, k: int, rotation: int = 0) -> torch.Tensor:
    """Invert b12x's N256/K128 lane-major weight repack: ``[E, rows, k // 2]`` uint8 codes."""
    e, nt, kt = rp.shape[0], rows // 256, k // 128
    tiles = rp.reshape(e, nt, kt, 4, 8, 8, 4, 4)  # per tile (kt, k4, a8, c8, d4, b4)
    words = tiles.permute(0, 1, 4, 7, 5, 2, 3, 6).reshape(e, rows, k // 8)  # (a8, b4, c8, kt, k4, d4)
    words = torch.stack([_unrotate(w, rotation) for w in words])
    return words.contiguous().view(torch.uint8)


def decode_w4a8_scales(sfb: torch.Tensor, rows: int, k: int, rotation: int = 0) -> torch.Tensor:
    """Invert b12x's E8M0 scale repack: ``[E, rows, k // 32]`` uint8 bytes."""
    e, nt, kt = sfb.shape[0], rows // 256, k // 128
    tiles = sfb.contiguous().view(torch.uint8).reshape(e, nt, kt, 32, 8, 4)  # per tile (kt, 32, 8, 4)
    grid = tiles.permute(0, 1, 3, 4, 2, 5).reshape(e, rows, k // 32)
    return torch.stack([_unrotate(g, rotation) for g in grid])


def test_plan_weights_declares_w4a8_mx():
    api = _api()
    layer = _layer(limit=7.0)
    wp = B.plan_weights(api, _geometry(layer))
    assert wp.activation.mode == api.fm.ActivationMode.A8 and wp.activation.swiglu_limit == 7.0
    assert wp.activation.io_dtype == torch.bfloat16 and wp.activation.nonlinearity == "silu"
    assert wp.source.format == api.fm.PackedSourceFormat.MXFP4_E8M0_K32
    assert wp.source.w13_layout == api.fm.W13Layout.W13
    assert (wp.geometry.num_experts, wp.geometry.hidden_size, wp.geometry.intermediate_size) == (E, K, N)
    assert wp.prepared_format.packing.value == "qmma_repacked"
    assert [s.quant_mode for s in wp._impl.specs] == ["w4a8_mx"]
    assert B.plan_weights(api, _geometry(_layer(layout="w31"))).source.w13_layout == api.fm.W13Layout.W31


@pytest.mark.parametrize("layout", ["w13", "w31"])
def test_prepare_weights_repacks_in_place_and_decodes_to_the_same_weights(layout):
    api = _api()
    layer = _layer(layout=layout)
    want13 = dequantize_mxfp4(layer.w13, layer.w13_scale)  # [E, 2N, K] in the checkpoint's row order
    want2 = dequantize_mxfp4(layer.w2, layer.w2_scale)
    before = [t.clone() for t in (layer.w13, layer.w13_scale, layer.w2, layer.w2_scale)]
    ptrs = [t.untyped_storage().data_ptr() for t in (layer.w13, layer.w2, layer.w13_scale, layer.w2_scale)]

    experts = B.repack_in_place(api, B.plan_weights(api, _geometry(layer)),
                                layer.w13, layer.w13_scale, layer.w2, layer.w2_scale)
    w13_rp, w2_rp, w13_sfb, w2_sfb = B.prepared_representation(experts)
    # in place: the prepared tensors ARE the checkpoint's storage, and its bytes changed
    assert [t.untyped_storage().data_ptr() for t in (w13_rp, w2_rp, w13_sfb, w2_sfb)] == ptrs
    assert not torch.equal(layer.w13, before[0]) and not torch.equal(layer.w2, before[2])
    assert not torch.equal(layer.w13_scale, before[1]) and not torch.equal(layer.w2_scale, before[3])

    # still the same weights: b12x keeps W13 in kernel order [up; gate], rotating a w31 source by N
    rot = N if layout == "w31" else 0
    got13 = dequantize_mxfp4(decode_w4a8_codes(w13_rp, 2 * N, K, rot), decode_w4a8_scales(w13_sfb, 2 * N, K, rot))
    got2 = dequantize_mxfp4(decode_w4a8_codes(w2_rp, K, N), decode_w4a8_scales(w2_sfb, K, N))
    assert torch.equal(got13, want13) and torch.equal(got2, want2)
    assert torch.equal(decode_w4a8_codes(w13_rp, 2 * N, K, rot), before[0])


def test_repack_refused_when_not_in_place():
    api = _api()
    layer = _layer()

    class Copying:  # a b12x that prepared into fresh memory
        PackedWeights = api.fm.PackedWeights

        @staticmethod
        def prepare_weights(plan, weights):
            rep = types.SimpleNamespace(w13_rp=weights.w13.clone(), w2_rp=weights.w2, w13_sfb=weights.w13_block_scales,
                                        w2_sfb=weights.w2_block_scales)
            return types.SimpleNamespace(_impl=types.SimpleNamespace(representation_for=lambda mode: rep))

    fake = dataclasses.replace(api, module="b12x", fm=Copying)
    with pytest.raises(RuntimeError, match=rf"b12x did not repack E={E} K={K} N={N} in place"):
        B.repack_in_place(fake, None, layer.w13, layer.w13_scale, layer.w2, layer.w2_scale)


@pytest.mark.parametrize("deterministic", [False, True])
def test_plan_execution_declares_each_capacity(deterministic):
    api = _api()
    layer = _layer()
    experts = B.repack_in_place(api, B.plan_weights(api, _geometry(layer)),
                                layer.w13, layer.w13_scale, layer.w2, layer.w2_scale)
    caps = (1, 2, 6, 8, 128, 512)
    rules = plans.parse_plan_table("1-2=triton:48:16,6=internal:none:32,8=heur")
    declared = B.declare_plans(api, experts, caps, 2, rules, deterministic)
    assert sorted(declared) == list(caps)
    for cap, (plan, pin) in declared.items():
        q = plan.query
        assert (q.num_tokens, q.top_k, q.routed_rows) == (cap, 2, 2 * cap)
        assert (q.num_experts, q.hidden_size, q.intermediate_size) == (E, K, N)
        assert q.quant_mode == "w4a8_mx" and q.source_format == "fp4_e8m0_k32" and q.activation == "silu"
        assert q.swiglu_limit == 7.0 and q.w13_layout == "w13" and q.io_dtype == "bfloat16"
        assert q.deterministic_output is (True if deterministic else None)
        assert plan.component_id == "moe.decode" and plan.prepared is None  # declared, not prepared
        assert pin == plans.match_plan(rules, cap, 2, deterministic)
        if pin is None:
            assert plan.override is None
        else:
            o = plan.override
            assert (o.backend, o.route_planner, o.max_active_clusters, o.dynamic_tile_m, o.dynamic_route_mode) == \
                ("dynamic", pin.planner, pin.max_active_clusters, pin.tile_m, "grouped")
    assert declared[1][0].override.route_planner == ("internal" if deterministic else "triton")


# ============================================================================ options and checks
def _spec(layer, **kw):
    capacities = b12x_ops.handle.plan_capacities(kw.get("max_tokens", 8192), kw.get("decode_token_counts", ()))
    return b12x_ops.handle.ExpertsSpec(
        geometry=_geometry(layer, kw.pop("deterministic", False)),
        w13=layer.w13, w13_scale=layer.w13_scale, w2=layer.w2, w2_scale=layer.w2_scale,
        w13_global_scale=kw.pop("w13_global_scale", None), w2_global_scale=None, expert_offset=0,
        max_tokens=kw.pop("max_tokens", 8192), capacities=capacities, options=kw.pop("options", {}),
        decode_token_counts=tuple(kw.pop("decode_token_counts", ())))


def test_options_default_capacities(tmp_path):
    opts = B.parse_options(_spec(_layer(), max_tokens=512), tmp_path / "b12x")
    assert opts.exact == () and opts.capacities == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert opts.rules == () and opts.tuned == ()  # N = 256: no default pin; nothing exact to race
    assert opts.cache_dir.name == "b12x-preparation" and opts.freeze and opts.warmup and opts.direct_ids


def test_options_decode_graphs_and_ladder(tmp_path):
    spec = _spec(_layer(), max_tokens=4096, decode_token_counts=(3,),
                 options=dict(graph_batch_sizes=(1, 2, 4), rows_per_request=(5, 6), cache_dir=str(tmp_path / "c"),
                              plan_table="1-6=internal:none:16"))
    opts = B.parse_options(spec, tmp_path / "b12x")
    assert opts.exact == (3, 5, 6, 10, 12, 20, 24)
    assert opts.capacities == (3, 5, 6, 10, 12, 20, 24, 128, 256, 512, 1024, 2048, 4096)
    assert opts.tuned == (10, 12, 20, 24)  # exact decode counts, less the pinned ones
    assert opts.cache_dir == tmp_path / "c"
    spec.options["prefill_ladder"] = (256, 1024)
    assert B.parse_options(spec, tmp_path / "b12x").capacities == (3, 5, 6, 10, 12, 20, 24, 256, 1024, 4096)


@pytest.mark.parametrize("options, why", [
    (dict(warm_up=True), r"takes the options .* got unknown \['warm_up'\]"),
    (dict(graph_batch_sizes=(64,), rows_per_request=(6,)), r"expected counts <= max_tokens \(256\), got \[384\]"),
    (dict(prefill_ladder=(512,)), r"prefill_ladder: expected counts <= max_tokens \(256\)"),
    (dict(plan_table="1-8=fast"), "plan_table: bad plan"),
    (dict(autotune="yes"), "autotune: expected"),
    (dict(compile_workers=-1), "compile_workers: expected None or an int >= 0"),
    (dict(freeze="no"), "freeze: expected True or False"),
])
def test_options_errors(tmp_path, options, why):
    with pytest.raises(ValueError, match=why):
        B.parse_options(_spec(_layer(), max_tokens=256, options=options), tmp_path / "b12x")


def test_options_refuse_b12x_default_cache(tmp_path):
    with pytest.raises(ValueError, match="b12x's shared default"):
        B.parse_options(_spec(_layer(), options=dict(cache_dir=tmp_path / "b12x")), tmp_path / "b12x")


def test_check_weights():
    B.check_weights(_spec(_layer()))
    B.check_weights(_spec(_layer(), w13_global_scale=torch.ones(E)))
    with pytest.raises(ValueError, match="w13_global_scale: expected None or all ones"):
        B.check_weights(_spec(_layer(), w13_global_scale=torch.full((E,), 2.0)))
    layer = _layer()
    layer.w2_scale[1, 5, 2] = 250
    with pytest.raises(ValueError, match=r"w2_scale: expected E8M0 bytes <= 247 \(b12x clamps larger ones\), got 250 at index \[1, 5, 2\]"):
        B.check_weights(_spec(layer))
    small = _samples.make_layer(E=2, K=128, N=128)
    with pytest.raises(ValueError, match="w13: expected sizes b12x repacks in place, got K = 128 is not a multiple of 256"):
        B.check_weights(_spec(small))
    layer = _layer()
    layer.w2 = torch.empty(E, N // 2, K, dtype=torch.uint8).transpose(1, 2)
    with pytest.raises(ValueError, match="w2: expected a contiguous tensor"):
        B.check_weights(_spec(layer))


# ============================================================================ orchestration
class _Recorder:
    def __init__(self):
        self.sessions, self.binds, self.runs, self.prepared = [], [], [], []


class _FakeSession:
    """Stands in for b12x's PreparationSession (which needs a CUDA device): records requests and
    installs a prepared state whose kernel writes a recognisable result."""

    def __init__(self, rec, limit, **kw):
        self.rec, self.limit, self.kw = rec, limit, kw
        self.frozen = False
        self._guard = None
        rec.sessions.append(self)

    def prepare(self, requests, autotune=None):
        for r in requests:
            assert not self.frozen
            plan = r.plan
            self.rec.prepared.append((plan.cap, autotune, r.benchmark_call is not None, plan.override))
            state = _FakeState(experts=plan.experts, scratch=types.SimpleNamespace(
                launch_plan=types.SimpleNamespace(max_tokens_per_launch=self.limit)), rec=self.rec, cap=plan.cap)
            plan.prepared = types.SimpleNamespace(state=state, selection=types.SimpleNamespace(source="default", config="cfg"))

    def freeze(self):
        self.frozen = True
        self._guard = _guard_stub()

    def close(self):
        pass


def _guard_stub():
    return types.SimpleNamespace(__exit__=lambda *a: None)


@dataclasses.dataclass
class _FakeBinding:
    a: torch.Tensor
    ids: torch.Tensor
    w: torch.Tensor
    out: torch.Tensor
    experts: object
    cap: int
    plan: object = None


@dataclasses.dataclass
class _FakeState:
    experts: object
    scratch: object
    rec: object
    cap: int

    def bind(self, *, scratch, a, topk_ids, topk_weights, output):
        assert a.shape[0] <= self.cap and a.is_contiguous() and output.is_contiguous()
        assert len(scratch) == 1 and scratch[0].dtype == torch.uint8
        self.rec.binds.append((self.cap, a.shape[0], topk_ids.dtype, topk_ids.data_ptr()))
        return _FakeBinding(a, topk_ids, topk_weights, output, self.experts, self.cap)


class _FakePlan:
    def __init__(self, experts, cap, override):
        self.experts, self.cap, self.override, self.prepared = experts, cap, override, None

    def request(self, *, name, prepare_call, benchmark_call=None):
        return types.SimpleNamespace(plan=self, name=name, benchmark_call=benchmark_call)

    def scratch_specs(self):
        return (types.SimpleNamespace(name="arena", shape=(1000 * self.cap,), dtype=torch.uint8, nbytes=1000 * self.cap),)


def _fake_api(rec, limit):
    """The real b12x (weights are planned and repacked by it for real, on the CPU) with the
    GPU-only session and launch replaced by recorders. The stand-in kernel writes, per row,
    ``sum_j w[m, j] * (id[m, j] + 1)`` for ids in ``[0, E)`` into every column."""
    api = _api()

    def plan_execution(*, experts, capacity, routing=None, override=None):
        return _FakePlan(experts, capacity.max_tokens, override)

    def run(*, binding):
        assert binding.plan is not None and binding.plan.prepared is not None
        rec.runs.append((binding.cap, binding.a.shape[0], binding.experts))
        ids, w = binding.ids.long(), binding.w.float()
        ok = (ids >= 0) & (ids < E)
        val = torch.where(ok, w * (ids + 1), 0.0).sum(1)
        binding.out.copy_(val[:, None].expand_as(binding.out))

    fm = types.SimpleNamespace(**{n: getattr(api.fm, n) for n in dir(api.fm) if not n.startswith("_")})
    fm.plan_execution, fm.run = plan_execution, run
    prep = types.SimpleNamespace(PreparationSession=lambda **kw: _FakeSession(rec, limit, **kw),
                                 PreparedCall=api.prep.PreparedCall)
    return dataclasses.replace(api, fm=fm, prep=prep)


@pytest.fixture
def orchestrated(monkeypatch, tmp_path):
    rec = _Recorder()
    box = {"limit": 1 << 20}
    monkeypatch.setattr(B, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(B, "load_api", lambda: _fake_api(rec, box["limit"]))
    monkeypatch.setattr(B, "_PLAN_SETS", weakref.WeakValueDictionary())
    monkeypatch.setattr(B, "_FROZEN", weakref.WeakSet())
    monkeypatch.setenv(plans.CACHE_ENV, str(tmp_path / "cache"))
    rec.box = box
    return rec


def _expected(layer, ids, w):
    lid = ids.long() - layer.offset
    ok = (ids >= 0) & (lid >= 0) & (lid < layer.E)
    return torch.where(ok, w.float() * (lid + 1), 0.0).sum(1)


def test_prepare_plans_once_per_geometry_and_runs_through_bind(orchestrated):
    rec = orchestrated
    l1, l2 = _layer(seed=1), _layer(seed=2)
    kw = dict(backend="b12x", max_tokens=64, decode_token_counts=(1, 2, 6), warmup=False, plan_table="1-2=internal:none:16")
    h1, h2 = l1.prepare(**kw), l2.prepare(**kw)
    assert h1.backend == h2.backend == "b12x"
    assert len(rec.sessions) == 1  # one plan set for the geometry
    s = rec.sessions[0]
    assert s.frozen and s.kw["cache_dir"] == str(Path(os.environ[plans.CACHE_ENV]) / "b12x-preparation")
    assert [(c, tuned) for c, _, tuned, _ in rec.prepared] == [(1, False), (2, False), (6, True), (64, False)]
    assert [c for c, _, _, o in rec.prepared if o is not None] == [1, 2]
    assert h1.capacities == (1, 2, 6, 64) and h1.max_tokens == 64
    assert h1._state.plan_set is h2._state.plan_set
    assert h1._state.experts is not h2._state.experts
    mem = h1.memory
    assert mem["device_bytes"] == mem["checkpoint_bytes"] == sum(
        t.numel() for t in (l1.w13, l1.w13_scale, l1.w2, l1.w2_scale))
    assert mem["shared_scratch_bytes"] == 64_000  # the arena holds the largest plan's scratch

    x, ids, w = _samples.make_batch(l1, 5, foreign=False)
    out = b12x_ops.moe_w4a8(x, ids, w, h2)  # int32 / fp32 contiguous at offset 0: ids go direct
    assert rec.binds[-1][:3] == (6, 5, torch.int32) and rec.binds[-1][3] == ids.data_ptr()
    assert rec.runs[-1][2] is h2._state.experts  # the layer's own weights, on the shared plan
    torch.testing.assert_close(out[:, 0].float(), _expected(l1, ids, w).to(torch.bfloat16).float())
    rep = B.report(h2)
    assert rep["capacities"] == [1, 2, 6, 64] and rep["layers"] == 2 and rep["direct_ids"] and rep["tuned"] == [6]
    assert rep["pins"] == {1: "internal:none:16", 2: "internal:none:16"}


def test_capacities_above_the_launch_limit_are_dropped_and_batches_chunk(orchestrated):
    rec = orchestrated
    rec.box["limit"] = 40
    layer = _samples.make_layer(E=E, K=K, N=N, top_k=2, offset=4, seed=5)
    with pytest.warns(RuntimeWarning, match=r"capacities \[64, 128\] exceed b12x's per-launch token limit \(40\).*chunks of 32"):
        h = layer.prepare(backend="b12x", max_tokens=128, warmup=False, prefill_ladder=(8, 32, 64))
    assert h.capacities == (8, 32) and h.max_tokens == 32
    x, ids, w = _samples.make_batch(layer, 75, padding_rows=5, strided=True)  # EP offset 4: remapped
    rec.binds.clear()
    out = torch.full((75, 2 * K), 7.0, dtype=torch.bfloat16)[:, :K]  # rows strided: copied back
    b12x_ops.moe_w4a8_out(x, ids, w, h, out)
    assert [(c, m) for c, m, _, _ in rec.binds] == [(32, 32), (32, 32), (32, 11)]
    assert all(d == torch.int32 for _, _, d, _ in rec.binds)
    torch.testing.assert_close(out[:, 0].float(), _expected(layer, ids, w).to(torch.bfloat16).float())
    assert not out[-5:].any()  # padding rows contribute nothing


def test_run_path_details(orchestrated):
    rec = orchestrated
    layer = _layer(seed=7)
    h = layer.prepare(backend="b12x", max_tokens=16, warmup=True, deterministic=True)
    assert {c for c, _, _ in rec.runs} == set(h.capacities)  # warm-up ran every plan once
    assert rec.sessions[0].frozen and all(not tuned for _, _, tuned, _ in rec.prepared)  # no race when deterministic
    x, ids, w = _samples.make_batch(layer, 3, foreign=False)
    rec.binds.clear()
    b12x_ops.moe_w4a8(x, ids, w, h)
    assert rec.binds[-1][3] != ids.data_ptr()  # deterministic output takes the remap, never direct ids
    assert b12x_ops.moe_w4a8(x[:0], ids[:0], w[:0], h).shape == (0, K)
    with pytest.raises(ValueError, match="x: expected bfloat16 .*got torch.float16"):
        b12x_ops.moe_w4a8(x.half(), ids, w, h)


def test_second_geometry_lifts_and_restores_the_freeze(orchestrated):
    rec = orchestrated
    keep = [_layer(seed=1).prepare(backend="b12x", max_tokens=8, warmup=False)]
    first = rec.sessions[0]
    lifted = []
    first._guard = types.SimpleNamespace(__exit__=lambda *a: lifted.append(True))
    keep.append(_samples.make_layer(E=E, K=K, N=N, top_k=3, seed=2).prepare(backend="b12x", max_tokens=8, warmup=False))
    assert lifted == [True] and first._guard is not None and len(rec.sessions) == 2
    assert rec.sessions[1].frozen


def test_handle_hook_reports_planned_capacities(monkeypatch):
    seen = []
    stub = types.SimpleNamespace(
        NAME="stub", prepare=lambda spec: "state", planned_capacities=lambda state: (2, 5),
        run=lambda state, x, ids, w, out: (seen.append(x.shape[0]), out.zero_()))
    monkeypatch.setattr(b12x_ops.handle.backends, "select", lambda name, device: stub)
    layer = _samples.make_layer()
    h = layer.prepare(backend="auto", max_tokens=64)
    assert h.capacities == (2, 5) and h.max_tokens == 5
    x, ids, w = _samples.make_batch(layer, 12)
    b12x_ops.moe_w4a8(x, ids, w, h)
    assert seen == [5, 5, 2]
