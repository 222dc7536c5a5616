"""Compile the Triton backend's stage kernels for a GPU this machine does not have, and report
what the compiler made of them: registers, spills, shared memory, async copies.

    python benchmarks/compile_offline.py [--geometries ...] [--sizes 1 64 8192] [--arch 90] [--loops]

Triton compiles for any NVIDIA target without a GPU (its wheel carries ptxas), so register
pressure and the effect of a kernel change on it can be checked here before spending device time.
The kernels are the ones a prepare on a GPU of ``--arch`` would launch (the default config per token
count: on sm_90 the inline-PTX decode, elsewhere Triton operations, ``geometry_plans``), with the
pointer alignment a real launch specializes on. Numbers depend on the triton version (the device's
triton is what counts: install the same version to compare). ``--loops`` also counts the SASS
instructions of each loop body by kind (a kernel's main loop per step, e.g. against the weights a
thread decodes in that step), which is how the decode's instruction budget is tracked.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from b12x_ops.backends.triton import plan as P  # noqa: E402

# element types of the pointer arguments, by name (what ``_launch`` passes)
_I16 = {"x_ptr", "wts_in_ptr", "out_ptr"}
_I32 = {"ids_ptr", "lid_ptr", "sorted_ptr", "blk_expert_ptr", "blk_rows_ptr", "cnt_ptr", "key_ptr", "off_ptr",
        "cnt1_ptr", "cnt2_ptr", "sync_ptr", "ref_ptr"}
_U8 = {"w_ptr", "s_ptr", "w13_ptr", "s13_ptr", "w2_ptr", "s2_ptr"}
_F32 = {"gs_ptr", "acc_ptr", "dst_ptr", "src_ptr", "part_ptr", "g13_ptr", "g2_ptr", "part1_ptr", "part2_ptr", "fw_ptr",
        "fx_ptr"}


def signature(launch: P.Launch) -> tuple[dict, dict]:
    fn = launch.fn
    no_align = {fn.arg_names[i] if isinstance(i, int) else i for i in getattr(fn, "do_not_specialize_on_alignment", ())}
    sig, attrs = {}, {}
    gemv = fn.__name__.startswith("gemv")
    for i, name in enumerate(fn.arg_names):
        if name in launch.constexprs:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            if name in _I16 or (name == "wts_ptr" and gemv):
                t = "*i16"
            elif name in _I32:
                t = "*i32"
            elif name in _U8:
                t = "*u8"
            elif name in _F32 or name == "wts_ptr":
                t = "*fp32"
            else:  # activations: bf16
                t = "*bf16"
            sig[name] = t
            if name not in no_align:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name == "limit" else "i32"
    return sig, attrs


def _cuobjdump(cubin: bytes, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)


def resources(cubin: bytes, name: str) -> str:
    out = _cuobjdump(cubin, "-res-usage")
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if name in line and i + 1 < len(lines):
            return lines[i + 1].strip()
    return out.strip()[-200:]


def loop_profile(cubin: bytes) -> list[tuple[int, collections.Counter]]:
    """Per loop (a backward branch): its body's instruction count and the count of each opcode."""
    ins = sass_instructions(_cuobjdump(cubin, "-sass"))
    loops = []
    for lo, hi in _loops(ins):
        body = [t for _, t in ins[lo:hi + 1]]
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
        loops.append((len(body), ops))
    return loops


def _loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """``(first, last)`` indices in ``ins`` of each loop: a branch back to an earlier instruction."""
    at = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA\s+0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            out.append((at[int(m.group(1), 16)], i))
    return out


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, instruction)`` of a cuobjdump SASS listing."""
    return [(int(m.group(1), 16), m.group(2)) for m in
            (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", ln) for ln in sass.splitlines()) if m]


_NO_REG_DST = ("HGMMA", "ST", "BAR", "BRA", "WARPGROUP", "DEPBAR", "LDGSTS", "RED", "ATOM", "MEMBAR", "FENCE", "NOP",
               "ISETP", "FSETP", "PLOP3", "UI", "UM", "US", "UL", "R2UR", "EXIT")


def _written(text: str) -> set[int]:
    """The general registers an instruction writes (its first operand; 1, 2 or 4 of them)."""
    t = re.sub(r"^@!?U?P\w+\s+", "", text)
    parts = t.split(None, 1)
    if len(parts) < 2 or parts[0].startswith(_NO_REG_DST):
        return set()
    m = re.match(r"R(\d+)", parts[1].split(",")[0].strip())
    if not m:
        return set()
    width = 4 if ".128" in parts[0] else 2 if (".64" in parts[0] or parts[0].startswith("CS2R") or "WIDE" in parts[0]) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def wgmma_operand_hazards(sass: str) -> list[tuple[int, int, str]]:
    """Where an instruction writes a register an in-flight wgmma reads its first operand from:
    ``(wgmma address, writer address, writer)`` for each ``HGMMA`` (bf16) or ``QGMMA`` (fp8) with a
    register operand and the first write to one of its 4 registers before the wait that covers it
    (the second ``WARPGROUP.DEPBAR.LE`` after it that leaves MMAs in flight, or the first ``0x0``),
    following the main loop's back edge once. ptxas does not always catch these across a loop's
    iterations (the hardware then reads whatever the writer left)."""
    ins = sass_instructions(sass)
    loop = next(((lo, hi) for lo, hi in _loops(ins) if any("GMMA" in x for _, x in ins[lo:hi + 1])), None)
    found = []
    for p, (a, t) in enumerate(ins):
        m = re.search(r"[HQ]GMMA\S*\s+R\d+,\s+R(\d+)", t)
        if not m:
            continue
        regs = set(range(int(m.group(1)), int(m.group(1)) + 4))
        waits, q = 0, p
        for _ in range(3 * len(ins)):
            q = loop[0] if loop and q == loop[1] else q + 1
            if q >= len(ins):
                break
            tq = ins[q][1]
            if "WARPGROUP.DEPBAR" in tq:
                waits += 1
                if "0x0" in tq or waits == 2:
                    break
            if _written(tq) & regs:
                found.append((a, ins[q][0], tq))
                break
    return found


def compile_launch(launch: P.Launch, arch: int):
    sig, attrs = signature(launch)
    if getattr(launch.fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource
        src = GluonASTSource(launch.fn, sig, dict(launch.constexprs), attrs)
    else:
        src = ASTSource(launch.fn, sig, dict(launch.constexprs), attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(launch.options))


def main(argv=None):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_moe import GEOMETRIES, SM90_LIMITS, routing, stage_programs, used_blocks, waves

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometries", nargs="*", default=list(GEOMETRIES))
    ap.add_argument("--sizes", nargs="*", type=int, default=[1, 8, 64, 512, 8192])
    ap.add_argument("--arch", type=int, default=90, help="compute capability as an integer (90: H100/H200)")
    ap.add_argument("--gemv", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--stages", nargs="*", default=["prologue", "gemm1", "gemm2", "finalize"])
    ap.add_argument("--loops", action="store_true", help="count each loop body's SASS instructions by kind")
    ap.add_argument("--pdl", action="store_true",
                    help="as programmatic dependent launches (plan.pdl_status; sm_90 and newer)")
    ap.add_argument("--gluon", action="store_true",
                    help="the Gluon kernels a prepare on that GPU takes (plan.with_gluon): the GEMMs with their edge "
                         "launches on sm_90, the GEMV on mma.sync on sm_80 and newer")
    args = ap.parse_args(argv)

    gemv = {"auto": None, "on": True, "off": False}[args.gemv]
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    print("| geometry | M | stage | kernel | tiles | warps/stages | resources | programs an SM (sm_90) "
          "| busy programs (CPU routing) | waves (132 SMs) | async copies |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.geometries:
        geo = GEOMETRIES[name]
        gp = geometry_plans(geo, args.arch, gemv, pdl=args.pdl, gluon=args.gluon)
        compiled = {}  # (a launch several token counts share compiles once)
        for M in args.sizes:
            cfg = gp.default(M)  # (what a GPU prepare runs untuned: with --gluon, the GEMV on mma.sync up to its bounds)
            rn = gp.runner(cfg, M)
            # the programs that have work, with the benchmark's routing drawn on the CPU (the same law as
            # its GPU draw, other values): an expert block each the routing fills, or a slot each (GEMV)
            blocks = M * geo["top_k"] if cfg.gemv else used_blocks(routing(M, geo["E"], geo["top_k"], "cpu", 7)[1],
                                                                   geo["E"], cfg.bm)
            busy = stage_programs(rn, cfg, M, geo["top_k"], geo["K"], blocks)
            for stage, ln, edge in (*((s_, ln_, False) for s_, ln_ in zip(("prologue", "gemm1", "gemm2", "finalize"),
                                                                        gp.stages(cfg, M))),
                                    ("gemm1", rn.edge1, True), ("gemm2", rn.edge2, True)):  # (edges: plan.edge_split)
                if ln is None or stage not in args.stages:
                    continue
                first = id(ln) not in compiled
                if first:
                    compiled[id(ln)] = _compile_report(ln, args.arch)
                res, asyncs, per_sm, ck = compiled[id(ln)]
                programs = blocks if edge else busy[stage]  # (an edge launch: a program a block)
                wv = f"{waves(programs, per_sm, SM90_LIMITS['sms']):.2f}" if per_sm else ""
                tiles = {k: v for k, v in ln.constexprs.items() if k.startswith("B") or k in ("RT", "NBT")}
                print(f"| {name} | {M} | {stage} | {ln.fn.__name__} | {tiles} | {ln.num_warps}/{ln.num_stages} "
                      f"| {res} | {per_sm} | {programs} | {wv} | {asyncs} |", flush=True)
                if args.loops and first and asyncs != "":
                    for n, ops in loop_profile(ck.asm["cubin"]):
                        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(10))
                        print(f"|  |  |  | loop of {n} instructions | {top} |  |  |  |  |  |  |", flush=True)


def _compile_report(ln, arch: int) -> tuple:
    """``(resources, async copies, programs an sm_90 SM holds, compiled kernel)`` of launch ``ln`` compiled
    for ``arch``; the error in the first field (and the rest empty) where it does not compile."""
    from bench_moe import SM90_LIMITS, programs_per_sm  # (main puts benchmarks/ on the path)

    try:
        ck = compile_launch(ln, arch)
        res = resources(ck.asm["cubin"], ln.fn.__name__).split(" CONSTANT")[0] + f" dyn-smem:{ck.metadata.shared}"
        per_sm = programs_per_sm(int(re.search(r"REG:(\d+)", res).group(1)), ln.num_warps, ck.metadata.shared,
                                 SM90_LIMITS)
        return res, ck.asm["ptx"].count("cp.async"), per_sm, ck
    except Exception as exc:  # noqa: BLE001 - report and go on
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}", "", "", None


def geometry_plans(geo, arch: int, gemv=None, pdl: bool = False, gluon: bool = False) -> P.GeometryPlans:
    """Dry plans of benchmark geometry ``geo`` with the choices a prepare on an ``arch`` GPU makes for a
    checkpoint of usual scales (bytes in [2, 128]): the folded inline-PTX decode on sm_90, Triton
    operations elsewhere (``plan.ptx_status``); ``pdl`` and ``gluon`` as asked, where that GPU takes them
    (``plan.pdl_status``: sm_90 and newer; ``plan.gluon_status``: the GEMMs on wgmma on sm_90, on mma.sync
    elsewhere unless B12X_OPS_TRITON_GLUON_SYNC=0; the GEMV on mma.sync with its folded asm,
    ``plan.gemv_mma_status``: sm_80 and newer)."""
    ptx = P._ptx_decision((arch // 10, arch % 10), True, None)[0]
    gp = P.GeometryPlans(_geometry(geo), True, gemv, ptx=ptx, dry=True, fold=ptx, pdl=pdl and arch >= 90)
    gp.ptx = gp.fold = ptx  # (the constructor's choice is this machine's: off under TRITON_INTERPRET=1)
    gp.dot_dtype = triton.language.bfloat16  # (the constructor's is fp32 under TRITON_INTERPRET=1)
    gp.mma = gp.mma_fold = gluon and (arch // 10, arch % 10) >= P.GEMV_MMA_MIN_CAPABILITY
    gp.choose_gluon((arch // 10, arch % 10) if gluon else None)  # (as a prepare there: plan.gluon_status)
    gp.mma_pdl = gp.pdl  # (``plan.gemv_mma_pdl``: as the other launches')
    return gp


def _geometry(geo):
    """A CPU ``Geometry`` of a benchmark geometry (only shapes and flags matter here)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_moe import plan_geometry

    return plan_geometry(geo, deterministic=True)


if __name__ == "__main__":
    main()
