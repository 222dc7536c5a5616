"""Plans, the shared scratch arena and precompiled launches for the Triton backend.

Everything here runs at ``prepare`` time except ``Launch.__call__`` and ``GeometryPlans.runner_for``,
which are the per-call path: a table lookup, a few integer divisions and direct launches of kernels
compiled at prepare (so an op call cannot compile: a missing kernel raises).

Handles of one ``Geometry`` share one ``GeometryPlans``: its configs per planned token count, its
compiled kernels and one scratch arena sized for its largest plan.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import sys
import time
import weakref
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from . import gluon_gemv as GG
from . import gluon_kernels as GK
from . import kernels as K_

log = logging.getLogger("b12x_ops.triton")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The prologue: at most RT slots a routing program (all of them in one program's registers up to
# RT slots) and a placing one, at most NBT blocks a step of the block table; QR rows of x of QK
# columns a step a quantizing program.
PROLOGUE = dict(RT=1024, NBT=512, QR=4, QK=512, warps=8)
# A quantizing program of the prologue takes one QK-column piece of its QR rows while the planned
# token count is under this many row groups, else whole rows (``quant_pieces``).
PROLOGUE_WHOLE_ROWS = 128
FINALIZE = dict(BR=4, BK=512, warps=4)
# Deterministic mode keeps one fp32 row per slot; above this many bytes a launch is split in chunks.
SLOT_BUFFER_BYTES = 256 << 20


def route_tiles(slots: int | None, num_experts: int, bm: int) -> tuple[int, int]:
    """``(RT, NBT)`` of a prologue planned for ``slots`` routed slots (None: any count): the
    smallest tiles that route them in one program, up to ``PROLOGUE``'s. A routing program's fixed
    cost (its sort and histograms) grows with its tile: at one gpt-oss token a 1024-slot tile took
    7.6 us on the H200, a 32-slot one 2.5 (``benchmarks/results/probe_routing.md``)."""
    rt = PROLOGUE["RT"] if slots is None else min(PROLOGUE["RT"], triton.next_power_of_2(max(32, slots)))
    nbt = min(PROLOGUE["NBT"], triton.next_power_of_2(-(-rt // bm) + min(num_experts, rt) + 1))
    return rt, nbt


def quant_pieces(tokens: int | None, hidden_size: int) -> int:
    """``QS``, the ``QK``-column pieces of its rows a quantizing program of the prologue planned for
    ``tokens`` (None: any count) takes. One piece a program at few tokens spreads their rows over
    many programs (H200, the prologue alone: DSv4 at 1-16 tokens 9.3-11.4 -> 4.8-5.6 us,
    ``benchmarks/results/probe_routing.md``); at ``QR * PROLOGUE_WHOLE_ROWS`` tokens and more,
    whole rows (one piece a program was 7-13 % slower there, ``benchmarks/NOTES.md``)."""
    kt = -(-hidden_size // PROLOGUE["QK"])
    if tokens is None or -(-tokens // PROLOGUE["QR"]) >= PROLOGUE_WHOLE_ROWS:
        return kt
    return 1


@dataclasses.dataclass(frozen=True)
class Config:
    """One planned token count's kernel configuration."""

    bm: int  # rows per expert block (both GEMMs)
    bn1: int  # GEMM1 N tile (columns of up and of gate)
    bk1: int  # GEMM1 K step
    warps1: int
    stages1: int
    bn2: int  # GEMM2 output (K) tile
    bk2: int  # GEMM2 reduction (N) step
    warps2: int
    stages2: int
    atomic: bool  # reduce into an fp32 accumulator with atomics (else per-slot rows, deterministic)
    # the small-M path, gemv1/gemv2 (bm is then 1, and bn1/bk1/warps1/stages1, bn2/bk2/warps2/stages2
    # are the two GEMV kernels' tiles)
    gemv: bool = False
    # the GEMV path only: programs that share one slot's K steps (gemv1) and one token's slots, or
    # above top_k its slots' N steps (gemv2), their sums added by the last to finish
    # (``kernels._last_of_split``)
    split1: int = 1
    split2: int = 1
    # the GEMV path only: x quantized once by a launch before gemv1 (``kernels.xquant_kernel``)
    # instead of in every gemv1 program
    xq: bool = False
    # the GEMV path without xq only: gemv1 and gemv2 as one launch (``kernels.gemv_fused_kernel``)
    fused: bool = False
    # the blocked path: GEMM1 in Gluon (``gluon_kernels.gemm1_gluon_kernel``, on sm_90's wgmma or on mma.sync,
    # ``sync``: bn1 = 64 or 128 in warps1 = bn1 / 8 or bn1 / 16 warps, 16 or 32 weight rows a warp, an even
    # stages1 >= 4), its MMAs under the next step's decode; ``gluon2`` the same for GEMM2
    # (``gemm2_gluon_kernel``: bn2 = 128 or 256 in bn2 / 16 or bn2 / 32 warps, an even stages2 >= 4).
    # Untuned plans set them by block size (``gluon_forms``)
    gluon: bool = False
    gluon2: bool = False
    # the Gluon GEMMs on mma.sync (``gluon_kernels.layouts(..., sync=True)``) instead of wgmma: every Gluon
    # GEMM of a GPU other than sm_90 (``GeometryPlans.gluon_sync``), and on sm_90 those of 16-row blocks
    # with B12X_OPS_TRITON_GLUON_SYNC16=1 (``gluon_sync16_on``); the forms of ``GLUON_SYNC_FORMS``
    sync: bool = False
    # the GEMV path (sm_80 and newer): gemv1 and gemv2 on mma.sync in Gluon (``gluon_gemv``), x quantized
    # first (xq), 64-row tiles of 4 warps, one pass of bk1 / 64 64-element chunks a program (split1 =
    # cdiv(cdiv(K, 64), bk1 / 64)) and of bk2 / 64 a slot's run (split2 = top_k * cdiv(cdiv(N, 64), bk2 / 64));
    # untuned plans set it by ``gemv_mma_form`` (``mma_config``)
    mma: bool = False
    # the mma.sync GEMV only: 64-element chunks whose loads a program keeps in flight, the next one's
    # issued as each is multiplied (0: all of its bk1 / 64 and bk2 / 64 chunks loaded first)
    window: int = 0

    def as_dict(self):
        return dataclasses.asdict(self)

    def tiles1(self) -> tuple:
        """What GEMM1's kernel is compiled and timed for (the tuner's key; a sixth entry, True,
        when x comes quantized)."""
        return (self.bn1, self.bk1, self.warps1, self.stages1, self.split1) + ((True,) if self.xq else ())

    def tiles2(self) -> tuple:
        return (self.bn2, self.bk2, self.warps2, self.stages2, self.split2)

    @classmethod
    def of(cls, bm: int, tiles1: tuple, tiles2: tuple, atomic: bool, gemv: bool = False) -> "Config":
        """A config from ``tiles1()``/``tiles2()``-style tuples (4 entries: no split)."""
        s1 = tiles1[4] if len(tiles1) > 4 else 1
        s2 = tiles2[4] if len(tiles2) > 4 else 1
        xq = bool(tiles1[5]) if len(tiles1) > 5 else False
        return cls(bm, *tiles1[:4], *tiles2[:4], atomic, gemv=gemv, split1=s1, split2=s2, xq=xq)


# (bm, gemm1 (bn, bk, warps, stages), gemm2 (bn, bk, warps, stages)) by rows per touched expert:
# the default first, then the alternative the tuner also times (it crosses them). bm is the block's
# token rows, bn the weight rows a program (64 a warpgroup on Hopper; GEMM1 takes bn rows of up and
# bn of gate). Dequantization is the ALU cost each expert block pays once per weight element, so
# bigger blocks amortize it over more rows. Chosen on the H200 by benchmarks/sweep_blocked.py
# (whole op, 3 layers, gpt-oss/DSv4/Qwen3 at M = 64, 512, 8192; results/sweep_blocked.md): a
# block of 1.5-2x the rows per expert, 64 weight rows a program for GEMM1 and 128 for GEMM2.
# With the repacked codes, GEMM2's 128-row tile of 64-element steps (one 32-byte chunk a step)
# gave wrong sums in about 1 call in 50 on the H200 when Triton pipelined it over 3 or 4 stages
# (Qwen3 and DSv4 shapes; never at 2 stages or 128-element steps): such steps now get at most 2
# stages (``_stages``), and the defaults take 128-element steps, as fast there
# (``results/sweep_blocked_repacked.md``). Above 64 rows an expert GEMM2 takes 128 weight rows a
# program: in 128-element steps at 3 stages (two programs an SM: 251-255 registers, 115 KB of shared
# memory) it is 5-7 % faster (whole op) on Qwen3 and DSv4 at M = 2048 and 8192 than in 64-element
# steps at 2 stages (``results/sweep_gemm2_bm128.md``); the tuner also times the latter.
_REGIMES = (
    (8, [(16, (64, 128, 4, 3), (64, 128, 4, 3)), (32, (64, 64, 4, 2), (128, 64, 4, 2))]),
    (24, [(32, (64, 128, 4, 3), (64, 128, 4, 3)), (16, (64, 64, 4, 2), (128, 64, 4, 2))]),
    (64, [(64, (64, 128, 4, 3), (64, 128, 4, 3)), (32, (128, 128, 8, 3), (128, 64, 4, 2))]),
    (1 << 30, [(128, (64, 128, 4, 3), (128, 128, 4, 3)), (64, (128, 128, 8, 3), (128, 64, 4, 2))]),
)


# Programmatic dependent launch: each stage kernel lets the next one launch early and waits for
# the previous one in its first statement (``kernels.pdl_start``), where the GPU (sm_90+) and triton
# support it; B12X_OPS_TRITON_PDL=0 turns it off. On by default since the eager calls launch by
# their chain (``chain.py``), whose C call passes the attribute at no host cost (through triton's
# launcher it cost host time: ``benchmarks/results/pdl_compare.md``): on an H100, graph replay 0.2-6.7 %
# faster at 1-64 tokens, the same at 2048, and a loop of eager calls 1-4 us less a call
# (``benchmarks/results/pdl_chain.md``).
PDL_DEFAULT = True


def _capability(device) -> tuple[int, int] | None:
    """``device``'s compute capability, or None where it is no CUDA device."""
    if device is None or torch.device(device).type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def pdl_status(device) -> tuple[bool, str]:
    """Whether stage kernels on ``device`` launch as programmatic dependent launches, and why."""
    env = os.environ.get("B12X_OPS_TRITON_PDL")
    if not (PDL_DEFAULT if env is None else env == "1"):
        return False, ("off (B12X_OPS_TRITON_PDL=0)" if env is not None
                       else "off by default (B12X_OPS_TRITON_PDL=1 turns it on)")
    if INTERPRET:
        return False, "off: TRITON_INTERPRET=1"
    if not K_.HAS_GDC:
        return False, "off: this triton has no griddepcontrol (3.4 and newer do)"
    cc = _capability(device)
    if cc is None:
        return False, f"off: needs a CUDA device of sm_90 or newer (got {device})"
    if cc[0] < 9:
        return False, f"off: needs sm_90 or newer (got sm_{cc[0]}{cc[1]})"
    return True, ("on: each stage kernel waits for the previous one, which lets it launch early "
                  "(B12X_OPS_TRITON_PDL=0 turns it off)")


# The GEMMs in Gluon (``gluon_kernels``) on sm_90: their MMAs run asynchronously under the next K
# step's decode, which ``tl.dot`` cannot express, and they write the same bits as the tl.dot GEMMs of
# the same tile. On by default (B12X_OPS_TRITON_GLUON=0 turns them off) for plans of at least
# GLUON_MIN_BM-row expert blocks, in the forms ``gluon_forms`` picks by block size. H200, each stage
# alone against tl.dot (``benchmarks/results/gluon_gemms.md``, sections 4 and 5):
# - 128-row blocks: GEMM1 in 128 columns of up and of gate a program (16 warps) at M = 8192: gpt-oss
#   3879 -> 2803 us, Qwen3 1559 -> 972, the DeepSeek rank 2025 -> 1764; GEMM2 in 256 W2 rows a
#   program (16 warps): gpt-oss (N = 2880) 1702 -> 1481 us. On the short reductions of Qwen3 and DSv4
#   (N = 768, 576) it was slower until its epilogue's atomics became 16-byte ones (b290083); since,
#   whole op at 2048 and 8192 tokens, Qwen3 -4.7 and -2.4 %, DSv4 at 8192 -3.4 %
#   (``benchmarks/results/epilogue_writes.md``), so every 128-row plan takes it.
# - 32- and 64-row blocks: GEMM1 in 64 columns a program (8 warps), GEMM2 in 128 rows (8 warps): at
#   M = 2048 (64-row blocks) gpt-oss GEMM1 1137 -> 1002 us, GEMM2 -> 498 (whole op 1809 -> 1684 with
#   GEMM2 alone), the DeepSeek rank GEMM1 684 -> 632 (the 128-column form 775: slower); at M = 512
#   gpt-oss (32-row blocks) GEMM1 467 -> 444, Qwen3 (64) 154 -> 142, and GEMM2 whole op -26 / -10 us.
# - 16-row blocks (8-128 tokens; DSv4 up to 512): GEMM1 in Gluon where N < GLUON_16_MAX_N, in 64 columns
#   of up and gate a program in 4 warps (32 weight rows a warp: one warpgroup's two m64 MMAs a step, the
#   tl.dot tile's shape; 2.5 SASS instructions a weight against tl.dot's 3.0) and 6 stages (4 K steps of
#   64 in flight; 121-143 registers). H100, whole op (``benchmarks/results/sweep_gluon16.md``, one
#   process): DSv4 (N = 576) at 16/32/64 tokens 205.6/305.3/466.1 -> 177.9/292.5/446.5 us, Qwen3
#   (N = 768) 104.2/126.6/139.8 -> 100.9/124.6/131.2. Their few 64-column tiles give few programs, whose
#   waits the six stages cover. gpt-oss (N = 2880, 45 tiles: three programs an SM at 145 registers
#   were 9 % slower) keeps tl.dot, as GEMM2 does everywhere (the Gluon forms within +-3 % there).
#   With 16 weight rows a warp (8 warps) the Gluon forms lost at 16-row blocks before
#   (``benchmarks/results/gluon_16rows.md``). H100, whole op against tl.dot in one call (NOTES): DSv4 at
#   16/32/64/128/512 tokens 12.2/3.3/4.5/2.8/4.2 % faster, Qwen3 at 16-128 1.6-6.7 %, but at 8 tokens
#   (48 and 64 slots: about 400-800 programs, which at 3 programs an SM no longer fit in one wave) 7.8
#   and 3.7 % slower: so from GLUON_16_MIN_SLOTS routed slots (tokens x top_k) on.
GLUON_GEMM1 = dict(bn1=128, bk1=64, stages1=4, warps1=16)  # (128-row blocks; warps: the launch's, 16 rows a warp)
GLUON_GEMM1_SMALL = dict(bn1=64, bk1=64, stages1=4, warps1=8)  # (32- and 64-row blocks)
GLUON_GEMM1_16 = dict(bn1=64, bk1=64, stages1=6, warps1=4)  # (16-row blocks: N and slots below)
GLUON_GEMM2 = dict(bn2=256, bk2=64, stages2=4, warps2=16)  # (128-row blocks)
GLUON_GEMM2_SMALL = dict(bn2=128, bk2=64, stages2=4, warps2=8)  # (32- and 64-row blocks)
GLUON_GEMM2_16 = dict(bn2=128, bk2=64, stages2=6, warps2=4)  # (a tuner candidate at 16-row blocks)
GLUON_MIN_BM = 32
GLUON_16_MAX_N = 2048
GLUON_16_MIN_SLOTS = 96
# What the tuner times on such a GPU (``candidate_configs(..., gluon=True)``) at blocks of at least
# GLUON_TUNE_MIN_BM rows (the block sizes the GPU test covers): both Gluon forms of each GEMM at the
# plan's own block size, at 16-row blocks also the 4-warp forms (GLUON_GEMM1_16, GLUON_GEMM2_16), beside
# the tl.dot tiles.
GLUON_TUNE_MIN_BM = 16


# The 8-warp Gluon GEMMs of 64-row blocks compile to 99-112 registers a thread, so an SM holds two
# of their programs (16 warps); Nsight Compute (``benchmarks/results/ncu_gluon_mid.txt``) found them
# issuing in 0.36-0.43 of cycles with 0.6-0.8 eligible warps a scheduler, waiting on loads,
# barriers and the wgmma. Capped at GLUON_BM64_MAXNREG (ptxas ``maxnreg``) they fit three (no local
# memory, loops 7-9 % longer), and ptxas then waits for each step's MMAs before the next decode
# (the two register sets no longer fit; 96 registers would keep the overlap, and two programs):
# more warps an SM pay more than the overlap did. H200, whole op
# (``benchmarks/results/gluon_cap.md``), Qwen3 at 512 tokens 211.7 -> 198.6 us, DSv4 at 2048
# 1097.2 -> 1037.8. The 32-row plans (75 registers, three programs) capped at 64 for four were 1 %
# slower (gpt-oss at 512), so they stay uncapped.
GLUON_BM64_MAXNREG = 80


def gluon_maxnreg(bm: int, warps: int, sync: bool = False) -> int | None:
    """The register cap of a Gluon GEMM launch of ``warps`` warps for ``bm``-row blocks (None: none); on
    mma.sync (``sync``), with one register set a step, none."""
    return GLUON_BM64_MAXNREG if bm == 64 and warps == 8 and not sync else None


# Off sm_90 (``gluon_status``: sm_80 and newer where the GEMV runs on mma.sync) the same kernels run on
# ``mma.sync.m16n8k16`` (``gluon_kernels.layouts(..., sync=True)``), the activations from shared memory
# into registers a step, and there the tl.dot GEMMs they replace decode with Triton operations (``ptx_status``),
# 1.4-1.9x slower than sm_90's (an H100 standing in, ``benchmarks/results/gemv_mma_off_hopper_h100.md``). So
# every blocked plan takes them there, in the forms whose shared memory fits every such GPU's 99 KB a block
# (sm_86, sm_89, sm_120; the 16-warp forms of 128 columns need 128 KB and more): GLUON_SYNC_FORMS by
# block size, the 16-row forms in 4 warps, the 8-warp forms from 32 rows. Their copies run one step further
# ahead than wgmma's (``gluon_kernels._lead``: stages - 1), so the 16-row forms take four stages where sm_90's
# take six (3 steps in flight, 24 KB: four programs in 99 KB where six stages' 36 KB fit two). Plans of larger
# blocks take GLUON_SYNC_MAX_BM rows: mma.sync reads the activations from registers, so 128-row blocks
# hold a step's [32, 128] tile of them besides the accumulator (150-181 registers, one 8-warp program an SM,
# compiled for sm_89) where 64-row blocks take 72-110.
GLUON_SYNC_FORMS = {16: (dict(GLUON_GEMM1_16, stages1=4), dict(GLUON_GEMM2_16, stages2=4))}
GLUON_SYNC_DEFAULT = (GLUON_GEMM1_SMALL, GLUON_GEMM2_SMALL)
GLUON_SYNC_MAX_BM = 64
# On by default since an H100 standing in for sm_89 ran them (``tests/test_triton_gpu.py``: sm_89's and sm_120's
# plans against the reference, eager and captured) in 0.55-0.91 of the tl.dot GEMMs' time at 16-2048 tokens and
# within 2.5 % at 8192 (``benchmarks/results/gluon_sync_h100.md``); B12X_OPS_TRITON_GLUON_SYNC=0 turns them off
# (the tl.dot GEMMs then; ``bench_moe.py --as-sm 89`` times either on an sm_90 GPU).


def gluon_sync_on() -> bool:
    """Whether GPUs other than sm_90 take the Gluon GEMMs on mma.sync (the default; ``B12X_OPS_TRITON_GLUON_SYNC=0``
    turns them off)."""
    return os.environ.get("B12X_OPS_TRITON_GLUON_SYNC", "1") != "0"


# On sm_90 the same mma.sync forms of 16-row blocks compile (offline, triton 3.9) to the wgmma forms'
# instructions a weight (a step's main loop 159 against 163 SASS instructions for 64 weights a thread) at
# half their registers (74-79 against 143-145: six programs an SM where three fit), and GEMM2 of 16-row
# blocks, which stays tl.dot there, would take them too. The 16-row plans (8-128 tokens) are where the
# HBM target is missed (62-75 %). Timed on an H100 (``bash benchmarks/h200_session.sh sync16``,
# ``benchmarks/results/sync16_h100.md``) they were no faster: Qwen3 3-14 % slower at 8-128 tokens, DSv4 and
# gpt-oss within 2 %; not yet timed on an H200. So they stay off: B12X_OPS_TRITON_GLUON_SYNC16=1 puts both GEMMs
# of every untuned 16-row plan on them (the tuner does not time them there).
def gluon_sync16_on() -> bool:
    """Whether sm_90's plans of 16-row blocks take the Gluon GEMMs on mma.sync (``B12X_OPS_TRITON_GLUON_SYNC16=1``)."""
    return os.environ.get("B12X_OPS_TRITON_GLUON_SYNC16", "0") == "1"


def gluon_forms(bm: int, geometry=None, tokens: int | None = None,
                sync: bool = False) -> tuple[dict | None, dict | None]:
    """The Gluon GEMM1 and GEMM2 forms an untuned plan of ``bm``-row blocks of ``geometry`` for ``tokens``
    tokens takes (None: tl.dot); with ``sync`` those of a GPU that runs them on mma.sync. Without a geometry
    and token count, a 16-row block's GEMM1 on sm_90 is tl.dot."""
    if sync:
        return GLUON_SYNC_FORMS.get(bm, GLUON_SYNC_DEFAULT)
    if (bm == 16 and geometry is not None and tokens is not None and geometry.intermediate_size < GLUON_16_MAX_N
            and tokens * geometry.top_k >= GLUON_16_MIN_SLOTS):
        return GLUON_GEMM1_16, None
    if bm < GLUON_MIN_BM:
        return None, None
    if bm < 128:
        return GLUON_GEMM1_SMALL, GLUON_GEMM2_SMALL
    return GLUON_GEMM1, GLUON_GEMM2


def _gluon_switched_off() -> str | None:
    """Why no Gluon kernel runs on any GPU (``B12X_OPS_TRITON_GLUON=0``, the interpreter), or None."""
    if os.environ.get("B12X_OPS_TRITON_GLUON", "1") != "1":
        return "off (B12X_OPS_TRITON_GLUON=0)"
    if INTERPRET:
        return "off: TRITON_INTERPRET=1 (the interpreter does not run Gluon)"
    return None


def gluon_status(device, ptx: bool = True, mma: bool | None = None) -> tuple[bool, str]:
    """Whether plans on ``device`` take the Gluon GEMMs (``gluon_forms``), and why (``b12x-ops info``): on
    sm_90 on wgmma with the inline-PTX decode (``ptx``), elsewhere on mma.sync wherever the GEMV runs there
    (``mma``, ``gemv_mma_status``; None: its answer for the usual scales)."""
    return _gluon_decision(_capability(device), ptx, mma, device)


def _gluon_decision(cc, ptx: bool, mma: bool | None, device=None) -> tuple[bool, str]:
    """``gluon_status`` for compute capability ``cc`` (None: no CUDA device)."""
    off = _gluon_switched_off()
    if off:
        return False, off
    if not GK.HAS_GLUON:
        return False, "off: this triton has no Gluon with Hopper's wgmma and mma_v2"
    if cc is None:
        return False, f"off: needs a CUDA device (got {device})"
    if cc != (9, 0):
        why = None
        if mma is None:
            mma, why = _gemv_mma_decision(cc, True, None, device)
        if not mma:
            return False, (why or "off: where the GEMV does not run on mma.sync (its decode is theirs)")
        if not gluon_sync_on():
            return False, (f"off on sm_{cc[0]}{cc[1]} (B12X_OPS_TRITON_GLUON_SYNC=0): the blocked calls' GEMMs run "
                           "tl.dot with the Triton-operations decode instead of Gluon on mma.sync")
        return True, (f"on, on mma.sync (sm_{cc[0]}{cc[1]}; Hopper's wgmma is sm_90's): the GEMMs of every blocked "
                      "call run in Gluon, decoding with the inline-PTX asm into their operands in place "
                      "(B12X_OPS_TRITON_GLUON_SYNC=0, B12X_OPS_TRITON_GLUON=0 or ptx=False turns it off)")
    if not ptx:
        return False, "off: it decodes with the inline-PTX decode, which these scales do not allow"
    return True, (f"on: the GEMMs of blocked calls with expert blocks of {GLUON_MIN_BM} rows or more run in Gluon, "
                  f"and GEMM1 of 16-row blocks where N < {GLUON_16_MAX_N} and a call routes {GLUON_16_MIN_SLOTS} slots "
                  "or more, their MMAs under the next step's decode "
                  "(B12X_OPS_TRITON_GLUON=0 turns it off)")


# The inline-PTX decode's asm (``mxtl.decode_repacked``) reads a thread's registers four at a time in the
# order of Hopper's wgmma operand (an MMA v3 dot operand of kWidth 2). Where triton puts a tl.dot on MMA v2
# instead, the operand (kWidth 4) holds the registers in another order: on an H100 the tiles it put there
# summed wrong (``benchmarks/results/dot_tiles.md``). On sm_80, sm_89 and sm_120 triton compiles every
# tl.dot on MMA v2, the plans' tiles included (offline, triton 3.6 and 3.9), so the PTX decode runs on
# sm_90 only; other GPUs decode with Triton operations.
PTX_CAPABILITY = (9, 0)


def ptx_status(device, fast_scales: bool = True, ptx=None) -> tuple[bool, str]:
    """Whether the kernels on ``device`` decode with inline PTX, and why (``b12x-ops info``; prepare's
    ``ptx`` option ``ptx``, the checkpoint's scale bytes in [2, 252] where ``fast_scales``)."""
    return _ptx_decision(_capability(device), fast_scales, ptx, device)


def _ptx_decision(cc, fast_scales: bool, ptx, device=None) -> tuple[bool, str]:
    """``ptx_status`` for compute capability ``cc`` (None: no CUDA device)."""
    if ptx is False:
        return False, "off (ptx=False): Triton operations decode"
    if INTERPRET:
        return False, "off: TRITON_INTERPRET=1 (the interpreter decodes with Triton operations)"
    if cc is None:
        return False, f"off: needs an sm_90 CUDA device (got {device})"
    if cc != PTX_CAPABILITY:
        return False, (f"off: its register order is sm_90's wgmma operand's, and on sm_{cc[0]}{cc[1]} triton's "
                       "tl.dot operand holds another, so Triton operations decode in the tl.dot kernels (the "
                       "mma.sync GEMV lays out its own operands and keeps it: see its line)")
    if not fast_scales:
        return False, "off: scale bytes outside [2, 252] (Triton operations decode)"
    return True, ("on: the tl.dot kernels and the Gluon ones decode with inline PTX where the checkpoint's scale "
                  "bytes lie in [2, 252] (ptx=False turns it off)")


def check_ptx_option(device, ptx) -> None:
    """Prepare's ``ptx`` option: True asks for the PTX decode, which runs on sm_90 only (``ptx_status``)."""
    cc = _capability(device)
    if ptx is True and cc not in (None, PTX_CAPABILITY):
        raise ValueError(f"prepare_experts: backend 'triton' option ptx: True needs an sm_90 GPU (the inline-PTX "
                         f"decode reads registers in the order of sm_90's wgmma operand, and triton's tl.dot "
                         f"operand on sm_{cc[0]}{cc[1]} holds another); use None or False")


# The GEMMs (tl.dot and Gluon) of blocks of at least HALF_MIN_BM rows run a block of at most half
# that many rows (an expert's part-empty last block, often) in the tile of half the rows: half the
# MMA work and activation loads, the same weights decoded, the same bits (``kernels.gemm1_kernel``'s
# ``HALF``). H200, whole op (``results/half_tiles.md``): 3-9 % faster with 64- and 128-row blocks on the
# three benchmark geometries, but 5 % slower with gpt-oss's 32-row blocks at 512 tokens (a 16-row
# Gluon tile), hence 64. B12X_OPS_TRITON_HALF=0 turns it off.
HALF_MIN_BM = 64


def half_tiles(bm: int) -> bool:
    """Whether the GEMMs of ``bm``-row blocks take the half tile for half-empty blocks."""
    return bm >= HALF_MIN_BM and os.environ.get("B12X_OPS_TRITON_HALF", "1") == "1"


# ... and where they take half tiles, a block of at most a quarter of its rows runs the tile of a
# quarter (``HALF`` 2), from QUARTER_MIN_BM-row blocks on. An expert's last block is often nearly empty:
# at 8192 tokens of DSv4 (128 rows an expert on average) about half the experts spill a few rows into a
# second 128-row block. H100, whole op against half tiles alone (``results/quarter_tiles.md``): DSv4 at 8192
# tokens 1.5 % faster, Qwen3 at 2048 and 8192 0.9 and 1.0 %, gpt-oss at 8192 +1.0 % within its spread, the
# 64-row plans at 2048 tokens unchanged. (At 32-row blocks the tl.dot tile would be 8 rows, below tl.dot's 16.)
# B12X_OPS_TRITON_QUARTER=0 turns it off.
QUARTER_MIN_BM = 64


def quarter_tiles(bm: int) -> bool:
    """Whether the GEMMs of ``bm``-row blocks also take the quarter tile for blocks a quarter full."""
    return half_tiles(bm) and bm >= QUARTER_MIN_BM and os.environ.get("B12X_OPS_TRITON_QUARTER", "1") == "1"


def _quarter_min_bm() -> int:
    """The smallest block size that takes quarter tiles, 0 where none does (the status line, the cache key)."""
    q = max(HALF_MIN_BM, QUARTER_MIN_BM)
    return q if quarter_tiles(q) else 0


def tail_tiles(bm: int) -> int:
    """The blocked GEMMs' ``HALF`` constexpr for ``bm``-row blocks: 0 the full tile always, 1 the half
    tile for blocks at most half full, 2 also the quarter tile for blocks at most a quarter full."""
    return 2 if quarter_tiles(bm) else int(half_tiles(bm))


# A Gluon GEMM whose outputs are not a multiple of its tile width runs its last, part-empty column
# tile in a launch of its own in the narrower tile (``edge_split``): the same kernel over the columns
# from ``C0`` (``kernels._block_tile``), its warps in proportion, right after the main launch,
# which then covers the whole tiles. Its MMAs and decode scale with the tile's rows, which in the wide
# tile were issued for absent columns as for real ones (``benchmarks/results/issued_work.md``): at
# 128-row blocks gpt-oss (N = K = 2880) issued GEMM1's 23rd tile of 128 columns with 64 real and
# GEMM2's 12th of 256 outputs with 64, the DeepSeek rank (N = 576) GEMM1's fifth of 128 with 64.
# Off by default (B12X_OPS_TRITON_EDGE=1 turns it on): on an H100 at 8192 tokens the whole op was slower
# with it, gpt-oss 3.0 % and DSv4 1.9 % (``benchmarks/results/edge_tiles.md``). An edge program runs
# the whole reduction as a wide one does (the same work a warp, half the warps), after the main
# launch's last wave: what the narrower tile saves in MMAs the extra wave of full-length programs
# costs back.
GLUON_WIDTHS = {"gemm1": (64, 128), "gemm2": (128, 256)}  # (the Gluon GEMMs' tile widths: bn1, bn2)

# The tl.dot kernels' tiles (the blocked GEMMs, gemv1, gemv2, the fused GEMV) that the inline-PTX decode
# computes right, as (columns, warps). Its asm (``mxtl.decode_repacked``) takes a thread's registers four
# at a time as the bytes of one code word, which holds only for some of the register layouts triton gives
# the decoded tile. On an H100 (``benchmarks/experiments/dot_tiles.py``, ``benchmarks/results/dot_tiles.md``)
# 64, 128 and 256 columns in 4 or 8 warps were right in all four kernels at every K step tried; 2 warps
# were wrong at every width, and 32 columns at some K steps in 4 and in 8 warps (relative L2 1.2-1.7).
# Every tile a plan or the tuner takes is among the right ones; ``GeometryPlans._check_dot`` refuses the
# others before anything compiles.
DOT_PTX_TILES = ((64, 4), (64, 8), (128, 4), (128, 8), (256, 4), (256, 8))


def edge_on() -> bool:
    return os.environ.get("B12X_OPS_TRITON_EDGE", "0") == "1"


def edge_split(out: int, bn: int, widths: tuple[int, ...]) -> int:
    """The width of the narrower tile a Gluon GEMM of ``out`` outputs in tiles of ``bn`` runs its last,
    part-empty tile in (the narrowest of ``widths`` that holds the rest), 0 where none: ``out`` a
    multiple of ``bn`` or below it (no whole tile for the main launch), no narrower width that holds
    the rest, or ``edge_on()`` false."""
    rest = out % bn
    fits = [w for w in widths if rest <= w < bn]
    return min(fits) if rest and out > bn and fits and edge_on() else 0


def edge_status() -> str:
    """Whether Gluon GEMMs run a part-empty last column tile narrower (``b12x-ops info``)."""
    if not edge_on():
        return ("off by default (B12X_OPS_TRITON_EDGE=1 runs a Gluon GEMM's part-empty last column tile in a "
                "narrower launch of its own; slower at 8192 tokens on an H100)")
    return ("on: a Gluon GEMM whose outputs are not a multiple of its tile runs the last tile in a launch of "
            "its own, in the narrowest tile that holds it (B12X_OPS_TRITON_EDGE=1)")


# Atomic plans with the Gluon GEMM1 may zero GEMM2's fp32 accumulator there (every GEMM1 program its
# share of rows, 16-byte stores) instead of in the prologue's quantizing programs, where the zeros
# are half the bytes (``gluon_kernels.gemm1_gluon_kernel``'s ``ZERO_ACC``).
# B12X_OPS_TRITON_ACC_ZERO: prologue (the default), gemm1 (before the program's main loop) or
# gemm1_last (after its epilogue). H200, the three places side by side (``results/acc_zero.md``):
# the prologue 12-36 us shorter at 8192 tokens and GEMM1 about as much longer; whole op -2.3 to
# +1.7 %, a loss on Qwen3: not the default.
ACC_ZERO_MODES = {"prologue": 0, "gemm1": 1, "gemm1_last": 2}
ACC_ZERO_DEFAULT = "prologue"


def _acc_zero_place() -> tuple[str, str | None]:
    """``B12X_OPS_TRITON_ACC_ZERO`` (or the default) and, for a place it does not know, what is wrong."""
    where = os.environ.get("B12X_OPS_TRITON_ACC_ZERO", ACC_ZERO_DEFAULT)
    if where in ACC_ZERO_MODES:
        return where, None
    return where, f"B12X_OPS_TRITON_ACC_ZERO={where!r}: expected one of {', '.join(ACC_ZERO_MODES)}"


def acc_zero_mode(cfg: Config) -> int:
    """Where ``cfg``'s GEMM1 zeroes the accumulator (``ACC_ZERO_MODES``; 0: it does not, and the
    prologue does if the plan is atomic)."""
    if not (cfg.atomic and cfg.gluon and not cfg.gemv):
        return 0
    where, wrong = _acc_zero_place()
    if wrong:
        raise ValueError(f"b12x_ops triton backend: {wrong}")
    return ACC_ZERO_MODES[where]


def acc_zero_in_gemm1(cfg: Config) -> bool:
    """Whether ``cfg``'s GEMM1 zeroes the accumulator (else its prologue does, if atomic)."""
    return acc_zero_mode(cfg) > 0


def acc_zero_status() -> str:
    """Which launch zeroes GEMM2's accumulator in atomic blocked plans (``b12x-ops info``); an unknown
    ``B12X_OPS_TRITON_ACC_ZERO`` is named here as at prepare."""
    where, wrong = _acc_zero_place()
    if wrong:
        return f"invalid {wrong}"
    if where == "prologue":
        return ("the prologue (B12X_OPS_TRITON_ACC_ZERO=gemm1 or gemm1_last moves it to the Gluon GEMM1, "
                "before its main loop or after its epilogue)")
    return (f"the Gluon GEMM1, {'before its main loop' if where == 'gemm1' else 'after its epilogue'}, where a plan "
            "has it, else the prologue (B12X_OPS_TRITON_ACC_ZERO)")


def half_tiles_status() -> str:
    """Whether the GEMMs take half tiles, and from which block size (``b12x-ops info``)."""
    if not half_tiles(HALF_MIN_BM):
        return "off (B12X_OPS_TRITON_HALF=0)"
    q = _quarter_min_bm()
    return (f"on: in plans of {HALF_MIN_BM}-row blocks or more, a block holding at most half its rows runs the tile "
            "of half the rows" + (f", and from {q}-row blocks one holding at most a quarter the tile of a quarter"
                                  if q else "; quarter tiles off")
            + " (B12X_OPS_TRITON_HALF=0, B12X_OPS_TRITON_QUARTER=0 turn them off)")


# The wide tiles of 16-row blocks (one warpgroup a program, ``results/sweep_gemm2_wide.md``):
# - GEMM2 in 128 weight rows a program instead of 64 (two m64 MMAs a step on the same activations),
#   everywhere. Its loop spends 3.3 SASS instructions a weight against 3.9 (417 for 128 weights a
#   thread a step against 250 for 64: the step's addressing, barriers and pipeline bookkeeping are
#   shared by twice the weights), at 123-127 registers against 69-78. H200, whole op at 16/32/64
#   tokens: DSv4 3.6/4.5/5.3 %, Qwen3 1.4/2.0/2.0 %, gpt-oss 0.9-1.6/1.8-2.2 % faster (at 64 tokens
#   gpt-oss gains only with GEMM1's wide tile below).
# - GEMM1 in 256 weight rows (128 of up, 128 of gate) instead of 128: 2.9 instructions a weight
#   against 3.3, at 164 registers against 95 (three programs an SM instead of five). It pays only
#   where N is long and an expert has a few rows: gpt-oss (N = 2880) 3.4-4.4 % faster at 64 tokens and
#   2.9 % at 128 with both wide tiles (2 and 4 rows an expert), 0.6-2 % slower at 16-32 tokens (at
#   most one); DSv4 (N = 576: 5 tiles of 128 columns, the last half empty) 5-10 % slower, Qwen3
#   (N = 768) up to 2.4 % slower. So it needs N >= GEMM1_WIDE_MIN_N and GEMM1_WIDE_MIN_ROWS rows an
#   expert; the tuner times both tiles of both GEMMs wherever 16-row blocks may serve.
GEMM2_WIDE_16 = (128, 128, 4, 3)
GEMM1_WIDE_16 = (128, 128, 4, 3)
GEMM1_WIDE_MIN_N = 2048
GEMM1_WIDE_MIN_ROWS = 2


def _stages(bk: int, stages: int) -> int:
    """Pipeline stages a launch gets: at most 2 for 64-element K steps (see ``_REGIMES``)."""
    return min(stages, 2) if bk <= 64 else stages


# Every geometry takes the block size ``_REGIMES`` gives its rows an expert. (Long GEMM2 reductions,
# N >= 2048, used to take 128-row blocks from 48 rows an expert: H200, gpt-oss at 2048
# tokens, 64 rows an expert, 1410 against 1467 us while the 64-row Gluon forms were uncapped,
# results/gluon_regimes.md. Under their register cap, GLUON_BM64_MAXNREG, 64-row blocks are faster
# there, 1329.7 against 1389.6 us, the same file's last section.)


def _rows(tokens: int, geometry) -> float:
    """Rows an expert a call of ``tokens`` routes, if its slots went to as many experts as they can."""
    slots = tokens * geometry.top_k
    return slots / max(1, min(geometry.num_experts, slots))


def _regime(tokens: int, geometry):
    g = geometry
    rows = _rows(tokens, g)
    for bound, cands in _REGIMES:
        if rows <= bound:
            return cands
    return _REGIMES[-1][1]


def _atomic(tokens: int, geometry) -> bool:
    return not geometry.deterministic and tokens * geometry.top_k > 256


# The GEMV path is the default up to this many routed slots (tokens * top_k) and tokens a call:
# below that, the blocked path's tensor-core tiles are mostly padding; above, its decode shared by
# a block's rows wins (measured on the H200, results/gemv_compare.md: GEMV 1.03-1.26x faster at
# M = 4, the blocked path 1.03-1.05x faster at M = 8 on the three benchmark geometries).
GEMV_MAX_SLOTS = 32
GEMV_MAX_TOKENS = 4
# ... and up to GEMV_MMA_MAX_SLOTS slots and GEMV_MMA_MAX_TOKENS tokens where the GEMV runs on mma.sync
# (``GeometryPlans.mma``: sm_80 and newer, measured on sm_90). H100, whole op, the mma.sync GEMV against the
# blocked path (``benchmarks/results/gemv_tokens.md``): gpt-oss at 5 / 6 / 8 tokens 102.7 / 119.0 / 153.1 us
# against 119.0 / 134.3 / 169.8 (the tl.dot GEMV, 172.2 at 8, was no faster than the blocked path); DSv4 at
# 5 / 6 / 8 tokens (30-48 slots) 0.86-0.89 of the blocked path; Qwen3 at 6 tokens (48 slots) 0.93, at 5 and
# 8 (40, 64) even. From 12 tokens on the GEMV reads a slot's weights where the blocked path reads an expert's
# once for its slots, and loses on gpt-oss (16 tokens: 281.3 against 273.9) and Qwen3 (123.5 against 94.1).
GEMV_MMA_MAX_SLOTS = 48
GEMV_MMA_MAX_TOKENS = 8
# GEMV tiles: gemv1 (bn: N outputs of up and of gate, a multiple of 16; bk: K step, a multiple of
# 64), gemv2 (bn: K outputs; bk: N step), with 4 warps. Both decode like the blocked GEMMs and
# multiply on the tensor cores (64 weight rows a warpgroup). A program's K steps wait on HBM one
# after another (its code loads are pipelined, but its x, activation and scale loads are not), so
# few steps a program and many programs is what keeps enough bytes in flight: the split gives a
# slot's K steps (gemv1), or a token's slots and then their N steps (gemv2), to that many programs,
# ``_GEMV_STEPS`` steps each.
_GEMV_TILES = ((64, 256), (64, 128), (64, 512))
_GEMV_STEPS = (1, 2, 4)
_GEMV1_PROGRAMS = 4800
_GEMV2_PROGRAMS = 600
# From this many tokens on, the GEMV path quantizes x in a launch of its own before gemv1 instead of
# in every gemv1 program (H200, three geometries: 5-8 % faster at M = 4; at M = 1-2 the launch costs
# about what it saves, within -3 % / +5 %; ``benchmarks/NOTES.md``).
GEMV_XQ_TOKENS = 3
# ... and from 2 tokens on where N is so wide that every slot's x would be quantized again in each of
# its many 64-column gemv1 tiles (gpt-oss: 45 tiles against Qwen3's 12 and DSv4's 9): H200, gpt-oss
# M = 2 58.4 -> 53.7 us, the tuner's pick there in two tuned runs (``benchmarks/NOTES.md``); the
# tuner kept x on the fly at M = 2 for Qwen3 and DSv4.
GEMV_XQ_WIDE_N = 2048


def gemv_quantizes_x_first(tokens: int, geometry) -> bool:
    """Whether the default GEMV plan for ``tokens`` quantizes x in a launch of its own before gemv1."""
    return tokens >= GEMV_XQ_TOKENS or (tokens >= 2 and geometry.intermediate_size >= GEMV_XQ_WIDE_N)


# gemv1 quantizing x itself (fewer than ``GEMV_XQ_TOKENS`` tokens) compiles to 130-160 registers a
# thread, which leaves an SM three 4-warp programs; capped at 128 it gets four (at 2 tokens with a
# few spills). H200, whole op (``benchmarks/experiments/maxreg.py ... gemv``): M = 1 gpt-oss 40.2 ->
# 36.3 us, Qwen3 19.5 -> 18.6, DSv4 24.2 -> 22.7; M = 2 gpt-oss 66.6 -> 64.6, Qwen3 29.2 -> 27.2.
# With x quantized first (161-165 registers) the cap was slower for gpt-oss (107.7 -> 115.3 at
# M = 4), so that form is left uncapped (its 128-element steps since need 66-100 registers).
# With the Triton-operations decode (GPUs other than sm_90) the cap spills a little and still wins on
# an H100 standing in for them, 3-8 % at M = 1-2 (``benchmarks/results/maxreg_ptx0_h100.md``).
GEMV1_MAXNREG = 128
# gemv1 and gemv2 in one launch where x is quantized on the fly (``kernels.gemv_fused_kernel``,
# gemv2's programs waiting inside the grid for their token's gemv1 programs): one launch's host
# time less a call (about 9 us on the H200's host). Its graph replay is slower (H200: gpt-oss M = 1
# 35.0 -> 42.2 us, Qwen3 18.3 -> 20.0; the waiting programs hold SM slots), so only a call made
# outside CUDA-graph capture may launch it, and only where prepare timed eager calls of it faster
# than of the two launches (``_warm``: where the host, not the GPU, sets the pace); a captured call
# launches the two (the same bits either way). B12X_OPS_TRITON_GEMV_FUSED=0 turns the one launch off.
GEMV_FUSED_EAGER = os.environ.get("B12X_OPS_TRITON_GEMV_FUSED", "1") != "0"


def gemv_fused_status() -> str:
    """Whether eager calls launch the GEMV path as one kernel, and why (``b12x-ops info``)."""
    if GEMV_FUSED_EAGER:
        return ("on: calls of the GEMV path outside CUDA-graph capture launch "
                "gemv1 and gemv2 as one kernel where prepare timed that faster (B12X_OPS_TRITON_GEMV_FUSED=0 turns "
                "it off)")
    return "off (B12X_OPS_TRITON_GEMV_FUSED=0)"


def eager_form(cfg: "Config", geometry=None, dot_ptx: bool = True) -> "Config | None":
    """What a call of ``cfg``'s plan launches outside CUDA-graph capture where that differs from
    ``cfg``: its one-launch GEMV form (``GEMV_FUSED_EAGER``; where ``cfg`` quantizes x in a launch
    of its own, the one launch quantizes it on the fly with the same tiles), else None.

    Where ``cfg`` runs on mma.sync the one launch is the tl.dot kernels' in K steps of one 64-element
    chunk, gemv2's programs of 64 rows and 4 warps, over runs as long as the plan's: the mma.sync
    kernels multiply a run chunk by chunk, a chunk's even elements then its odd ones, and tl.dot
    steps of one chunk do the same (longer steps take all of a step's even elements first), so both
    add the same products in the same order and write the same bits. That needs the ``geometry``;
    where steps of one chunk cannot cut the plan's runs, there is no one-launch form. (With steps of
    four chunks, H200: one value in 4096 one bf16 unit apart at Qwen3's two tokens.) That was shown where
    the tl.dot kernels run on wgmma with the PTX decode (``dot_ptx``, sm_90); elsewhere they run on MMA v2
    with their K elements in other registers, so an mma.sync plan there has no one-launch form."""
    if not (GEMV_FUSED_EAGER and cfg.gemv and not cfg.fused):
        return None
    out = dataclasses.replace(cfg, fused=True, xq=False, mma=False, window=0)
    if not cfg.mma:
        return out
    if not dot_ptx:
        return None
    if geometry is None:
        raise ValueError(f"eager_form: {cfg} needs its geometry (the runs of its mma.sync kernels)")
    nq1, nq2 = mma_chunks(geometry)
    runs1, runs2 = cfg.split1, cfg.split2 // geometry.top_k
    for q, nq, runs in ((cfg.bk1 // 64, nq1, runs1), (cfg.bk2 // 64, nq2, runs2)):
        if runs > 1 and -(-nq // runs) != q:  # (runs of one-chunk steps: as many chunks as the plan's?)
            return None
    return dataclasses.replace(out, bk1=64, bk2=64, bn2=GEMV_MMA_BN2[0], warps2=GEMV_MMA_BN2[1])


# The GEMV path on mma.sync (``gluon_gemv``: both operands in registers, the weights' first loads before
# the wait for the previous kernel, from sm_90 on) on every GPU from sm_80 (``gemv_mma_status``). H200, whole op,
# CUDA-graph replay over 4 layers (``benchmarks/results/gemv_mma.md``), us, tl.dot GEMV -> mma.sync in the
# same call, its programs then loading every chunk first: at one token gpt-oss 35.4 -> 32.4 and 36.0 -> 32.2,
# Qwen3 18.0 -> 15.7, 17.9 -> 16.9 and 17.3 -> 17.0 (three calls), DSv4 22.8 -> 22.8 and 23.2 -> 22.5;
# at two Qwen3 26.4 -> 24.5, DSv4 35.9 -> 35.2, but gpt-oss 53.7 -> 55.2 (its wide N: the tl.dot gemv2
# is faster there); at four tokens slower but on Qwen3 (42.5 -> 41.0). Programs of 64 rows and 4 warps,
# but gemv2's of 128 rows and 8 warps where K <= 2048: half as many programs over K's few output tiles
# (same call, 64/4 -> 128/8: Qwen3 one token 15.6 -> 15.1 us, two 26.0 -> 25.7; DSv4, K = 5120, 22.2 ->
# 22.2 and 35.8 -> 36.6; gpt-oss 32.0 -> 32.6; ``benchmarks/results/gemv_forms.md``).
GEMV_MMA_SMALL_K = 2048
GEMV_MMA_BN1 = 64  # (gemv1's columns of up and of gate a program, in 4 warps)
GEMV_MMA_BN2, GEMV_MMA_BN2_SMALL_K = (64, 4), (128, 8)  # (gemv2's rows and warps a program)
# A program keeps the loads of GEMV_MMA_WINDOW chunks in flight and issues the next chunk's as it
# multiplies one (``Config.window``), so its runs can be long: each kernel's runs are of equal length, the
# longest of at most GEMV_MMA_Q1_MAX chunks (gemv1) or GEMV_MMA_Q2_MAX (gemv2) that still leaves the launch
# GEMV_MMA_MIN_PROGRAMS programs (one chunk where none does). H100, whole op, against the plans before
# (every load first, runs of 2-6 chunks: 4/4, 2/6, 4/3 at one token), in one call: one token gpt-oss
# 33.4 -> 27.0 us (15/9 chunks), Qwen3 15.9 -> 14.9 (8/4), DSv4 21.9 -> 19.6 (10/9); two tokens Qwen3
# 24.4 -> 22.5 (16/6), DSv4 34.2 -> 28.2 (16/9). A window of 1, 3 or 4 chunks, and runs that leave fewer
# programs, were slower in the sweeps before (``benchmarks/results/gemv_window.md``). With the window the
# mma.sync GEMV also wins at 2-4 tokens, where the tl.dot GEMV had been faster with every load first:
# H200, gpt-oss 51.6 -> 40.6 us at two tokens, 77.1 -> 55.9 at three, 91.1 -> 71.6 at four (15/9 chunks,
# the rule's; ``benchmarks/results/gemv_tokens.md``).
GEMV_MMA_WINDOW = 2
GEMV_MMA_Q1_MAX, GEMV_MMA_Q2_MAX, GEMV_MMA_MIN_PROGRAMS = 16, 10, 384
# Where those runs make more programs than the GPU holds at once, the launch runs in waves, and a last wave
# little filled streams at a fraction of the bandwidth: the runs are then the ones (of at most that length)
# with the least time modelled as waves x (run + GEMV_MMA_WAVE_OVERHEAD chunks: a program's start, split-K
# handshake and drain), the longer where two tie. Programs an SM: GEMV_MMA_PER_SM for gemv1 (96 registers,
# 4 warps), gemv2 of 64 rows (59-70 registers, 4 warps) and of 128 rows (64, 8 warps): triton 3.6, sm_90. H100,
# whole op, the rule's runs against the model's (``benchmarks/results/gemv_waves.md``): Qwen3 at 4 tokens
# 16 -> 8 chunks (768 gemv1 programs at 5 an SM: 1.16 waves; 1536: 2.33) 39.7-40.0 -> 38.3-38.4 us, DSv4
# at 3 tokens 16 -> 10 (1.23 -> 1.96 waves) 42.3-42.4 -> 39.5-39.6; the model keeps the rule's runs at every
# other form timed there and in ``gemv_tokens.md``, each of them the fastest timed. Within one wave the rule's
# runs stand (at one token, runs shorter than the rule's were no faster, ``gemv_window.md``).
# As whole plans, each run at the count it was made for (``gemv_plans_h100.md``): DSv4 at 3 tokens 6.8 %,
# Qwen3 at 4 and 5 3.2 / 4.2 %, DSv4 at 6 2.1 % faster, none slower. A ladder plan also runs the counts
# below its own: Qwen3's 4-token plan runs 3 tokens 4.4 % slower than the rule's runs would (a captured
# engine pads to a size it plans exactly, so the model weighs a plan's own count).
GEMV_MMA_WAVE_OVERHEAD = 4
GEMV_MMA_PER_SM = (5, 7, 4)
SM_COUNT_DEFAULT = 132  # (H100 / H200: plans made without a GPU, as ``compile_offline`` and the tests make them)


def mma_chunks(geometry) -> tuple[int, int]:
    """The 64-element chunks of gemv1's reduction (K) and of gemv2's (N): what the mma.sync GEMV's
    programs take runs of."""
    return -(-geometry.hidden_size // 64), -(-geometry.intermediate_size // 64)


def _mma_gemv2_tile(geometry) -> tuple[int, int]:
    """The mma.sync gemv2's rows and warps a program: 128 and 8 where K <= ``GEMV_MMA_SMALL_K``, else 64 and 4."""
    return GEMV_MMA_BN2_SMALL_K if geometry.hidden_size <= GEMV_MMA_SMALL_K else GEMV_MMA_BN2


def _sm_count(device) -> int:
    """``device``'s SM count, or ``SM_COUNT_DEFAULT`` where it is no CUDA device."""
    if device is None or torch.device(device).type != "cuda":
        return SM_COUNT_DEFAULT
    return torch.cuda.get_device_properties(device).multi_processor_count


def _mma_run(nq: int, programs_a_run: int, most: int, slots: int | None = None) -> int:
    """A kernel's chunks a run (of its ``nq``): the largest divisor of ``nq`` up to ``most`` at which the
    launch still has ``GEMV_MMA_MIN_PROGRAMS`` programs (``programs_a_run`` for each of its ``nq / run``
    runs), else 1; where that makes more programs than the GPU's ``slots`` (programs it holds at once),
    the divisor up to it with the least modelled time, waves x (run + ``GEMV_MMA_WAVE_OVERHEAD``), the
    longer of two that tie."""
    fits = [q for q in range(1, min(most, nq) + 1)
            if nq % q == 0 and programs_a_run * (nq // q) >= GEMV_MMA_MIN_PROGRAMS]
    run = max(fits, default=1)
    if slots is None or programs_a_run * (nq // run) <= slots:
        return run
    return min((q for q in range(1, run + 1) if nq % q == 0),
               key=lambda q: (-(-programs_a_run * (nq // q) // slots) * (q + GEMV_MMA_WAVE_OVERHEAD), -q))


def gemv_mma_form(tokens: int, geometry, most: int = GEMV_MMA_MAX_TOKENS) -> tuple[int, int] | None:
    """The mma.sync GEMV's chunks a program ``(gemv1, gemv2)`` for an untuned plan of ``tokens`` tokens,
    or None where the tl.dot GEMV is the default (above ``most`` tokens)."""
    g = geometry
    if tokens > most:
        return None
    nq1, nq2 = mma_chunks(g)
    bn2, warps2 = _mma_gemv2_tile(g)
    tiles1, tiles2 = -(-g.intermediate_size // GEMV_MMA_BN1), -(-g.hidden_size // bn2)
    sms = _sm_count(g.device)
    return (_mma_run(nq1, tokens * g.top_k * tiles1, GEMV_MMA_Q1_MAX, GEMV_MMA_PER_SM[0] * sms),
            _mma_run(nq2, tokens * g.top_k * tiles2, GEMV_MMA_Q2_MAX, GEMV_MMA_PER_SM[1 if warps2 == 4 else 2] * sms))


def mma_q1_candidates(tokens: int, geometry, most: int = GEMV_MMA_MAX_TOKENS) -> list[int]:
    """gemv1's chunks a program that the tuner times on mma.sync: 4 and the untuned form's count (2 and 4
    above ``most`` tokens, where ``gemv_mma_form`` has none)."""
    form = gemv_mma_form(tokens, geometry, most)
    return sorted({4, form[0]} if form else {2, 4})


# Off sm_90 the blocked path's tl.dot GEMMs decode with Triton operations: on an H100 standing in for such a GPU
# (``bench_moe.py --as-sm 89``, ``benchmarks/results/gemv_mma_off_hopper_h100.md``) they took 1.4-1.8x the
# sm_90 plans' time, while the mma.sync GEMV took 1.06-1.22x, so the GEMV may win there above the bound
# measured on sm_90 (``GEMV_MMA_MAX_TOKENS``, ``GEMV_MMA_MAX_SLOTS``). With the Gluon GEMMs on mma.sync in
# their place (``gluon_sync_on``) it still did on that stand-in: 0.87-0.93 of the blocked path's time at 12
# tokens, 0.92-0.99 at 16 (``benchmarks/results/gemv_bound_sync_h100.md``). The stand-in has the H100's
# memory, and on a GPU of slower memory the GEMV's reads of an expert's weights a slot (the blocked path's,
# once an expert) may cost more, so the untuned plans keep the bound; the tuner (on by default) also times the
# mma.sync GEMV up to GEMV_MMA_TUNE_MAX_TOKENS tokens and GEMV_MMA_TUNE_MAX_SLOTS slots there, beside the
# blocked tiles, and keeps what is faster on the GPU at hand (``benchmarks/results/tuner_off_hopper_h100.md``:
# the GEMV at 8 and 16 tokens on Qwen3).
GEMV_MMA_TUNE_MAX_TOKENS = 32
GEMV_MMA_TUNE_MAX_SLOTS = 192


def tunes_wide_gemv(tokens: int, geometry, mma: bool, dot_ptx: bool) -> bool:
    """Whether the tuner times the mma.sync GEMV for ``tokens`` tokens above the untuned plans' bound: where it
    runs (``mma``) and the blocked path's tl.dot GEMMs decode with Triton operations (not ``dot_ptx``), up to
    ``GEMV_MMA_TUNE_MAX_TOKENS`` and ``GEMV_MMA_TUNE_MAX_SLOTS``."""
    return (mma and not dot_ptx and not use_gemv(tokens, geometry, mma=True) and tokens <= GEMV_MMA_TUNE_MAX_TOKENS
            and tokens * geometry.top_k <= GEMV_MMA_TUNE_MAX_SLOTS)


def mma_q2_candidates(geometry) -> list[int]:
    """gemv2's chunks a program that the tuner times on mma.sync: 3, 4, 6, 8, a slot's whole row and
    the untuned plans' counts."""
    forms = [gemv_mma_form(t, geometry) for t in range(1, GEMV_MMA_MAX_TOKENS + 1)]
    return sorted({3, 4, 6, 8, mma_chunks(geometry)[1]} | {f[1] for f in forms if f})


def mma_config(cfg: "Config", geometry, q1: int, q2: int, window: int = GEMV_MMA_WINDOW) -> "Config":
    """GEMV ``cfg`` on mma.sync (``Config.mma``) with ``q1``/``q2`` chunks a program, ``window`` of them in
    flight (0: every load first); gemv2's programs of 128 rows where K <= ``GEMV_MMA_SMALL_K``, else 64."""
    g = geometry
    nq1, nq2 = mma_chunks(g)
    bn2, warps2 = _mma_gemv2_tile(g)
    return dataclasses.replace(cfg, mma=True, xq=True, fused=False, bn1=GEMV_MMA_BN1, bk1=64 * q1, warps1=4,
                               stages1=1, split1=-(-nq1 // q1), bn2=bn2, bk2=64 * q2, warps2=warps2, stages2=1,
                               split2=g.top_k * -(-nq2 // q2), window=window)


# The mma.sync GEMV lays its operands out itself: the decode's asm writes the m16n8k16 A fragments in
# place, and ``convert_layout(..., assert_trivial=True)`` fails the compile unless they are where the MMA
# reads them, on any target. mma.sync and every instruction of the asm (``fma.rn.bf16x2`` the newest) exist
# from sm_80 on, so unlike the tl.dot kernels' PTX decode (``PTX_CAPABILITY``, whose operand order is
# triton's choice) it runs on every GPU the backend takes: compiled offline for sm_80, sm_89 and sm_120
# (``tests/test_compile_off_hopper.py``), with no local memory (``benchmarks/results/gemv_mma_off_hopper_offline.md``).
GEMV_MMA_MIN_CAPABILITY = (8, 0)


def gemv_mma_status(device, ptx=None, fast_scales: bool = True) -> tuple[bool, str]:
    """Whether GEMV plans on ``device`` run on mma.sync, and why (``b12x-ops info``; prepare's ``ptx``
    option ``ptx``, the checkpoint's scale bytes in [2, 252] where ``fast_scales``)."""
    cc = _capability(device)
    return _gemv_mma_decision(cc, fast_scales, ptx, device, cc is not None and gemv_mma_pdl(device))


def _gemv_mma_decision(cc, fast_scales: bool, ptx, device=None, pdl: bool = False) -> tuple[bool, str]:
    """``gemv_mma_status`` for compute capability ``cc`` (None: no CUDA device; ``pdl``: its launches are
    programmatic dependent launches)."""
    off = _gluon_switched_off()
    if off:
        return False, off
    if not GG.HAS_GLUON_MMA:
        return False, "off: this triton has no Gluon with mma_v2"
    if cc is None:
        return False, f"off: needs a CUDA device (got {device})"
    if cc < GEMV_MMA_MIN_CAPABILITY:
        return False, f"off: needs sm_80 or newer (got sm_{cc[0]}{cc[1]})"
    if ptx is False:
        return False, "off (ptx=False): its decode is the inline-PTX asm"
    if not fast_scales:
        return False, "off: scale bytes outside [2, 252] (its decode is the inline-PTX asm)"
    return True, (f"on: untuned plans of up to {GEMV_MMA_MAX_TOKENS} tokens run gemv1 and gemv2 on mma.sync "
                  f"in Gluon, decoding with the inline-PTX asm, {GEMV_MMA_WINDOW} chunks' loads in flight a program, "
                  f"{'with' if pdl else 'without'} programmatic dependent launch (B12X_OPS_TRITON_GLUON=0 or "
                  "ptx=False turns it off)")


def gemv_mma_pdl(device) -> bool:
    """Whether the mma.sync GEMV launches as programmatic dependent launches (its weights' loads before
    the wait): where the GPU and triton have them, unless B12X_OPS_TRITON_PDL=0."""
    if os.environ.get("B12X_OPS_TRITON_PDL") == "0" or INTERPRET or not K_.HAS_GDC:
        return False
    cc = _capability(device)
    return cc is not None and cc[0] >= 9


def _parts(steps: int, parts: int) -> int:
    """``parts`` lowered to the count of runs of ``ceil(steps / parts)`` steps it really makes (the
    kernels cut whole runs: 25 steps in 6 parts are 5 runs of 5, a sixth would have none)."""
    return -(-steps // -(-steps // parts))


def _steps_stages(per: int) -> int:
    """Pipeline stages for a program of ``per`` K steps (1: no pipeline, all its loads at once)."""
    return 1 if per == 1 else min(per, 3)


def gemv_candidates(geometry) -> tuple[list[tuple], list[tuple]]:
    """The gemv1 and gemv2 tiles ``(bn, bk, warps, stages, split)`` the tuner times."""
    g = geometry
    t1, t2 = [], []
    for bn, bk in _GEMV_TILES:
        steps1 = -(-g.hidden_size // bk)
        steps2 = -(-g.intermediate_size // bk)
        for per in _GEMV_STEPS:
            c1 = (bn, bk, 4, _steps_stages(per), -(-steps1 // per))
            if per <= steps1 and c1 not in t1:
                t1.append(c1)
        for per in _GEMV_STEPS + (steps2,):
            c2 = (bn, bk, 4, _steps_stages(min(per, steps2)), g.top_k * -(-steps2 // per))
            if per <= steps2 and c2 not in t2:
                t2.append(c2)
    return t1, t2


def use_gemv(tokens: int, geometry, mode=None, mma: bool = False) -> bool:
    """Whether the GEMV path serves ``tokens``: ``mode`` True/False forces it, None decides by size (up
    to ``GEMV_MAX_SLOTS`` slots and ``GEMV_MAX_TOKENS`` tokens; with ``mma``, where the GEMV runs on
    mma.sync, ``GEMV_MMA_MAX_SLOTS`` and ``GEMV_MMA_MAX_TOKENS``)."""
    if mode is not None:
        return bool(mode)
    slots, tokens_most = (GEMV_MMA_MAX_SLOTS, GEMV_MMA_MAX_TOKENS) if mma else (GEMV_MAX_SLOTS, GEMV_MAX_TOKENS)
    return tokens * geometry.top_k <= slots and tokens <= tokens_most


def gemv_config(tokens: int, geometry) -> Config:
    """The default GEMV tiles (64 rows a program, H200 sweeps ``results/sweep_gemv_steps.md`` and
    ``results/sweep_gemv_defaults.md``):

    - gemv1 quantizing x itself (``gemv_quantizes_x_first`` false): 256-element K steps, one a
      program while that keeps the programs under about ``_GEMV1_PROGRAMS``;
    - gemv1 after x's own quantizing launch: 128-element steps, about 4 a program, 3 stages;
    - gemv2: one slot a program, 256-element N steps (128 where a 256 step would leave more than an
      eighth of N as masked tail), 3 stages, each slot's steps split in runs of about 4 while that
      keeps the programs under ``_GEMV2_PROGRAMS``."""
    g = geometry
    slots = tokens * g.top_k
    xq = gemv_quantizes_x_first(tokens, g)
    bk1 = 128 if xq else 256
    steps1 = -(-g.hidden_size // bk1)
    cap1 = -(-_GEMV1_PROGRAMS // (slots * -(-g.intermediate_size // 64)))
    split1 = _parts(steps1, min(-(-steps1 // 4) if xq else steps1, cap1))
    bk2 = 256 if (-g.intermediate_size) % 256 * 8 <= g.intermediate_size else 128
    steps2 = -(-g.intermediate_size // bk2)
    runs = _parts(steps2, max(1, min((steps2 + 2) // 4, _GEMV2_PROGRAMS // (slots * -(-g.hidden_size // 64)))))
    g1 = (64, bk1, 4, _steps_stages(-(-steps1 // split1)), split1) + ((True,) if xq else ())
    g2 = (64, bk2, 4, 3, g.top_k * runs)
    return Config.of(1, g1, g2, False, gemv=True)  # (gemv2 sums a token's slots itself: no atomics)


def default_config(tokens: int, geometry, gemv=None, mma: bool = False) -> Config:
    """A good configuration without tuning: the GEMV path for few slots (``gemv`` None; ``use_gemv``,
    ``mma``: a GPU whose GEMV runs on mma.sync), else by rows per touched expert."""
    if use_gemv(tokens, geometry, gemv, mma):
        return gemv_config(tokens, geometry)
    bm, g1, g2 = _regime(tokens, geometry)[0]
    if bm == 16:  # (the wide tiles above)
        g2 = GEMM2_WIDE_16
        if geometry.intermediate_size >= GEMM1_WIDE_MIN_N and _rows(tokens, geometry) >= GEMM1_WIDE_MIN_ROWS:
            g1 = GEMM1_WIDE_16
    return Config(bm, *g1, *g2, _atomic(tokens, geometry))


def candidate_configs(tokens: int, geometry, gemv=None, gluon: bool = False, mma: bool | None = None,
                      dot_ptx: bool = True, gluon_sync: bool = False) -> list[Config]:
    """The small search space the tuner times for one token count (GEMM1 and GEMM2 separately):
    the GEMV tiles where that path may serve the count, the blocked ones unless GEMV is forced, with
    ``gluon`` (a GPU that runs them: ``gluon_status``) the Gluon GEMMs at blocks of at least
    ``GLUON_TUNE_MIN_BM`` rows, and with ``mma`` (``gemv_mma_status``; None: as ``gluon``, sm_90's
    answer) the GEMV on mma.sync; where the tl.dot GEMMs decode with Triton operations (not
    ``dot_ptx``), that GEMV up to a wider bound too (``tunes_wide_gemv``). With ``gluon_sync`` (the Gluon
    GEMMs on mma.sync) only their forms that fit 99 KB of shared memory: the 8-warp and 4-warp ones."""
    mma = gluon if mma is None else mma
    out = []
    gemv_path = gemv is True or (gemv is None and use_gemv(tokens, geometry, mma=mma))
    wide_gemv = gemv is None and tunes_wide_gemv(tokens, geometry, mma, dot_ptx)  # (then not gemv_path)
    d = gemv_config(tokens, geometry)  # (the default among the GEMV tiles)
    if gemv_path:
        t1, t2 = gemv_candidates(geometry)
        t1 += [c + (True,) for c in t1]  # (each with x quantized by a launch of its own, too)
        t1 += [d.tiles1()] if d.tiles1() not in t1 else []
        t2 += [d.tiles2()] if d.tiles2() not in t2 else []
        for g1 in t1:
            for g2 in t2:
                out.append(Config.of(1, g1, g2, False, gemv=True))
    if mma and (gemv_path or wide_gemv):  # (the GEMV on mma.sync, a few chunk counts, a slot's whole row among them)
        most = GEMV_MMA_TUNE_MAX_TOKENS if wide_gemv else GEMV_MMA_MAX_TOKENS
        out += [mma_config(d, geometry, q1, q2) for q1 in mma_q1_candidates(tokens, geometry, most)
                for q2 in mma_q2_candidates(geometry)]
    if gemv is True:
        return out
    cands = _regime(tokens, geometry)
    g1s = [g1 for _, g1, _ in cands]
    g2s = [g2 for _, _, g2 in cands]
    for bm, _, _ in cands:
        wide = bm == 16  # (the wide tiles of 16-row blocks with them, at 16-row blocks only)
        for g1 in g1s + [GEMM1_WIDE_16] * wide:
            for g2 in g2s + [GEMM2_WIDE_16] * wide:
                c = Config(bm, *g1, *g2, _atomic(tokens, geometry))
                if c not in out:
                    out.append(c)
    if gluon:  # (sm_90: the Gluon GEMMs beside the tl.dot tiles, crossed with them by the tuner)
        for bm, g1, g2 in cands:
            if bm >= GLUON_TUNE_MIN_BM and (bm <= GLUON_SYNC_MAX_BM or not gluon_sync):
                c = Config(bm, *g1, *g2, _atomic(tokens, geometry))
                if gluon_sync:  # (the 8-warp forms and the 4-warp ones at every block size)
                    forms1, forms2 = zip(GLUON_SYNC_DEFAULT, GLUON_SYNC_FORMS[16])
                else:
                    narrow1, narrow2 = ((GLUON_GEMM1_16,), (GLUON_GEMM2_16,)) if bm == 16 else ((), ())
                    forms1, forms2 = (GLUON_GEMM1_SMALL, GLUON_GEMM1) + narrow1, (GLUON_GEMM2_SMALL, GLUON_GEMM2) + narrow2
                out += [dataclasses.replace(c, gluon=True, sync=gluon_sync, **f) for f in forms1]
                out += [dataclasses.replace(c, gluon2=True, sync=gluon_sync, **f) for f in forms2]
    return out


def _cols(c1: int) -> dict:
    """A Gluon GEMM's main-launch constexprs where it has an edge launch (columns up to ``c1``), none
    where not (the kernel's defaults: all columns, ``Launch``)."""
    return dict(C0=0, C1=c1) if c1 else {}


class Launch:
    """One stage kernel with fixed compile-time parameters, launched precompiled after prepare."""

    def __init__(self, fn, constexprs: dict[str, Any], num_warps: int, num_stages: int, maxnreg: int | None = None,
                 pdl: bool = False):
        self.fn = fn
        # (a constexpr with a default that is not given takes it: the tail below is then whole)
        sig = inspect.signature(getattr(fn, "fn", fn))  # (the Python function, jitted or interpreted)
        constexprs = dict({n: p.default for n, p in sig.parameters.items() if n not in constexprs
                           and p.default is not p.empty and "constexpr" in str(p.annotation)}, **constexprs)
        if "PDL" in fn.arg_names:  # (stage kernels: see kernels.pdl_start)
            constexprs = dict(constexprs, PDL=bool(pdl))
        else:  # (a kernel that cannot wait for the previous one must not start before it ends)
            pdl = False
        self.constexprs = constexprs
        self.num_warps = num_warps
        self.num_stages = num_stages
        # a cap on registers a thread (ptxas ``maxnreg``), for more programs an SM; None: none.
        # ``pdl``: launched as a programmatic dependent launch (the kernel waits in ``pdl_start``)
        self.options = dict(num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}),
                            **({"launch_pdl": True} if pdl else {}))
        self.compiled = None
        self._direct = None  # (after compiling) the launcher's C function, or None (``_direct_launch``)
        self.frozen = False
        # every stage kernel declares its constexprs last: a call's full argument list (the launcher
        # takes constexprs too) is then its runtime arguments plus this fixed tail
        names = fn.arg_names
        tail = names[len(names) - len(constexprs):]
        if set(tail) != set(constexprs):
            raise TypeError(f"{fn.__name__}: its constexprs {sorted(constexprs)} must be its last parameters")
        self._tail = tuple(constexprs[n] for n in tail)
        self.n_args = len(names) - len(constexprs)

    def _full_args(self, args: tuple) -> tuple:
        return args + self._tail

    def __call__(self, grid: tuple[int, int, int], *args):
        ck = self.compiled
        if ck is None:
            if self.frozen:
                raise RuntimeError(
                    f"b12x_ops triton backend: kernel {self.fn.__name__} {self.constexprs} was not compiled at "
                    f"prepare time and the handle is frozen (an op call never compiles)")
            ck = self.fn[grid](*args, **self.constexprs, **self.options)
            if not INTERPRET:
                self.compiled = ck
                self._run, self._function, self._packed = ck.run, ck.function, ck.packed_metadata
                self._direct = _direct_launch(ck.run)
            return
        full = self._full_args(args)
        stream = _raw_stream(_current_device())
        k = _RUNTIME_KNOBS
        enter = leave = md = None
        if k is not None:
            enter, leave = _active(k.launch_enter_hook), _active(k.launch_exit_hook)
            if enter is not None:
                md = ck.launch_metadata(grid, stream, *full)
        d = self._direct
        if d is not None:
            d[0](grid[0], grid[1], grid[2], stream, self._function, d[1], d[2], None, None, self._packed, md, enter,
                 leave, *full)
        else:
            self._run(grid[0], grid[1], grid[2], stream, self._function, self._packed, md, enter, leave, *full)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)
# The launcher's own C entry point is called directly (``_direct_launch``) on the triton versions
# whose launcher this was checked against; ``B12X_OPS_TRITON_DIRECT_LAUNCH=0`` turns it off.
DIRECT_LAUNCH_VERSIONS = ("3.6.",)
DIRECT_LAUNCH = os.environ.get("B12X_OPS_TRITON_DIRECT_LAUNCH", "1") != "0"


def direct_launch_status() -> str:
    """How a compiled launch reaches the driver (``b12x-ops info``)."""
    if not DIRECT_LAUNCH:
        return "through triton's launcher object (B12X_OPS_TRITON_DIRECT_LAUNCH=0)"
    if not triton.__version__.startswith(DIRECT_LAUNCH_VERSIONS):
        return (f"through triton's launcher object (its C function is called directly on triton "
                f"{', '.join(v + 'x' for v in DIRECT_LAUNCH_VERSIONS)} only; this is {triton.__version__})")
    return (f"the launcher's C function called directly (triton {triton.__version__}; "
            "B12X_OPS_TRITON_DIRECT_LAUNCH=0 turns it off)")


def _direct_launch(launcher) -> tuple | None:
    """``(launch, cooperative, pdl)``: the compiled C function behind triton's launcher object and
    the two flags its Python ``__call__`` passes it, where that ``__call__`` adds nothing else (no
    global or profile scratch to allocate); None where it may (then the launcher is called).

    triton 3.6's ``CudaLauncher.__call__(gx, gy, gz, stream, function, *args)`` allocates the two
    scratch buffers (only for sizes above 0) and calls ``self.launch(gx, gy, gz, stream, function,
    launch_cooperative_grid, launch_pdl, global_scratch, profile_scratch, *args)``; skipping it saves
    a Python frame, a closure and two calls a launch."""
    if (not DIRECT_LAUNCH or not triton.__version__.startswith(DIRECT_LAUNCH_VERSIONS)
            or type(launcher).__name__ != "CudaLauncher"):  # (NVIDIA's launcher only: the one checked)
        return None
    try:
        launch = launcher.launch
        flags = (launcher.launch_cooperative_grid, launcher.launch_pdl)
        scratch = (launcher.global_scratch_size, launcher.profile_scratch_size)
    except AttributeError:
        return None
    if not callable(launch) or any(scratch):
        return None
    return (launch, *flags)


def _active(hook):
    """A launch hook that does something, or None (newer triton keeps an empty HookChain)."""
    if hook is None or (hasattr(hook, "calls") and not hook.calls):
        return None
    return hook


_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)  # (read once: hooks may change, the object not)


class Runner(NamedTuple):
    """A config's launches and the grid factors that depend on it alone (``GeometryPlans.runner``)."""

    cfg: Config
    prologue: Launch | None
    gemm1: Launch
    gemm2: Launch
    finalize: Launch | None
    n_tiles1: int  # gemm1/gemv1 programs per expert block (or slot): N tiles
    n_tiles2: int  # gemm2 programs per block (gemv2: per token): K tiles
    n_tiles_fin: int  # finalize's K tiles
    prologue_rows: int  # rows of x a prologue program quantizes
    route_slots: int  # slots a routing program of the prologue routes
    finalize_rows: int  # rows a finalize program writes
    num_experts: int
    xquant_tiles: int  # the GEMV path's xquant programs a token (x's QK-column pieces)
    prologue_pieces: int  # the prologue's quantizing programs a row group (cdiv(cdiv(K, QK), QS))
    # the Gluon GEMMs' last column tiles in launches of their own, one program a block (``edge_split``;
    # n_tiles1 / n_tiles2 then count the main launch's whole tiles), or None
    edge1: Launch | None = None
    edge2: Launch | None = None

    @property
    def edges(self) -> list:
        """The edge launches this runner has (none, GEMM1's, GEMM2's or both)."""
        return [e for e in (self.edge1, self.edge2) if e is not None]

    def prologue_programs(self, tokens: int, top_k: int) -> int:
        """The prologue's grid (``kernels.prologue_programs``)."""
        return K_.prologue_programs(tokens, top_k, self.route_slots, self.prologue_rows, self.prologue_pieces)

    def fused_programs(self, tokens: int, top_k: int) -> int:
        """The fused GEMV launch's grid (``kernels.gemv_fused_programs``)."""
        return K_.gemv_fused_programs(tokens, top_k, self.n_tiles1, self.n_tiles2)

    def blocks(self, slots: int) -> int:
        """Expert blocks a call of ``slots`` routed slots launches (``kernels.num_blocks``)."""
        return K_.num_blocks(slots, self.num_experts, self.cfg.bm)


class Arena:
    """Scratch buffers of one geometry, grown (never shrunk) to its largest plan; layers share it.

    Buffers replaced by a larger prepare stay referenced, so CUDA graphs captured earlier keep
    valid pointers (capture after preparing every layer to share one set)."""

    def __init__(self, device, dry: bool = False):
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}
        self.retired: list[torch.Tensor] = []
        # bumped whenever a buffer is made or replaced: what a handle's cached addresses of the
        # buffers (``_operands`` in the backend) are checked against on every call
        self.version = 0
        self.dry = dry  # only size the buffers (memory estimates): nothing is allocated
        self.sizes: dict[str, int] = {}

    def need(self, name: str, numel: int, dtype, zeroed: bool = False) -> None:
        """At least ``numel`` elements of ``dtype`` in buffer ``name`` (``zeroed``: all zero when
        made, for counters the kernels keep at zero between calls)."""
        if self.dry:
            nbytes = max(1, numel) * torch.empty((), dtype=dtype).element_size()
            self.sizes[name] = max(self.sizes.get(name, 0), nbytes)
            return
        cur = self.buffers.get(name)
        if cur is not None and cur.numel() >= numel and cur.dtype == dtype:
            return
        if cur is not None:
            self.retired.append(cur)
        self.buffers[name] = (torch.zeros if zeroed else torch.empty)(max(1, numel), dtype=dtype, device=self.device)
        self.version += 1

    def __getitem__(self, name):
        return self.buffers[name]

    def nbytes(self) -> int:
        if self.dry:
            return sum(self.sizes.values())
        return sum(t.numel() * t.element_size() for t in self.buffers.values())


class GeometryPlans:
    """Configs, compiled launches and the arena shared by every handle of one geometry."""

    def __init__(self, geometry, fast_scales: bool, gemv=None, ptx=None, dry: bool = False, fold: bool = False,
                 pdl=None):
        self.geometry = geometry
        self.gemv = gemv  # the GEMV path: None by token count, True always, False never
        # the GEMM and GEMV kernels decode with inline PTX (sm_90, scale bytes in [2, 252]) unless ptx=False;
        # a plan of no CUDA device (dry plans, the offline compiles) decides as sm_90 would
        self.ptx = _ptx_decision(_capability(geometry.device) or PTX_CAPABILITY, fast_scales, ptx)[0]
        # scale bytes in [2, 128]: the PTX decode folds its 2^126 into the scale (one fma a pair less)
        self.fold = bool(fold and self.ptx)
        self.configs: dict[int, Config] = {}
        self.caps: list[int] = []
        self._cap_of: list[int] = []  # cap_for(m) for every m up to the top planned count (``add``)
        self.launches: dict[tuple, Launch] = {}
        self.runners: dict[int, Runner] = {}  # per planned count: what a call launches
        self.eager_runners: dict[int, Runner] = {}  # ... outside graph capture, where that differs
        self.arena = Arena(geometry.device, dry)
        # the handles' states that use these plans: their eager fast paths (``State.fast``) are emptied
        # whenever the plans or the arena change (``changed``)
        self.handles = weakref.WeakSet()
        g = geometry
        self.e_pad = triton.next_power_of_2(g.num_experts + 1)
        self.act_dtype = torch.float32 if INTERPRET and not dry else torch.bfloat16
        self.dot_dtype = tl.float32 if INTERPRET else tl.bfloat16
        self.slot_chunk = max(1, SLOT_BUFFER_BYTES // (g.top_k * g.hidden_size * 4))
        self.pdl = pdl_status(g.device)[0] if pdl is None else bool(pdl)
        # the GEMV on mma.sync (``gemv_mma_status``: sm_80 and newer; its asm folds as the PTX decode does)
        self.mma = False if dry else _gemv_mma_decision(_capability(g.device), fast_scales, ptx)[0]
        self.mma_fold = bool(fold and self.mma)
        self.choose_gluon(None if dry else _capability(g.device))
        self.mma_pdl = gemv_mma_pdl(g.device)  # (the mma.sync GEMV's launches)

    def choose_gluon(self, cc) -> None:
        """The Gluon GEMMs of a GPU of capability ``cc`` (None: none), given ``ptx`` and ``mma``
        (``gluon_status``): ``gluon`` on wgmma on sm_90 or elsewhere on mma.sync (``gluon_sync``, decoding as
        the mma.sync GEMV does), and on sm_90 with B12X_OPS_TRITON_GLUON_SYNC16=1 those of 16-row blocks on
        mma.sync (``sync16``)."""
        self.gluon = _gluon_decision(cc, self.ptx, self.mma)[0]
        self.gluon_sync = self.gluon and cc != (9, 0)
        self.sync16 = self.gluon and not self.gluon_sync and self.mma and gluon_sync16_on()

    # ---- per call
    def cap_for(self, m: int) -> int:
        """The planned token count that serves a call of ``m`` tokens (the top one above it)."""
        if m < len(self._cap_of):
            return self._cap_of[m]
        i = bisect.bisect_left(self.caps, m)
        return self.caps[min(i, len(self.caps) - 1)]

    def plan_for(self, m: int) -> tuple[int, Config]:
        cap = self.cap_for(m)
        return cap, self.configs[cap]

    def runner_for(self, m: int, capturing=None) -> Runner:
        """What a call of ``m`` tokens launches (built by ``add`` at prepare): the plan's eager form
        (``eager_form``) where it has one and ``capturing()`` (asked only then) is false."""
        cap = self.cap_for(m)
        rn = self.eager_runners.get(cap)
        if rn is not None and capturing is not None and not capturing():
            return rn
        return self.runners[cap]

    # ---- prepare
    def runner(self, cfg: Config, tokens: int | None = None) -> Runner:
        """``cfg``'s launches for calls of at most ``tokens`` tokens (None: any count; the
        prologue's routing tiles depend on it)."""
        g = self.geometry
        stages = self.stages(cfg, tokens)
        blocked = stages[0] is not None and not cfg.gemv
        rt = stages[0].constexprs["RT"] if blocked else PROLOGUE["RT"]
        kt = -(-g.hidden_size // PROLOGUE["QK"])
        qs = stages[0].constexprs["QS"] if blocked else kt
        edge1, edge2 = (self.edge(k, cfg, tokens) if blocked else None for k in ("gemm1", "gemm2"))
        tiles = (lambda out, bn, edge: out // bn if edge is not None else -(-out // bn))
        return Runner(cfg, *stages, tiles(g.intermediate_size, cfg.bn1, edge1) * cfg.split1,
                      tiles(g.hidden_size, cfg.bn2, edge2) * cfg.split2,
                      -(-g.hidden_size // FINALIZE["BK"]), PROLOGUE["QR"], rt, FINALIZE["BR"], g.num_experts,
                      kt, -(-kt // qs), edge1, edge2)

    def _edge_of(self, kind: str, cfg: Config) -> tuple[int, int]:
        """``(width, first column)`` of a Gluon GEMM's edge launch (``edge_split``; width 0: none)."""
        g = self.geometry
        gluon, out, bn = ((cfg.gluon, g.intermediate_size, cfg.bn1) if kind == "gemm1"
                          else (cfg.gluon2, g.hidden_size, cfg.bn2))
        w = edge_split(out, bn, GLUON_WIDTHS[kind]) if gluon and not cfg.gemv else 0
        return w, out // bn * bn

    def edge(self, kind: str, cfg: Config, tokens: int | None = None) -> Launch | None:
        """The launch of ``kind``'s last column tile in its narrower width (``edge_split``), None where
        there is none: the main launch's kernel and constexprs, the tile's width, warps in proportion
        (16 or 32 weight rows a warp, as the main launch's), the columns from the main launch's end,
        and no accumulator rows to zero (the main launch zeroes them where GEMM1 does)."""
        w, c0 = self._edge_of(kind, cfg)
        if not w:
            return None
        main = self.launch(kind, cfg, tokens)
        bn, warps = (cfg.bn1, cfg.warps1) if kind == "gemm1" else (cfg.bn2, cfg.warps2)
        nw = warps * w // bn
        key = ("edge", kind, main.constexprs["BM"], w, main.constexprs["BK"], nw, main.constexprs["STAGES"],
               main.constexprs.get("ATOMIC"), main.constexprs["HALF"], c0, cfg.sync)
        hit = self.launches.get(key)
        if hit is not None:
            return hit
        rows = 2 * w if kind == "gemm1" else w
        c = {k: v for k, v in main.constexprs.items() if k != "PDL"}
        c.update(BN=w, C0=c0, C1=0, **GK.layouts(rows, cfg.bm, nw, cfg.sync))
        if kind == "gemm1":
            c["ZERO_ACC"] = 0
        ln = Launch(main.fn, c, nw, 1, gluon_maxnreg(cfg.bm, nw, cfg.sync), pdl=self.pdl)
        self.launches[key] = ln
        return ln

    def stages(self, cfg: Config, tokens: int | None = None) -> tuple:
        """The (prologue, gemm1, gemm2, finalize) launches of ``cfg`` for calls of at most ``tokens``
        tokens (the GEMV path: (xquant or None, gemv1, gemv2, None))."""
        return tuple(self.launch(k, cfg, tokens) if k in self.kinds(cfg) else None
                     for k in ("prologue", "gemm1", "gemm2", "finalize"))

    @staticmethod
    def kinds(cfg: Config) -> tuple[str, ...]:
        if cfg.fused:  # (one launch: the fused kernel in gemm1's place)
            return ("gemm1",)
        if cfg.gemv:
            return ("prologue", "gemm1", "gemm2") if cfg.xq else ("gemm1", "gemm2")
        return ("prologue", "gemm1", "gemm2", "finalize")

    def launch(self, kind: str, cfg: Config, tokens: int | None = None) -> Launch:
        g = self.geometry
        if kind == "prologue" and cfg.gemv:
            key = ("xquant",)
        elif kind == "prologue":
            rt, nbt = route_tiles(None if tokens is None else tokens * g.top_k, g.num_experts, cfg.bm)
            qs = quant_pieces(tokens, g.hidden_size)
            zero_acc = cfg.atomic and not acc_zero_in_gemm1(cfg)  # (else GEMM1 zeroes it, or nothing needs it)
            key = (kind, cfg.bm, zero_acc, rt, nbt, qs)
        elif kind == "gemm1" and cfg.fused:
            key = ("gemv_fused",) + cfg.tiles1() + cfg.tiles2()
        elif kind == "gemm1" and cfg.gemv:
            key = ("gemv1_mma", cfg.window) + cfg.tiles1() if cfg.mma else ("gemv1",) + cfg.tiles1()
        elif kind == "gemm2" and cfg.gemv:
            key = ("gemv2_mma", cfg.window) + cfg.tiles2() if cfg.mma else ("gemv2",) + cfg.tiles2()
        elif kind == "gemm1" and cfg.gluon:
            key = ("gemm1_gluon", cfg.bm, cfg.bn1, cfg.bk1, cfg.warps1, cfg.stages1, acc_zero_mode(cfg), cfg.sync)
        elif kind == "gemm1":
            key = (kind, cfg.bm, cfg.bn1, cfg.bk1, cfg.warps1, _stages(cfg.bk1, cfg.stages1))
        elif kind == "gemm2" and cfg.gluon2:
            key = ("gemm2_gluon", cfg.bm, cfg.bn2, cfg.bk2, cfg.warps2, cfg.stages2, cfg.atomic, cfg.sync)
        elif kind == "gemm2":
            key = (kind, cfg.bm, cfg.bn2, cfg.bk2, cfg.warps2, _stages(cfg.bk2, cfg.stages2), cfg.atomic)
        else:
            key = (kind, cfg.atomic)
        blocked_gemm = kind in ("gemm1", "gemm2") and not cfg.gemv
        half = tail_tiles(cfg.bm) if blocked_gemm else 0  # (the blocked GEMMs' HALF, in their key too)
        c1 = 0  # (a Gluon GEMM with an edge launch: the columns its main launch ends at, in its key too)
        if blocked_gemm:
            w, c0 = self._edge_of(kind, cfg)
            c1 = c0 if w else 0
            key += (half, c1)
        hit = self.launches.get(key)
        if hit is not None:
            return hit
        common = dict(K=g.hidden_size, TOPK=g.top_k)

        def mk(fn, constexprs, num_warps, num_stages, maxnreg=None):  # (every stage kernel: the plans' PDL)
            return Launch(fn, constexprs, num_warps, num_stages, maxnreg, pdl=self.pdl)

        if kind == "prologue" and cfg.gemv:
            ln = mk(K_.xquant_kernel, dict(K=g.hidden_size, QK=PROLOGUE["QK"]), 4, 1)
        elif kind == "prologue":
            p = PROLOGUE
            ln = mk(K_.prologue_kernel, dict(common, E=g.num_experts, E_PAD=self.e_pad, BM=cfg.bm, RT=rt,
                                             NBT=nbt, QR=p["QR"], QK=p["QK"], QS=qs,
                                             ZERO_ACC=zero_acc),
                    p["warps"], 1)
        elif cfg.gemv and cfg.mma:  # (gluon_gemv: the constexprs, then the layouts)
            self._check_mma(cfg)
            gm = dict(common, N=g.intermediate_size, E=g.num_experts, HAS_GS=g.has_global_scales, FOLD=self.mma_fold)
            if kind == "gemm1":
                ln = Launch(GG.gemv1_mma_kernel, dict(gm, UP_FIRST=g.w13_layout == "w13",
                                                      HAS_LIMIT=g.swiglu_limit is not None, BN=cfg.bn1,
                                                      Q=cfg.bk1 // 64, SPLIT=cfg.split1,
                                                      L=cfg.window, **GG.layouts(cfg.warps1, True)),
                            cfg.warps1, 1, pdl=self.mma_pdl)
            else:
                ln = Launch(GG.gemv2_mma_kernel, dict(gm, BN=cfg.bn2, Q=cfg.bk2 // 64, KP=cfg.split2 // g.top_k,
                                                      L=cfg.window, **GG.layouts(cfg.warps2, False)),
                            cfg.warps2, 1, pdl=self.mma_pdl)
        elif cfg.gemv:  # (gemv1, gemv2, or both as one launch)
            self._check_dot(cfg, kind)
            st1, st2 = _stages(cfg.bk1, cfg.stages1), _stages(cfg.bk2, cfg.stages2)
            gv = dict(common, N=g.intermediate_size, E=g.num_experts, HAS_GS=g.has_global_scales,
                      DOT_DTYPE=self.dot_dtype, PTX=self.ptx, FOLD=self.fold)
            gv1 = dict(gv, UP_FIRST=g.w13_layout == "w13", HAS_LIMIT=g.swiglu_limit is not None)
            if kind == "gemm1" and cfg.fused:
                ln = mk(K_.gemv_fused_kernel, dict(gv1, BN1=cfg.bn1, BK1=cfg.bk1, SPLIT1=cfg.split1, BN2=cfg.bn2,
                                                   BK2=cfg.bk2, SPLIT2=cfg.split2, ST1=st1, ST2=st2),
                        cfg.warps1, max(st1, st2), GEMV1_MAXNREG)
            elif kind == "gemm1":
                ln = mk(K_.gemv1_kernel, dict(gv1, BN=cfg.bn1, BK=cfg.bk1, SPLIT=cfg.split1, XQ=cfg.xq, STAGES=st1),
                        cfg.warps1, st1, None if cfg.xq else GEMV1_MAXNREG)
            else:  # (gemm2: the GEMV path has no finalize)
                ln = mk(K_.gemv2_kernel, dict(gv, BN=cfg.bn2, BK=cfg.bk2, SPLIT=cfg.split2, STAGES=st2),
                        cfg.warps2, st2)
        elif kind == "gemm1":  # (tl.dot, or Gluon: the same tile's constexprs, the layouts instead of the dot's)
            g1 = dict(common, N=g.intermediate_size, UP_FIRST=g.w13_layout == "w13",
                      HAS_LIMIT=g.swiglu_limit is not None, HAS_GS=g.has_global_scales, BM=cfg.bm, BN=cfg.bn1,
                      BK=cfg.bk1, FOLD=self.fold, HALF=half)
            if cfg.gluon:
                self._check_gluon(cfg, "GEMM1", "bn1", GLUON_WIDTHS["gemm1"], "stages1", 2 * cfg.bn1, cfg.warps1)
                ln = mk(GK.gemm1_gluon_kernel, dict(g1, STAGES=cfg.stages1, ZERO_ACC=acc_zero_mode(cfg), **_cols(c1),
                                                    **self._gluon_fold(cfg),
                                                    **GK.layouts(2 * cfg.bn1, cfg.bm, cfg.warps1, cfg.sync)),
                        cfg.warps1, 1, gluon_maxnreg(cfg.bm, cfg.warps1, cfg.sync))
            else:
                self._check_dot(cfg, kind)
                ln = mk(K_.gemm1_kernel, dict(g1, DOT_DTYPE=self.dot_dtype, PTX=self.ptx),
                        cfg.warps1, _stages(cfg.bk1, cfg.stages1))
        elif kind == "gemm2":
            g2 = dict(common, N=g.intermediate_size, HAS_GS=g.has_global_scales, ATOMIC=cfg.atomic, BM=cfg.bm,
                      BN=cfg.bn2, BK=cfg.bk2, FOLD=self.fold, HALF=half)
            if cfg.gluon2:
                self._check_gluon(cfg, "GEMM2", "bn2", GLUON_WIDTHS["gemm2"], "stages2", cfg.bn2, cfg.warps2)
                ln = mk(GK.gemm2_gluon_kernel, dict(g2, STAGES=cfg.stages2, **_cols(c1), **self._gluon_fold(cfg),
                                                    **GK.layouts(cfg.bn2, cfg.bm, cfg.warps2, cfg.sync)),
                        cfg.warps2, 1, gluon_maxnreg(cfg.bm, cfg.warps2, cfg.sync))
            else:
                self._check_dot(cfg, kind)
                ln = mk(K_.gemm2_kernel, dict(g2, DOT_DTYPE=self.dot_dtype, PTX=self.ptx),
                        cfg.warps2, _stages(cfg.bk2, cfg.stages2))
        else:
            f = FINALIZE
            ln = mk(K_.finalize_kernel, dict(common, ATOMIC=cfg.atomic, BR=f["BR"], BK=f["BK"]), f["warps"], 1)
        self.launches[key] = ln
        return ln

    def _gluon_fold(self, cfg: Config) -> dict:
        """``cfg``'s Gluon GEMMs' FOLD: on mma.sync the GEMV's (its asm, ``mma_fold``), else the PTX decode's."""
        return dict(FOLD=self.mma_fold) if cfg.sync else {}

    def _check_gluon(self, cfg: Config, stage: str, bn_name: str, widths: tuple, st_name: str, rows: int,
                     warps: int) -> None:
        """A Gluon GEMM's requirements (``gluon_kernels``; its tile width and stages are ``cfg``'s fields
        ``bn_name`` and ``st_name``, its ``rows`` weight rows in ``warps`` warps), before anything compiles."""
        bn, stages = getattr(cfg, bn_name), getattr(cfg, st_name)
        decode = self.mma if cfg.sync else self.ptx  # (on mma.sync the GEMV's asm decode, else the PTX decode)
        if (not decode or not GK.HAS_GLUON or bn not in widths or stages < 4 or stages % 2
                or warps not in (rows // 16, rows // 32)):
            raise ValueError(f"b12x_ops triton backend: no Gluon {stage} for {cfg} (it needs the inline-PTX "
                             f"decode{' of the mma.sync GEMV' if cfg.sync else ''}, triton's Gluon, "
                             f"{bn_name} = {widths[0]} or {widths[1]}, an even "
                             f"{st_name} >= 4, and {rows // 16} or {rows // 32} warps: 16 or 32 of its {rows} rows a "
                             "warp)")

    def _check_dot(self, cfg: Config, kind: str) -> None:
        """Refuse, before anything compiles, a ``tl.dot`` kernel's tile that the inline-PTX decode sums
        wrong (its columns and warps not among ``DOT_PTX_TILES``); without that decode every tile passes."""
        if not self.ptx:
            return
        if cfg.fused:  # (the fused GEMV: both products in warps1)
            fields = (("bn1", "warps1"), ("bn2", "warps1"))
        else:
            fields = (("bn1", "warps1"),) if kind == "gemm1" else (("bn2", "warps2"),)
        for bn_name, warps_name in fields:
            tile = (getattr(cfg, bn_name), getattr(cfg, warps_name))
            if tile not in DOT_PTX_TILES:
                raise ValueError(
                    f"b12x_ops triton backend: no tl.dot {kind} for {cfg} with the inline-PTX decode: its "
                    f"({bn_name}, {warps_name}) must be one of {', '.join(map(str, DOT_PTX_TILES))} (got {tile}; "
                    "the others sum wrong)")

    def _check_mma(self, cfg: Config) -> None:
        """The mma.sync GEMV's requirements (``gluon_gemv``), before anything compiles."""
        g = self.geometry
        nq1, nq2 = mma_chunks(g)
        q1, q2 = cfg.bk1 // 64, cfg.bk2 // 64
        ok = (self.mma and GG.HAS_GLUON_MMA and cfg.xq and not cfg.fused and cfg.bn1 % 32 == 0 and cfg.bn2 % 16 == 0
              and cfg.bk1 % 64 == 0 and cfg.bk2 % 64 == 0 and q1 >= 1 and q2 >= 1
              and cfg.split1 == -(-nq1 // q1) and cfg.split2 == g.top_k * -(-nq2 // q2))
        if not ok:
            raise ValueError(f"b12x_ops triton backend: no mma.sync GEMV for {cfg} (it needs the inline-PTX decode, "
                             "triton's Gluon, x quantized first, bn1 a multiple of 32, bn2 of 16, bk1 and bk2 of 64, "
                             "and the splits of mma_config)")

    def reserve(self, cap: int, cfg: Config) -> None:
        """The arena's buffers for calls of ``cap`` tokens by ``cfg``."""
        version = self.arena.version
        self._reserve(cap, cfg)
        if self.arena.version != version:
            self.changed()

    def _reserve(self, cap: int, cfg: Config) -> None:
        g = self.geometry
        a = self.arena
        for name, dt in (("xq", self.act_dtype), ("lid", torch.int32), ("wts", torch.float32), ("sorted", torch.int32),
                         ("blk_expert", torch.int32), ("blk_rows", torch.int32), ("route_key", torch.int32),
                         ("route_off", torch.int32),
                         ("act", self.act_dtype), ("acc", torch.float32), ("slots", torch.float32),
                         ("part1", torch.float32), ("part2", torch.float32)):
            a.need(name, 1, dt)
        if cfg.gemv:  # (x quantized,) one activation row a slot, and the split-K sums and counts
            S = cap * g.top_k
            if cfg.xq:
                a.need("xq", cap * g.hidden_size, self.act_dtype)
            t1, t2 = S * -(-g.intermediate_size // cfg.bn1), cap * -(-g.hidden_size // cfg.bn2)
            a.need("act", S * g.intermediate_size, self.act_dtype)
            # (the mma.sync GEMV's programs store their sums and count themselves in even unsplit)
            a.need("part1", t1 * cfg.split1 * 2 * cfg.bn1 if cfg.split1 > 1 or cfg.mma else 1, torch.float32)
            a.need("part2", t2 * cfg.split2 * 2 * cfg.bn2 if cfg.split2 > 1 or cfg.mma else 1, torch.float32)
            a.need("cnt1", t1 if cfg.split1 > 1 else 1, torch.int32, zeroed=True)  # (reset by the kernels)
            a.need("cnt2", t2 if cfg.split2 > 1 or cfg.mma else 1, torch.int32, zeroed=True)
            if cfg.fused:  # tickets, finished gemv2 programs, gemv1 programs done a token
                a.need("sync", 2 + cap, torch.int32, zeroed=True)
            return
        tokens = min(cap, self.slot_chunk) if not cfg.atomic else cap
        S = tokens * g.top_k
        nb = K_.num_blocks(S, g.num_experts, cfg.bm)
        a.need("xq", tokens * g.hidden_size, self.act_dtype)
        a.need("lid", S, torch.int32)
        a.need("wts", S, torch.float32)
        a.need("sorted", nb * cfg.bm, torch.int32)
        a.need("blk_expert", nb, torch.int32)
        a.need("blk_rows", nb, torch.int32)
        a.need("route_key", S, torch.int32)
        a.need("route_off", S, torch.int32)
        a.need("route_cnt", K_.route_cnt_words(self.e_pad), torch.int32, zeroed=True)  # (the kernel resets it)
        a.need("act", nb * cfg.bm * g.intermediate_size, self.act_dtype)
        if cfg.atomic:
            a.need("acc", tokens * g.hidden_size, torch.float32)
        else:
            a.need("slots", S * g.hidden_size, torch.float32)

    def default(self, tokens: int) -> Config:
        """The untuned plan of ``tokens`` tokens on this GPU: ``default_config`` (the GEMV path up to
        ``GEMV_MMA_MAX_SLOTS`` slots and ``GEMV_MMA_MAX_TOKENS`` tokens where it runs on mma.sync) in
        ``with_gluon``'s forms."""
        return self.with_gluon(default_config(tokens, self.geometry, self.gemv, mma=self.mma), tokens)

    def with_gluon(self, cfg: Config, tokens: int | None = None) -> Config:
        """``cfg`` with its GEMMs in Gluon where this GPU takes them, in the forms of its block size
        (``gluon_forms``), and a GEMV plan for ``tokens`` tokens on mma.sync where ``gemv_mma_form`` says
        so: what an untuned plan runs (a tuned one runs what the tuner timed fastest,
        ``candidate_configs(..., gluon=True)``)."""
        if cfg.gemv:
            form = None if not self.mma or tokens is None or cfg.mma or cfg.fused else gemv_mma_form(
                tokens, self.geometry)
            return cfg if form is None else mma_config(cfg, self.geometry, *form)
        if not self.gluon or cfg.gluon or cfg.gluon2:
            return cfg
        sync = self.gluon_sync or (self.sync16 and cfg.bm == 16)
        if sync and cfg.bm > GLUON_SYNC_MAX_BM:
            cfg = dataclasses.replace(cfg, bm=GLUON_SYNC_MAX_BM)  # (its GEMMs' tiles: the forms below)
        f1, f2 = gluon_forms(cfg.bm, self.geometry, tokens, sync)
        if f1 is not None:
            cfg = dataclasses.replace(cfg, gluon=True, sync=sync, **f1)
        if f2 is not None:
            cfg = dataclasses.replace(cfg, gluon2=True, sync=sync, **f2)
        return cfg

    def add(self, cap: int, cfg: Config) -> None:
        self.configs[cap] = cfg
        self.caps = sorted(self.configs)
        self._cap_of = [self.caps[min(bisect.bisect_left(self.caps, m), len(self.caps) - 1)]
                        for m in range(self.caps[-1] + 1)]
        self.reserve(cap, cfg)
        self.runners[cap] = self.runner(cfg, cap)
        eager = eager_form(cfg, self.geometry, self.ptx)
        if eager is not None:
            self.reserve(cap, eager)
            self.eager_runners[cap] = self.runner(eager, cap)
        self.changed()

    def changed(self) -> None:
        """Empty the handles' fast paths (the plan of a token count or a buffer may have changed)."""
        for state in self.handles:
            state.fast.clear()


# ------------------------------------------------------------------------------- tuning cache
def cache_dir(option: str | None = None) -> str:
    return option or os.environ.get("B12X_OPS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "b12x_ops")


def cache_path(geometry, directory: str, gemv=None, ptx=False, gluon=False, mma=None, gluon_sync=False) -> str:
    g = geometry
    dev = torch.cuda.get_device_name(g.device) if g.device.type == "cuda" else "cpu"
    key = json.dumps([g.num_experts, g.hidden_size, g.intermediate_size, g.top_k, g.w13_layout, g.swiglu_limit is not None,
                      g.has_global_scales, g.deterministic, dev, triton.__version__, 26, gemv, ptx, gluon,
                      gluon if mma is None else mma, gluon_sync,
                      HALF_MIN_BM if half_tiles(HALF_MIN_BM) else 0,
                      _quarter_min_bm()])
    # (the version: 26 the Gluon GEMMs on mma.sync off sm_90 (``gluon_sync``); 25 the tuner's mma.sync picks keep their loads in flight (``Config.window``; they had
    # none), and off sm_90 it times that GEMV up to ``GEMV_MMA_TUNE_MAX_TOKENS``; 24 the Gluon GEMMs' epilogues write 16 bytes a store or atomic (whole calls'
    # timings change); 23 the prologue's placement spread over placing programs (whole calls' timings
    # change); 22 long reductions' block sizes by the regimes, so their candidates too; 21 the
    # register cap of the 64-row Gluon GEMMs; 20 the decode of 9 integer
    # instructions a word (timings change); 19 GEMM1's 256-row tile of 16-row blocks among the
    # candidates; 18 GEMM2's 128-row tile of 16-row blocks among them; 17 the mma.sync GEMV's gemv2
    # of 3, 4, 6, 8 chunks or a whole row, of 128 rows where K <= 2048; 16 the mma.sync GEMV's gemv2
    # of 4, 6 or 8 chunks; 15 the GEMV on mma.sync among the candidates; 14 block sizes and the GEMV
    # path compared by the whole call's time; 13 the tuner's totals with routing and finalize, timed
    # from a cold L2; 12 GEMM2's 128-row tile; 11 the half tiles)
    h = hashlib.sha1(key.encode()).hexdigest()[:16]
    return os.path.join(directory, f"triton-plans-{h}.json")


def load_cache(path: str) -> dict[int, Config]:
    try:
        with open(path) as f:
            raw = json.load(f)
        return {int(k): Config(**v) for k, v in raw.get("configs", {}).items()}
    except (OSError, ValueError, TypeError):
        return {}


def save_cache(path: str, configs: dict[int, Config], geometry) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"geometry": repr(geometry), "configs": {str(k): c.as_dict() for k, c in configs.items()}}, f,
                      indent=1)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home must not break prepare
        log.warning("b12x_ops triton: cannot write the tuning cache %s: %s", path, exc)


class Progress:
    """A stderr progress line, shown once a step has taken over a second (and always logged)."""

    def __init__(self, what: str, total: int):
        self.what, self.total, self.t0, self.done = what, total, time.perf_counter(), 0

    def step(self, note: str = "") -> None:
        self.done += 1
        log.info("%s %d/%d %s", self.what, self.done, self.total, note)
        if time.perf_counter() - self.t0 > 1.0:
            end = "\n" if self.done == self.total else ""
            print(f"\r[b12x_ops] {self.what}: {self.done}/{self.total} {note:<40}", end=end, file=sys.stderr, flush=True)
