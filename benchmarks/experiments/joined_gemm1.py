"""GEMM1 as one dot over a tile of 2 BN W13 rows (BN of up, then BN of gate), an experiment.

The package's ``gemm1_kernel`` runs two dots (up and gate, BN rows each) against one activation
tile. Here both halves are one ``[2 BN, BM]`` accumulator, split at the end, so that a program can
take 256 W13 rows in 16 warps at 128 registers a thread (the activation tile, read from L2 once per
program, then serves twice the rows: Nsight Compute shows the large-M GEMMs at 74-82 % of L2
throughput). Exact against the reference under the interpreter; on the H200 it was no faster
(``benchmarks/NOTES.md``). Timed by ``large_m.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from b12x_ops.backends.triton.kernels import _block_tile, _gemm1_tile, _jit, _mma_step, _store_act, _w13_groups


@triton.jit
def load_joined(up_g, DG: tl.constexpr, gvalid, q0, NQ: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr):
    """``mxtl.load_repacked`` for the up groups from ``up_g`` then the gate groups ``DG`` bytes on."""
    G: tl.constexpr = BN // 16
    Q: tl.constexpr = BKH // 32
    g = tl.arange(0, 2 * G)
    q = tl.arange(0, Q)
    lb = tl.arange(0, 512)
    gv = tl.where(g < G, g, g - G)
    base = tl.where(g < G, 0, DG) + gv * (NQ * 512)
    off = (base[:, None, None] + (q0 + q[None, :, None]) * 512) + lb[None, None, :]
    valid = tl.reshape(tl.permute(tl.join(gvalid, gvalid), (1, 0)), (2 * G,))
    m = valid[:, None, None] & ((q0 + q) < NQ)[None, :, None]
    return tl.reshape(tl.load(up_g + off, mask=m, other=0), (2 * G, Q, 32, 16))


@_jit(dns=("nblocks",))
def gemm1_joined_kernel(
    xq_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, a_ptr,
    nblocks, limit,
    K: tl.constexpr, N: tl.constexpr, TOPK: tl.constexpr, UP_FIRST: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr = False, FOLD: tl.constexpr = False,
):
    """``gemm1_kernel`` with one dot over up and gate rows (same arguments)."""
    pid_m, pid_n, e = _block_tile(blk_expert_ptr, N, BN)
    if e < 0:
        return
    rows, rvalid, tok, offs_n, nvalid, _, _ = _gemm1_tile(pid_m, pid_n, blk_rows_ptr, sorted_ptr, N, TOPK, UP_FIRST, BM,
                                                          BN, BM)  # (all BM rows: no half tile)
    KH: tl.constexpr = K // 2
    KS: tl.constexpr = K // 32
    BKH: tl.constexpr = BK // 2
    NQ: tl.constexpr = (KH + 31) // 32
    up_g, gate_g, gvalid = _w13_groups(w_ptr, e, pid_n, N, NQ, BN, UP_FIRST)
    s_e = s_ptr + e.to(tl.int64) * (2 * N * KS)
    offs_h = tl.arange(0, BKH)
    offs_s = tl.arange(0, BK // 32)
    xT = xq_ptr + tok[None, :] * K + (32 * (offs_h // 16) + offs_h % 16)[:, None]
    acc = tl.zeros((2 * BN, BM), dtype=tl.float32)
    r2 = tl.arange(0, 2 * BN)
    w_rows = tl.where(r2 < BN, (UP_FIRST == 0) * N + pid_n * BN + r2, UP_FIRST * N + pid_n * BN + r2 - BN)
    r_ok = (pid_n * BN + r2 % BN) < N
    row_s = s_e + w_rows[:, None] * KS + offs_s[None, :]
    s = tl.load(row_s, mask=r_ok[:, None] & (offs_s < KS)[None, :], other=0)
    for k0 in range(0, K, BK):
        hmask = (k0 // 2 + offs_h) < KH
        xm = hmask[:, None] & rvalid[None, :]
        xe = tl.load(xT + k0, mask=xm, other=0.0).to(DOT_DTYPE)
        xo = tl.load(xT + k0 + 16, mask=xm, other=0.0).to(DOT_DTYPE)
        sm = r_ok[:, None] & ((k0 // 32 + BK // 32 + offs_s) < KS)[None, :]
        s_next = tl.load(row_s + (k0 + BK) // 32, mask=sm, other=0)
        t = load_joined(up_g, (N // 16) * NQ * 512 * (2 * UP_FIRST - 1), gvalid, k0 // 64, NQ, BN, BKH)
        acc = _mma_step(t, s, xe, xo, acc, 2 * BN, BKH, DOT_DTYPE, PTX, FOLD)
        s = s_next
    acc_u, acc_g = tl.split(tl.permute(tl.reshape(acc, (2, BN, BM)), (1, 2, 0)))
    _store_act(acc_u, acc_g, gs_ptr, e, limit, a_ptr, rows, rvalid, offs_n, nvalid, N, HAS_GS, HAS_LIMIT)
