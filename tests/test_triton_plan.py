"""The Triton backend's GEMV plan arithmetic (``plan.gemv_config``, ``plan.gemv_candidates``) on
the CPU: every default and candidate split gives each program work the kernels can do, and the
default is among what the tuner times. (The kernels themselves run in ``test_triton_interp.py``.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

pytest.importorskip("triton")

from b12x_ops.backends.triton import plan as P  # noqa: E402
from b12x_ops.handle import Geometry  # noqa: E402


def geometry(E, K, N, top_k):
    return Geometry(num_experts=E, hidden_size=K, intermediate_size=N, top_k=top_k, w13_layout="w13",
                    activation="silu", swiglu_limit=None, has_global_scales=False, device=torch.device("cpu"),
                    deterministic=False)


def parts_of(steps: int, split: int) -> list[int]:
    """Steps each of ``split`` programs takes when ``steps`` are cut in runs of ceil(steps / split)
    (``gemv1_kernel``'s ``PER``, ``gemv2_kernel``'s ``NPER``)."""
    per = -(-steps // split)
    return [max(0, min(steps, (p + 1) * per) - p * per) for p in range(split)]


def check_gemv1(g, tiles):
    bn, bk, warps, stages, split = tiles[:5]
    assert tiles[5:] in ((), (True,))  # (x quantized by a launch of its own)
    assert bn % 16 == 0 and bk % 64 == 0 and warps in (4, 8) and stages >= 1 and split >= 1
    steps = -(-g.hidden_size // bk)
    parts = parts_of(steps, split)
    assert sum(parts) == steps
    if split > 1:  # a split of a slot's K steps leaves no program of a tile idle but maybe the last
        assert all(p > 0 for p in parts[:-1]), (tiles, parts)
    assert stages == 1 or max(parts) > 1  # one-step programs need no pipeline


def check_gemv2(g, tiles):
    bn, bk, warps, stages, split = tiles
    assert bn % 16 == 0 and bk % 64 == 0 and stages >= 1 and split >= 1
    if split > g.top_k and split % g.top_k == 0:  # one slot and one run of its N steps a program
        steps = -(-g.intermediate_size // bk)
        runs = parts_of(steps, split // g.top_k)
        assert sum(runs) == steps and all(r > 0 for r in runs), (tiles, runs)  # no idle program
    else:  # runs of slots
        assert split <= g.top_k or split % g.top_k


GEOS = {"gpt-oss-120b": (128, 2880, 2880, 4), "dsv4.1-tp4": (384, 5120, 576, 6), "qwen3-30b-a3b": (128, 2048, 768, 8),
        "small": (5, 160, 64, 2)}


@pytest.mark.parametrize("name", list(GEOS))
@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
def test_gemv_defaults_are_valid_and_among_the_candidates(name, tokens):
    g = geometry(*GEOS[name])
    cfg = P.gemv_config(tokens, g)
    assert cfg.gemv and cfg.bm == 1 and not cfg.atomic  # gemv2 sums a token's slots itself
    check_gemv1(g, cfg.tiles1())
    check_gemv2(g, cfg.tiles2())
    cands = P.candidate_configs(tokens, g, gemv=True)
    assert cfg.tiles1() in {c.tiles1() for c in cands} and cfg.tiles2() in {c.tiles2() for c in cands}
    for c in cands:
        check_gemv1(g, c.tiles1())
        check_gemv2(g, c.tiles2())
    # x is quantized once, by a launch of its own, from a few tokens on (from 2 where N is wide: its
    # many column tiles would each quantize it again); the tuner times both ways
    assert cfg.xq == P.gemv_quantizes_x_first(tokens, g)
    assert cfg.xq == (tokens >= P.GEMV_XQ_TOKENS or (tokens == 2 and g.intermediate_size >= P.GEMV_XQ_WIDE_N))
    assert {c.xq for c in cands} == {False, True}
    assert all(P.Config.of(1, c.tiles1(), c.tiles2(), False, gemv=True) == c for c in cands)


def test_gemv_defaults_on_the_benchmark_layers():
    """The tiles the H200 sweeps and tuned runs chose (results/sweep_gemv_steps.md,
    sweep_gemv_defaults.md, NOTES): gpt-oss at one token one 256-element K step a gemv1 program, from
    2 tokens x quantized first and four 128-element steps (Qwen3 and DSv4 from 3); gemv2 in
    256-element N steps, runs of 4 at one token; fewer, longer programs as the tokens grow."""
    g = geometry(*GEOS["gpt-oss-120b"])
    assert P.gemv_config(1, g).tiles1() == (64, 256, 4, 1, 12)  # (one step a program under 4800 programs)
    assert P.gemv_config(2, g).tiles1() == (64, 128, 4, 3, 6, True)  # (x quantized first: 4 steps of 128, 3 stages)
    assert P.gemv_config(4, g).tiles1() == (64, 128, 4, 3, 6, True)
    qwen3 = geometry(128, 2048, 768, 8)
    assert P.gemv_config(2, qwen3).tiles1() == (64, 256, 4, 1, 8) and P.gemv_config(3, qwen3).xq
    assert P.gemv_config(1, g).tiles2() == (64, 256, 4, 3, 12)
    assert P.gemv_config(4, g).tiles2() == (64, 256, 4, 3, 4)
    # gemv2's 256-element steps only where their masked tail is at most an eighth of N
    dsv4 = geometry(384, 5120, 576, 6)
    assert P.gemv_config(1, dsv4).tiles2()[1] == 128 and P.gemv_config(1, g).tiles2()[1] == 256
    split1 = [P.gemv_config(m, g).split1 for m in (1, 2, 3, 4)]
    assert split1 == sorted(split1, reverse=True)


@settings(max_examples=300, deadline=None)
@given(E=st.integers(1, 512), K=st.integers(1, 256).map(lambda k: 32 * k), N=st.integers(1, 128).map(lambda n: 32 * n),
       top_k=st.integers(1, 16), tokens=st.integers(1, 4))
@example(E=1, K=32, N=3104, top_k=1, tokens=1)  # (25 N steps: 6 runs of 5 left one empty)
def test_gemv_splits_are_valid_for_any_layer(E, K, N, top_k, tokens):
    g = geometry(E, K, N, min(top_k, E))
    cfg = P.gemv_config(tokens, g)
    check_gemv1(g, cfg.tiles1())
    check_gemv2(g, cfg.tiles2())
    slots = tokens * g.top_k
    # gemv1's programs: about _GEMV1_PROGRAMS, or one step each when the slots x tiles are few
    programs = slots * -(-N // 64) * cfg.split1
    assert cfg.split1 == 1 or programs <= P._GEMV1_PROGRAMS + slots * -(-N // 64) * 2


def test_gluon_gemm2_output_layout_holds_each_element_once():
    """The Gluon GEMM2 epilogue's layout (``gluon_kernels._out_layout``: 4 adjacent outputs a thread,
    for 16-byte atomics) for every tile a plan or the tuner can launch (``bn2`` 128 or 256 at
    ``bn2 / 16`` warps; 16 to 128 token rows): it spans the tile exactly, so no element is held by
    two threads (an atomic issued twice would add twice) and none is left out; a tile it cannot
    cover so is refused when compiling."""
    from b12x_ops.backends.triton import gluon_kernels as GK

    if not GK.HAS_GLUON:
        pytest.skip("this triton has no Gluon")
    for bn in (128, 256):
        nw = bn // 16
        for bm in (16, 32, 64, 128):  # (the half tiles of 64 and 128 rows among them)
            lay = GK._out_layout(bn, bm, nw)
            assert list(lay.size_per_thread) == [4, 1] and list(lay.order) == [0, 1]
            assert lay.warps_per_cta[0] * lay.warps_per_cta[1] == nw
            for d, size in enumerate((bn, bm)):
                span = lay.size_per_thread[d] * lay.threads_per_warp[d] * lay.warps_per_cta[d]
                assert span <= size and size % span == 0, (bn, bm, d, span)
    with pytest.raises(AssertionError):
        GK._out_layout(128, 4, 16)  # (4 tokens, 16 warps: the warps would repeat outputs)


@pytest.mark.parametrize("name", list(GEOS))
def test_gluon_gemms_take_the_plans_of_32_row_blocks_and_more(name, monkeypatch):
    """Where the Gluon GEMMs are on (by default on sm_90), a plan of at least ``GLUON_MIN_BM``-row
    expert blocks gets them in the forms measured for its block size (``gluon_forms``: GEMM1 in 64
    columns below 128-row blocks, 128 at them; GEMM2 in 128 rows below, in 256 at them); smaller blocks and the GEMV path keep the tl.dot kernels;
    the rest of the config is unchanged; the 8-warp launches of 64-row blocks are capped at
    ``GLUON_BM64_MAXNREG`` registers, no other; turned off, and on a CPU geometry, it is off
    (``gluon_status`` says why)."""
    g = geometry(*GEOS[name])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True)
    assert not gp.gluon  # (a dry plan, on the CPU)
    monkeypatch.delenv("B12X_OPS_TRITON_GLUON", raising=False)
    assert P.gluon_status(torch.device("cpu"))[1] in ("off: needs a CUDA device (got cpu)",
                                                      "off: this triton has no Gluon with Hopper's wgmma and mma_v2",
                                                      "off: TRITON_INTERPRET=1 (the interpreter does not run Gluon)")
    monkeypatch.setenv("B12X_OPS_TRITON_GLUON", "0")
    assert P.gluon_status(torch.device("cpu")) == (False, "off (B12X_OPS_TRITON_GLUON=0)")
    gp.gluon = gp.mma = True  # (as an sm_90 prepare sets them)
    seen = set()
    for tokens in (1, 4, 16, 64, 512, 2048, 8192):
        cfg = P.default_config(tokens, g)
        got = gp.with_gluon(cfg, tokens)
        assert got.bm == cfg.bm and got.atomic == cfg.atomic and got.gemv == cfg.gemv
        if not cfg.gemv and cfg.bm == 16:
            assert gp.with_gluon(cfg) == cfg  # (no token count: 16-row blocks stay tl.dot)
        if (not cfg.gemv and cfg.bm == 16 and g.intermediate_size < P.GLUON_16_MAX_N
                and tokens * g.top_k >= P.GLUON_16_MIN_SLOTS):
            # (16-row blocks of a short N: GEMM1 in 4 warps of 32 weight rows, GEMM2 tl.dot)
            assert got == dataclasses.replace(cfg, gluon=True, **P.GLUON_GEMM1_16) and got.warps1 == 2 * got.bn1 // 32
            assert gp.stages(got, tokens)[1].num_warps == 4
            continue
        if cfg.gemv:  # (the GEMV path on mma.sync: the test below)
            assert gp.with_gluon(cfg) == cfg
            continue
        if cfg.bm < P.GLUON_MIN_BM:
            assert got == cfg
            continue
        seen.add(cfg.bm)
        assert got.gluon
        want1 = (64, 64, 4) if cfg.bm < 128 else (128, 64, 4)
        assert (got.bn1, got.bk1, got.stages1) == want1
        want2 = (128, 64, 4, 8) if cfg.bm < 128 else (256, 64, 4, 16)
        assert got.gluon2 and (got.bn2, got.bk2, got.stages2, got.warps2) == want2
        assert gp.with_gluon(got) == got  # (a config already in Gluon is kept as it is)
        # the launches' register cap: the 8-warp forms of 64-row blocks only (three programs an SM)
        _, l1, l2, _ = gp.stages(got, tokens)
        assert l1.options.get("maxnreg") == (P.GLUON_BM64_MAXNREG if cfg.bm == 64 else None), (tokens, l1.options)
        if got.gluon2:
            assert l2.options.get("maxnreg") == (P.GLUON_BM64_MAXNREG if cfg.bm == 64 else None), (tokens, l2.options)
    assert 128 in seen  # (the largest batches always run 128-row blocks)
    for bm in (16, 32, 64, 128):  # (every block size: what gluon_forms picks, or tl.dot below GLUON_MIN_BM)
        f1, f2 = P.gluon_forms(bm)
        assert (f1 is None) == (f2 is None) == (bm < P.GLUON_MIN_BM)
        for tokens in (8, 16, 64):
            f1, f2 = P.gluon_forms(bm, g, tokens)
            short = bm == 16 and g.intermediate_size < P.GLUON_16_MAX_N and tokens * g.top_k >= P.GLUON_16_MIN_SLOTS
            assert (f1 is None) == (bm < P.GLUON_MIN_BM and not short)
            assert (f2 is None) == (bm < P.GLUON_MIN_BM)
    gp.gluon = False
    assert gp.with_gluon(P.default_config(8192, g)) == P.default_config(8192, g)


@pytest.mark.parametrize("cc, on, sync", [((9, 0), True, False), ((8, 0), True, True), ((8, 9), True, True),
                                          ((12, 0), True, True), ((10, 0), True, True), ((7, 5), False, False),
                                          (None, False, False)])
def test_gluon_gemms_run_on_mma_sync_off_sm90_wherever_the_gemv_does(monkeypatch, cc, on, sync):
    """``gluon_status`` by compute capability: wgmma on sm_90 (with the PTX decode), mma.sync on every other
    GPU from sm_80 where the GEMV runs on mma.sync (``gemv_mma_status``, the same asm decode), off below sm_80,
    without a CUDA device, with ``ptx=False`` (the GEMV's answer) and under the interpreter; each with its
    reason. ``GeometryPlans.gluon_sync`` says which of the two MMAs a GPU's plans take. The mma.sync ones are
    on by default; ``B12X_OPS_TRITON_GLUON_SYNC=0`` turns them off, saying so."""
    monkeypatch.setattr(P, "INTERPRET", False)
    monkeypatch.delenv("B12X_OPS_TRITON_GLUON", raising=False)
    monkeypatch.setattr(P, "_capability", lambda device: cc)
    if sync and on and P.GG.HAS_GLUON_MMA:
        monkeypatch.setenv("B12X_OPS_TRITON_GLUON_SYNC", "0")
        assert P.gluon_status("cuda") == (False, f"off on sm_{cc[0]}{cc[1]} (B12X_OPS_TRITON_GLUON_SYNC=0): the "
                                                 "blocked calls' GEMMs run tl.dot with the Triton-operations decode "
                                                 "instead of Gluon on mma.sync")
    monkeypatch.delenv("B12X_OPS_TRITON_GLUON_SYNC", raising=False)
    got, why = P.gluon_status("cuda")
    assert got is (on and P.GK.HAS_GLUON and P.GG.HAS_GLUON_MMA), why
    if got:
        assert why.startswith("on, on mma.sync (sm_" if sync else "on: the GEMMs"), why
        if sync:  # (the GEMV's answer decides: ptx=False turns both off)
            assert P.gluon_status("cuda", mma=P.gemv_mma_status("cuda", ptx=False)[0]) == (
                False, "off: where the GEMV does not run on mma.sync (its decode is theirs)")
        else:  # (sm_90: the PTX decode's answer)
            assert P.gluon_status("cuda", mma=False) == (True, why)
            assert P.gluon_status("cuda", ptx=False)[0] is False
    elif cc is None:
        assert why == "off: needs a CUDA device (got cuda)"
    else:
        assert why.startswith("off") and f"sm_{cc[0]}{cc[1]}" in why, why
    monkeypatch.setattr(P, "INTERPRET", True)
    assert P.gluon_status("cuda") == (False, "off: TRITON_INTERPRET=1 (the interpreter does not run Gluon)")


@pytest.mark.parametrize("name", list(GEOS))
def test_gluon_gemms_on_mma_sync_take_every_blocked_plan_in_forms_that_fit_99_kb(name):
    """Off sm_90 (``gluon_sync``) every blocked plan takes both GEMMs in Gluon on mma.sync: the 4-warp
    forms at 16-row blocks, the 8-warp ones from 32 rows (``GLUON_SYNC_FORMS``), plans of larger blocks at
    ``GLUON_SYNC_MAX_BM`` rows. Their launches are built with mma.sync's layouts (``version`` 2), the
    GEMV's fold, no register cap; the GEMV path is the mma.sync GEMV's. The tuner times only those forms,
    at blocks of at most ``GLUON_SYNC_MAX_BM`` rows (the 16-warp forms need more than 99 KB)."""
    g = geometry(*GEOS[name])
    gp = P.GeometryPlans(g, True, None, ptx=False, dry=True)
    gp.gluon = gp.gluon_sync = gp.mma = gp.mma_fold = True  # (as a prepare on sm_80, sm_89 or sm_120 sets them)
    assert not gp.ptx and not gp.fold
    sizes = set()
    for tokens in (9, 16, 64, 512, 2048, 8192):
        cfg = gp.default(tokens)
        if cfg.gemv:
            assert cfg.mma
            continue
        want1, want2 = P.GLUON_SYNC_FORMS.get(cfg.bm, P.GLUON_SYNC_DEFAULT)
        assert cfg.gluon and cfg.gluon2 and cfg.bm <= P.GLUON_SYNC_MAX_BM, (tokens, cfg)
        assert dataclasses.replace(cfg, **want1, **want2) == cfg, (tokens, cfg)
        plain = P.default_config(tokens, g)
        assert cfg.atomic == plain.atomic and cfg.bm == min(plain.bm, P.GLUON_SYNC_MAX_BM)
        sizes.add(cfg.bm)
        for ln in gp.stages(cfg, tokens)[1:3]:
            assert list(ln.constexprs["mma"].version) == [2, 0] and ln.constexprs["FOLD"] is True
            assert ln.options.get("maxnreg") is None
    assert P.GLUON_SYNC_MAX_BM in sizes
    for tokens in (16, 512, 8192):
        extra = [c for c in P.candidate_configs(tokens, g, False, gluon=True, mma=True, dot_ptx=False,
                                                gluon_sync=True) if c.gluon or c.gluon2]
        assert extra and all(c.bm <= P.GLUON_SYNC_MAX_BM for c in extra)
        for c in extra:
            assert c.warps1 <= 8 if c.gluon else c.warps2 <= 8  # (no 16-warp form)
            gp.stages(c, tokens)  # (launchable: GeometryPlans' checks)


@pytest.mark.parametrize("name", list(GEOS))
def test_sync16_puts_sm90s_16_row_plans_on_mma_sync_and_nothing_else(name):
    """On sm_90 with ``B12X_OPS_TRITON_GLUON_SYNC16=1`` (``GeometryPlans.sync16``) every untuned plan of 16-row
    blocks runs both GEMMs in Gluon on mma.sync (``Config.sync``, the forms of ``GLUON_SYNC_FORMS[16]``,
    mma.sync's layouts and the GEMV's fold); plans of larger blocks keep their wgmma forms and the GEMV path
    its plans; without it nothing runs on mma.sync. A config's ``sync`` is in its launches' keys."""
    g = geometry(*GEOS[name])
    plain = P.GeometryPlans(g, True, None, ptx=True, dry=True)
    plain.gluon = plain.mma = plain.mma_fold = True  # (as an sm_90 prepare sets them)
    on = P.GeometryPlans(g, True, None, ptx=True, dry=True)
    on.gluon = on.mma = on.mma_fold = on.sync16 = True  # (... with B12X_OPS_TRITON_GLUON_SYNC16=1)
    bms = set()
    for tokens in (8, 16, 64, 128, 512, 2048, 8192):
        before, after = plain.default(tokens), on.default(tokens)
        assert not before.sync
        if before.gemv or before.bm != 16:
            assert after == before, (tokens, after)
            continue
        bms.add(tokens)
        f1, f2 = P.GLUON_SYNC_FORMS[16]
        assert after == dataclasses.replace(before, gluon=True, gluon2=True, sync=True, **f1, **f2), (tokens, after)
        for ln, was in zip(on.stages(after, tokens)[1:3], plain.stages(before, tokens)[1:3]):
            assert list(ln.constexprs["mma"].version) == [2, 0] and ln.constexprs["FOLD"] is True
            assert ln.options.get("maxnreg") is None and ln is not was
    assert bms  # (some count of each geometry plans 16-row blocks)
    cfg = on.default(min(bms))
    assert on.launch("gemm1", cfg) is not on.launch("gemm1", dataclasses.replace(cfg, sync=False))
    assert not P.gluon_sync16_on()  # (off unless asked)


@pytest.mark.parametrize("name", list(GEOS))
def test_the_accumulator_is_zeroed_once_by_gluon_gemm1_or_the_prologue(name, monkeypatch):
    """GEMM2's fp32 accumulator is zeroed by exactly one launch of an atomic blocked plan: the
    Gluon GEMM1 where the plan has it (``acc_zero_mode``: before its main loop or after its
    epilogue), else the prologue, and by neither in the deterministic form (no accumulator) or on the
    GEMV path (no GEMM2 accumulator); ``B12X_OPS_TRITON_ACC_ZERO`` picks the place, each in launches
    of its own, and an unknown place is an error naming the variable."""

    g = geometry(*GEOS[name])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True)
    gp.gluon = gp.mma = True  # (as an sm_90 prepare sets them)
    monkeypatch.delenv("B12X_OPS_TRITON_ACC_ZERO", raising=False)
    seen = set()
    for tokens in (1, 16, 512, 2048, 8192):
        for atomic in (True, False):
            cfg = dataclasses.replace(gp.with_gluon(P.default_config(tokens, g)), atomic=atomic)
            for where, mode in P.ACC_ZERO_MODES.items():
                monkeypatch.setenv("B12X_OPS_TRITON_ACC_ZERO", where)
                pro, g1 = gp.stages(cfg, tokens)[:2]
                by_g1 = g1.constexprs.get("ZERO_ACC", 0)
                by_pro = bool(pro is not None and pro.constexprs.get("ZERO_ACC", False))
                assert by_g1 == P.acc_zero_mode(cfg) == (mode if atomic and cfg.gluon else 0), (tokens, cfg, where)
                assert by_pro == (atomic and not cfg.gemv and not by_g1), (tokens, cfg, where)
                seen.add((by_g1, by_pro))
            monkeypatch.delenv("B12X_OPS_TRITON_ACC_ZERO")
            want = P.ACC_ZERO_MODES[P.ACC_ZERO_DEFAULT] if atomic and cfg.gluon else 0
            assert P.acc_zero_mode(cfg) == want
    assert {(1, False), (2, False), (0, True), (0, False)} <= seen
    monkeypatch.setenv("B12X_OPS_TRITON_ACC_ZERO", "epilogue")
    with pytest.raises(ValueError, match="B12X_OPS_TRITON_ACC_ZERO='epilogue'"):
        P.acc_zero_mode(dataclasses.replace(gp.with_gluon(P.default_config(8192, g)), atomic=True))


@pytest.mark.parametrize("name", list(GEOS))
@pytest.mark.parametrize("tokens", [16, 512, 2048, 8192])
def test_tuner_times_the_gluon_gemms_where_they_run(name, tokens):
    """On a GPU that runs the Gluon GEMMs (``gluon=True``) the tuner also times GEMM1 and GEMM2 in
    Gluon, at the block sizes of at least ``GLUON_TUNE_MIN_BM`` rows the regime offers, each beside
    the other GEMM's tl.dot tile; their tiles are ones a plan can launch (``GeometryPlans.launch``'s
    checks), and without ``gluon`` the search space is the tl.dot one alone."""
    g = geometry(*GEOS[name])
    plain = P.candidate_configs(tokens, g, False)
    assert not any(c.gluon or c.gluon2 for c in plain)
    cands = P.candidate_configs(tokens, g, False, gluon=True)
    assert cands[:len(plain)] == plain
    extra = cands[len(plain):]
    sizes = sorted({bm for bm, _, _ in P._regime(tokens, g) if bm >= P.GLUON_TUNE_MIN_BM})
    # (two forms of each GEMM a block size, three at 16-row blocks: the 4-warp ones too)
    assert sorted({c.bm for c in extra}) == sizes and len(extra) == sum(6 if bm == 16 else 4 for bm in sizes)
    forms1 = {tuple(f[k] for k in ("bn1", "bk1", "stages1", "warps1"))
              for f in (P.GLUON_GEMM1, P.GLUON_GEMM1_SMALL, P.GLUON_GEMM1_16)}
    forms2 = {tuple(f[k] for k in ("bn2", "bk2", "stages2", "warps2"))
              for f in (P.GLUON_GEMM2, P.GLUON_GEMM2_SMALL, P.GLUON_GEMM2_16)}
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True)
    for c in extra:
        assert c.gluon != c.gluon2 and not c.gemv and c.atomic == plain[0].atomic
        if c.gluon:
            assert c.bn1 in (64, 128) and c.stages1 >= 4 and c.stages1 % 2 == 0
            assert (c.bn1, c.bk1, c.stages1, c.warps1) in forms1
            assert c.warps1 in (c.bn1 // 8, c.bn1 // 16) and (c.warps1 == c.bn1 // 8 or c.bm == 16)
        else:
            assert c.bn2 in (128, 256) and c.stages2 >= 4 and c.stages2 % 2 == 0
            assert (c.bn2, c.bk2, c.stages2, c.warps2) in forms2
            assert c.warps2 in (c.bn2 // 16, c.bn2 // 32) and (c.warps2 == c.bn2 // 16 or c.bm == 16)
        # (the launch takes the config's warps)
        stage = gp.stages(c, tokens)[1 if c.gluon else 2]
        assert stage.num_warps == (c.warps1 if c.gluon else c.warps2)
    # the tuner keys a stage by its tile and form (``_tune_one``): per block size, the tl.dot keys are
    # the plain search's and each Gluon form of GEMM1 / GEMM2 adds one key (the 4-warp forms at 16 rows too)
    for bm in sizes:
        k1 = {(c.tiles1(), c.gluon) for c in cands if c.bm == bm}
        k2 = {(c.tiles2(), c.gluon2) for c in cands if c.bm == bm}
        assert k1 == {(c.tiles1(), False) for c in plain if c.bm == bm} | {
            (c.tiles1(), True) for c in extra if c.bm == bm and c.gluon}
        assert k2 == {(c.tiles2(), False) for c in plain if c.bm == bm} | {
            (c.tiles2(), True) for c in extra if c.bm == bm and c.gluon2}
        assert len(k1) == len({(c.tiles1(), False) for c in plain if c.bm == bm}) + (3 if bm == 16 else 2)
        assert len(k2) == len({(c.tiles2(), False) for c in plain if c.bm == bm}) + (3 if bm == 16 else 2)


def test_mma_gemv_runs_are_the_longest_that_keep_enough_programs():
    """``plan._mma_run``: runs of equal length (a divisor of the chunks), the longest up to the cap that
    leaves the launch ``GEMV_MMA_MIN_PROGRAMS`` programs; one chunk where no run does, and the whole
    reduction where it is shorter than the cap and one run a tile already gives enough programs."""
    least = P.GEMV_MMA_MIN_PROGRAMS
    assert P._mma_run(45, 180, 16) == 15  # (gpt-oss gemv1 at one token: 3 runs x 180 = 540)
    assert P._mma_run(45, 180, 10) == 9  # (its gemv2: 5 runs x 180 = 900)
    assert P._mma_run(32, 96, 16) == 8  # (Qwen3 gemv1: 16 would give 192)
    assert P._mma_run(7, 60, 16) == 1  # (a prime count: 7 chunks in one run would give 60 programs)
    assert P._mma_run(7, least, 16) == 7 and P._mma_run(7, least - 1, 16) == 1
    assert P._mma_run(12, least, 10) == 6  # (the cap: 12 is not taken, 6 is its largest divisor under 10)
    for nq in range(1, 40):
        for per in (1, 7, 64, 200, least):
            q = P._mma_run(nq, per, 10)
            assert nq % q == 0 and q <= 10 and (q == 1 or per * (nq // q) >= least), (nq, per, q)


def test_mma_gemv_runs_weigh_their_waves_past_one():
    """Where the rule's runs make more programs than the GPU holds at once (``slots``), ``plan._mma_run``
    takes the run up to the rule's with the least waves x (run + ``GEMV_MMA_WAVE_OVERHEAD``), the longer
    of two that tie; within one wave, the rule's run."""
    o = P.GEMV_MMA_WAVE_OVERHEAD
    # Qwen3's gemv1 at 4 tokens (384 programs a run, 32 chunks, 5 x 132 slots): 16 chunks make 768 programs,
    # 2 waves of 16 + o; 8 make 1536, 3 waves of 8 + o (timed: 39.7 -> 38.3 us)
    assert P._mma_run(32, 384, 16) == 16 and P._mma_run(32, 384, 16, 660) == 8
    # DSv4's at 3 tokens (162 a run, 80 chunks): 16 -> 810 programs (2 x 20), 10 -> 1296 (2 x 14)
    assert P._mma_run(80, 162, 16, 660) == 10
    # one wave: the rule's run (DSv4 at one token, 10 chunks: 432 programs)
    assert P._mma_run(80, 54, 16, 660) == P._mma_run(80, 54, 16) == 10
    # a tie: gpt-oss's gemv1 at 2 tokens (360 a run, 45 chunks): 15 -> 2 waves x 19, 9 -> 3 x 13: 15
    assert P._mma_run(45, 360, 16, 660) == 15
    for nq in range(1, 50):
        for per in (1, 54, 162, 360, 384, 720):
            for slots in (264, 660, 924):
                rule, run = P._mma_run(nq, per, 16), P._mma_run(nq, per, 16, slots)
                assert nq % run == 0 and run <= rule, (nq, per, slots)
                if per * (nq // rule) <= slots:
                    assert run == rule, (nq, per, slots)
                    continue

                def time(q):
                    return -(-per * (nq // q) // slots) * (q + o)
                assert all(time(q) > time(run) or (time(q) == time(run) and q <= run)
                           for q in range(1, rule + 1) if nq % q == 0), (nq, per, slots)


def test_gemv_mma_forms_of_the_benchmark_geometries():
    """``gemv_mma_form`` without a GPU (``SM_COUNT_DEFAULT`` SMs): the rule's runs but where a launch
    needs more than one wave: DSv4 at 3, 5 and 6 tokens, Qwen3 at 4 and 5, gpt-oss at 5."""
    want = {"gpt-oss-120b": [(15, 9)] * 4 + [(9, 9)] + [(15, 9)] * 3,
            "dsv4.1-tp4": [(10, 9), (16, 9), (10, 9), (16, 9), (10, 9), (10, 9), (16, 9), (16, 9)],
            "qwen3-30b-a3b": [(8, 4), (16, 6), (16, 6), (8, 6), (8, 6), (16, 6), (16, 6), (16, 6)]}
    assert P.SM_COUNT_DEFAULT == 132 and P.GEMV_MMA_PER_SM == (5, 7, 4)
    for name, forms in want.items():
        g = geometry(*GEOS[name])
        assert [P.gemv_mma_form(t, g) for t in range(1, 9)] == forms, name


@pytest.mark.parametrize("name", list(GEOS))
def test_gemv_path_serves_up_to_eight_tokens_where_it_runs_on_mma_sync(name):
    """The untuned plans' path by token count: the GEMV path up to 32 slots and 4 tokens, 48 slots and 8
    tokens (``GEMV_MMA_MAX_SLOTS``, ``GEMV_MMA_MAX_TOKENS``) where its kernels run on mma.sync (H100: gpt-oss
    at 8 tokens 156.9 us against the blocked path's 170.4, DSv4 at 8 0.89 of it, while the tl.dot GEMV,
    172.2 at gpt-oss's 8, is not faster than the blocked path); a forced mode overrides either; the
    tuner's candidates follow the same bound."""
    g = geometry(*GEOS[name])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=True)
    gp.ptx = gp.fold = True
    assert (P.GEMV_MAX_SLOTS, P.GEMV_MAX_TOKENS, P.GEMV_MMA_MAX_SLOTS, P.GEMV_MMA_MAX_TOKENS) == (32, 4, 48, 8)
    for tokens in range(1, 13):
        for gluon, slots, most in ((False, 32, 4), (True, 48, 8)):
            gp.gluon = gp.mma = gluon
            cfg = gp.default(tokens)
            want = tokens * g.top_k <= slots and tokens <= most
            assert cfg.gemv == want == P.use_gemv(tokens, g, mma=gluon), (tokens, gluon)
            assert cfg.mma == (want and gluon), (tokens, gluon)  # (a GEMV plan on such a GPU: mma.sync)
            assert cfg == gp.with_gluon(P.default_config(tokens, g, None, mma=gluon), tokens)
            cands = P.candidate_configs(tokens, g, None, gluon=gluon)
            assert any(c.gemv for c in cands) == want and any(not c.gemv for c in cands)
            if want and gluon:
                assert any(c.mma for c in cands)
        assert P.use_gemv(tokens, g, True) and not P.use_gemv(tokens, g, False, mma=True)
    # the benchmark's geometries: the top token count on the GEMV path, without and with mma.sync
    want = {"gpt-oss-120b": (4, 8), "dsv4.1-tp4": (4, 8), "qwen3-30b-a3b": (4, 6), "small": (4, 8)}[name]
    for gluon, top in zip((False, True), want):
        gp.gluon = gp.mma = gluon
        assert gp.default(top).gemv and not gp.default(top + 1).gemv, (gluon, top)


@pytest.mark.parametrize("name", list(GEOS))
def test_gemv_on_mma_sync_takes_every_token_count_of_the_gemv_path(name):
    """Where the Gluon GEMMs run (sm_90), an untuned GEMV plan of any token count the GEMV path serves
    (``GEMV_MMA_MAX_TOKENS``, 1-8) runs on mma.sync (``gluon_gemv``; H200, gpt-oss: 21-27 % faster at 2-4
    tokens with two chunks in flight); its config quantizes x first, its splits cover every 64-element
    chunk once (``mma_config``), its launches pass ``_check_mma`` and take their constexprs last,
    eager calls fall back to the one-launch tl.dot GEMV, and a config the kernels cannot run is
    refused before anything compiles."""

    g = geometry(*GEOS[name])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=True)
    gp.ptx = gp.fold = True  # (a GPU prepare's choices)
    nq1, nq2 = -(-g.hidden_size // 64), -(-g.intermediate_size // 64)
    for tokens in range(1, P.GEMV_MMA_MAX_TOKENS + 2):
        cfg = P.default_config(tokens, g, gemv=True)
        want = tokens <= P.GEMV_MMA_MAX_TOKENS == 8
        form = P.gemv_mma_form(tokens, g)
        assert (form is not None) == want, (tokens, form)
        gp.mma = False
        assert gp.with_gluon(cfg, tokens) == cfg
        gp.mma = True
        got = gp.with_gluon(cfg, tokens)
        assert got.mma == want and gp.with_gluon(cfg) == cfg  # (no token count: unchanged)
        if not want:
            assert got == cfg
            continue
        q1, q2 = form
        bn2 = (128, 8) if g.hidden_size <= 2048 else (64, 4)  # (gemv2: 128-row programs where K is short)
        # runs of equal length: the rule's, the longest (up to 16 chunks for gemv1, 10 for gemv2) that
        # leaves the launch GEMV_MMA_MIN_PROGRAMS programs, or one chunk where none does; or, where the
        # rule's programs need more than one wave (132 SMs without a GPU), a shorter one by the waves
        # (``test_mma_gemv_runs_weigh_their_waves_past_one``)
        a_run = (tokens * g.top_k * -(-g.intermediate_size // 64), tokens * g.top_k * -(-g.hidden_size // bn2[0]))
        slots = (5 * 132, (4 if bn2[1] == 8 else 7) * 132)
        for q, nq, per, most, sl in ((q1, nq1, a_run[0], 16, slots[0]), (q2, nq2, a_run[1], 10, slots[1])):
            assert nq % q == 0 and q <= most, (tokens, q, nq)
            assert q == 1 or per * (nq // q) >= P.GEMV_MMA_MIN_PROGRAMS, (tokens, q, nq)
            rule = max((d for d in range(1, min(most, nq) + 1)
                        if nq % d == 0 and per * (nq // d) >= P.GEMV_MMA_MIN_PROGRAMS), default=1)
            assert q == P._mma_run(nq, per, most, sl) and q <= rule, (tokens, q, nq)
            assert q == rule or per * (nq // rule) > sl, (tokens, q, nq)
        assert got.window == P.GEMV_MMA_WINDOW == 2  # (two chunks' loads in flight)
        assert got.gemv and got.xq and not got.fused and (got.bn1, got.warps1) == (64, 4)
        assert (got.bn2, got.warps2) == bn2
        assert got.split1 * (got.bk1 // 64) >= nq1 > (got.split1 - 1) * (got.bk1 // 64)
        kp = got.split2 // g.top_k
        assert got.split2 % g.top_k == 0 and kp * (got.bk2 // 64) >= nq2 > (kp - 1) * (got.bk2 // 64)
        assert gp.with_gluon(got, tokens) == got
        # eager calls: the tl.dot one launch in steps of one chunk over the plan's runs (the same
        # products in the same order as the mma.sync kernels: the same bits)
        eager = P.eager_form(got, g)
        assert eager.fused and not eager.mma and not eager.xq and (eager.bn2, eager.warps2) == (64, 4)
        assert (eager.bk1, eager.bk2, eager.split1, eager.split2) == (64, 64, got.split1, got.split2)
        assert (eager.bn1, eager.warps1) == (got.bn1, got.warps1)
        for q, nq, runs in ((q1, nq1, got.split1), (q2, nq2, kp)):  # (the kernels' run: ceil(steps / runs) steps)
            assert runs == 1 or -(-nq // runs) == q
        with pytest.raises(ValueError, match="needs its geometry"):
            P.eager_form(got)
        # runs that steps of one chunk cannot cut as the plan does: no one-launch form (e.g. 4 + 4 + 1)
        for q in range(1, nq2 + 1):
            odd = P.mma_config(cfg, g, q1, q)
            runs = odd.split2 // g.top_k
            assert (P.eager_form(odd, g) is None) == (runs > 1 and -(-nq2 // runs) != q), q
        launches = gp.stages(got, tokens)
        assert [ln.fn.__name__ if ln else None for ln in launches] == ["xquant_kernel", "gemv1_mma_kernel",
                                                                       "gemv2_mma_kernel", None]
        for ln in launches[1:3]:
            args = tuple(f"arg{i}" for i in range(ln.n_args))
            rest = iter(args)
            assert list(ln._full_args(args)) == [ln.constexprs[n] if n in ln.constexprs else next(rest)
                                                 for n in ln.fn.arg_names]
        assert launches[1].constexprs["Q"] == q1 and launches[2].constexprs["KP"] == kp
        for bad in (dict(split1=got.split1 + 1), dict(xq=False), dict(bk2=96), dict(split2=got.split2 - 1)):
            with pytest.raises(ValueError, match="no mma.sync GEMV"):
                gp.stages(dataclasses.replace(got, **bad), tokens)
    # the tuner: with Gluon, the mma.sync forms (gemv1 of 4 chunks and the default's, gemv2 of 3, 4, 6,
    # 8, a whole row and the defaults'; two chunks in flight) beside the tl.dot GEMV tiles, a group of
    # their own
    plain = P.candidate_configs(1, g, None)
    cands = P.candidate_configs(1, g, None, gluon=True)
    mma = [c for c in cands if c.mma]
    q2s = P.mma_q2_candidates(g)
    assert {3, 4, 6, 8, nq2} <= set(q2s) and {P.gemv_mma_form(t, g)[1] for t in (1, 2, 3, 4) if P.gemv_mma_form(t, g)} <= set(q2s)
    q1s = P.mma_q1_candidates(1, g)
    assert q1s == sorted({4, P.gemv_mma_form(1, g)[0]} if P.gemv_mma_form(1, g) else {2, 4})
    assert {(c.bk1 // 64, c.bk2 // 64) for c in mma} == {(q1, q2) for q1 in q1s for q2 in q2s}
    assert not any(c.mma for c in plain) and len(mma) == len(q1s) * len(q2s) and all(c.gemv and c.xq for c in mma)
    assert all(c.window == P.GEMV_MMA_WINDOW for c in mma)
    for c in mma:
        gp.stages(c, 1)  # (passes _check_mma)


def test_untuned_plans_take_the_gluon_gemm1_and_tuned_ones_keep_their_choice(tmp_path):
    """Without tuning a plan's configs are the defaults with ``with_gluon`` applied (GEMM1 in Gluon
    at 128-row blocks where the GPU runs it); ``add`` keeps a config as given (a tuned one, which
    may have timed tl.dot faster); the tuning cache is keyed by whether Gluon was in the search."""
    import types

    from b12x_ops.backends import triton as TB

    g = geometry(*GEOS["gpt-oss-120b"])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True)
    gp.gluon = gp.mma = True  # (as an sm_90 prepare sets them)
    state = types.SimpleNamespace(plans=gp)
    chosen = TB._choose_configs(state, [1, 64, 8192], tune=False, cache_dir_opt=str(tmp_path))
    assert chosen[8192] == gp.with_gluon(P.default_config(8192, g)) and chosen[8192].gluon
    assert chosen[1] == P.mma_config(P.default_config(1, g), g, *P.gemv_mma_form(1, g))  # (the GEMV on mma.sync)
    assert chosen[64] == P.default_config(64, g)
    plain = P.default_config(8192, g)
    gp.add(8192, plain)
    assert gp.configs[8192] == plain and not gp.configs[8192].gluon
    a, b = (P.cache_path(g, str(tmp_path), None, True, gl) for gl in (False, True))
    assert a != b


@pytest.mark.parametrize("name", list(GEOS))
def test_block_sizes_follow_the_rows_an_expert(name):
    """Every geometry's blocked plans take the block size of ``_REGIMES``' bound for their rows an
    expert, long GEMM2 reductions too (gpt-oss at 2048 tokens, 64 rows an expert: 64-row blocks;
    at 4096, 128 rows: 128-row blocks)."""
    g = geometry(*GEOS[name])
    bounds = [b for b, _ in P._REGIMES]
    for tokens in (8, 64, 512, 1024, 2048, 4096, 8192):
        cfg = P.default_config(tokens, g)
        if cfg.gemv:
            continue
        rows = tokens * g.top_k / min(g.num_experts, tokens * g.top_k)
        want = next((c for b, c in P._REGIMES if rows <= b), P._REGIMES[-1][1])[0][0]
        assert cfg.bm == want, (tokens, rows, bounds, cfg.bm)
    if name == "gpt-oss-120b":
        assert P.default_config(2048, g).bm == 64 and P.default_config(4096, g).bm == 128


def test_16_row_blocks_take_the_wide_tiles():
    """16-row blocks run GEMM2 in 128 weight rows a program (one warpgroup) everywhere, and GEMM1 in
    256 (128 of up, 128 of gate) where N >= GEMM1_WIDE_MIN_N and an expert gets at least
    GEMM1_WIDE_MIN_ROWS rows (gpt-oss from 64 tokens); the tuner times both tiles of both GEMMs
    wherever 16-row blocks may serve."""
    narrow1, narrow2 = (64, 128, 4, 3), (64, 128, 4, 3)
    gpt, dsv4, qwen = (geometry(*GEOS[n]) for n in ("gpt-oss-120b", "dsv4.1-tp4", "qwen3-30b-a3b"))
    want1 = {(gpt, 8): narrow1, (gpt, 16): narrow1, (gpt, 32): narrow1, (gpt, 64): P.GEMM1_WIDE_16,
             (gpt, 128): P.GEMM1_WIDE_16}
    for g in (gpt, dsv4, qwen):
        for tokens in (8, 16, 32, 64, 128):
            cfg = P.default_config(tokens, g)
            assert cfg.bm == 16 and not cfg.gemv
            assert cfg.tiles2()[:4] == P.GEMM2_WIDE_16, (g, tokens)
            assert cfg.tiles1()[:4] == want1.get((g, tokens), narrow1), (g, tokens)
            cands = P.candidate_configs(tokens, g)
            assert cfg in cands
            assert {c.tiles2()[:4] for c in cands if c.bm == 16} >= {P.GEMM2_WIDE_16, narrow2}
            assert {c.tiles1()[:4] for c in cands if c.bm == 16} >= {P.GEMM1_WIDE_16, narrow1}
            assert all(c.tiles1()[:4] != P.GEMM1_WIDE_16 for c in cands if c.bm != 16)  # (16-row blocks only)
    assert P._rows(64, gpt) == P.GEMM1_WIDE_MIN_ROWS and P._rows(32, gpt) < P.GEMM1_WIDE_MIN_ROWS
    assert dsv4.intermediate_size < qwen.intermediate_size < P.GEMM1_WIDE_MIN_N <= gpt.intermediate_size


def test_gluon_configs_name_their_warps_when_a_launch_cannot_take_them():
    """A Gluon GEMM's warps are its config's (16 or 32 weight rows a warp): any other count is refused
    before anything compiles, by an error that names the field and the counts it may be, and the
    layouts refuse warps that are not whole warpgroups of whole 16-row groups."""
    from b12x_ops.backends.triton import gluon_kernels as GK

    if not GK.HAS_GLUON:
        pytest.skip("this triton has no Gluon")
    g = geometry(*GEOS["qwen3-30b-a3b"])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True)
    gp.ptx = True
    base = P.default_config(64, g)
    for bad in (16, 2, 6):  # (128 weight rows: 8 or 4 warps)
        with pytest.raises(ValueError, match=r"no Gluon GEMM1 .* 8 or 4 warps"):
            gp.stages(dataclasses.replace(base, gluon=True, **dict(P.GLUON_GEMM1_16, warps1=bad)), 64)
    with pytest.raises(ValueError, match=r"no Gluon GEMM2 .* 16 or 8 warps"):
        gp.stages(dataclasses.replace(base, gluon2=True, **dict(P.GLUON_GEMM2_16, bn2=256, warps2=4)), 64)
    for ok in (4, 8):
        cfg = dataclasses.replace(base, gluon=True, **dict(P.GLUON_GEMM1_16, warps1=ok))
        assert gp.stages(cfg, 64)[1].num_warps == ok
    with pytest.raises(ValueError, match="6 warps for 128 rows"):
        GK.layouts(128, 16, 6)
    assert GK.layouts(128, 16)["mma"] == GK.layouts(128, 16, 8)["mma"]


def _tl_dot_kinds(cfg):
    """The stages of ``cfg`` that run a ``tl.dot`` kernel (not Gluon, not the mma.sync GEMV)."""
    if cfg.mma:
        return ()
    if cfg.gemv:
        return ("gemm1",) if cfg.fused else ("gemm1", "gemm2")
    return tuple(k for k, gl in (("gemm1", cfg.gluon), ("gemm2", cfg.gluon2)) if not gl)


@pytest.mark.parametrize("name", list(GEOS))
def test_tl_dot_tiles_the_ptx_decode_sums_wrong_are_refused(name):
    """With the inline-PTX decode a ``tl.dot`` kernel sums right only in some tiles (columns and warps
    among ``plan.DOT_PTX_TILES``; measured by ``experiments/dot_tiles.py``):
    every config a plan or the tuner can take is among them; a tile outside is refused by an error
    naming its fields before a launch is made, on the blocked path and the GEMV's; without the PTX
    decode (the Triton-operations one, the interpreter's) the same tiles are taken."""
    g = geometry(*GEOS[name])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True)
    gp.ptx = True  # (as a GPU prepare sets it)
    checked = set()
    for tokens in (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64, 128, 512, 2048, 8192):
        cfgs = P.candidate_configs(tokens, g, gluon=True) + P.candidate_configs(tokens, g)
        cfgs += [P.default_config(tokens, g), P.default_config(tokens, g, mma=True)]
        for cfg in cfgs:
            for kind in _tl_dot_kinds(cfg):
                gp._check_dot(cfg, kind)
                bn, warps = (cfg.bn1, cfg.warps1) if kind == "gemm1" else (cfg.bn2, cfg.warps2)
                checked.add((cfg.gemv, kind, bn, warps))
    assert {(False, "gemm1", 64, 4), (False, "gemm2", 128, 4), (True, "gemm1", 64, 4)} <= checked
    blocked = dataclasses.replace(P.default_config(64, g), gluon=False, gluon2=False)
    small = P.default_config(1, g, gemv=True)
    assert not blocked.gemv and small.gemv and not small.mma
    bad = [(blocked, "gemm1", dict(bn1=32), r"its \(bn1, warps1\) must be one of \(64, 4\), .* \(got \(32, 4\)"),
           (blocked, "gemm1", dict(warps1=2), r"\(bn1, warps1\) .* \(got \(\d+, 2\)"),
           (blocked, "gemm2", dict(bn2=32), r"\(bn2, warps2\) .* \(got \(32, 4\)"),
           (blocked, "gemm2", dict(warps2=2), r"\(bn2, warps2\) .* \(got \(\d+, 2\)"),
           (blocked, "gemm2", dict(bn2=256, warps2=2), r"\(bn2, warps2\) .* \(got \(256, 2\)"),
           (small, "gemm1", dict(bn1=32), r"no tl.dot gemm1 .* \(got \(32, 4\)"),
           (small, "gemm2", dict(warps2=2), r"no tl.dot gemm2 .* \(got \(\d+, 2\)")]
    for cfg, kind, change, msg in bad:
        before = len(gp.launches)
        with pytest.raises(ValueError, match=msg):
            gp.launch(kind, dataclasses.replace(cfg, **change), 64)
        assert len(gp.launches) == before
    plain = P.GeometryPlans(g, True, None, ptx=False, dry=True)
    assert not plain.ptx
    for cfg, kind, change, _ in bad:
        assert plain.launch(kind, dataclasses.replace(cfg, **change), 64).num_warps in (2, 4, 8)
    for warps in (4, 8):  # (256 columns: the GPU tests' reference for the Gluon GEMM2 of that width)
        assert gp.launch("gemm2", dataclasses.replace(blocked, bn2=256, warps2=warps), 64).num_warps == warps


@pytest.mark.parametrize("name", list(GEOS))
def test_tuner_times_the_mma_sync_gemv_wider_where_the_blocked_path_decodes_with_triton_operations(name):
    """Off sm_90 (the tl.dot GEMMs decode with Triton operations, ``dot_ptx`` False) the tuner also times the
    GEMV on mma.sync above the untuned plans' bound, up to ``GEMV_MMA_TUNE_MAX_TOKENS`` tokens and
    ``GEMV_MMA_TUNE_MAX_SLOTS`` slots, beside the blocked tiles (which it keeps); every such candidate is one the
    plans can launch (``_check_mma``), its gemv1 runs the untuned form's or 4 chunks, its loads in flight the
    window. Not on sm_90, not without the mma.sync GEMV, not with the path forced either way."""
    g = geometry(*GEOS[name])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=True)
    gp.mma = gp.mma_fold = True
    assert (P.GEMV_MMA_TUNE_MAX_TOKENS, P.GEMV_MMA_TUNE_MAX_SLOTS) == (32, 192)
    wide_seen = 0
    for tokens in (1, 6, 8, 9, 12, 16, 24, 32, 33, 48, 64):
        plain = P.candidate_configs(tokens, g, None, False, True)  # (sm_90's answer for this count)
        cands = P.candidate_configs(tokens, g, None, False, True, dot_ptx=False)
        slots = tokens * g.top_k
        wide = (not P.use_gemv(tokens, g, mma=True) and tokens <= 32 and slots <= 192)
        assert P.tunes_wide_gemv(tokens, g, True, False) == wide, tokens
        assert not P.tunes_wide_gemv(tokens, g, True, True) and not P.tunes_wide_gemv(tokens, g, False, False)
        extra = [c for c in cands if c not in plain]
        assert [c for c in cands if c in plain] == plain  # (the blocked tiles, all kept)
        if not wide:
            assert not extra, tokens
            continue
        wide_seen += 1
        assert extra and all(c.gemv and c.mma and c.window == P.GEMV_MMA_WINDOW for c in extra), tokens
        form = P.gemv_mma_form(tokens, g, P.GEMV_MMA_TUNE_MAX_TOKENS)
        assert {c.bk1 // 64 for c in extra} == {4, form[0]}
        assert {c.bk2 // 64 for c in extra} == set(P.mma_q2_candidates(g))
        for c in extra:
            gp.reserve(tokens, c)
            assert [ln.fn.__name__ for ln in gp.stages(c, tokens) if ln is not None] == [
                "xquant_kernel", "gemv1_mma_kernel", "gemv2_mma_kernel"]
        for forced in (True, False):
            assert not [c for c in P.candidate_configs(tokens, g, forced, False, True, dot_ptx=False) if c.mma] or forced
    assert wide_seen >= {"qwen3-30b-a3b": 3, "dsv4.1-tp4": 4, "gpt-oss-120b": 5, "small": 5}[name]


def test_tuner_keeps_the_window_of_the_mma_sync_gemv_it_picks(monkeypatch):
    """The tuner's pick is the config it timed: an mma.sync GEMV keeps its loads in flight
    (``Config.window``), which ``Config.of`` does not carry (the tuner's picks ran every load first before)."""
    import types

    from b12x_ops.backends import triton as TB

    g = geometry(*GEOS["gpt-oss-120b"])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=True)
    gp.mma = gp.mma_fold = True
    cap = 2
    x = torch.zeros(cap, g.hidden_size, dtype=torch.bfloat16)
    monkeypatch.setattr(TB, "_synthetic_batch", lambda state, m, seed: (x, None, None))
    monkeypatch.setattr(TB, "_l2_flush_buffer", lambda device: None)
    timed = []
    monkeypatch.setattr(TB, "_launch_all", lambda state, cfg, *args, stages=None: timed.append(cfg))
    # (the mma.sync GEMV's launches are the fastest, everything else slower)
    monkeypatch.setattr(TB, "_time_ms", lambda fn, flush, reps=15: (fn(), 1.0 if timed[-1].mma else 2.0)[1])
    cands = P.candidate_configs(cap, g, None, False, True)
    assert any(c.mma for c in cands)
    best = TB._tune_one(types.SimpleNamespace(plans=gp), cap)
    assert best.mma and best.window == P.GEMV_MMA_WINDOW, best
    assert best in cands


@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1), (7, 5), None])
def test_gemv_runs_on_mma_sync_from_sm80_and_only_its_launches_take_the_asm_off_hopper(monkeypatch, cc):
    """The GEMV on mma.sync (``gemv_mma_status``) lays out its own operands, so it runs with the asm decode
    on every GPU from sm_80 on, where the tl.dot kernels' PTX decode is sm_90's alone (``ptx_status``):
    off with ``ptx=False``, other scale bytes, ``B12X_OPS_TRITON_GLUON=0`` or no CUDA device, each with its
    reason. A prepare's untuned plans there take it for every token count the GEMV path serves (up to
    ``GEMV_MMA_MAX_TOKENS`` and ``GEMV_MMA_MAX_SLOTS``), its launches with the folded asm, while the
    blocked tl.dot GEMMs keep the Triton-operations decode off sm_90; the tuner times it; its plans have
    a one-launch eager form on sm_90 only (where the tl.dot GEMV's bits were shown the same); and the
    tuning cache tells the two apart."""
    monkeypatch.setattr(P, "INTERPRET", False)
    monkeypatch.setattr(P.GG, "HAS_GLUON_MMA", True)
    monkeypatch.setattr(P, "_capability", lambda device: cc)
    monkeypatch.delenv("B12X_OPS_TRITON_GLUON", raising=False)
    monkeypatch.delenv("B12X_OPS_TRITON_PDL", raising=False)
    want = cc is not None and cc >= (8, 0)
    on, why = P.gemv_mma_status("cuda")
    assert on is want, why
    if want:
        assert why.startswith("on: untuned plans of up to 8 tokens run gemv1 and gemv2 on mma.sync in Gluon, decoding "
                              "with the inline-PTX asm"), why
        pdl = cc[0] >= 9 and P.K_.HAS_GDC
        assert (" with programmatic dependent launch" in why) == pdl, why
        assert P.gemv_mma_status("cuda", ptx=False) == (False, "off (ptx=False): its decode is the inline-PTX asm")
        assert P.gemv_mma_status("cuda", fast_scales=False) == (
            False, "off: scale bytes outside [2, 252] (its decode is the inline-PTX asm)")
        monkeypatch.setenv("B12X_OPS_TRITON_GLUON", "0")
        assert P.gemv_mma_status("cuda") == (False, "off (B12X_OPS_TRITON_GLUON=0)")
        monkeypatch.delenv("B12X_OPS_TRITON_GLUON")
    elif cc is None:
        assert why == "off: needs a CUDA device (got cuda)"
    else:
        assert why == "off: needs sm_80 or newer (got sm_75)"
    if cc is None or not want:
        return
    sm90 = cc == P.PTX_CAPABILITY
    g = geometry(*GEOS["dsv4.1-tp4"])
    gp = P.GeometryPlans(g, True, None, fold=True)  # (as a prepare on that GPU: a CPU geometry stands in)
    assert (gp.mma, gp.mma_fold, gp.ptx, gp.fold) == (True, True, sm90, sm90)
    assert not gp.ptx or P.ptx_status("cuda")[0]
    assert not P.GeometryPlans(g, True, None, ptx=False).mma and not P.GeometryPlans(g, False, None).mma
    for tokens in range(1, P.GEMV_MMA_MAX_TOKENS + 2):
        cfg = gp.default(tokens)
        serves = tokens <= P.GEMV_MMA_MAX_TOKENS and tokens * g.top_k <= P.GEMV_MMA_MAX_SLOTS
        assert cfg.gemv == cfg.mma == serves, (tokens, cfg)
        assert any(c.mma for c in P.candidate_configs(tokens, g, None, gp.gluon, gp.mma)) == serves
        for kind, ln in zip(("prologue", "gemm1", "gemm2", "finalize"), gp.stages(cfg, tokens)):
            if ln is None:
                continue
            if cfg.mma and kind != "prologue":
                assert ln.fn.__name__ == f"gemv{kind[-1]}_mma_kernel" and ln.constexprs["FOLD"], (tokens, kind)
            elif kind.startswith("gemm") and not (cfg.gluon or cfg.gluon2):  # (tl.dot: the decode by ptx_status)
                assert ln.constexprs["PTX"] is sm90 and ln.constexprs["FOLD"] is sm90, (tokens, kind)
    gp.add(1, gp.default(1))
    assert (1 in gp.eager_runners) is sm90
    key = (g, "/tmp", None, gp.ptx, gp.gluon)
    assert P.cache_path(*key, mma=True) != P.cache_path(*key, mma=False)


@pytest.mark.parametrize("cc, on", [((9, 0), True), ((8, 0), False), ((8, 6), False), ((8, 9), False),
                                    ((10, 0), False), ((12, 0), False), (None, False)])
def test_ptx_decode_runs_on_sm90_only_and_ptx_true_elsewhere_is_refused(monkeypatch, cc, on):
    """The inline-PTX decode reads registers in sm_90's wgmma operand order (``plan.ptx_status``): on, by
    default, on sm_90 with scale bytes in [2, 252]; off on other GPUs, where triton's tl.dot operand holds
    another order (``test_compile_sm90``), and off with ``ptx=False``, other scale bytes or no CUDA device,
    each with its reason (``b12x-ops info``); prepare's ``ptx=True`` on a GPU other than sm_90 is refused
    by an error naming the option, and None and False pass."""
    monkeypatch.setattr(P, "INTERPRET", False)
    monkeypatch.setattr(P, "_capability", lambda device: cc)
    got, why = P.ptx_status("cuda")
    assert got is on
    if on:
        assert why.startswith("on:")
        assert P.ptx_status("cuda", fast_scales=False) == (False, "off: scale bytes outside [2, 252] (Triton "
                                                                  "operations decode)")
    elif cc is None:
        assert why == "off: needs an sm_90 CUDA device (got cuda)"
    else:
        assert f"on sm_{cc[0]}{cc[1]} triton's tl.dot operand holds another" in why
    assert P.ptx_status("cuda", ptx=False) == (False, "off (ptx=False): Triton operations decode")
    for ptx in (None, False):
        P.check_ptx_option("cuda", ptx)
    if on or cc is None:
        P.check_ptx_option("cuda", True)
    else:
        with pytest.raises(ValueError, match=rf"option ptx: True needs an sm_90 GPU .* sm_{cc[0]}{cc[1]}"):
            P.check_ptx_option("cuda", True)
    monkeypatch.setattr(P, "INTERPRET", True)
    assert not P.ptx_status("cuda")[0]


@settings(max_examples=200, deadline=None)
@given(E=st.integers(1, 512), K=st.integers(1, 256).map(lambda k: 32 * k), N=st.integers(1, 128).map(lambda n: 32 * n),
       top_k=st.integers(1, 16), tokens=st.sampled_from([1, 2, 3, 5, 8, 13, 16, 40, 64, 100, 512, 3000, 8192]))
def test_every_plan_and_candidate_takes_a_tile_the_ptx_decode_sums_right(E, K, N, top_k, tokens):
    """For any layer and token count, every ``tl.dot`` tile a plan or the tuner may take is among
    ``plan.DOT_PTX_TILES`` (so ``GeometryPlans._check_dot`` never refuses a plan's own config)."""
    g = geometry(E, K, N, min(top_k, E))
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True)
    gp.ptx = True  # (as a GPU prepare sets it)
    cfgs = P.candidate_configs(tokens, g, gluon=True) + [P.default_config(tokens, g),
                                                          P.default_config(tokens, g, mma=True)]
    for cfg in cfgs:
        for kind in _tl_dot_kinds(cfg):
            gp._check_dot(cfg, kind)  # (raises where a tile is not among them)


def _cuda_launcher(launch, coop=0, pdl=1, global_scratch=0, profile_scratch=0):
    """An instance of the installed triton's CUDA launcher class, its compiled C function replaced by
    ``launch`` (no GPU, no compile: only its Python ``__call__`` runs)."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    lau = object.__new__(driver.CudaLauncher)
    lau.launch, lau.num_ctas = launch, 1
    lau.global_scratch_size, lau.global_scratch_align = global_scratch, 1
    lau.profile_scratch_size, lau.profile_scratch_align = profile_scratch, 1
    lau.launch_cooperative_grid, lau.launch_pdl = coop, pdl
    return lau


def test_direct_launch_passes_the_launchers_c_function_what_its_call_would():
    """``plan._direct_launch``: on the triton versions it names, calling the launcher's C function
    directly hands it exactly what the launcher's own ``__call__`` does (checked here against the
    installed triton's class where it is one of them); elsewhere, with scratch to allocate, or with
    the knob off, no direct path (the launcher is called)."""
    import triton
    seen = []
    lau = _cuda_launcher(lambda *a: seen.append(a))
    args = (7, 8, 9, 1234, 5678, (4, 1, 0), None, None, None, "x", 3, 2.5)  # (grid, stream, function, ...)
    direct = P._direct_launch(lau)
    if triton.__version__.startswith(P.DIRECT_LAUNCH_VERSIONS):
        assert direct is not None and direct[0] is lau.launch and direct[1:] == (0, 1)
        lau(*args)
        direct[0](*args[:5], direct[1], direct[2], None, None, *args[5:])
        assert len(seen) == 2 and seen[0] == seen[1]
    else:
        assert direct is None
    for bad in (dict(global_scratch=64), dict(profile_scratch=64)):
        assert P._direct_launch(_cuda_launcher(lambda *a: None, **bad)) is None
    assert P._direct_launch(object()) is None  # (a launcher of another shape)


def test_compiled_launch_call_hands_the_launcher_its_arguments_and_constexprs(monkeypatch):
    """``Launch.__call__`` after compiling: the current stream, the kernel's handle and metadata, the
    runtime arguments and the constexprs (the launcher takes both), through the launcher's C function
    where ``_direct_launch`` gave one, else through the launcher; a launch-enter hook gets its
    metadata made."""
    import triton
    from b12x_ops.backends.triton import kernels as K_
    ln = P.Launch(K_.finalize_kernel, dict(K=64, TOPK=2, ATOMIC=False, BR=4, BK=64), num_warps=4, num_stages=1)
    seen = []

    class Compiled:
        def launch_metadata(self, grid, stream, *full):
            return ("md", grid, stream, len(full))

    monkeypatch.setattr(P, "_raw_stream", lambda dev: 1000 + dev)
    monkeypatch.setattr(P, "_current_device", lambda: 3)
    ln.compiled, ln._function, ln._packed = Compiled(), 99, (4, 1, 0)
    ln._run = lambda *a: seen.append(("launcher",) + a)
    args = tuple(range(ln.n_args))
    full = args + ln._tail
    ln._direct = (lambda *a: seen.append(("direct",) + a), 0, 1)
    ln((5, 6, 7), *args)
    ln._direct = None
    ln((5, 6, 7), *args)
    assert seen[0] == ("direct", 5, 6, 7, 1003, 99, 0, 1, None, None, (4, 1, 0), None, None, None) + full
    assert seen[1] == ("launcher", 5, 6, 7, 1003, 99, (4, 1, 0), None, None, None) + full
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is not None:  # (a profiler's hook: the metadata is made for it)
        hook = lambda md: None  # noqa: E731
        monkeypatch.setattr(knobs, "launch_enter_hook", hook)
        seen.clear()
        ln((5, 6, 7), *args)
        assert seen[0][:8] == ("launcher", 5, 6, 7, 1003, 99, (4, 1, 0), ("md", (5, 6, 7), 1003, len(full)))
        assert seen[0][8] is hook


@settings(max_examples=40, deadline=None)
@given(st.sets(st.integers(1, 300), min_size=1, max_size=6), st.data())
def test_cap_for_serves_each_count_by_the_smallest_plan_above_it(caps, data):
    """``GeometryPlans.cap_for`` (a table made by ``add``): a call of ``m`` tokens takes the smallest
    planned count of at least ``m``, and the top one above every plan (the handle runs larger batches
    in chunks of it); the table follows each ``add``."""
    g = geometry(8, 256, 128, 2)
    gp = P.GeometryPlans(g, True, None, ptx=False, dry=True)
    added = []
    for cap in data.draw(st.permutations(sorted(caps))):
        gp.add(cap, P.default_config(cap, g))
        added.append(cap)
        for m in list(range(1, max(added) + 3)):
            above = [c for c in added if c >= m]
            assert gp.cap_for(m) == (min(above) if above else max(added)), (sorted(added), m)


def test_launch_is_programmatic_only_for_kernels_that_wait():
    """``Launch(pdl=True)`` gives a stage kernel its ``PDL`` constexpr (it waits for the previous
    kernel first) and the launch its PDL attribute; a kernel with no ``PDL`` parameter cannot wait, so
    its launch stays an ordinary one whatever is asked (an early start would read inputs not yet
    written). Every stage kernel of the package has the parameter."""
    import triton
    import triton.language as tl
    from b12x_ops.backends.triton import gluon_gemv as GG
    from b12x_ops.backends.triton import gluon_kernels as GK
    from b12x_ops.backends.triton import kernels as K_

    fin = dict(K=64, TOPK=2, ATOMIC=False, BR=4, BK=64)
    on = P.Launch(K_.finalize_kernel, fin, num_warps=4, num_stages=1, pdl=True)
    assert on.constexprs["PDL"] is True and on.options.get("launch_pdl") is True
    off = P.Launch(K_.finalize_kernel, fin, num_warps=4, num_stages=1, pdl=False)
    assert off.constexprs["PDL"] is False and "launch_pdl" not in off.options

    @triton.jit
    def no_wait_kernel(x_ptr, N: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, N), tl.zeros((N,), tl.float32))

    ln = P.Launch(no_wait_kernel, dict(N=16), num_warps=1, num_stages=1, pdl=True)
    assert "PDL" not in ln.constexprs and "launch_pdl" not in ln.options
    kernels = [getattr(K_, n) for n in dir(K_) if n.endswith("_kernel") and hasattr(getattr(K_, n), "arg_names")]
    for mod in (GK, GG):
        kernels += [getattr(mod, n) for n in dir(mod) if n.endswith("_kernel") and hasattr(getattr(mod, n), "arg_names")]
    assert len(kernels) >= 8 and all("PDL" in k.arg_names for k in kernels), [k.__name__ for k in kernels]


@pytest.mark.parametrize("cc, env, on", [((9, 0), None, True), ((12, 0), None, True), ((9, 0), "0", False),
                                         ((8, 9), None, False), ((8, 0), "1", False)])
def test_pdl_is_on_by_default_where_the_gpu_and_triton_have_it(monkeypatch, cc, env, on):
    """Programmatic dependent launch: on by default on sm_90 and newer, off on older GPUs whatever
    is asked, and off where ``B12X_OPS_TRITON_PDL=0``; each answer with its reason."""
    from b12x_ops.backends.triton import kernels as K_

    monkeypatch.setattr(P, "INTERPRET", False)
    monkeypatch.setattr(K_, "HAS_GDC", True)
    monkeypatch.setattr(P, "_capability", lambda device: cc)
    if env is None:
        monkeypatch.delenv("B12X_OPS_TRITON_PDL", raising=False)
    else:
        monkeypatch.setenv("B12X_OPS_TRITON_PDL", env)
    got, why = P.pdl_status(torch.device("cuda"))
    assert got is on, (cc, env, why)
    if on:
        assert why.startswith("on: ") and "B12X_OPS_TRITON_PDL=0 turns it off" in why
    elif env == "0":
        assert why == "off (B12X_OPS_TRITON_PDL=0)"
    else:
        assert why == f"off: needs sm_90 or newer (got sm_{cc[0]}{cc[1]})"
    if on:  # (the same GPU with a triton that cannot wait)
        monkeypatch.setattr(K_, "HAS_GDC", False)
        assert P.pdl_status(torch.device("cuda")) == (False, "off: this triton has no griddepcontrol (3.4 and newer do)")


@given(out=st.integers(32, 8192).map(lambda n: 32 * (n // 32)), kind=st.sampled_from(["gemm1", "gemm2"]),
       wide=st.booleans())
@example(out=2880, kind="gemm1", wide=True)
@example(out=2880, kind="gemm2", wide=True)
@example(out=2880, kind="gemm2", wide=False)
@example(out=576, kind="gemm1", wide=True)
@example(out=768, kind="gemm1", wide=True)
@example(out=64, kind="gemm1", wide=True)
@example(out=160, kind="gemm2", wide=True)
@settings(max_examples=60, deadline=None)
def test_edge_split_runs_the_last_tile_in_the_narrowest_width_that_holds_it(out, kind, wide):
    """``edge_split`` (asked for: off by default): a part-empty last tile runs in the narrowest Gluon width
    that holds its columns, only where that is narrower than the tile and the main launch keeps a whole
    tile; the main launch's whole tiles and that one tile cover the outputs exactly once."""
    widths = P.GLUON_WIDTHS[kind]
    bn = widths[-1] if wide else widths[0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("B12X_OPS_TRITON_EDGE", "0")  # (off: never)
        assert P.edge_split(out, bn, widths) == 0
        mp.setenv("B12X_OPS_TRITON_EDGE", "1")
        w = P.edge_split(out, bn, widths)
    rest = out % bn
    if w:
        assert out > bn and w in widths and rest <= w < bn and all(x < rest or x >= w for x in widths)
        assert (out // bn) * bn + rest == out and (out // bn) * bn % w == 0  # (C0 a multiple of the edge's tile)
    else:
        assert rest == 0 or out < bn or not [x for x in widths if rest <= x < bn]
    if out == 2880:  # (gpt-oss: GEMM1's 128-wide tiles end in 64 columns, GEMM2's 256-wide in 64 outputs)
        assert w == ({"gemm1": 64, "gemm2": 128}[kind] if wide else 0), (kind, bn)


@pytest.mark.parametrize("name, E, K, N, top_k, want", [
    ("gpt-oss-120b", 128, 2880, 2880, 4, ((64, 2816), (128, 2816))),
    ("dsv4.1-tp4", 384, 5120, 576, 6, ((64, 512), None)),
    ("qwen3-30b-a3b", 128, 2048, 768, 8, (None, None)),
    ("odd-ep", 5, 160, 64, 2, (None, None))])  # (N and K below a whole tile: one part-empty tile, no edge)
def test_gluon_gemms_run_their_part_empty_last_tile_narrower(monkeypatch, name, E, K, N, top_k, want):
    """At 128-row blocks (8192 tokens) the Gluon GEMMs' runners carry an edge launch where the outputs are
    not a multiple of the tile (gpt-oss: both GEMMs; DSv4: GEMM1; Qwen3: none): the same kernel at the
    narrower width from the main launch's last whole tile (``C0``), warps in proportion, GEMM1's edge
    zeroing no accumulator rows; the main launch ends there (``C1``) and counts its whole tiles.
    B12X_OPS_TRITON_EDGE=1 asks for them; 0 (and the default): no edge, the main launch over every column."""
    from b12x_ops.backends.triton import gluon_kernels as GK

    if not GK.HAS_GLUON:
        pytest.skip("this triton has no Gluon with Hopper's wgmma")
    g = geometry(E, K, N, top_k)
    for on in (True, False, None):
        if on is None:  # (the default: off)
            monkeypatch.delenv("B12X_OPS_TRITON_EDGE", raising=False)
        else:
            monkeypatch.setenv("B12X_OPS_TRITON_EDGE", "1" if on else "0")
        gp = P.GeometryPlans(g, True, False, ptx=True, dry=True, fold=True)
        gp.ptx, gp.gluon = True, True
        cfg = gp.with_gluon(P.default_config(8192, g, gemv=False), 8192)
        assert cfg.bm == 128 and cfg.gluon and cfg.gluon2 and (cfg.bn1, cfg.bn2) == (128, 256)
        rn = gp.runner(cfg, 8192)
        for edge, main, out, bn, warps, tiles, w in ((rn.edge1, rn.gemm1, N, cfg.bn1, cfg.warps1, rn.n_tiles1, want[0]),
                                                    (rn.edge2, rn.gemm2, K, cfg.bn2, cfg.warps2, rn.n_tiles2, want[1])):
            if not on or w is None:
                assert edge is None and main.constexprs["C0"] == main.constexprs["C1"] == 0
                assert tiles == -(-out // bn)
                continue
            width, c0 = w
            assert edge.fn is main.fn and edge.constexprs["BN"] == width and edge.num_warps == warps * width // bn
            assert (edge.constexprs["C0"], edge.constexprs["C1"], main.constexprs["C0"], main.constexprs["C1"]) == \
                (c0, 0, 0, c0)
            assert tiles == c0 // bn and edge.constexprs.get("ZERO_ACC", 0) == 0 and edge.options == dict(
                main.options, num_warps=edge.num_warps)
            same = {k for k in main.constexprs if k not in ("BN", "C0", "C1", "ZERO_ACC") and
                    k not in GK.layouts(64, 128)}  # (the layouts: the width's own)
            assert all(edge.constexprs[k] == main.constexprs[k] for k in same), same
