"""The Triton backend's stage kernels compile for sm_90 on this CPU-only machine.

Triton's wheel carries ptxas, so ``benchmarks/compile_offline.py`` can compile a prepare's launches
for a GPU that is not here. The interpreter suite checks the kernels' arithmetic; this checks what
the interpreter never sees: the inline PTX (its constraints, registers and instructions as ptxas
reads them), the GPU-only constexpr branches, and the asynchronous-copy pipelines of the GEMMs.
"""

from __future__ import annotations

import collections
import os
import re
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (the ``offline`` fixture, benchmarks/compile_offline.py, is conftest.py's)


GEOMETRIES = {  # the benchmark's three layers (benchmarks/bench_moe.py)
    "gpt-oss-120b": dict(E=128, K=2880, N=2880, top_k=4, limit=7.0),
    "dsv4.1-tp4": dict(E=384, K=5120, N=576, top_k=6, limit=10.0),
    "qwen3-30b-a3b": dict(E=128, K=2048, N=768, top_k=8, limit=None),
}


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("fold", [True, False])
def test_default_launches_compile_for_sm90(offline, name, fold):
    import re

    import triton

    from b12x_ops.backends.triton import plan as P

    g = offline._geometry(GEOMETRIES[name])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=fold)
    gp.ptx, gp.fold, gp.dot_dtype = True, fold, triton.language.bfloat16  # a GPU prepare's choices
    seen = {}
    for M in (1, 64, 8192):
        for stage, ln in zip(("prologue", "gemm1", "gemm2", "finalize"), gp.stages(P.default_config(M, g), M)):
            if ln is not None and id(ln) not in seen:
                seen[id(ln)] = (stage, ln, offline.compile_launch(ln, 90))
    kinds = {ck.metadata.name for _, _, ck in seen.values()}
    assert {"gemv1_kernel", "gemv2_kernel", "prologue_kernel", "gemm1_kernel", "gemm2_kernel",
            "finalize_kernel"} <= kinds
    for stage, ln, ck in seen.values():
        assert ck.asm["cubin"], stage
        ptx = ck.asm["ptx"]
        if ck.metadata.name in ("gemm1_kernel", "gemm2_kernel", "gemv1_kernel", "gemv2_kernel"):
            # the inline one-word decode, in the form the scales allow, the load pipeline (for
            # launches of more than one stage: one-step GEMV programs load straight to registers)
            # and the tensor cores (the GEMV kernels' too)
            assert "0x81808180" in ptx and "fma.rn.bf16x2" in ptx, stage
            assert (ptx.count("fma.rn.bf16x2") % 4 == 0) and ("0x7E807E80" in ptx) != fold, stage
            assert ("cp.async" in ptx) == (ln.num_stages > 1), stage
            assert "wgmma" in ptx, stage
            _assert_asm_in_operand_layout(ck, stage)
        if ck.metadata.name == "prologue_kernel":
            # x's quant-dequant goes out in the split layout 8 or 16 bytes a store, not 2 (the tile
            # is put in that order in registers)
            narrow = [w for w in re.findall(r"\bst\.global[\w.]*", ptx) if re.search(r"\.[bu](?:8|16)$", w)]
            assert not narrow, (stage, narrow)


def _assert_asm_in_operand_layout(ck, what):
    """The one-word asm (pack 4) decodes the 4 bytes a thread holds side by side: it is only right
    when its operands are in the MMA operand's register order (K pair, then row + 8), the grouping
    ``layout.repack_codes`` writes. Triton chooses the layouts: check it chose that one."""
    asm = [ln for ln in ck.asm["ttgir"].splitlines() if "elementwise_inline_asm" in ln]
    assert asm, what
    for a in asm:
        types = a.rsplit(":", 1)[1]
        assert "#linear" not in types and "#blocked" not in types, (what, types[:300])
        assert types.count("dot_op<{opIdx = 0") == 4 and "kWidth = 2" in types, (what, types[:300])


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_every_tile_candidate_keeps_the_decode_in_operand_layout(offline, name):
    """Every configuration the tuner may pick, compiled: the asm's operands stay in the MMA operand
    layout in each tile shape (4 and 8 warps, GEMV and blocked)."""
    from b12x_ops.backends.triton import plan as P

    g = offline._geometry(GEOMETRIES[name])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=True)
    gp.ptx = gp.fold = True
    seen = set()
    for M in (1, 2, 16, 64, 512, 8192):
        for cfg in P.candidate_configs(M, g):
            for ln in gp.stages(cfg)[1:3]:
                if id(ln) not in seen:
                    seen.add(id(ln))
                    ck = offline.compile_launch(ln, 90)
                    _assert_asm_in_operand_layout(ck, (ln.fn.__name__, ln.constexprs, ln.num_warps))
    assert len(seen) >= 10


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_gemv1_fits_four_programs_an_sm(offline, name):
    """gemv1 quantizing x itself (1-2 tokens) is capped at ``GEMV1_MAXNREG`` registers a thread, so
    that four of its 4-warp programs fit an SM's 64K registers (uncapped it took 130-160: three).
    The form that loads x quantized is left uncapped."""
    import re

    from b12x_ops.backends.triton import plan as P

    g = offline._geometry(GEOMETRIES[name])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=True)
    gp.ptx = gp.fold = True
    checked = 0
    for M in (1, 2, 3, 4):
        cfg = P.default_config(M, g)
        if not cfg.gemv:
            continue
        ln = gp.stages(cfg, M)[1]
        assert ln.fn.__name__ == "gemv1_kernel"
        assert ln.options.get("maxnreg") == (None if cfg.xq else P.GEMV1_MAXNREG), (M, ln.options)
        if not cfg.xq:
            ck = offline.compile_launch(ln, 90)
            regs = int(re.search(r"REG:(\d+)", offline.resources(ck.asm["cubin"], "gemv1_kernel")).group(1))
            assert regs <= P.GEMV1_MAXNREG and 4 * regs * 32 * ln.num_warps <= 65536, (M, regs)
            checked += 1
    assert checked >= 1


@pytest.mark.parametrize("pdl", [False, True])
def test_stage_kernels_wait_for_the_previous_launch_first_under_pdl(offline, pdl):
    """As programmatic dependent launches, every stage kernel waits for the previous kernel
    (``griddepcontrol.wait``) before its first memory access and then lets the next one launch;
    without, neither instruction is there."""
    import re

    from b12x_ops.backends.triton import plan as P

    g = offline._geometry(GEOMETRIES["qwen3-30b-a3b"])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=True, pdl=pdl)
    gp.ptx = gp.fold = True
    names = set()
    for M in (1, 4, 64):
        for ln in gp.stages(P.default_config(M, g), M):
            if ln is None:
                continue
            ck = offline.compile_launch(ln, 90)
            ptx = ck.asm["ptx"]
            names.add(ck.metadata.name)
            assert bool(ck.metadata.launch_pdl) == pdl
            assert ("griddepcontrol.wait" in ptx) == pdl and ("griddepcontrol.launch_dependents" in ptx) == pdl
            if pdl:  # the wait comes before any global load or store
                body = ptx[ptx.index("griddepcontrol.wait"):]
                before = ptx[: ptx.index("griddepcontrol.wait")]
                assert not re.search(r"\bld\.global|\bst\.global|cp\.async|atom\.", before), ck.metadata.name
                assert "ld.global" in body or "cp.async" in body
    assert names == {"xquant_kernel", "gemv1_kernel", "gemv2_kernel", "prologue_kernel", "gemm1_kernel",
                     "gemm2_kernel", "finalize_kernel"}


@pytest.mark.parametrize("pdl", [False, True])
def test_gluon_gemms_wait_for_the_previous_launch_first_under_pdl(offline, monkeypatch, pdl):
    """The Gluon GEMMs of the blocked path (sm_90, 64- and 128-row plans, and the narrower launches of
    gpt-oss's part-empty last column tiles, ``plan.edge_split``, asked for), as programmatic dependent
    launches, wait for the previous kernel before their first memory access, as every stage kernel
    does (they once launched early without waiting, and read the prologue's routing before it was
    written); without PDL neither instruction is there. The edge launches spill nothing."""
    from b12x_ops.backends.triton import gluon_kernels as GK
    from b12x_ops.backends.triton import plan as P

    if not GK.HAS_GLUON:
        pytest.skip("this triton has no Gluon with Hopper's wgmma")
    monkeypatch.setenv("B12X_OPS_TRITON_EDGE", "1")
    names = set()
    edges = 0
    for name, sizes in (("qwen3-30b-a3b", (512, 8192)), ("gpt-oss-120b", (8192,))):
        g = offline._geometry(GEOMETRIES[name])
        gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=True, pdl=pdl)
        gp.ptx = gp.fold = True
        gp.gluon = True
        for M in sizes:
            cfg = gp.with_gluon(P.default_config(M, g), M)
            rn = gp.runner(cfg, M)
            for ln in [rn.gemm1, rn.gemm2] + rn.edges:
                ck = offline.compile_launch(ln, 90)
                edge = ln in (rn.edge1, rn.edge2)
                edges += edge
                if edge:
                    assert "STACK:0 " in offline.resources(ck.asm["cubin"], ck.metadata.name), ck.metadata.name
                _assert_waits_first(ck, ln, pdl)
                names.add(ck.metadata.name)
    assert names == {"gemm1_gluon_kernel", "gemm2_gluon_kernel"} and edges == 2


def _assert_waits_first(ck, ln, pdl):
    """Compiled launch ``ln`` (``ck``): with ``pdl``, its first memory access after the wait for the previous
    kernel; without, neither that wait nor the early launch of the next."""
    import re

    ptx = ck.asm["ptx"]
    assert bool(ck.metadata.launch_pdl) == pdl and ln.constexprs["PDL"] == pdl
    assert ("griddepcontrol.wait" in ptx) == pdl and ("griddepcontrol.launch_dependents" in ptx) == pdl
    if pdl:
        before = ptx[: ptx.index("griddepcontrol.wait")]
        assert not re.search(r"\bld\.global|\bst\.global|cp\.async|atom\.|red\.", before), ck.metadata.name


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_fused_gemv_compiles_with_both_decodes_in_operand_layout(offline, name):
    """The one-launch GEMV (``gemv_fused_kernel``, what eager calls launch at 1-4 tokens): both
    roles' decodes stay in the MMA operand layout, four 4-warp programs fit an SM, the counts are
    released and the waits acquire."""
    import re

    from b12x_ops.backends.triton import plan as P

    g = offline._geometry(GEOMETRIES[name])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=True)
    gp.ptx = gp.fold = True
    forms = [(M, P.eager_form(P.default_config(M, g))) for M in (1, 2, 3, 4)]
    # (and those of the mma.sync plans, whose gemv2 of 6 chunks the tl.dot kernels take as 4)
    # (every token count the GEMV path serves on mma.sync, 1-8, each form once)
    forms += [(M, P.eager_form(P.mma_config(P.default_config(M, g, gemv=True), g, *P.gemv_mma_form(M, g)), g))
              for M in range(1, P.GEMV_MMA_MAX_TOKENS + 1) if P.gemv_mma_form(M, g)]
    forms = list({cfg: (M, cfg) for M, cfg in reversed(forms)}.values())
    for M, cfg in forms:
        assert cfg.gemv and cfg.fused and not cfg.xq
        stages = gp.stages(cfg, M)
        assert [s is None for s in stages] == [True, False, True, True]
        ck = offline.compile_launch(stages[1], 90)
        assert ck.metadata.name == "gemv_fused_kernel"
        _assert_asm_in_operand_layout(ck, (name, M))
        regs = int(re.search(r"REG:(\d+)", offline.resources(ck.asm["cubin"], "gemv_fused_kernel")).group(1))
        assert regs <= P.GEMV1_MAXNREG
        ptx = ck.asm["ptx"]  # (the wait's atomic add of 0 becomes an acquire load)
        # (spellings vary by version: an unused result makes the count a red.release)
        mem = [ln for ln in ptx.splitlines() if re.search(r"\b(atom|red|ld)\.", ln)]
        assert any("acquire" in ln for ln in mem) and any("release" in ln for ln in mem)


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("fold", [True, False])
def test_gluon_gemms_compile_with_their_mmas_in_flight(offline, name, fold, monkeypatch):
    """The Gluon GEMMs (``gluon_kernels``; GEMM1 by default on sm_90, ``plan.gluon_status``) compile for
    sm_90: the decode's asm in the wgmma operand's register layout (the kernels' ``assert_trivial``
    conversions would fail the compile otherwise), the main loop's wait leaving the step's two MMAs
    in flight (``wgmma.wait_group`` 2; in the SASS too, but for the launches capped at
    ``plan.GLUON_BM64_MAXNREG`` registers, where ptxas waits for them instead) with no write to an
    in-flight MMA's operand registers before the wait that covers it, one barrier a K step in the
    main loop (the compiler's barrier analysis adding none between a step's copies and its reads;
    triton 3.9's adds one a loop trip, at the back edge), shared memory within an SM's, and no local
    memory (16-warp tiles keep a few bytes of stack at their 128-register cap, the 64-row ones at
    theirs), and the epilogues' global writes 8 or 16 bytes wide (GEMM2 in both reduction modes; GEMM1
    also where it zeroes GEMM2's accumulator); also the 4-warp forms of 16-row blocks (32 weight rows a
    warp)."""
    import dataclasses
    import re

    import triton

    from b12x_ops.backends.triton import plan as P

    g = offline._geometry(GEOMETRIES[name])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=fold)
    gp.ptx, gp.fold, gp.dot_dtype = True, fold, triton.language.bfloat16
    big = dataclasses.replace(P.default_config(8192, g), gluon=True, **P.GLUON_GEMM1)
    forms = [(1, big), (2, dataclasses.replace(big, gluon2=True, bn2=128, bk2=64, stages2=4, warps2=8)),
             (2, dataclasses.replace(big, gluon2=True, bn2=256, bk2=64, stages2=4, warps2=16)),
             (1, dataclasses.replace(big, bm=64, bn1=64, warps1=8)), (1, dataclasses.replace(big, bm=32, bn1=64, warps1=8)),
             (2, dataclasses.replace(big, bm=32, gluon2=True, **P.GLUON_GEMM2_SMALL)),
             (2, dataclasses.replace(big, bm=64, gluon2=True, **P.GLUON_GEMM2_SMALL)),
             (2, dataclasses.replace(big, gluon2=True, atomic=not big.atomic, **P.GLUON_GEMM2)),
             # (GEMM1 zeroing GEMM2's accumulator, ``plan.acc_zero_mode``: 16-byte stores too)
             (1, dataclasses.replace(big, atomic=True)),
             (1, dataclasses.replace(big, bm=64, bn1=64, warps1=8, atomic=True)),
             # (16-row blocks: 4 warps of 32 weight rows, 6 stages)
             (1, dataclasses.replace(big, bm=16, **P.GLUON_GEMM1_16)),
             (1, dataclasses.replace(big, bm=16, atomic=True, **P.GLUON_GEMM1_16)),
             (2, dataclasses.replace(big, bm=16, gluon2=True, **P.GLUON_GEMM2_16))]
    # (where GEMM1 zeroes the accumulator in atomic plans: first, and once last)
    forms = [(which, cfg, "gemm1") for which, cfg in forms] + [(1, dataclasses.replace(big, atomic=True), "gemm1_last")]
    for which, cfg, where in forms:
        monkeypatch.setenv("B12X_OPS_TRITON_ACC_ZERO", where)
        ln = gp.stages(cfg, 8192)[which]
        assert which == 2 or ln.constexprs["ZERO_ACC"] == (P.ACC_ZERO_MODES[where] if cfg.atomic else 0), cfg
        assert ln.options.get("maxnreg") == (P.GLUON_BM64_MAXNREG if cfg.bm == 64 else None)
        ck = offline.compile_launch(ln, 90)
        ptx, what = ck.asm["ptx"], (which, cfg.tiles1(), cfg.tiles2())
        assert "0x81808180" in ptx and ("0x7E807E80" in ptx) != fold, what
        assert "wgmma.mma_async" in ptx and "cp.async" in ptx, what
        assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+2;", ptx), what
        sass = offline._cuobjdump(ck.asm["cubin"], "-sass")
        if ln.options.get("maxnreg") is None:
            assert "WARPGROUP.DEPBAR.LE gsb0, 0x2" in sass, what
        else:  # (under the cap ptxas waits for each step's MMAs: the trade ``plan.GLUON_BM64_MAXNREG`` measured)
            assert "WARPGROUP.DEPBAR.LE gsb0, 0x0" in sass, what
        assert offline.wgmma_operand_hazards(sass) == [], what
        bk, stages = (cfg.bk1, cfg.stages1) if which == 1 else (cfg.bk2, cfg.stages2)
        loops = offline.loop_profile(ck.asm["cubin"])
        # (a reduction of fewer than two trips of the unrolled loop compiles to straight code: DSv4's GEMM2
        # of 9 steps at 6 stages)
        assert loops or -(-(g.hidden_size if which == 1 else g.intermediate_size) // bk) < 2 * stages, what
        if loops:
            n, ops = max(loops, key=lambda loop: loop[0])
            rpw = (2 * cfg.bn1 // cfg.warps1) if which == 1 else (cfg.bn2 // cfg.warps2)  # (weight rows a warp)
            steps = ops["HGMMA"] // (bk // 16 * rpw // 16)  # (bk / 16 HGMMA a step, twice with 32 rows a warp)
            assert steps >= 2 and steps <= ops["BAR"] <= steps + 1, (what, ops["BAR"], steps)
        assert ck.metadata.shared <= 227 * 1024, what
        assert "LOCAL:0" in offline.resources(ck.asm["cubin"], ck.metadata.name).replace(" ", ""), what
        # the epilogues' global writes: GEMM1's activations 8 or 16 bytes a store (4 or 8 bf16, the half
        # tile's or the full one's; the quarter tile of 128-row blocks, ``HALF`` 2, stores 2 bf16 a thread,
        # 4 bytes), GEMM2's fp32 outputs 16 bytes a store or atomic
        writes = re.findall(r"\b(?:st|atom|red)\.global[\w.]*", ptx)
        quarter = which == 1 and ln.constexprs["HALF"] == 2
        wide = (r"\.(?:v[24]\.)?b32$" if quarter else r"\.v[24]\.b32$") if which == 1 else r"\.v4\.(?:b32|f32)$"
        assert writes and all(re.search(wide, w) for w in writes), (what, sorted(set(writes)))
        assert any(re.search(r"\.v[24]\.", w) for w in writes), (what, sorted(set(writes)))


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_gluon_gemms_on_mma_sync_compile_for_sm90_at_half_the_registers(offline, name, monkeypatch):
    """With ``B12X_OPS_TRITON_GLUON_SYNC16=1`` (``plan.gluon_sync16_on``) the 16-row plans' GEMMs are the Gluon
    ones on mma.sync (``Config.sync``): for sm_90 they compile to ``mma.sync`` with no wgmma, the decode's asm
    (the folded form), their copies ``stages - 1`` steps ahead (``gluon_kernels._lead``: ``cp.async.wait_group``
    ``stages - 2`` a step), no local memory, and at most 96 registers (five programs an SM and more; the wgmma
    forms of 16-row blocks take 143-145, ``benchmarks/results/sync16_sm90_offline.md``). Without it the
    same counts run as before."""
    import re

    from b12x_ops.backends.triton import plan as P

    plans = {}
    for v in ("0", "1"):
        monkeypatch.setenv("B12X_OPS_TRITON_GLUON_SYNC16", v)
        plans[v] = offline.geometry_plans(GEOMETRIES[name], 90, pdl=True, gluon=True)
    assert plans["1"].sync16 and not plans["0"].sync16
    cfg = plans["1"].default(64)
    assert cfg.bm == 16 and cfg.sync and cfg.gluon and cfg.gluon2, cfg
    assert not plans["0"].default(64).sync
    for ln in plans["1"].stages(cfg, 64)[1:3]:
        ck = offline.compile_launch(ln, 90)
        ptx, what = ck.asm["ptx"], (name, ck.metadata.name)
        assert "mma.sync" in ptx and "wgmma" not in ptx, what
        assert "0x81808180" in ptx and "0x7E807E80" not in ptx, what  # (the asm, folded: mma_fold)
        waits = set(re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx))
        assert waits == {str(ln.constexprs["STAGES"] - 2), "0"}, (what, waits)
        res = offline.resources(ck.asm["cubin"], ck.metadata.name).replace(" ", "")
        assert "LOCAL:0" in res and int(re.search(r"REG:(\d+)", res).group(1)) <= 96, (what, res)


@pytest.mark.parametrize("shape", [(2048, 768), (2080, 800)])
def test_gluon_kernels_load_scale_bytes_in_pairs_where_rows_have_an_even_count(offline, shape):
    """The Gluon GEMMs and GEMVs load a lane's scale bytes two at a time (a row's two 32-element blocks of
    a 64-element chunk, one 16-bit load: ``gluon_kernels._load_scales``) where the reduction has an even
    number of blocks (K or N a multiple of 64), and byte by byte where it has not (2080 = 65 blocks,
    800 = 25): no 8-bit load in the first case (the kernels load no other bytes), 8-bit ones in the second."""
    import dataclasses

    import triton

    from b12x_ops.backends.triton import plan as P

    K, N = shape
    g = offline._geometry(dict(E=8, K=K, N=N, top_k=2, limit=None))
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=True)
    gp.ptx, gp.fold, gp.dot_dtype = True, True, triton.language.bfloat16
    big = dataclasses.replace(P.default_config(8192, g), gluon=True, gluon2=True, **P.GLUON_GEMM1,
                              **P.GLUON_GEMM2)
    launches = [(f"gemm{w}", gp.stages(big, 8192)[w]) for w in (1, 2)]
    gp.gluon = gp.mma = gp.mma_fold = True  # (as an sm_90 prepare sets them)
    gemv = gp.with_gluon(P.default_config(1, g), 1)
    assert gemv.mma, gemv
    launches += [(f"gemv{w}", gp.stages(gemv, 1)[w]) for w in (1, 2)]
    for what, ln in launches:
        red = N if what.endswith("2") else K
        sass = offline._cuobjdump(offline.compile_launch(ln, 90).asm["cubin"], "-sass")
        u8, u16 = sass.count("LDG.E.U8 "), sass.count("LDG.E.U16 ")
        assert (u8 == 0 < u16) if red % 64 == 0 else u8 > 0, (what, red, u8, u16)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-120b"])
@pytest.mark.parametrize("form", ["persistent", "persistent_half", "deferred"])
def test_persistent_gemm2_experiment_compiles(offline, name, form, monkeypatch):
    """``benchmarks/experiments/gluon_persistent.py``'s GEMM2s (drop-ins for the Gluon GEMM2, not a
    plan's kernels yet) compile for sm_90 at the 128-row plan of 8192 tokens, with reductions (N / 64
    steps a multiple of the ring, 12, and not, 45), in each form (the walk with full tiles only, with
    the half tiles, ``GLUON_PERSISTENT_HALF=1``, and with the reductions deferred into the next
    tile's loop): no write to an in-flight MMA's operand registers, the reductions 16 bytes a
    thread, and the ring kept across tiles beside the epilogue's conversion (or the deferred
    outputs) in an SM's shared memory; the full-tile walks keep the main loop's MMAs in flight (the
    half-tile form does not at Qwen3: ptxas waits)."""
    import dataclasses
    import importlib.util
    import re

    import triton

    from b12x_ops.backends.triton import gluon_kernels as GK
    from b12x_ops.backends.triton import plan as P

    path = os.path.join(ROOT, "benchmarks", "experiments", "gluon_persistent.py")
    half = form == "persistent_half"
    monkeypatch.setenv("GLUON_PERSISTENT_HALF", "1" if half else "0")  # (read when the module loads)
    monkeypatch.setattr(sys, "path", list(sys.path))  # (the module puts the repository on it)
    spec = importlib.util.spec_from_file_location("gluon_persistent", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kernel = mod.gemm2_deferred_kernel if form == "deferred" else mod.gemm2_persistent_kernel
    monkeypatch.setattr(GK, "gemm2_gluon_kernel", kernel)
    g = dataclasses.replace(offline._geometry(GEOMETRIES[name]), deterministic=False)
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=True)
    gp.ptx, gp.fold, gp.dot_dtype, gp.gluon = True, True, triton.language.bfloat16, True
    cfg = gp.with_gluon(P.default_config(8192, g), 8192)
    assert cfg.gluon2 and cfg.bm == 128
    ln = gp.stages(cfg, 8192)[2]
    assert ln.fn is kernel
    ck = offline.compile_launch(ln, 90)
    sass = offline._cuobjdump(ck.asm["cubin"], "-sass")
    assert ("WARPGROUP.DEPBAR.LE gsb0, 0x2" in sass) or half
    assert offline.wgmma_operand_hazards(sass) == []
    assert 96 * 1024 < ck.metadata.shared <= 227 * 1024
    # the main loop's steps as compiled (a trip of STAGES steps, the NSTEP % STAGES left over before it),
    # two MMAs a step of two k16 HGMMA each; twice over where the half tiles have their own loop, or
    # the first trip is peeled (deferred)
    steps = cfg.stages2 + (-(-GEOMETRIES[name]["N"] // cfg.bk2)) % cfg.stages2
    peeled = cfg.stages2 if form == "deferred" else 0
    assert sass.count("HGMMA") == 4 * (steps + peeled) * (2 if half else 1)
    writes = re.findall(r"\b(?:st|atom|red)\.global[\w.]*", ck.asm["ptx"])
    assert writes and all(re.search(r"\.v4\.f32$", w) for w in writes), sorted(set(writes))


@pytest.mark.parametrize("name", sorted(GEOMETRIES) + ["odd"])
def test_mma_gemv_compiles_with_its_weights_loaded_before_the_wait(offline, name):
    """The GEMV on mma.sync (``gluon_gemv``; untuned plans at 1-2 tokens on sm_90) compiles for sm_90:
    the decode's asm writes the ``m16n8k16`` A fragments in place (its ``assert_trivial`` conversions
    would fail the compile otherwise), two ``mma.sync`` a 64-element chunk and no shared-memory
    operand. As programmatic dependent launches, every code load (16 bytes a lane) comes before the
    wait for the previous kernel and every store after it; with a window of W chunks (``Config.window``)
    the first W chunks' code loads come before it and each later chunk's come one by one after. Registers
    stay within four programs an SM, with no local memory. "odd" has K and N of 2.5 chunks (96, 160: half
    chunks masked)."""
    import re

    from b12x_ops.backends.triton import plan as P

    geo = GEOMETRIES.get(name, dict(E=5, K=160, N=96, top_k=3, limit=3.0))
    g = offline._geometry(geo)
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=True)
    gp.ptx = gp.fold = gp.mma = gp.mma_fold = True
    gp.mma_pdl = True
    forms = [(1, (2, 4), 0), (2, (4, 4), 0), (1, (4, 2), 0), (1, (6, 5), 2)]
    forms += [(M, P.gemv_mma_form(M, g), P.GEMV_MMA_WINDOW) for M in range(1, P.GEMV_MMA_MAX_TOKENS + 1)
              if P.gemv_mma_form(M, g)]
    forms = list({f[1:]: f for f in reversed(forms)}.values())  # (each form once, at its fewest tokens)
    for M, (q1, q2), window in forms:
        cfg = P.mma_config(P.default_config(M, g, gemv=True), g, q1, q2, window)
        for which, kernel in ((1, "gemv1_mma_kernel"), (2, "gemv2_mma_kernel")):
            ln = gp.stages(cfg, M)[which]
            ck = offline.compile_launch(ln, 90)
            ptx, what = ck.asm["ptx"], (name, M, q1, q2, which)
            assert ck.metadata.name == kernel and bool(ck.metadata.launch_pdl), what
            q = q1 if which == 1 else q2
            mmas = len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx))
            rows = 2 * cfg.bn1 if which == 1 else cfg.bn2
            assert mmas == 2 * q * 2 * (rows // 16 // ln.num_warps), (what, mmas)  # (a warp's: even, odd; 2 k16)
            assert "wgmma" not in ptx and "ld.shared" not in ptx.split("griddepcontrol.wait")[0], what
            before, after = ptx.split("griddepcontrol.wait")
            v4 = r"ld\.global(?:\.nc)?\.v4\.b32"
            per_chunk = rows // 16 // ln.num_warps  # (a lane's 16 code bytes of each of its row groups)
            first = min(window, q) if window else q
            assert len(re.findall(v4, before)) == first * per_chunk, (what, window)
            assert len(re.findall(v4, after)) == (q - first) * per_chunk, (what, window)
            assert not re.search(r"\bst\.global|\batom\.|\bred\.", before), what
            assert "griddepcontrol.launch_dependents" in after, what
            res = offline.resources(ck.asm["cubin"], ck.metadata.name).replace(" ", "")
            regs = int(re.search(r"REG:(\d+)", res).group(1))
            assert regs * 128 * 4 <= 65536 and "LOCAL:0" in res, (what, res)


def test_wgmma_operand_hazard_check_finds_a_write_to_an_in_flight_operand(offline):
    """The SASS check the Gluon test relies on: a loop whose decode rewrites the registers the last
    trip's MMA still reads (the wait keeps 2 groups in flight) is flagged; the same loop with the
    two steps' operands in two register sets is not."""
    def listing(lines):
        return "\n".join(f"        /*{16 * i:04x}*/                   {t} ;" for i, t in enumerate(lines))

    racy = listing([
        "HMUL2.BF16_V2 R92, R3, R98.H0_H0",  # the decode writes the operand
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R24, R92, gdesc[UR8], R24, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x2",  # (the MMA above stays in flight)
        "BRA 0x0",  # the next trip's decode rewrites R92 before a second wait
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
    ])
    found = offline.wgmma_operand_hazards(racy)
    assert [(a, w) for a, w, _ in found] == [(0x20, 0x0)]
    two_sets = listing([
        "HMUL2.BF16_V2 R92, R3, R98.H0_H0",
        "HGMMA.64x128x16.F32.BF16 R24, R92, gdesc[UR8], R24, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x2",
        "HMUL2.BF16_V2 R96, R3, R98.H0_H0",  # the other step's set
        "HGMMA.64x128x16.F32.BF16 R24, R96, gdesc[UR8], R24, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x2",  # (covers the first MMA: R92 is free again)
        "BRA 0x0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
    ])
    assert offline.wgmma_operand_hazards(two_sets) == []


def _experiment(name, monkeypatch, env=None):
    """A module of ``benchmarks/experiments`` loaded afresh (its knobs are read when it loads)."""
    import importlib.util

    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, "benchmarks")] + list(sys.path))
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", "experiments", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-120b"])
@pytest.mark.parametrize("form", ["probe", "gemm1", "gemm1_promoted", "bf16_undecoded"])
def test_fp8_experiments_compile(offline, name, form, monkeypatch):
    """``benchmarks/experiments/fp8_probe.py`` and ``fp8_gemm1.py`` (``results/fp8_mma.md``) compile for
    sm_90 as drop-ins for the Gluon GEMMs at the 128-row plan of 8192 tokens: the e4m3 forms on QGMMA
    (two k32 a K step of 64, the package's ring and register-set scheme, the previous step's MMAs in
    flight under the decode), the promoted GEMM1 (``FP8_GEMM1_PSTEPS=2`` in 8-warp programs of 64
    columns) with its fp32 adds and no local memory, and the package's bf16 GEMMs without their decode
    on the same HGMMA with a loop about half as long; no write to an in-flight MMA's operand
    registers in any."""
    import dataclasses

    import triton

    from b12x_ops.backends.triton import gluon_kernels as GK
    from b12x_ops.backends.triton import plan as P

    g = dataclasses.replace(offline._geometry(GEOMETRIES[name]), deterministic=False)
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=True)
    gp.ptx, gp.fold, gp.dot_dtype, gp.gluon = True, True, triton.language.bfloat16, True
    cfg = gp.with_gluon(P.default_config(8192, g), 8192)
    assert cfg.gluon and cfg.gluon2 and cfg.bm == 128
    base = [offline.compile_launch(gp.stages(cfg, 8192)[1], 90)]
    base_loop = max(n for n, _ in offline.loop_profile(base[0].asm["cubin"]))
    gp.launches.clear()
    if form == "gemm1_promoted":
        mod = _experiment("fp8_gemm1", monkeypatch, {"FP8_GEMM1_PSTEPS": "2"})
        cfg = dataclasses.replace(cfg, bn1=64, warps1=8)
    else:
        mod = _experiment("fp8_gemm1" if form == "gemm1" else "fp8_probe", monkeypatch,
                          {"FP8_PROBE_DECODE": "1", "FP8_GEMM1_PSTEPS": "0", "FP8_GEMM1_PROMOTE": "0"})
    if form in ("gemm1", "gemm1_promoted"):
        monkeypatch.setattr(GK, "gemm1_gluon_kernel", mod.gemm1_fp8_kernel)
        which = (1,)
    elif form == "probe":
        monkeypatch.setattr(GK, "gemm1_gluon_kernel", mod.gemm1_fp8_probe_kernel)
        monkeypatch.setattr(GK, "gemm2_gluon_kernel", mod.gemm2_fp8_probe_kernel)
        which = (1, 2)
    else:
        which = (1,)
    if form == "bf16_undecoded":  # (swapped by hand: the package's functions must rehash before and after)
        decode = GK._decode_operands
        GK._decode_operands = mod._undecoded_operands
        mod._forget_compiled()
    try:
        _check_fp8_experiment_launches(offline, gp, cfg, which, form, base_loop)
    finally:
        if form == "bf16_undecoded":
            GK._decode_operands = decode
            mod._forget_compiled()


def _check_fp8_experiment_launches(offline, gp, cfg, which, form, base_loop):
    for w in which:
        ck = offline.compile_launch(gp.stages(cfg, 8192)[w], 90)
        sass = offline._cuobjdump(ck.asm["cubin"], "-sass")
        assert offline.wgmma_operand_hazards(sass) == [], (form, w)
        assert "LOCAL:0" in offline.resources(ck.asm["cubin"], ck.metadata.name).replace(" ", ""), (form, w)
        # (the main loop's trip; ptxas unrolls Qwen3's GEMM2, 3 trips of 4 steps, whole: then the kernel)
        n, ops = max(offline.loop_profile(ck.asm["cubin"]) or [(0, collections.Counter(
            re.findall(r"\b([HQ]GMMA)\b", sass)))], key=lambda loop: loop[0])
        if form == "bf16_undecoded":
            assert "WARPGROUP.DEPBAR.LE gsb0, 0x2" in sass and "QGMMA" not in sass
            assert ops["HGMMA"] == 16 and n < 0.6 * base_loop, (n, base_loop)
            continue
        assert "HGMMA" not in sass and re.search(r"QGMMA\.64x\d+x32\.F32\.E4M3\.E4M3", sass), (form, w)
        # (a loop trip: 4 steps of two k32 MMAs; unrolled: a multiple of that, both tile sizes)
        assert ops["QGMMA"] == 2 * 4 if n else ops["QGMMA"] % 8 == 0 < ops["QGMMA"], (form, w, ops["QGMMA"])
        if form == "gemm1_promoted":
            assert ops["FADD"] >= 2 * 32, ops["FADD"]  # (two promotions a trip, 32+ accumulators a thread)
        else:
            assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass, (form, w)


def test_offline_report_gives_each_launch_its_programs_an_sm(offline, capsys):
    """``compile_offline.py``'s table: each launch's registers and shared memory, the programs an sm_90 SM
    holds of it (``bench_moe.programs_per_sm`` of those registers, the launch's warps and its shared
    memory), its busy programs and their waves on 132 SMs, as the benchmark's per-stage cells give them."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from bench_moe import SM90_LIMITS, programs_per_sm
    finally:
        sys.path.pop(0)
    offline.main(["--geometries", "qwen3-30b-a3b", "--sizes", "1", "--stages", "gemm1", "gemm2"])
    rows = [ln.split(" | ") for ln in capsys.readouterr().out.splitlines() if ln.startswith("| qwen3-30b-a3b | 1 |")]
    assert len(rows) == 2, rows
    for row in rows:
        warps = int(row[5].split("/")[0])
        regs = int(re.search(r"REG:(\d+)", row[6]).group(1))
        shared = int(re.search(r"dyn-smem:(\d+)", row[6]).group(1))
        assert int(row[7]) == programs_per_sm(regs, warps, shared, SM90_LIMITS) > 0, row
        assert float(row[9]) == round(int(row[8]) / (int(row[7]) * SM90_LIMITS["sms"]), 2) > 0, row  # (waves)
    assert int(rows[0][8]) % 8 == 0  # (one token's 8 slots: gemv1's programs are a multiple of them)


def _decode_operand_layouts(kernel) -> set[str]:
    """The layouts of the inline-PTX decode's operands in a compiled kernel's TTGIR: ``"v3 kWidth 2"`` (a
    dot operand of an MMA of that version and kWidth), or ``"linear"``/the encoding's name otherwise."""
    ttgir = kernel.asm["ttgir"]
    defs = dict(re.findall(r"^(#\w+) = (.+)$", ttgir, re.M))
    found = set()
    for line in ttgir.splitlines():
        if "elementwise_inline_asm" not in line or "0x81C081C0" not in line:
            continue
        enc = re.findall(r"tensor<[^,>]+, ([^>]+>?)>", line)[0]
        enc = defs.get(enc, enc)
        kw, parent = re.search(r"kWidth = (\d+)", enc), re.search(r"parent = (#\w+)", enc)
        version = re.search(r"versionMajor = (\d+)", defs.get(parent.group(1), "")) if parent else None
        found.add(f"v{version.group(1)} kWidth {kw.group(1)}" if kw and version else enc.split("<")[0])
    assert found, "no inline-PTX decode in the kernel"
    return found


def test_ptx_decode_meets_the_wgmma_operand_order_only_on_sm90(offline, monkeypatch):
    """The inline-PTX decode reads a thread's registers in the order of sm_90's wgmma operand (a dot operand
    of MMA v3, kWidth 2). Compiled for sm_90, every tile ``plan.DOT_PTX_TILES`` lets the tl.dot kernels take
    (the blocked GEMM1 and GEMM2, gemv1, gemv2) gives the decoded tile that layout. The tiles that summed
    wrong on an H100 (32 columns in 4 warps at K steps of 128; 2 warps; ``results/dot_tiles.md``) get MMA
    v2's (kWidth 4). So do the plans' own tiles compiled for sm_80, sm_89 and sm_120, where the PTX decode
    is therefore off (``plan.ptx_status``)."""
    import dataclasses

    from b12x_ops.backends.triton import plan as P

    monkeypatch.setattr(P.GeometryPlans, "_check_dot", lambda self, cfg, kind: None)  # (the wrong tiles too)
    gp = offline.geometry_plans(dict(E=8, K=512, N=256, top_k=4, limit=None), 90)  # (an sm_90 prepare's choices)
    g = gp.geometry
    blocked = dataclasses.replace(P.default_config(32, g, gemv=False), bm=16, gluon=False, gluon2=False)
    small = P.default_config(2, g, gemv=True)
    assert not small.mma and small.gemv

    def layouts(kind, cfg, arch):
        gp.launches.clear()
        return _decode_operand_layouts(offline.compile_launch(gp.launch(kind, cfg, 32), arch))

    wgmma = {"v3 kWidth 2"}
    for bn, warps in P.DOT_PTX_TILES:
        for cfg in (blocked, small):
            assert layouts("gemm1", dataclasses.replace(cfg, bn1=bn, warps1=warps), 90) == wgmma, (cfg, bn, warps)
            assert layouts("gemm2", dataclasses.replace(cfg, bn2=bn, warps2=warps), 90) == wgmma, (cfg, bn, warps)
    mma_v2 = {"v2 kWidth 4"}
    assert layouts("gemm1", dataclasses.replace(blocked, bn1=32, bk1=128, warps1=4), 90) == mma_v2
    assert layouts("gemm2", dataclasses.replace(blocked, warps2=2), 90) == mma_v2
    for arch in (80, 89, 120):
        for kind, cfg in (("gemm1", blocked), ("gemm2", blocked), ("gemm1", small)):
            assert layouts(kind, cfg, arch) == mma_v2, (arch, kind)
