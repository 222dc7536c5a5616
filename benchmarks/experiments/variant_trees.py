"""Diagnostic and trial copies of the package, each this checkout with a few exact edits (timing only).

    python benchmarks/experiments/variant_trees.py OUT_DIR
    bash benchmarks/compare_trees.sh noepi=OUT_DIR/noepi noconv=OUT_DIR/noconv st6=OUT_DIR/st6 main=. -- \
        --no-tune --layers 4 --reps 10 --bf16-layers 0 --diagnose --sizes 2048 8192

Writes one tree (``b12x_ops`` and ``benchmarks`` of this checkout, edited) a variant under OUT_DIR:

- ``noepi``: the Gluon GEMM2 epilogue's atomics (or stores) predicated off at run time, by a
  condition the compiler cannot decide (``slot < 0``: the slot ids are loaded); the layout
  conversion, the router weights and everything before stay. Its outputs are wrong: the
  benchmark's GEMM2 column is what it is for. (A first version used ``nrow < 0``, which the
  compiler decides inside the full-tile branch, ``nrow > BM / 2``: it dropped the atomics and part
  of the MMAs; the SASS counts of ``HGMMA`` and ``REDG`` must match the package's, as they do for
  these edits.) ``results/gemm2_epilogue.md``.
- ``noconv``: as ``noepi`` and without the conversion to ``_out_layout`` (the predicated-off atomics
  issued from the accumulator's layout, 4 bytes each). Same file.
- ``st6``: GEMM2's 128-row Gluon form in six pipeline stages (four). Same file.
- ``cap2``: GEMM2's 128-row Gluon form as 8-warp programs of 128 W2 rows, capped at 128 registers
  (``plan.gluon_maxnreg``), two an SM; ``cap12``: and GEMM1's as 8-warp programs of 64 columns.
  ``results/gluon_128_cap.md``.
"""

from __future__ import annotations

import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GK = os.path.join("b12x_ops", "backends", "triton", "gluon_kernels.py")
PLAN = os.path.join("b12x_ops", "backends", "triton", "plan.py")

MASK = "        msk = (offs_o < K)[:, None] & rvalid[None, :]\n        if ATOMIC:"
MASK_OFF = "        msk = (offs_o < K)[:, None] & rvalid[None, :] & (slot < 0)[None, :]\n        if ATOMIC:"
CONVERT = ("        out_l: gl.constexpr = _out_layout(BN, BM, gl.num_warps())\n"
           "        acc = gl.convert_layout(acc, out_l)\n")
NO_CONVERT = "        out_l: gl.constexpr = acc.type.layout\n"
GEMM2 = "GLUON_GEMM2 = dict(bn2=256, bk2=64, stages2=4, warps2=16)"
GEMM2_ST6 = "GLUON_GEMM2 = dict(bn2=256, bk2=64, stages2=6, warps2=16)"
GEMM2_8W = "GLUON_GEMM2 = dict(bn2=128, bk2=64, stages2=4, warps2=8)"
GEMM1 = "GLUON_GEMM1 = dict(bn1=128, bk1=64, stages1=4, warps1=16)"
GEMM1_8W = "GLUON_GEMM1 = dict(bn1=64, bk1=64, stages1=4, warps1=8)"
CAP = "    return GLUON_BM64_MAXNREG if bm == 64 and warps == 8 and not sync else None"
CAP_128 = ("    return 128 if (bm, warps) == (128, 8) else GLUON_BM64_MAXNREG if (bm, warps) == (64, 8) and not sync "
           "else None")

VARIANTS = {
    "noepi": [(GK, MASK, MASK_OFF)],
    "noconv": [(GK, MASK, MASK_OFF), (GK, CONVERT, NO_CONVERT)],
    "st6": [(PLAN, GEMM2, GEMM2_ST6)],
    "cap2": [(PLAN, GEMM2, GEMM2_8W), (PLAN, CAP, CAP_128)],
    "cap12": [(PLAN, GEMM2, GEMM2_8W), (PLAN, CAP, CAP_128), (PLAN, GEMM1, GEMM1_8W)],
}


def _edit(path: str, old: str, new: str) -> None:
    with open(path) as f:
        text = f.read()
    if text.count(old) != 1:
        raise SystemExit(f"{path}: the text to replace is not there once (the kernel changed?):\n{old}")
    with open(path, "w") as f:
        f.write(text.replace(old, new))


def main(out: str) -> None:
    for name, edits in VARIANTS.items():
        tree = os.path.join(out, name)
        shutil.rmtree(tree, ignore_errors=True)
        for part in ("b12x_ops", "benchmarks"):
            shutil.copytree(os.path.join(ROOT, part), os.path.join(tree, part),
                            ignore=shutil.ignore_patterns("__pycache__", "results"))
        for rel, old, new in edits:
            _edit(os.path.join(tree, rel), old, new)
        print(f"{name}: {tree}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
