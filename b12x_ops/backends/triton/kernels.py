"""The stage kernels of the Triton W4A8 MoE, each with its pure-torch twin beside it.

A call of the blocked (tensor-core) path is four launches with grids derived from shapes only
(no host sync):

1. ``prologue``: its first ``cdiv(S, RT)`` programs route the ``S`` slots (local ids, slot
   weights, a per-expert histogram, expert blocks of ``BM`` rows, and the slots scattered into
   those blocks: one program from registers up to ``RT`` slots, see "Routing" below); every other
   program quantizes ``QR`` rows and ``QS`` pieces of ``QK`` columns of ``x`` to MXFP8 (stored
   dequantized, exact in bf16, in the split column order) and zeroes that piece of the fp32
   accumulator when the reduction uses atomics.
2. ``gemm1``: per (expert block, N tile): ``h = dq8(x) @ W13[e]^T`` with the MXFP4 weights decoded
   in registers, the global scale, SwiGLU (+ limit) and the MXFP8 quant-dequant of the result.
3. ``gemm2``: per (expert block, K tile): ``y = dq8(a) @ W2[e]^T`` times the global scale and the
   router weight, added into the fp32 accumulator (atomics) or stored per slot (deterministic).
4. ``finalize``: the accumulator (or the sum of a token's slots, in slot order) rounded once to
   the output dtype.

Both GEMMs are computed transposed, ``W[e] tile @ rows^T``: see "Blocked GEMMs" below.

Padding and foreign slots are routed to no block, so they cost no GEMM work; blocks past the
batch's real ones exit at their first load. The small-M path is two or three launches,
``xquant`` (from a few tokens on), ``gemv1`` and ``gemv2`` (see there), or for some eager calls
one, ``gemv_fused_kernel``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import swiglu as swiglu_torch
from ...mx import dequantize_mxfp4, quant_dequant_mxfp8
from .mxtl import decode_repacked, load_repacked, mxfp8_apply, mxfp8_block_scale, quant_dequant_mxfp8_tile


def num_blocks(num_slots: int, num_experts: int, bm: int) -> int:
    """Upper bound on expert blocks of ``bm`` rows: every expert's partial block plus full ones."""
    if num_slots == 0:
        return 0
    return -(-num_slots // bm) + min(num_experts, num_slots)  # (plain ints: triton.cdiv costs ~2 us a call)


# ------------------------------------------------------------------------------- split layout
# The blocked GEMMs read activations in the "split" column order: in
# every 32 columns, the 16 even elements first, then the 16 odd ones. Byte ``h`` of a 32-element
# MXFP4 block holds elements ``2h`` and ``2h + 1``, so the activations a chunk of code bytes meets
# are then two runs of 16 contiguous values (vector loads) instead of two stride-2 gathers.
@triton.jit
def split_col(c):
    """Column of element ``c`` in the split layout."""
    return (c // 32) * 32 + (c % 2) * 16 + (c % 32) // 2


def split_perm(n: int) -> torch.Tensor:
    """Twin of ``split_col``: ``perm[c]`` is element ``c``'s column (``t_split[..., perm] = t``)."""
    c = torch.arange(n)
    return (c // 32) * 32 + (c % 2) * 16 + (c % 32) // 2


def unsplit(t: torch.Tensor) -> torch.Tensor:
    """The natural column order of a split-layout ``[..., n]`` tensor."""
    return t[..., split_perm(t.shape[-1])]


# ---------------------------------------------------------------------------- shared pieces
@triton.jit
def local_expert(gid, expert_offset, E: tl.constexpr):
    """``(local id, ours)`` of global expert ids ``gid`` (int64): padding (-1) and other ranks' ids
    are not ours."""
    lid = gid - expert_offset
    return lid, (gid >= 0) & (lid >= 0) & (lid < E)


@triton.jit
def _block_tile(blk_expert_ptr, OUT: tl.constexpr, BN: tl.constexpr, C0: tl.constexpr = 0, C1: tl.constexpr = 0):
    """A blocked GEMM program's ``(expert block, tile of BN of the OUT outputs, the block's
    expert)``, block-major: a block's tiles run together and share its rows in L2. The expert is
    negative for a block past the batch's real ones (the program then does nothing). ``C0``, ``C1``:
    a launch of the outputs ``[C0, C1)`` only (``C1`` 0: to OUT; ``C0`` a multiple of BN), its tiles
    still counted from output 0, so that a Gluon GEMM's last, part-empty tile can run in a narrower
    launch of its own (``plan.edge_split``)."""
    pid = tl.program_id(0)
    END: tl.constexpr = OUT if C1 == 0 else C1
    NT: tl.constexpr = (END - C0 + BN - 1) // BN
    pid_m = pid // NT
    return pid_m, C0 // BN + pid % NT, tl.load(blk_expert_ptr + pid_m)


@triton.jit
def _block_slots(pid_m, blk_rows_ptr, sorted_ptr, BM: tl.constexpr, BMX: tl.constexpr):
    """``(rows, valid, slot)`` of the first ``BMX`` rows of expert block ``pid_m`` (of ``BM``): their
    int64 row index in the block-ordered buffers, whether each holds a slot, and that slot."""
    offs_r = tl.arange(0, BMX)
    rvalid = offs_r < tl.load(blk_rows_ptr + pid_m)
    slot = tl.load(sorted_ptr + pid_m * BM + offs_r, mask=rvalid, other=0)
    return (pid_m * BM + offs_r).to(tl.int64), rvalid, slot


@triton.jit
def _gemm1_tile(pid_m, pid_n, blk_rows_ptr, sorted_ptr, N: tl.constexpr, TOPK: tl.constexpr,
                UP_FIRST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BMX: tl.constexpr):
    """A GEMM1 program's rows and columns: ``_block_slots``' rows and valid flags, the rows' token
    indices (int64), the tile's intermediate columns and valid flags, and its W13 rows of up and
    of gate."""
    rows, rvalid, slot = _block_slots(pid_m, blk_rows_ptr, sorted_ptr, BM, BMX)
    tok = (slot // TOPK).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nvalid = offs_n < N
    up_rows, gate_rows = _up_gate_rows(offs_n, N, UP_FIRST)
    return rows, rvalid, tok, offs_n, nvalid, up_rows, gate_rows


@triton.jit
def _up_gate_rows(offs_n, N: tl.constexpr, UP_FIRST: tl.constexpr):
    """W13 rows of up and of gate for intermediate columns ``offs_n`` (layout w13: up first)."""
    if UP_FIRST:
        up, gate = offs_n, offs_n + N
    else:
        up, gate = offs_n + N, offs_n
    return up, gate


@triton.jit
def _swiglu(up, gate, gs_ptr, e, limit, HAS_GS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """``silu(min(gate, L)) * clamp(up, -L, L)`` of fp32 sums, after the expert's global scale."""
    if HAS_GS:
        g = tl.load(gs_ptr + e)
        up = up * g
        gate = gate * g
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _store_act(acc_u, acc_g, gs_ptr, e, limit, a_ptr, rows, rvalid, offs_n, nvalid, N: tl.constexpr,
               HAS_GS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """GEMM1's epilogue: ``dq8(silu(gate) * up)`` of ``[BN, BM]`` tiles into the block's rows of
    ``a`` (split layout)."""
    BM: tl.constexpr = acc_u.shape[1]
    BN: tl.constexpr = acc_u.shape[0]
    act = tl.trans(_swiglu(acc_u, acc_g, gs_ptr, e, limit, HAS_GS, HAS_LIMIT))  # [BM, BN]
    act = quant_dequant_mxfp8_tile(act, BM, BN)
    tl.store(a_ptr + rows[:, None] * N + split_col(offs_n)[None, :], act, mask=rvalid[:, None] & nvalid[None, :])


@triton.jit
def _reduce_rows(acc, e, gs_ptr, wts_ptr, slot, rvalid, offs_o, ovalid, dst_ptr, K: tl.constexpr,
                 TOPK: tl.constexpr, HAS_GS: tl.constexpr, ATOMIC: tl.constexpr):
    """A GEMM2 ``[BN outputs, BM rows]`` tile times the global scale and the router weights, added into
    the fp32 ``[M, K]`` accumulator (ATOMIC) or stored in the slots' rows of ``[M * TOPK, K]``."""
    if HAS_GS:
        acc = acc * tl.load(gs_ptr + e)
    acc = acc * tl.load(wts_ptr + slot, mask=rvalid, other=0.0)[None, :]
    msk = ovalid[:, None] & rvalid[None, :]
    if ATOMIC:
        tok = (slot // TOPK).to(tl.int64)
        tl.atomic_add(dst_ptr + tok[None, :] * K + offs_o[:, None], acc, mask=msk, sem="relaxed")
    else:
        tl.store(dst_ptr + slot.to(tl.int64)[None, :] * K + offs_o[:, None], acc, mask=msk)



# ------------------------------------------------------------------------------------- prologue
def _jit(*, dns, dnsa=()):
    """``triton.jit`` for kernels launched precompiled: arguments that change from call to call
    (sizes, strides, the caller's tensors) must not be specialized on, or a kernel compiled for
    one batch would assume facts (divisibility, alignment) another batch breaks."""
    try:
        return triton.jit(do_not_specialize=dns, do_not_specialize_on_alignment=dnsa)
    except TypeError:  # older triton: no alignment switch; do_not_specialize covers both there
        return triton.jit(do_not_specialize=tuple(dns) + tuple(dnsa))


try:  # programmatic dependent launch (sm_90+): triton 3.4 and newer
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:  # pragma: no cover - older triton
    gdc_launch_dependents = gdc_wait = None
    HAS_GDC = False


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """The first statement of every stage kernel. With ``PDL`` (the launch lets the next kernel in
    the stream start before this one ends): wait until the previous kernel has finished and its
    writes are visible, before any memory access (so no read of its outputs and no write over its
    inputs comes early), then let the next kernel launch. The next kernel's programs then take
    SMs as this one's last programs leave, and wait in their own ``pdl_start``: what overlaps is
    launch latency and scheduling, never memory traffic."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def half_bits_to_f32(raw, is_fp16):
    """fp32 value of 16-bit floats given as int16 bits: fp16 when ``is_fp16`` (a runtime flag), else bf16."""
    as_bf16 = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    as_fp16 = raw.to(tl.float16, bitcast=True).to(tl.float32)
    return tl.where(is_fp16 != 0, as_fp16, as_bf16)


@triton.jit
def load_weight_raw(ptr, mask, kind):
    """A router weight from an int16 view of the caller's tensor: ``kind`` 0 fp32 (two halves,
    little endian), 1 bf16, 2 fp16. One compiled kernel serves every weight dtype."""
    lo = tl.load(ptr, mask=mask, other=0)
    hi = tl.load(ptr + 1, mask=mask & (tl.zeros_like(lo).to(tl.int32) + kind == 0), other=0)
    f32 = ((hi.to(tl.int32) << 16) | (lo.to(tl.int32) & 0xFFFF)).to(tl.float32, bitcast=True)
    return tl.where(kind == 0, f32, half_bits_to_f32(lo, kind == 2))


@triton.jit
def f32_to_half_bits(v, is_fp16):
    """int16 bits of fp32 ``v`` rounded (nearest even) to fp16 when ``is_fp16``, else to bf16."""
    bits = v.to(tl.int32, bitcast=True)
    bf = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    bf = tl.where(v != v, 0x7FC0, bf)  # NaN stays NaN
    fp = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return tl.where(is_fp16 != 0, fp, bf).to(tl.int16)


# Routing: every routed slot of ours gets a row in its expert's blocks of ``BM`` rows. A tile of
# ``RT`` slots is one program's; within a tile the rank of a slot among the tile's slots of its
# expert comes from one register sort of the keys ``expert * RT + slot`` (the sorted position minus
# the expert's first position), so no per-slot atomics and no global round trip between the
# histogram and the scatter. Up to ``RT`` slots (``S <= RT``: the decode and small-prefill sizes)
# program 0 is the whole routing: histogram, expert blocks and scatter, from registers. Above, each
# of the ``cdiv(S, RT)`` routing programs adds its tile's histogram to the expert counts with one
# vector of atomics (the old values: the tile's base row in each expert) and stores its slots' rows
# within their experts, in expert order; the last of them to finish (acquire-release count, as in
# ``_last_of_split``) reads the counts (resetting them to zero for the next call), writes the
# block table and each expert's first row, and raises a flag (release). As many placing programs
# as routing ones come next in the grid: placer ``t`` waits for the flag (acquire) and places tile
# ``t``'s slots (streaming loads, stores in runs of consecutive rows, no atomics); the last placer
# to finish lowers the flag. (The placement used to be the last routing program's, one program
# walking every slot: about 0.6 ns a slot, 39 us at 65536 slots, in sequence with everything else.)
# A placer waits only on programs launched before it, which the GPU starts first; and there are
# at most ``cdiv(S, RT)`` of them waiting, far fewer than an SM count's worth of resident programs.
# The interpreter runs programs in order, so it finds the flag raised.
#
# ``cnt`` (int32, zero between calls, ``route_cnt_words``): the expert counts ``[0, E_PAD)``, the
# routing programs' arrivals at ``E_PAD``, the flag at ``E_PAD + 32`` and the placers' arrivals at
# ``E_PAD + 33`` (another 128-byte line than the arrivals the routing programs add to), the
# experts' first rows at ``E_PAD + 64 ..``.
CNT_FLAG = tl.constexpr(32)
CNT_ROWS = tl.constexpr(64)


def route_cnt_words(e_pad: int) -> int:
    """Words of the prologue's ``cnt`` buffer for ``E_PAD`` experts (see "Routing")."""
    return CNT_ROWS.value + 2 * e_pad


@triton.jit
def _route_tile(ids_ptr, wts_in_ptr, lid_ptr, wts_ptr, t, S, stride_im, stride_ik, stride_wm, stride_wk,
                expert_offset, w_kind, E: tl.constexpr, E_PAD: tl.constexpr, TOPK: tl.constexpr, RT: tl.constexpr):
    """Tile ``t`` of ``RT`` slots: stores its ``lid`` and ``wts``; returns its per-expert histogram
    ``[E_PAD]`` (bin ``E`` holds the slots that are not ours) and, in expert order, each slot's
    ``(sort key expert * RT + slot in the tile, expert, slot, rank among the tile's slots of its
    expert)`` (expert ``E``: not ours; those sort last)."""
    loc = tl.arange(0, RT)
    s = t * RT + loc
    sm = s < S
    m = s // TOPK
    j = s - m * TOPK
    gid = tl.load(ids_ptr + m.to(tl.int64) * stride_im + j * stride_ik, mask=sm, other=-1).to(tl.int64)
    lid, ours = local_expert(gid, expert_offset, E)
    ok = sm & ours
    w = load_weight_raw(wts_in_ptr + m.to(tl.int64) * stride_wm + j * stride_wk, sm, w_kind)
    tl.store(lid_ptr + s, tl.where(ok, lid, -1).to(tl.int32), mask=sm)
    tl.store(wts_ptr + s, tl.where(ok, w, 0.0), mask=sm)
    key = tl.where(ok, lid, E).to(tl.int32)
    hist = tl.histogram(key, E_PAD)
    srt = tl.sort(key * RT + loc)  # (distinct keys: the sort is a permutation)
    e_s = srt // RT
    first = tl.cumsum(hist, 0) - hist  # each expert's first position in the sorted tile
    rank = loc - tl.gather(first, e_s, 0)
    return hist, srt, e_s, t * RT + srt % RT, rank


@triton.jit
def _block_table(counts, nblocks, blk_expert_ptr, blk_rows_ptr, E: tl.constexpr, E_PAD: tl.constexpr,
                 BM: tl.constexpr, NBT: tl.constexpr):
    """Expert blocks of ``BM`` rows from the per-expert ``counts`` ``[E_PAD]``: stores
    ``blk_expert`` (-1 past the real blocks) and ``blk_rows`` for the ``nblocks`` blocks and
    returns each expert's first block. A block's expert is the number of experts whose blocks end
    at or before it: a histogram of the block ends and its cumsum, ``NBT`` blocks at a time."""
    eidx = tl.arange(0, E_PAD)
    nblk = tl.where(eidx < E, (counts + BM - 1) // BM, 0)
    blk_end = tl.cumsum(nblk, 0)
    blk_start = blk_end - nblk
    for b0 in range(0, nblocks, NBT):
        b = b0 + tl.arange(0, NBT)
        v = blk_end - b0
        inside = (v >= 0) & (v < NBT)
        ex = tl.sum((v < 0).to(tl.int32), 0) + tl.cumsum(tl.histogram(tl.where(inside, v, 0), NBT, mask=inside), 0)
        exc = tl.minimum(ex, E_PAD - 1)
        used = ex < E
        rows = tl.minimum(tl.gather(counts, exc, 0) - (b - tl.gather(blk_start, exc, 0)) * BM, BM)
        tl.store(blk_expert_ptr + b, tl.where(used, ex, -1), mask=b < nblocks)
        tl.store(blk_rows_ptr + b, tl.where(used, rows, 0), mask=b < nblocks)
    return blk_start


@_jit(dns=("M", "stride_im", "stride_ik", "stride_wm", "stride_wk", "stride_xm", "expert_offset", "nblocks", "w_kind",
           "x_fp16"),
      dnsa=("ids_ptr", "wts_in_ptr", "x_ptr"))
def prologue_kernel(
    ids_ptr, wts_in_ptr, x_ptr, xq_ptr, acc_ptr,
    lid_ptr, wts_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, cnt_ptr, key_ptr, off_ptr,
    M, stride_im, stride_ik, stride_wm, stride_wk, stride_xm, expert_offset, nblocks, w_kind, x_fp16,
    K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr,
    RT: tl.constexpr, NBT: tl.constexpr, QR: tl.constexpr, QK: tl.constexpr,
    QS: tl.constexpr, ZERO_ACC: tl.constexpr, PDL: tl.constexpr = False,
):
    """Programs ``0 .. R - 1`` (``R = cdiv(S, RT)``) route and, where ``R > 1``, the next ``R`` place
    (see "Routing" above; ``cnt`` as there; ``key`` and ``off``, ``S`` each, the tiles' sort keys and
    rows within their experts); the others quantize pieces of x to MXFP8, stored dequantized (exact
    in the GEMMs' bf16) in the split column order into ``xq``. The routing programs come first, so
    they start first."""
    pdl_start(PDL)
    pid = tl.program_id(0)
    S = M * TOPK
    R = (S + RT - 1) // RT
    NP = tl.where(R > 1, R, 0)  # placing programs
    if pid < R:
        hist, srt, e_s, slot_s, rank = _route_tile(ids_ptr, wts_in_ptr, lid_ptr, wts_ptr, pid, S, stride_im,
                                                   stride_ik, stride_wm, stride_wk, expert_offset, w_kind, E, E_PAD,
                                                   TOPK, RT)
        eidx = tl.arange(0, E_PAD)
        mine = e_s < E
        if R == 1:  # the whole batch in this tile: blocks and rows from registers
            blk_start = _block_table(hist, nblocks, blk_expert_ptr, blk_rows_ptr, E, E_PAD, BM, NBT)
            tl.store(sorted_ptr + tl.gather(blk_start * BM, e_s, 0) + rank, slot_s, mask=mine)
        else:
            # this tile's first row in each expert, then its slots' sort keys and rows within their
            # experts, in the tile's expert order (coalesced here, and runs of consecutive rows for
            # the placement: its stores coalesce too); its slots not ours sort last, past S
            base = tl.atomic_add(cnt_ptr + eidx, hist, mask=(eidx < E) & (hist > 0), sem="relaxed")
            q = pid * RT + tl.arange(0, RT)
            tl.store(key_ptr + q, srt, mask=q < S)
            tl.store(off_ptr + q, tl.gather(base, e_s, 0) + rank, mask=q < S)
            tl.debug_barrier()  # every thread's stores before the count (the release covers them)
            done = tl.atomic_add(cnt_ptr + E_PAD, 1, sem="acq_rel")
            if done == R - 1:
                counts = tl.atomic_xchg(cnt_ptr + eidx, 0, mask=eidx < E, sem="relaxed")
                tl.store(cnt_ptr + E_PAD, 0)
                counts = tl.where(eidx < E, counts, 0)
                first_row = _block_table(counts, nblocks, blk_expert_ptr, blk_rows_ptr, E, E_PAD, BM, NBT) * BM
                tl.store(cnt_ptr + CNT_ROWS + E_PAD + eidx, first_row)
                tl.debug_barrier()  # (every thread's stores before the flag; the release covers them)
                tl.atomic_xchg(cnt_ptr + E_PAD + CNT_FLAG, 1, sem="release")
    elif pid < R + NP:
        # ---- placer t: tile t's slots at their rows, once the last routing program has raised the flag
        t = pid - R
        while tl.atomic_add(cnt_ptr + E_PAD + CNT_FLAG, 0, sem="acquire") == 0:
            pass
        c = t * RT + tl.arange(0, RT)
        eidx = tl.arange(0, E_PAD)
        first_row = tl.load(cnt_ptr + CNT_ROWS + E_PAD + eidx, cache_modifier=".cg")  # (L2 reads: other
        key = tl.load(key_ptr + c, mask=c < S, other=E * RT, cache_modifier=".cg")  # programs wrote these)
        off = tl.load(off_ptr + c, mask=c < S, other=0, cache_modifier=".cg")
        e = key // RT
        pos = tl.gather(first_row, tl.minimum(e, E_PAD - 1), 0) + off
        tl.store(sorted_ptr + pos, t * RT + key % RT, mask=e < E)
        tl.debug_barrier()  # (every thread's reads of the first rows before the count)
        if tl.atomic_add(cnt_ptr + E_PAD + CNT_FLAG + 1, 1, sem="acq_rel") == NP - 1:  # the last placer:
            tl.store(cnt_ptr + CNT_ROWS + E_PAD + eidx, tl.zeros_like(first_row))  # zeros for the next call
            tl.store(cnt_ptr + E_PAD + CNT_FLAG, 0)
            tl.store(cnt_ptr + E_PAD + CNT_FLAG + 1, 0)
    else:
        # ---- MXFP8 quant-dequant of QR rows and QS pieces of QK columns of x (and zeroing of that
        # piece of the accumulator). Few tokens take one piece a program, so that their rows are spread over
        # many programs (DSv4's K = 5120 walked in 10 steps one after another took 9-11 us); many
        # tokens take whole rows (QS = cdiv(K, QK)), where more programs only cost more overhead.
        KP: tl.constexpr = ((K + QK - 1) // QK + QS - 1) // QS  # a row group's programs
        q = pid - R - NP
        rows = (q // KP) * QR + tl.arange(0, QR)
        rm = rows < M
        c0 = (q % KP) * (QS * QK)
        end = tl.minimum(c0 + QS * QK, K)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        ks = c0 + tl.arange(0, QK)
        raw = tl.load(x_rows + ks[None, :], mask=rm[:, None] & (ks < end)[None, :], other=0)
        for k0 in range(c0, end, QK):
            # the next piece's load before this one's work: two pieces in flight
            kn = k0 + QK + tl.arange(0, QK)
            nxt = tl.load(x_rows + kn[None, :], mask=rm[:, None] & (kn < end)[None, :], other=0)
            ks = k0 + tl.arange(0, QK)
            msk = rm[:, None] & (ks < K)[None, :]
            xq = quant_dequant_mxfp8_tile(half_bits_to_f32(raw, x_fp16), QR, QK)
            # put the tile in the split layout's order in registers (``split_col``: within each 32
            # columns, the even ones then the odd ones), so that a thread's adjacent values go to
            # adjacent addresses: 16-byte stores instead of 2-byte ones (the mask is unchanged, as K
            # and the piece are multiples of 32). H200: the prologue at 8192 tokens 78 -> 55 us
            # (gpt-oss), 122 -> 92 (DSv4), 45 -> 38 (Qwen3).
            xq = tl.reshape(tl.permute(tl.reshape(xq, (QR, QK // 32, 16, 2)), (0, 1, 3, 2)), (QR, QK))
            tl.store(xq_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], xq, mask=msk)
            if ZERO_ACC:
                tl.store(acc_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], tl.zeros((QR, QK), tl.float32),
                         mask=msk)
            raw = nxt


@_jit(dns=("M", "stride_xm", "x_fp16"), dnsa=("x_ptr",))
def xquant_kernel(x_ptr, xq_ptr, M, stride_xm, x_fp16, K: tl.constexpr, QK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (token, ``QK`` columns): MXFP8 quant-dequant of that piece of x into ``xq`` (split
    column order), as the prologue's quantizing programs do. The GEMV path's first launch when its
    config quantizes x once (``Config.xq``) instead of in every gemv1 program."""
    pdl_start(PDL)
    m = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1) * QK + tl.arange(0, QK)
    msk = ks < K
    raw = tl.load(x_ptr + m * stride_xm + ks, mask=msk, other=0)
    q = quant_dequant_mxfp8_tile(tl.reshape(half_bits_to_f32(raw, x_fp16), (1, QK)), 1, QK)
    tl.store(xq_ptr + m * K + split_col(ks), tl.reshape(q, (QK,)), mask=msk)


def prologue_programs(tokens: int, top_k: int, rt: int, qr: int, pieces: int) -> int:
    """Grid of ``prologue_kernel``: ``R = cdiv(S, rt)`` routing programs, as many placing ones where
    ``R > 1``, then ``cdiv(tokens, qr)`` times ``pieces`` (a row group's programs,
    ``cdiv(cdiv(K, QK), QS)``) quantizing ones."""
    r = -(-(tokens * top_k) // rt)
    return r + (r if r > 1 else 0) + -(-tokens // qr) * pieces


def route_torch(topk_ids, topk_weights, expert_offset, num_experts, bm):
    """Twin of the routing half of ``prologue_kernel``.

    Returns ``(lid, wts, sorted_slots, blk_expert, blk_rows)`` with slots inside each expert in
    token order (the kernel's order within an expert is unspecified; tests compare sets).
    """
    m, top_k = topk_ids.shape
    S = m * top_k
    gid = topk_ids.reshape(-1).to(torch.int64)
    lid = gid - expert_offset
    ok = (gid >= 0) & (lid >= 0) & (lid < num_experts)
    lid32 = torch.where(ok, lid, -1).to(torch.int32)
    wts = torch.where(ok, topk_weights.reshape(-1).to(torch.float32), 0.0)
    nb = num_blocks(S, num_experts, bm)
    counts = torch.bincount(lid[ok], minlength=num_experts)[:num_experts]
    nblk = (counts + bm - 1) // bm
    starts = torch.cumsum(nblk, 0) - nblk
    blk_expert = torch.full((nb,), -1, dtype=torch.int32)
    blk_rows = torch.zeros(nb, dtype=torch.int32)
    sorted_slots = torch.full((nb * bm,), -1, dtype=torch.int32)
    for e in range(num_experts):
        slots = ok.nonzero().squeeze(1)[lid[ok] == e]
        for i in range(int(nblk[e])):
            b = int(starts[e]) + i
            blk_expert[b] = e
            blk_rows[b] = min(bm, int(counts[e]) - i * bm)
        sorted_slots[int(starts[e]) * bm: int(starts[e]) * bm + len(slots)] = slots.to(torch.int32)
    return lid32, wts, sorted_slots, blk_expert, blk_rows


def routed_pairs(sorted_slots, blk_expert, blk_rows, bm):
    """The ``(expert, slot)`` pairs a block table places, as sorted ``expert * 2**32 + slot`` keys
    (int64): equal for two routings that place the same slots in each expert's blocks, in any
    order (what the tests compare, given identical block tables)."""
    nb = blk_expert.numel()
    rows = sorted_slots[: nb * bm].reshape(nb, bm).to(torch.int64)
    keep = torch.arange(bm, device=rows.device)[None, :] < blk_rows[:, None]
    keys = blk_expert.to(torch.int64)[:, None] * (1 << 32) + rows
    return keys[keep].sort().values


# ---------------------------------------------------------------------------------------- twins
def gemm1_torch(xq_rows, w13, w13_scale, e, layout, limit, g13=None):
    """Twin of ``gemm1_kernel`` for one expert: dq8 rows ``[T, K]`` fp32 to ``dq8(a)`` ``[T, N]``."""
    w = dequantize_mxfp4(w13[e], w13_scale[e])
    h = xq_rows @ w.T
    if g13 is not None:
        h = h * g13[e]
    n = w.shape[0] // 2
    up, gate = (h[:, :n], h[:, n:]) if layout == "w13" else (h[:, n:], h[:, :n])
    return quant_dequant_mxfp8(swiglu_torch(gate, up, limit))


def gemm2_torch(a_rows, w2, w2_scale, e, weights, g2=None):
    """Twin of ``gemm2_kernel`` for one expert: weighted ``dq8(a) @ W2[e]^T`` rows, fp32 ``[T, K]``."""
    y = a_rows @ dequantize_mxfp4(w2[e], w2_scale[e]).T
    if g2 is not None:
        y = y * g2[e]
    return y * weights[:, None]


# ------------------------------------------------------------------------------- blocked GEMMs
# Each program computes ``W[e] tile @ rows^T``: a ``[BN, BM]`` tile with the weight rows on the
# MMA's M side (64 a warpgroup on Hopper) and the expert block's rows (as few as 16) on its N side.
# The decoded weights are the MMA's first operand, which Hopper can take from registers; the
# activations (split layout, see ``split_col``) are the second. The codes are in the repacked
# layout (``layout.py``): a step loads 16 contiguous bytes a lane a 32-byte chunk and decodes them
# in the operand's own registers (``mxtl.decode_repacked``). Programs run block-major (a
# block's N tiles side by side), so that at large M a block's activation rows are read from HBM
# once, not once per N tile. (Measured on the H200 against the row-major form, ``rows @ W^T`` with
# tiles of rows: 2-6x faster; ``benchmarks/results/sweep_blocked.md``.) K steps (``BK``) are
# multiples of 64, BN multiples of 16.
@triton.jit
def _w13_groups(w_ptr, e, pid_n, N: tl.constexpr, NQ: tl.constexpr, BN: tl.constexpr, UP_FIRST: tl.constexpr):
    """The first repacked row groups of a W13 tile's up and gate rows (expert ``e``, columns
    ``pid_n * BN ..``), and which of the tile's 16-row groups exist."""
    w_e = w_ptr + e.to(tl.int64) * (2 * N * NQ * 32)
    UP0: tl.constexpr = 0 if UP_FIRST else N  # the first W13 row of up, and of gate
    GATE0: tl.constexpr = N if UP_FIRST else 0
    up_g = w_e + ((pid_n * BN + UP0) // 16) * (NQ * 512)
    gate_g = w_e + ((pid_n * BN + GATE0) // 16) * (NQ * 512)
    gvalid = (pid_n * BN + 16 * tl.arange(0, BN // 16)) < N
    return up_g, gate_g, gvalid


@triton.jit
def _mma_step(t, scale_bytes, ve, vo, acc, BN: tl.constexpr, BKH: tl.constexpr, DOT_DTYPE: tl.constexpr,
              PTX: tl.constexpr, FOLD: tl.constexpr):
    """One K step of a product (all four GEMM kernels): the loaded code tile ``t``
    (``mxtl.load_repacked``) decoded with its scale bytes and multiplied by the step's even and odd
    activations ``ve``/``vo``, added into ``acc``."""
    we, wo = decode_repacked(t, scale_bytes, BN, BKH, DOT_DTYPE, PTX, FOLD)
    acc = tl.dot(we, ve, acc)
    return tl.dot(wo, vo, acc)


@_jit(dns=("nblocks",))
def gemm1_kernel(
    xq_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, a_ptr,
    nblocks, limit,
    K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, UP_FIRST: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr = False, FOLD: tl.constexpr = False,
    PDL: tl.constexpr = False, HALF: tl.constexpr = False,
):
    """Program (expert block, tile of BN columns of up and of gate): ``dq8(silu(gate) * up)`` of the
    block's rows, ``[BM, BN]`` into ``a`` (split layout). ``PTX`` decodes with inline PTX (``FOLD``:
    in its one-fma form, for scale bytes up to 128). ``HALF``: a block of at most BM / 2 rows runs
    the tile of BM / 2: half the MMA work and activation loads for an expert's part-empty last block
    (the decode of the weights is the same either way); with ``HALF`` 2 a block of at most BM / 4 rows
    runs the tile of BM / 4 (``plan.tail_tiles``)."""
    pdl_start(PDL)
    pid_m, pid_n, e = _block_tile(blk_expert_ptr, N, BN)
    if e < 0:
        return
    if HALF:
        nrow = tl.load(blk_rows_ptr + pid_m)
        if HALF >= 2 and nrow <= BM // 4:
            _gemm1_block(pid_m, pid_n, e, xq_ptr, sorted_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, K,
                         N, TOPK, UP_FIRST, HAS_LIMIT, HAS_GS, BM, BM // 4, BN, BK, DOT_DTYPE, PTX, FOLD)
        elif nrow <= BM // 2:
            _gemm1_block(pid_m, pid_n, e, xq_ptr, sorted_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, K,
                         N, TOPK, UP_FIRST, HAS_LIMIT, HAS_GS, BM, BM // 2, BN, BK, DOT_DTYPE, PTX, FOLD)
        else:
            _gemm1_block(pid_m, pid_n, e, xq_ptr, sorted_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, K,
                         N, TOPK, UP_FIRST, HAS_LIMIT, HAS_GS, BM, BM, BN, BK, DOT_DTYPE, PTX, FOLD)
    else:
        _gemm1_block(pid_m, pid_n, e, xq_ptr, sorted_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, K, N,
                     TOPK, UP_FIRST, HAS_LIMIT, HAS_GS, BM, BM, BN, BK, DOT_DTYPE, PTX, FOLD)


@triton.jit
def _gemm1_block(pid_m, pid_n, e, xq_ptr, sorted_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit,
                 K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, UP_FIRST: tl.constexpr,
                 HAS_LIMIT: tl.constexpr, HAS_GS: tl.constexpr, BM: tl.constexpr, BMX: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr,
                 FOLD: tl.constexpr):
    """``gemm1_kernel``'s program on the first ``BMX`` rows of its ``BM``-row block."""
    rows, rvalid, tok, offs_n, nvalid, up_rows, gate_rows = _gemm1_tile(pid_m, pid_n, blk_rows_ptr, sorted_ptr, N,
                                                                        TOPK, UP_FIRST, BM, BN, BMX)
    KH: tl.constexpr = K // 2
    KS: tl.constexpr = K // 32
    BKH: tl.constexpr = BK // 2
    NQ: tl.constexpr = (KH + 31) // 32  # 32-byte chunks a row (the last one padded)
    up_g, gate_g, gvalid = _w13_groups(w_ptr, e, pid_n, N, NQ, BN, UP_FIRST)
    s_e = s_ptr + e.to(tl.int64) * (2 * N * KS)
    offs_h = tl.arange(0, BKH)
    offs_s = tl.arange(0, BK // 32)
    # byte h of the chunk meets elements k0 + 2h (split column k0 + 32 (h // 16) + h % 16) and k0 + 2h + 1 (+16)
    xT = xq_ptr + tok[None, :] * K + (32 * (offs_h // 16) + offs_h % 16)[:, None]  # [BKH, BMX]
    acc_u = tl.zeros((BN, BMX), dtype=tl.float32)
    acc_g = tl.zeros((BN, BMX), dtype=tl.float32)
    # The scale bytes (one a thread: too few for an asynchronous copy, so Triton's pipeline leaves
    # them out) are loaded one step ahead into registers, or each step would wait on HBM for them.
    up_s = s_e + up_rows[:, None] * KS + offs_s[None, :]
    gate_s = s_e + gate_rows[:, None] * KS + offs_s[None, :]
    sm = nvalid[:, None] & (offs_s < KS)[None, :]
    su = tl.load(up_s, mask=sm, other=0)
    sg = tl.load(gate_s, mask=sm, other=0)
    for k0 in range(0, K, BK):
        hmask = (k0 // 2 + offs_h) < KH
        xm = hmask[:, None] & rvalid[None, :]
        xe = tl.load(xT + k0, mask=xm, other=0.0).to(DOT_DTYPE)
        xo = tl.load(xT + k0 + 16, mask=xm, other=0.0).to(DOT_DTYPE)
        sm = nvalid[:, None] & ((k0 // 32 + BK // 32 + offs_s) < KS)[None, :]
        su_next = tl.load(up_s + (k0 + BK) // 32, mask=sm, other=0)
        sg_next = tl.load(gate_s + (k0 + BK) // 32, mask=sm, other=0)
        q0 = k0 // 64
        acc_u = _mma_step(load_repacked(up_g, gvalid, q0, NQ, BN, BKH), su, xe, xo, acc_u, BN, BKH, DOT_DTYPE, PTX, FOLD)
        acc_g = _mma_step(load_repacked(gate_g, gvalid, q0, NQ, BN, BKH), sg, xe, xo, acc_g, BN, BKH, DOT_DTYPE, PTX,
                          FOLD)
        su, sg = su_next, sg_next
    _store_act(acc_u, acc_g, gs_ptr, e, limit, a_ptr, rows, rvalid, offs_n, nvalid, N, HAS_GS, HAS_LIMIT)


@_jit(dns=("nblocks",))
def gemm2_kernel(
    a_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr,
    nblocks,
    K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, HAS_GS: tl.constexpr, ATOMIC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PTX: tl.constexpr = False, FOLD: tl.constexpr = False, PDL: tl.constexpr = False, HALF: tl.constexpr = False,
):
    """Program (expert block, tile of BN outputs): ``wts * dq8(a) @ W2[e]^T`` for the block's rows, a
    ``[BN outputs, BM rows]`` tile reduced over N in BK steps, added into the fp32 ``[M, K]``
    accumulator (ATOMIC) or stored in the slots' rows of ``[M * TOPK, K]`` (deterministic).
    ``HALF``: a block of at most BM / 2 rows runs the tile of BM / 2, and with ``HALF`` 2 one of at most
    BM / 4 rows the tile of BM / 4."""
    pdl_start(PDL)
    pid_m, pid_n, e = _block_tile(blk_expert_ptr, K, BN)
    if e < 0:
        return
    if HALF:
        nrow = tl.load(blk_rows_ptr + pid_m)
        if HALF >= 2 and nrow <= BM // 4:
            _gemm2_block(pid_m, pid_n, e, a_ptr, sorted_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr, K,
                         N, TOPK, HAS_GS, ATOMIC, BM, BM // 4, BN, BK, DOT_DTYPE, PTX, FOLD)
        elif nrow <= BM // 2:
            _gemm2_block(pid_m, pid_n, e, a_ptr, sorted_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr, K,
                         N, TOPK, HAS_GS, ATOMIC, BM, BM // 2, BN, BK, DOT_DTYPE, PTX, FOLD)
        else:
            _gemm2_block(pid_m, pid_n, e, a_ptr, sorted_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr, K,
                         N, TOPK, HAS_GS, ATOMIC, BM, BM, BN, BK, DOT_DTYPE, PTX, FOLD)
    else:
        _gemm2_block(pid_m, pid_n, e, a_ptr, sorted_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr, K, N,
                     TOPK, HAS_GS, ATOMIC, BM, BM, BN, BK, DOT_DTYPE, PTX, FOLD)


@triton.jit
def _gemm2_block(pid_m, pid_n, e, a_ptr, sorted_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr,
                 K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, HAS_GS: tl.constexpr, ATOMIC: tl.constexpr,
                 BM: tl.constexpr, BMX: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 PTX: tl.constexpr, FOLD: tl.constexpr):
    """``gemm2_kernel``'s program on the first ``BMX`` rows of its ``BM``-row block."""
    rows, rvalid, slot = _block_slots(pid_m, blk_rows_ptr, sorted_ptr, BM, BMX)
    offs_o = pid_n * BN + tl.arange(0, BN)
    ovalid = offs_o < K
    NH: tl.constexpr = N // 2
    NS: tl.constexpr = N // 32
    BKH: tl.constexpr = BK // 2
    NQ: tl.constexpr = (NH + 31) // 32
    w_g = w_ptr + e.to(tl.int64) * (K * NQ * 32) + (pid_n * BN // 16) * (NQ * 512)
    gvalid = (pid_n * BN + 16 * tl.arange(0, BN // 16)) < K
    s_e = s_ptr + e.to(tl.int64) * (K * NS)
    offs_h = tl.arange(0, BKH)
    offs_s = tl.arange(0, BK // 32)
    aT = a_ptr + rows[None, :] * N + (32 * (offs_h // 16) + offs_h % 16)[:, None]
    acc = tl.zeros((BN, BMX), dtype=tl.float32)
    row_s = s_e + offs_o[:, None] * NS + offs_s[None, :]
    s = tl.load(row_s, mask=ovalid[:, None] & (offs_s < NS)[None, :], other=0)  # one step ahead, as in gemm1
    for n0 in range(0, N, BK):
        hmask = (n0 // 2 + offs_h) < NH
        am = hmask[:, None] & rvalid[None, :]
        ae = tl.load(aT + n0, mask=am, other=0.0).to(DOT_DTYPE)
        ao = tl.load(aT + n0 + 16, mask=am, other=0.0).to(DOT_DTYPE)
        sm = ovalid[:, None] & ((n0 // 32 + BK // 32 + offs_s) < NS)[None, :]
        s_next = tl.load(row_s + (n0 + BK) // 32, mask=sm, other=0)
        acc = _mma_step(load_repacked(w_g, gvalid, n0 // 64, NQ, BN, BKH), s, ae, ao, acc, BN, BKH, DOT_DTYPE, PTX, FOLD)
        s = s_next
    _reduce_rows(acc, e, gs_ptr, wts_ptr, slot, rvalid, offs_o, ovalid, dst_ptr, K, TOPK, HAS_GS, ATOMIC)


# ---------------------------------------------------------------------------------- small-M GEMV
# The small-M path needs no routing pass: ``gemv1`` runs per (routed slot, N tile, K part) and
# reads the slot's expert id itself (foreign and padding slots exit at once), quantizes its token's
# row of x to MXFP8 on the fly (or, with ``Config.xq``, reads it quantized by ``xquant_kernel``, a
# launch before it: every program of a token then no longer quantizes the same row again, which
# pays from a few tokens on) and writes the slot's ``dq8(silu(gate) * up)`` row (split layout);
# ``gemv2`` runs per (token, K tile, part), adds the token's slots in slot order
# (deterministic, no atomics, no accumulator to zero) and writes the output in its dtype. A
# program's K steps wait on memory one after another, so the parts (``plan.gemv_config``) give
# each program few steps, and the last program of a tile to finish adds the parts. Both
# decode the codes as the blocked GEMMs do (``mxtl.decode_repacked``, the MMA operand's own
# registers) and multiply on the tensor cores with the one row as column 0 of a 16-column operand
# whose other columns are zero: the MMA's work is wasted 15 times over, but the decode (the
# ALU cost per weight, which bounds these kernels) is the blocked path's cheap one. (The CUDA-core
# form, fp32 products summed per 32-element block, took about 5.4 instructions a weight.)
@triton.jit
def _last_of_split(part_ptr, cnt_ptr, part, u, v, SPLIT: tl.constexpr):
    """The split-K handshake of the GEMV kernels. Each of a tile's ``SPLIT`` programs stores its
    fp32 ``[BN]`` sums ``u`` and ``v`` at its place in the tile's ``part`` rows, then counts
    itself in at ``cnt`` (acquire-release, GPU scope). The last to arrive returns ``(1, sum u,
    sum v)`` over the parts in part order (the same bits whichever program is last) and resets
    the count for the next call; the others return ``(0, ...)``."""
    BN: tl.constexpr = u.shape[0]
    r = tl.arange(0, BN)
    tl.store(part_ptr + part * (2 * BN) + r, u)
    tl.store(part_ptr + part * (2 * BN) + BN + r, v)
    tl.debug_barrier()  # every thread's stores before the count (the release covers them)
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    su = tl.zeros((BN,), dtype=tl.float32)
    sv = tl.zeros((BN,), dtype=tl.float32)
    last = done == SPLIT - 1
    if last:
        for p in tl.static_range(SPLIT):  # (L2 reads: these rows were written by other SMs)
            su += tl.load(part_ptr + p * (2 * BN) + r, cache_modifier=".cg")
            sv += tl.load(part_ptr + p * (2 * BN) + BN + r, cache_modifier=".cg")
        tl.store(cnt_ptr, 0)
    return last.to(tl.int32), su, sv


@triton.jit
def gemv_program(pid, rows, SPLIT: tl.constexpr):
    """A GEMV program's ``(row, part, N tile)`` from its id: rows (gemv1's slots, gemv2's tokens)
    fastest, then the ``SPLIT`` parts, then the tiles (the grid ``rows x SPLIT x tiles`` the Runner
    launches; the mma.sync GEMV's too, ``gluon_gemv``)."""
    rest = pid // rows
    return pid % rows, rest % SPLIT, rest // SPLIT


@triton.jit
def _column0(v, DOT_DTYPE: tl.constexpr):
    """``[BKH]`` values as the ``[BKH, 16]`` MMA operand whose column 0 they are (the rest zeros)."""
    col = tl.arange(0, 16)
    return tl.where(col[None, :] == 0, v[:, None], 0.0).to(DOT_DTYPE)


@_jit(dns=("S", "stride_xm", "stride_im", "stride_ik", "expert_offset", "x_fp16"), dnsa=("x_ptr", "ids_ptr"))
def gemv1_kernel(
    x_ptr, xq_ptr, ids_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, part_ptr, cnt_ptr,
    S, stride_xm, stride_im, stride_ik, expert_offset, x_fp16, limit,
    K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr, UP_FIRST: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_GS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PTX: tl.constexpr = False, FOLD: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    XQ: tl.constexpr = False, STAGES: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    """Program (slot b, N tile, K part): ``dq8(silu(gate) * up)`` of slot ``b``, ``[BN]``, into
    row ``b`` of ``a`` (split layout). ``x`` and the ids come as raw 16-/32-bit views (see
    ``prologue_kernel``); with ``XQ`` the token's row is read from ``xq`` instead, quantized
    (``xquant_kernel``). With ``SPLIT`` > 1 the K steps are split between that many programs
    (more programs in flight where slots x tiles are few): each writes its fp32 sums to ``part``,
    and the last to finish (``_last_of_split``) adds them in part order (the same bits whichever
    finishes last) and writes the activations."""
    pdl_start(PDL)
    _gemv1_program(tl.program_id(0), x_ptr, xq_ptr, ids_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, part_ptr, cnt_ptr, S,
                   stride_xm, stride_im, stride_ik, expert_offset, x_fp16, limit, K, N, TOPK, E, UP_FIRST, HAS_LIMIT,
                   HAS_GS, BN, BK, DOT_DTYPE, PTX, FOLD, SPLIT, XQ, STAGES)


@triton.jit
def _gemv1_program(
    pid, x_ptr, xq_ptr, ids_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, part_ptr, cnt_ptr,
    S, stride_xm, stride_im, stride_ik, expert_offset, x_fp16, limit,
    K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr, UP_FIRST: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_GS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PTX: tl.constexpr, FOLD: tl.constexpr, SPLIT: tl.constexpr, XQ: tl.constexpr,
    STAGES: tl.constexpr,
):
    """gemv1's program ``pid`` (``gemv1_kernel``; also a role of ``gemv_fused_kernel``)."""
    b, part, pid_n = gemv_program(pid, S, SPLIT)
    m = b // TOPK
    gid = tl.load(ids_ptr + m.to(tl.int64) * stride_im + (b - m * TOPK) * stride_ik).to(tl.int64)
    e, ours = local_expert(gid, expert_offset, E)
    if ours == 0:  # padding or another rank's expert: no work
        return
    offs_n = pid_n * BN + tl.arange(0, BN)
    nvalid = offs_n < N
    up_rows, gate_rows = _up_gate_rows(offs_n, N, UP_FIRST)
    KH: tl.constexpr = K // 2
    KS: tl.constexpr = K // 32
    BKH: tl.constexpr = BK // 2
    NB: tl.constexpr = BK // 32
    NQ: tl.constexpr = (KH + 31) // 32
    up_g, gate_g, gvalid = _w13_groups(w_ptr, e, pid_n, N, NQ, BN, UP_FIRST)
    s_e = s_ptr + e * (2 * N * KS)
    j = tl.arange(0, NB)  # 32-element block within the step
    r32 = tl.arange(0, 32)
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    # (XQ: the quantized row as column 0 of the MMA's second operand, loaded as such, as gemv2's
    # activations)
    col = tl.arange(0, 16)
    offs_h = tl.arange(0, BKH)
    xq_h = xq_ptr + m.to(tl.int64) * K + (32 * (offs_h // 16) + offs_h % 16)[:, None] + 0 * col[None, :]
    # this part's K range: whole steps
    PER: tl.constexpr = ((K + BK - 1) // BK + SPLIT - 1) // SPLIT * BK
    k_lo = part * PER
    k_hi = tl.minimum(k_lo + PER, K)
    up_s = s_e + up_rows[:, None] * KS + j[None, :]
    gate_s = s_e + gate_rows[:, None] * KS + j[None, :]
    sm = nvalid[:, None] & ((k_lo // 32 + j) < KS)[None, :]
    su = tl.load(up_s + k_lo // 32, mask=sm, other=0)  # scale bytes one step ahead, as in gemm1
    sg = tl.load(gate_s + k_lo // 32, mask=sm, other=0)
    acc_u = tl.zeros((BN, 16), dtype=tl.float32)
    acc_g = tl.zeros((BN, 16), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):  # (this loop's pipeline depth)
        # both code tiles' loads first: they then wait on memory together (the MMAs' fences keep
        # the compiler from hoisting a later load above them)
        tu = load_repacked(up_g, gvalid, k0 // 64, NQ, BN, BKH)
        tg = load_repacked(gate_g, gvalid, k0 // 64, NQ, BN, BKH)
        if XQ:
            xm = ((k0 // 2 + offs_h) < KH)[:, None] & (col == 0)[None, :]
            xe = tl.load(xq_h + k0, mask=xm, other=0.0).to(DOT_DTYPE)
            xo = tl.load(xq_h + k0 + 16, mask=xm, other=0.0).to(DOT_DTYPE)
        else:
            # this step of x, quantized to MXFP8 on the fly (a block's maximum within a warp),
            # then its even and odd elements as column 0 of the MMA's second operand
            raw = tl.load(x_row + k0 + 32 * j[:, None] + r32[None, :], mask=((k0 + 32 * j) < K)[:, None], other=0)
            xv = half_bits_to_f32(raw, x_fp16)
            pow2, inv = mxfp8_block_scale(tl.max(tl.abs(xv), axis=1))
            xv = mxfp8_apply(xv, pow2[:, None], inv[:, None])
            xe, xo = tl.split(tl.reshape(xv, (NB, 16, 2)))
            xe = _column0(tl.reshape(xe, (BKH,)), DOT_DTYPE)
            xo = _column0(tl.reshape(xo, (BKH,)), DOT_DTYPE)
        sm = nvalid[:, None] & ((k0 // 32 + NB + j) < k_hi // 32)[None, :]  # (this part's: k_hi <= K)
        su_next = tl.load(up_s + (k0 + BK) // 32, mask=sm, other=0)
        sg_next = tl.load(gate_s + (k0 + BK) // 32, mask=sm, other=0)
        acc_u = _mma_step(tu, su, xe, xo, acc_u, BN, BKH, DOT_DTYPE, PTX, FOLD)
        acc_g = _mma_step(tg, sg, xe, xo, acc_g, BN, BKH, DOT_DTYPE, PTX, FOLD)
        su, sg = su_next, sg_next
    up = tl.sum(acc_u, axis=1)  # (columns 1.. are zeros)
    gate = tl.sum(acc_g, axis=1)
    if SPLIT > 1:
        tile = b.to(tl.int64) * ((N + BN - 1) // BN) + pid_n
        last, up, gate = _last_of_split(part_ptr + tile * (SPLIT * 2 * BN), cnt_ptr + tile, part, up, gate, SPLIT)
        if last == 0:
            return
    act = _swiglu(up, gate, gs_ptr, e, limit, HAS_GS, HAS_LIMIT)
    act = tl.reshape(quant_dequant_mxfp8_tile(tl.reshape(act, (1, BN)), 1, BN), (BN,))
    tl.store(a_ptr + b.to(tl.int64) * N + split_col(offs_n), act, mask=nvalid)


@triton.jit
def _gemv2_slot(a_row, w_g, gvalid, s_e, offs_o, ovalid, n_lo, n_hi, N: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr, FOLD: tl.constexpr,
                STAGES: tl.constexpr):
    """``dq8(a) @ W2[e]^T`` over the N steps ``n_lo .. n_hi`` of one slot's activation row (split
    layout) for ``BN`` output rows (their repacked row groups from ``w_g``), fp32 ``[BN]``."""
    NH: tl.constexpr = N // 2
    NS: tl.constexpr = N // 32
    BKH: tl.constexpr = BK // 2
    NQ: tl.constexpr = (NH + 31) // 32
    offs_h = tl.arange(0, BKH)
    offs_s = tl.arange(0, BK // 32)
    col = tl.arange(0, 16)
    # the activations as column 0 of the MMA's second operand, loaded as such (a masked load that
    # feeds the MMA: Triton's pipeline copies it to shared memory with the codes)
    a_h = a_row + (32 * (offs_h // 16) + offs_h % 16)[:, None] + 0 * col[None, :]
    acc = tl.zeros((BN, 16), dtype=tl.float32)
    row_s = s_e + offs_o[:, None] * NS + offs_s[None, :]
    s = tl.load(row_s + n_lo // 32, mask=ovalid[:, None] & ((n_lo // 32 + offs_s) < NS)[None, :], other=0)
    for n0 in tl.range(n_lo, n_hi, BK, num_stages=STAGES):  # (this loop's pipeline depth)
        am = ((n0 // 2 + offs_h) < NH)[:, None] & (col == 0)[None, :]
        ae = tl.load(a_h + n0, mask=am, other=0.0).to(DOT_DTYPE)
        ao = tl.load(a_h + n0 + 16, mask=am, other=0.0).to(DOT_DTYPE)
        sm = ovalid[:, None] & ((n0 // 32 + BK // 32 + offs_s) < n_hi // 32)[None, :]  # (this run's: n_hi <= N)
        s_next = tl.load(row_s + (n0 + BK) // 32, mask=sm, other=0)
        acc = _mma_step(load_repacked(w_g, gvalid, n0 // 64, NQ, BN, BKH), s, ae, ao, acc, BN, BKH, DOT_DTYPE, PTX, FOLD)
        s = s_next
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv2_slot_term(a_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, gs_ptr, m64, jj, pid_n, stride_im, stride_ik, stride_wm,
                     stride_wk, expert_offset, w_kind, gvalid, offs_o, ovalid, n_lo, n_hi, total,
                     K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr, HAS_GS: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr,
                     FOLD: tl.constexpr, STAGES: tl.constexpr):
    """``total`` plus slot ``jj``'s term of token ``m64`` (``wts * dq8(a) @ W2[e]^T`` over its N
    steps ``n_lo .. n_hi``), or ``total`` when the slot is padding or another rank's."""
    NS: tl.constexpr = N // 32
    NQ: tl.constexpr = (N // 2 + 31) // 32
    gid = tl.load(ids_ptr + m64 * stride_im + jj * stride_ik).to(tl.int64)
    e, ours = local_expert(gid, expert_offset, E)
    if ours:
        w_g = w_ptr + e * (K * NQ * 32) + (pid_n * BN // 16) * (NQ * 512)
        y = _gemv2_slot(a_ptr + (m64 * TOPK + jj) * N, w_g, gvalid, s_ptr + e * (K * NS), offs_o, ovalid, n_lo,
                        n_hi, N, BN, BK, DOT_DTYPE, PTX, FOLD, STAGES)
        if HAS_GS:
            y = y * tl.load(gs_ptr + e)
        total += y * load_weight_raw(wts_ptr + m64 * stride_wm + jj * stride_wk, True, w_kind)
    return total


@_jit(dns=("M", "stride_im", "stride_ik", "stride_wm", "stride_wk", "expert_offset", "w_kind", "stride_om",
           "out_fp16"),
      dnsa=("ids_ptr", "wts_ptr", "out_ptr"))
def gemv2_kernel(
    a_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr,
    M, stride_im, stride_ik, stride_wm, stride_wk, expert_offset, w_kind, stride_om, out_fp16,
    K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr, HAS_GS: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr = False,
    FOLD: tl.constexpr = False, SPLIT: tl.constexpr = 1, STAGES: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    """Program (token m, K tile of BN outputs, part): ``sum_j wts[m, j] * dq8(a[m, j]) @ W2[e_j]^T``
    over the token's local slots in slot order, rounded once to the output dtype. With ``SPLIT``
    > 1 the work is split between that many programs: a multiple of ``TOPK`` gives each one slot
    and one of ``SPLIT / TOPK`` runs of its N steps, any other split runs of consecutive slots (some
    of them empty above ``TOPK``). The last program to finish adds the parts' sums in part order
    (``_last_of_split``)."""
    pdl_start(PDL)
    _gemv2_program(tl.program_id(0), a_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr, M,
                   stride_im, stride_ik, stride_wm, stride_wk, expert_offset, w_kind, stride_om, out_fp16, K, N, TOPK,
                   E, HAS_GS, BN, BK, DOT_DTYPE, PTX, FOLD, SPLIT, STAGES)


@triton.jit
def _gemv2_program(
    pid, a_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr,
    M, stride_im, stride_ik, stride_wm, stride_wk, expert_offset, w_kind, stride_om, out_fp16,
    K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr, HAS_GS: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr, FOLD: tl.constexpr,
    SPLIT: tl.constexpr, STAGES: tl.constexpr,
):
    """gemv2's program ``pid`` (``gemv2_kernel``; also a role of ``gemv_fused_kernel``)."""
    m, part, pid_n = gemv_program(pid, M, SPLIT)
    offs_o = pid_n * BN + tl.arange(0, BN)
    ovalid = offs_o < K
    KP: tl.constexpr = SPLIT // TOPK if SPLIT % TOPK == 0 else 1  # runs of N steps a slot
    RUNS: tl.constexpr = SPLIT // KP  # runs of slots
    PER: tl.constexpr = (TOPK + RUNS - 1) // RUNS  # slots a run
    NPER: tl.constexpr = ((N + BK - 1) // BK + KP - 1) // KP * BK  # N elements a run of steps
    run = part // KP
    n_lo = (part % KP) * NPER
    n_hi = tl.minimum(n_lo + NPER, N)
    gvalid = (pid_n * BN + 16 * tl.arange(0, BN // 16)) < K
    m64 = m.to(tl.int64)
    total = tl.zeros((BN,), dtype=tl.float32)
    if RUNS == TOPK:  # one slot a program (the split a multiple of TOPK): that slot's code alone
        total = _gemv2_slot_term(a_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, gs_ptr, m64, run, pid_n, stride_im, stride_ik,
                                 stride_wm, stride_wk, expert_offset, w_kind, gvalid, offs_o, ovalid, n_lo, n_hi,
                                 total, K, N, TOPK, E, HAS_GS, BN, BK, DOT_DTYPE, PTX, FOLD, STAGES)
    else:
        # (each slot's loop unpipelined: with several pipelined loops in a split's program, about one
        # H100 call in 300 gave other bits; none in 9000 unpipelined: ``results/split_race.md``)
        for jj in tl.static_range(TOPK):  # slot order: the sum is the same every run
            if jj // PER == run:
                total = _gemv2_slot_term(a_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, gs_ptr, m64, jj, pid_n, stride_im,
                                         stride_ik, stride_wm, stride_wk, expert_offset, w_kind, gvalid, offs_o,
                                         ovalid, n_lo, n_hi, total, K, N, TOPK, E, HAS_GS, BN, BK, DOT_DTYPE, PTX,
                                         FOLD, 1)
    if SPLIT > 1:
        tile = m64 * ((K + BN - 1) // BN) + pid_n
        last, total, _ = _last_of_split(part_ptr + tile * (SPLIT * 2 * BN), cnt_ptr + tile, part, total, total, SPLIT)
        if last == 0:
            return
    tl.store(out_ptr + m64 * stride_om + offs_o, f32_to_half_bits(total, out_fp16), mask=ovalid)


@_jit(dns=("M", "stride_xm", "stride_im", "stride_ik", "stride_wm", "stride_wk", "expert_offset", "x_fp16", "w_kind",
           "stride_om", "out_fp16"),
      dnsa=("x_ptr", "ids_ptr", "wts_ptr", "out_ptr"))
def gemv_fused_kernel(
    x_ptr, ids_ptr, wts_ptr, w13_ptr, s13_ptr, g13_ptr, w2_ptr, s2_ptr, g2_ptr, a_ptr, out_ptr,
    part1_ptr, cnt1_ptr, part2_ptr, cnt2_ptr, sync_ptr,
    M, stride_xm, stride_im, stride_ik, stride_wm, stride_wk, expert_offset, x_fp16, w_kind, stride_om, out_fp16,
    limit,
    K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr, UP_FIRST: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_GS: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr, SPLIT1: tl.constexpr,
    BN2: tl.constexpr, BK2: tl.constexpr, SPLIT2: tl.constexpr, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr,
    FOLD: tl.constexpr, ST1: tl.constexpr = 1, ST2: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    """gemv1 and gemv2 in one launch of ``G1 + G2`` programs (their two grids; x quantized on the
    fly), one launch's host time less than the two. A program takes a ticket (``sync[0]``): the
    first ``G1`` tickets are gemv1's programs, the rest gemv2's. A gemv1 program counts itself in
    at its token's ``sync[2 + m]`` when done (release); a gemv2 program waits until all of its
    token's gemv1 programs are in (acquire), then runs. Tickets, not program ids, give the roles:
    a gemv2 program can only hold a ticket once every gemv1 ticket is held by a running program,
    and those never wait, so every wait ends. The last gemv2 program to finish (``sync[1]``)
    zeroes the tickets and counts for the next call."""
    pdl_start(PDL)
    S = M * TOPK
    NT1: tl.constexpr = (N + BN1 - 1) // BN1
    NT2: tl.constexpr = (K + BN2 - 1) // BN2
    G1 = S * NT1 * SPLIT1
    G2 = M * NT2 * SPLIT2
    t = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    if t < G1:
        _gemv1_program(t, x_ptr, x_ptr, ids_ptr, w13_ptr, s13_ptr, g13_ptr, a_ptr, part1_ptr, cnt1_ptr, S,
                       stride_xm, stride_im, stride_ik, expert_offset, x_fp16, limit, K, N, TOPK, E, UP_FIRST,
                       HAS_LIMIT, HAS_GS, BN1, BK1, DOT_DTYPE, PTX, FOLD, SPLIT1, False, ST1)
        tl.debug_barrier()  # every thread's stores before the count (the release covers them)
        tl.atomic_add(sync_ptr + 2 + (t % S) // TOPK, 1, sem="release")
    else:
        u = t - G1
        m = u % M
        while tl.atomic_add(sync_ptr + 2 + m, 0, sem="acquire") < TOPK * NT1 * SPLIT1:
            pass
        _gemv2_program(u, a_ptr, ids_ptr, wts_ptr, w2_ptr, s2_ptr, g2_ptr, out_ptr, part2_ptr, cnt2_ptr, M,
                       stride_im, stride_ik, stride_wm, stride_wk, expert_offset, w_kind, stride_om, out_fp16, K, N,
                       TOPK, E, HAS_GS, BN2, BK2, DOT_DTYPE, PTX, FOLD, SPLIT2, ST2)
        tl.debug_barrier()
        done = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel")
        if done == G2 - 1:  # every program has finished: zero the tickets and counts for the next call
            tl.store(sync_ptr, 0)
            tl.store(sync_ptr + 1, 0)
            for i in range(0, M):
                tl.store(sync_ptr + 2 + i, 0)


def gemv_fused_programs(tokens: int, top_k: int, n_tiles1: int, n_tiles2: int) -> int:
    """Grid of ``gemv_fused_kernel``: gemv1's ``tokens * top_k * n_tiles1`` programs (tiles times
    split) plus gemv2's ``tokens * n_tiles2``."""
    return tokens * top_k * n_tiles1 + tokens * n_tiles2


def gemv1_torch(xq_row, w13, w13_scale, e, layout, limit, g13=None):
    """Twin of ``gemv1_kernel`` for one slot: a dq8 row ``[K]`` to ``dq8(a)`` ``[N]``."""
    return gemm1_torch(xq_row[None, :], w13, w13_scale, e, layout, limit, g13)[0]


def gemv2_torch(a_rows, w2, w2_scale, lids, weights, g2=None):
    """Twin of ``gemv2_kernel`` for one token before the final rounding: ``a_rows`` ``[TOPK, N]``,
    the slots' local ids (negative: not ours) and router weights; fp32 ``[K]``, in slot order."""
    total = torch.zeros(w2.shape[1], dtype=torch.float32)
    for j, e in enumerate(lids):
        if e >= 0:
            total += gemm2_torch(a_rows[j][None, :], w2, w2_scale, int(e),
                                 torch.as_tensor([float(weights[j])], dtype=torch.float32), g2)[0]
    return total


# ------------------------------------------------------------------------------------- finalize
@_jit(dns=("M", "stride_om", "out_fp16"), dnsa=("out_ptr",))
def finalize_kernel(
    src_ptr, lid_ptr, out_ptr, M, stride_om, out_fp16,
    K: tl.constexpr, TOPK: tl.constexpr, ATOMIC: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_start(PDL)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BR + tl.arange(0, BR)
    rm = rows < M
    ks = pid_k * BK + tl.arange(0, BK)
    msk = rm[:, None] & (ks < K)[None, :]
    r64 = rows.to(tl.int64)
    if ATOMIC:
        acc = tl.load(src_ptr + r64[:, None] * K + ks[None, :], mask=msk, other=0.0)
    else:
        acc = tl.zeros((BR, BK), dtype=tl.float32)
        for j in tl.static_range(TOPK):
            ok = tl.load(lid_ptr + r64 * TOPK + j, mask=rm, other=-1) >= 0
            acc += tl.load(src_ptr + (r64 * TOPK + j)[:, None] * K + ks[None, :], mask=msk & ok[:, None], other=0.0)
    tl.store(out_ptr + r64[:, None] * stride_om + ks[None, :], f32_to_half_bits(acc, out_fp16), mask=msk)


def finalize_torch(per_slot, lid, m, top_k, dtype):
    """Twin of ``finalize_kernel`` (slot mode): sum a token's local slots in slot order, round once."""
    y = per_slot.reshape(m, top_k, -1) * (lid.reshape(m, top_k, 1) >= 0)
    acc = torch.zeros(m, y.shape[-1], dtype=torch.float32)
    for j in range(top_k):
        acc += y[:, j]
    return acc.to(dtype)
