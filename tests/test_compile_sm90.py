"""The Triton backend's stage kernels compile for sm_90 on this CPU-only machine.

Triton's wheel carries ptxas, so ``benchmarks/compile_offline.py`` can compile a prepare's launches
for a GPU that is not here. The interpreter suite checks the kernels' arithmetic; this checks what
the interpreter never sees: the inline PTX (its constraints, registers and instructions as ptxas
reads them), the GPU-only constexpr branches, and the asynchronous-copy pipelines of the GEMMs.
"""

from __future__ import annotations

import os
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def offline():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("compile tests need the compiler, not the interpreter (unset TRITON_INTERPRET)")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import compile_offline
    finally:
        sys.path.pop(0)
    return compile_offline


GEOMETRIES = {  # the benchmark's three layers (benchmarks/bench_moe.py)
    "gpt-oss-120b": dict(E=128, K=2880, N=2880, top_k=4, limit=7.0),
    "dsv4.1-tp4": dict(E=384, K=5120, N=576, top_k=6, limit=10.0),
    "qwen3-30b-a3b": dict(E=128, K=2048, N=768, top_k=8, limit=None),
}


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("fold", [True, False])
def test_default_launches_compile_for_sm90(offline, name, fold):
    import triton

    from b12x_ops.backends.triton import plan as P

    g = offline._geometry(GEOMETRIES[name])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=fold)
    gp.ptx, gp.fold, gp.dot_dtype = True, fold, triton.language.bfloat16  # a GPU prepare's choices
    seen = {}
    for M in (1, 64, 8192):
        for stage, ln in zip(("prologue", "gemm1", "gemm2", "finalize"), gp.stages(P.default_config(M, g))):
            if ln is not None and id(ln) not in seen:
                seen[id(ln)] = (stage, offline.compile_launch(ln, 90, False))
    kinds = {ck.metadata.name for _, ck in seen.values()}
    assert {"gemv1_kernel", "gemv2_kernel", "prologue_kernel", "gemm1_kernel", "gemm2_kernel",
            "finalize_kernel"} <= kinds
    for stage, ck in seen.values():
        assert ck.asm["cubin"], stage
        ptx = ck.asm["ptx"]
        if ck.metadata.name in ("gemm1_kernel", "gemm2_kernel"):
            # the inline decode, in the form the scales allow, and the GEMMs' load pipeline
            assert ("mul.lo.u32" in ptx) and (("fma.rn.bf16x2" in ptx)), stage
            assert (ptx.count("fma.rn.bf16x2") % 2 == 0) and ("0x7E807E80" in ptx) != fold, stage
            assert "cp.async" in ptx, stage
            assert "wgmma" in ptx, stage


def test_fp8_launches_compile_for_sm90(offline):
    from b12x_ops.backends.triton import plan as P

    g = offline._geometry(GEOMETRIES["qwen3-30b-a3b"])
    gp = P.GeometryPlans(g, True, False, ptx=True, dry=True, fp8=True)
    for M in (64, 512):
        for ln in gp.stages(P.default_config(M, g, gemv=False))[1:3]:
            ck = offline.compile_launch(ln, 90, True)
            assert ck.metadata.name in ("gemm1_fp8_kernel", "gemm2_fp8_kernel")
            assert "e4m3" in ck.asm["ptx"]  # fp8 tensor-core MMAs


@pytest.mark.parametrize("M", [16, 8192])
def test_experimental_repacked_gemms_compile_for_sm90_with_shorter_loops(offline, M):
    """``benchmarks/experiments/repacked.py`` in place of the package's blocked GEMMs: each
    compiles (inline PTX of the one-word decode, pack 4), its code tile takes no 2-byte
    shared-memory loads, and its K loop is at least 15 % shorter than the package kernel's."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from experiments import repacked as R
    finally:
        sys.path.pop(0)
    from b12x_ops.backends.triton import kernels as K_
    from b12x_ops.backends.triton import plan as P

    g = offline._geometry(GEOMETRIES["gpt-oss-120b"])
    cfg = P.default_config(M, g, gemv=False)
    loops = {}
    for tag, kernels in (("package", (K_.gemm1_kernel, K_.gemm2_kernel)), ("repacked", (R.gemm1_kernel, R.gemm2_kernel))):
        saved = K_.gemm1_kernel, K_.gemm2_kernel
        K_.gemm1_kernel, K_.gemm2_kernel = kernels
        try:
            gp = P.GeometryPlans(g, True, False, ptx=True, dry=True, fold=True)
            gp.ptx = gp.fold = True
            lns = gp.stages(cfg)[1:3]
        finally:
            K_.gemm1_kernel, K_.gemm2_kernel = saved
        for ln in lns:
            assert ln.fn in kernels
            ck = offline.compile_launch(ln, 90, False)
            (n, ops), = offline.loop_profile(ck.asm["cubin"])  # one loop: the K steps
            loops[tag, ln.fn.__name__] = (n, ops)
            if tag == "repacked":
                assert "0x01000100" in ck.asm["ptx"]  # the one-word decode's fourth pair
                # the asm sees its 4 bytes in the MMA operand's register order (K pair, then row + 8),
                # the grouping repack_codes writes: its operands are in that layout, not another
                asm = [ln_ for ln_ in ck.asm["ttgir"].splitlines() if "elementwise_inline_asm" in ln_]
                assert asm and all("dot_op<{opIdx = 0" in a and "#linear" not in a for a in asm)
    for name in ("gemm1_kernel", "gemm2_kernel"):
        (n0, ops0), (n1, ops1) = loops["package", name], loops["repacked", name]
        assert n1 <= 0.85 * n0, (name, n0, n1)
        assert ops1["LDS"] < ops0["LDS"], (name, ops0["LDS"], ops1["LDS"])
