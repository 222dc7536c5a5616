"""The prologue as it was before the multi-program routing (one routing program), kept for
``probe_routing.py``'s comparison only: not part of the package. Launch: grid ``1 + cdiv(M, QR)``,
``cursor`` a scratch of ``E_PAD`` int32 (no state between calls)."""

from __future__ import annotations

import triton
import triton.language as tl

from b12x_ops.backends.triton.kernels import (_jit, half_bits_to_f32, load_weight_raw, local_expert,
                                              quant_dequant_mxfp8_tile, split_col)

OLD = dict(CH=1024, BCH=32, QR=4, QK=512, warps=8)


@_jit(dns=("M", "stride_im", "stride_ik", "stride_wm", "stride_wk", "stride_xm", "expert_offset", "nblocks", "w_kind",
           "x_fp16"),
      dnsa=("ids_ptr", "wts_in_ptr", "x_ptr"))
def old_prologue_kernel(
    ids_ptr, wts_in_ptr, x_ptr, xq_ptr, acc_ptr,
    lid_ptr, wts_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, cursor_ptr,
    M, stride_im, stride_ik, stride_wm, stride_wk, stride_xm, expert_offset, nblocks, w_kind, x_fp16,
    K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr,
    CH: tl.constexpr, BCH: tl.constexpr, QR: tl.constexpr, QK: tl.constexpr, ZERO_ACC: tl.constexpr,
):
    """Program 0 routes; the others quantize rows of x to MXFP8, stored dequantized (exact in the
    GEMMs' bf16) in the split column order into ``xq``."""
    pid = tl.program_id(0)
    if pid == 0:
        # ---- routing, one program: histogram, expert blocks, scatter
        S = M * TOPK
        eidx = tl.arange(0, E_PAD)
        counts = tl.zeros((E_PAD,), dtype=tl.int32)
        for c0 in range(0, S, CH):
            s = c0 + tl.arange(0, CH)
            sm = s < S
            m = s // TOPK
            j = s - m * TOPK
            gid = tl.load(ids_ptr + m.to(tl.int64) * stride_im + j * stride_ik, mask=sm, other=-1).to(tl.int64)
            lid, ours = local_expert(gid, expert_offset, E)
            ok = sm & ours
            w = load_weight_raw(wts_in_ptr + m.to(tl.int64) * stride_wm + j * stride_wk, sm, w_kind)
            lid32 = tl.where(ok, lid, -1).to(tl.int32)
            tl.store(lid_ptr + s, lid32, mask=sm)
            tl.store(wts_ptr + s, tl.where(ok, w, 0.0), mask=sm)
            counts += tl.histogram(tl.where(ok, lid32, E), E_PAD)
        nblk = tl.where(eidx < E, (counts + BM - 1) // BM, 0)
        blk_end = tl.cumsum(nblk, 0)
        blk_start = blk_end - nblk
        tl.store(cursor_ptr + eidx, blk_start * BM)
        for b0 in range(0, nblocks, BCH):
            b = b0 + tl.arange(0, BCH)
            ex = tl.sum((blk_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
            used = ex < E
            onehot = eidx[None, :] == ex[:, None]
            st = tl.sum(tl.where(onehot, blk_start[None, :], 0), axis=1)
            cnt = tl.sum(tl.where(onehot, counts[None, :], 0), axis=1)
            rows = tl.minimum(cnt - (b - st) * BM, BM)
            tl.store(blk_expert_ptr + b, tl.where(used, ex, -1), mask=b < nblocks)
            tl.store(blk_rows_ptr + b, tl.where(used, rows, 0), mask=b < nblocks)
        tl.debug_barrier()
        for c0 in range(0, S, CH):
            s = c0 + tl.arange(0, CH)
            sm = s < S
            lid = tl.load(lid_ptr + s, mask=sm, other=-1)
            ok = lid >= 0
            pos = tl.atomic_add(cursor_ptr + tl.where(ok, lid, 0), 1, mask=ok, sem="relaxed")
            tl.store(sorted_ptr + pos, s, mask=ok)
    else:
        # ---- MXFP8 quant-dequant of QR rows of x (and zeroing of their accumulator rows)
        rows = (pid - 1) * QR + tl.arange(0, QR)
        rm = rows < M
        for k0 in range(0, K, QK):
            ks = k0 + tl.arange(0, QK)
            msk = rm[:, None] & (ks < K)[None, :]
            raw = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :], mask=msk, other=0)
            q = quant_dequant_mxfp8_tile(half_bits_to_f32(raw, x_fp16), QR, QK)
            tl.store(xq_ptr + rows.to(tl.int64)[:, None] * K + split_col(ks)[None, :], q, mask=msk)
            if ZERO_ACC:
                tl.store(acc_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], tl.zeros((QR, QK), tl.float32), mask=msk)


