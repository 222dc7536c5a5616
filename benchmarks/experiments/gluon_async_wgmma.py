"""Does triton's Gluon (``triton.experimental.gluon``) let a warpgroup's MMA of one K step run under
the work of the next, with the MMA's first operand in registers? (Offline: compiles for sm_90 and
prints the wgmma and wait instructions.)

    python benchmarks/experiments/gluon_async_wgmma.py

The blocked GEMMs decode the weights into the wgmma's register operand; with ``tl.dot`` each step
waits for its MMAs to finish before the next step's decode (``WARPGROUP.DEPBAR.LE gsb0, 0x0``), which
is what bounds the large-M tiles (``benchmarks/NOTES.md``). A toy loop here issues step k's MMAs
asynchronously, loads step k + 1's operand meanwhile, and waits with one group still in flight.
With triton 3.6 the SASS shows ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` in the loop: the primitive a
decode-under-MMA kernel needs.
"""

from __future__ import annotations

import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compile_offline as C  # noqa: E402


@gluon.jit
def toy_kernel(a_ptr, b_ptr, c_ptr, K: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """``c = a @ b`` for one ``[BM, BN]`` tile, the A operand in registers one step ahead."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    ra = gl.arange(0, BM, layout=gl.SliceLayout(1, a_l))
    ka = gl.arange(0, BK, layout=gl.SliceLayout(0, a_l))
    rb = gl.arange(0, BK, layout=gl.SliceLayout(1, blk))
    nb = gl.arange(0, BN, layout=gl.SliceLayout(0, blk))
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BK, BN], b_sl)
    acc = gl.zeros([BM, BN], gl.float32, layout=mma)
    a = gl.load(a_ptr + ra[:, None] * K + ka[None, :])
    for k0 in range(0, K, BK):
        i = (k0 // BK) % 2
        b_smem.index(i).store(gl.load(b_ptr + (k0 + rb)[:, None] * BN + nb[None, :]))
        fence_async_shared()
        a_next = gl.load(a_ptr + ra[:, None] * K + (k0 + BK + ka)[None, :], mask=(k0 + BK + ka < K)[None, :],
                         other=0.0)
        acc = warpgroup_mma(a, b_smem.index(i), acc, is_async=True)
        acc, a = warpgroup_mma_wait(num_outstanding=1, deps=[acc, a])
        a = a_next
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    om = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    on = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    gl.store(c_ptr + om[:, None] * BN + on[None, :], acc)


def main():
    sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "K": "constexpr", "BM": "constexpr",
           "BN": "constexpr", "BK": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    src = GluonASTSource(toy_kernel, sig, dict(K=1024, BM=64, BN=64, BK=64), attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    sass = C._cuobjdump(ck.asm["cubin"], "-sass")
    print(f"triton {triton.__version__}, sm_90:", C.resources(ck.asm["cubin"], "toy_kernel"))
    for line in sass.splitlines():
        if "HGMMA" in line or "WARPGROUP.DEPBAR" in line:
            print("  " + line.split(";")[0].split("*/")[-1].strip())


if __name__ == "__main__":
    main()
