"""The Triton backend's untuned launches compile for the GPUs besides sm_90 that it claims (sm_80 and newer).

The backend has run on H100 and H200 GPUs only, so off Hopper this is what checks the claim. A prepare
on an A100 (sm_80), an L40 or RTX 4090 (sm_89) or an RTX 5090 forced onto ``backend="triton"`` (sm_120)
takes the Triton-operations decode in its tl.dot kernels (``plan.ptx_status``), the GEMV on mma.sync in
Gluon with the inline-PTX decode's asm up to its bounds (``plan.gemv_mma_status``: sm_80 and newer), the
blocked GEMMs in Gluon on mma.sync with the same asm above them (``plan.gluon_status``, ``gluon_sync``; with
``B12X_OPS_TRITON_GLUON_SYNC=0`` the tl.dot GEMMs, also compiled here), and
programmatic dependent launches from sm_90 on (``plan.pdl_status``); its launches, the MXFP8 conversions and
the tl.dot GEMMs the tuner also times among them, must compile for that target with ptxas, put their
products on MMA v2 (``mma.sync``) and fit the target's shared memory, and the Gluon kernels' operand layouts
must pass their ``assert_trivial`` conversions there (the asm's registers are where the MMA reads them). It
checks compilation, not numbers: the arithmetic is the interpreter suite's and the sm_90 suite's (which runs
the same mma.sync GEMV, and the GEMMs on mma.sync on an sm_90 GPU standing in for the others).
"""

from __future__ import annotations

import os
import re
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (the ``offline`` fixture, benchmarks/compile_offline.py, is conftest.py's)

# A block's largest opt-in shared memory (CUDA programming guide, compute capabilities table)
SHARED_LIMIT = {80: 163 * 1024, 89: 99 * 1024, 120: 99 * 1024}

# one benchmark layer an arch (benchmarks/bench_moe.py's GEOMETRIES), so each geometry is seen once
CASES = [(80, "gpt-oss-120b"), (89, "dsv4.1-tp4"), (120, "qwen3-30b-a3b")]
SIZES = (1, 4, 8, 64, 8192)  # GEMV, GEMV after xquant, blocked small, blocked large (its largest tiles)


def _plans(offline, arch: int, name: str):
    from b12x_ops.backends.triton import plan as P

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from bench_moe import GEOMETRIES
    finally:
        sys.path.pop(0)
    ptx, why = P._ptx_decision((arch // 10, arch % 10), True, None)
    assert not ptx and f"sm_{arch}" in why, why  # (what ptx_status says on that GPU)
    gp = offline.geometry_plans(GEOMETRIES[name], arch, pdl=True, gluon=True)  # (as far as that GPU takes them)
    assert not gp.ptx and not gp.fold and gp.pdl == (arch >= 90)
    assert gp.gluon and gp.gluon_sync  # (the blocked GEMMs in Gluon on mma.sync)
    assert gp.mma and gp.mma_fold  # (the GEMV on mma.sync, its asm folded for the usual scales)
    mma, why = P._gemv_mma_decision((arch // 10, arch % 10), True, None)
    assert mma is (P.GG.HAS_GLUON_MMA and not P.INTERPRET), why  # (what gemv_mma_status says on that GPU)
    return gp


@pytest.mark.parametrize("arch,name", CASES)
def test_untuned_launches_compile_off_hopper(offline, arch, name, monkeypatch):
    from b12x_ops.backends.triton import plan as P

    monkeypatch.delenv("B12X_OPS_TRITON_GLUON_SYNC", raising=False)  # (the default: the Gluon GEMMs on mma.sync)

    gp = _plans(offline, arch, name)
    compiled = {}
    for M in SIZES:
        cfg = gp.default(M)
        assert cfg.gemv or (cfg.gluon and cfg.gluon2 and cfg.bm <= P.GLUON_SYNC_MAX_BM), (M, cfg)
        assert cfg.mma == (M <= P.GEMV_MMA_MAX_TOKENS and cfg.gemv), (M, cfg)
        rn = gp.runner(cfg, M)
        launches = (*zip(("prologue", "gemm1", "gemm2", "finalize"), gp.stages(cfg, M)),
                    ("edge1", rn.edge1), ("edge2", rn.edge2))
        for stage, ln in launches:
            if ln is not None and id(ln) not in compiled:
                compiled[id(ln)] = (M, stage, ln, offline.compile_launch(ln, arch))
    # the mma.sync GEMV forms the tuner times there above the untuned plans' bound (``plan.tunes_wide_gemv``),
    # the tl.dot GEMV (the tuner's other GEMV candidates; the plans' without Gluon) at 1 and 4 tokens, and the
    # tl.dot GEMMs (the tuner's other blocked candidates) at 64 and 8192
    assert P.tunes_wide_gemv(16, gp.geometry, True, False)
    wide = [c for c in P.candidate_configs(16, gp.geometry, None, False, True, dot_ptx=False) if c.mma]
    dot = [P.default_config(m, gp.geometry, gemv=True) for m in (1, 4)] + [P.default_config(m, gp.geometry)
                                                                             for m in (64, 8192)]
    assert wide and not any(c.mma or c.gluon or c.gluon2 for c in dot)
    for M, cfg in [(16, c) for c in wide] + list(zip((1, 4, 64, 8192), dot)):
        gp.reserve(M, cfg)
        for stage, ln in zip(("prologue", "gemm1", "gemm2", "finalize"), gp.stages(cfg, M)):
            if ln is not None and id(ln) not in compiled:
                compiled[id(ln)] = (M, stage, ln, offline.compile_launch(ln, arch))
    kinds = {ck.metadata.name for *_, ck in compiled.values()}
    assert {"gemv1_mma_kernel", "gemv2_mma_kernel", "gemv1_kernel", "gemv2_kernel", "xquant_kernel",
            "prologue_kernel", "gemm1_kernel", "gemm2_kernel", "finalize_kernel", "gemm1_gluon_kernel",
            "gemm2_gluon_kernel"} <= kinds, kinds
    for M, stage, ln, ck in compiled.values():
        what = (arch, name, M, stage, ck.metadata.name)
        assert ck.asm["cubin"], what
        ptx = ck.asm["ptx"]
        assert f".target sm_{arch}" in ptx, what
        assert ck.metadata.shared <= SHARED_LIMIT[arch], (what, ck.metadata.shared)
        assert "wgmma" not in ptx, what
        # (the inline-PTX decode in the Gluon kernels only: its pair-3 mask is in the asm)
        assert ("0x81808180" in ptx) == ck.metadata.name.endswith(("_mma_kernel", "_gluon_kernel")), what
        assert ("griddepcontrol" in ptx) == (arch >= 90), what  # (PDL from sm_90 on)
        if ck.metadata.name.startswith(("gemm", "gemv")):
            assert "mma.sync" in ptx, what
        if ck.metadata.name.endswith("_gluon_kernel"):  # (copies stages - 1 steps ahead: gluon_kernels._lead)
            waits = set(re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx))
            assert waits == {str(ln.constexprs["STAGES"] - 2), "0"}, (what, waits)  # (a step's, the drain's)
