"""Experiment: gemv1 on ``mma.sync`` with every operand in registers (Gluon), against the GEMV path's gemv1.

The package's gemv1 (``kernels.gemv1_kernel``) multiplies on Hopper's wgmma, whose second operand
(x as column 0 of a 16-column tile) must sit in shared memory: each K step stores it there, converts
the scale bytes to the operand's layout and sums the accumulator's one real column across warps, a
dozen CTA barriers a step, about 1300 SASS instructions a thread a step at gpt-oss M = 1 (of them 488
the decode's). ``mma.sync`` (sm_80's ``m16n8k16``, which sm_90 runs too) takes both operands from
registers, so here:

* a program (slot, tile of ``BN`` columns of up and of gate, part of ``KP`` elements of K) issues all
  of its code loads first (16 contiguous bytes a lane a 64-element chunk, ``mxtl.load_repacked``'s
  layout) and then, chunk by chunk, decodes them in place (the decode's asm writes the ``m16n8k16``
  A fragments: ``convert_layout(..., assert_trivial=True)`` proves it) and issues two MMAs;
* x comes quantized (``kernels.xquant_kernel``, split order) and is loaded straight into the B
  fragments, column 0 only (the other 7 columns are zeros), so a row's sum is the sum of its
  accumulator row (adding zeros: exact) and no barrier runs before the epilogue;
* the epilogue adds the parts in part order (the split-K handshake of ``kernels._last_of_split``),
  then SwiGLU and the MXFP8 quant-dequant of the activations, as the package's gemv1.

``gemv2_mma_kernel`` is gemv2 in the same form: a program (token, tile of ``BN`` outputs, slot j, run of
``Q`` chunks of its activation row) adds ``wts * dq8(a) @ W2[e_j]^T`` of its run; the last of a tile's
programs adds them in (slot, run) order and writes the output row.

Run on a GPU (Gluon does not run in Triton's interpreter):

    python benchmarks/experiments/gemv_mma.py qwen3-30b-a3b,gpt-oss-120b,dsv4.1-tp4 1,2,4 \
        64/2/4,64/1/4,32/4/4 64/2/4,64/4/4

Forms are ``BN/Q/warps``, gemv1's then gemv2's. ``GEMV_MMA_PDL=1`` launches both as programmatic
dependent launches whose weight loads come before the wait for the previous kernel (``_gdc``). Each line: a form's kernel alone (gemv1 with x's
quantizing launch) and the whole op with it (gemv1 forms with the plan's gemv2; gemv2 forms with the
fastest gemv1 form), us per layer from CUDA-graph replay over 4 layers, against the plan's; its
activations (output) against the plan's gemv1's (whole op's).
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from b12x_ops.backends.triton import gluon_kernels as GK  # noqa: E402

if GK.HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from b12x_ops.backends.triton.gluon_kernels import _barrier, _to_operand
    from b12x_ops.backends.triton.kernels import _swiglu, local_expert, split_col
    from b12x_ops.backends.triton.mxtl import _DECODE_PTX, _DECODE_PTX_FOLD, mxfp8_apply, mxfp8_block_scale

    def mma_layouts(nw: int) -> dict:
        """The layouts of a program of ``nw`` warps: ``mma`` the ``m16n8k16`` accumulator (a warp a
        16-row group, groups ``w, w + nw, ...``), ``a_l``/``b_l`` its operands, ``code_l`` the loaded
        ``[G, 1, 32, 16]`` chunk of codes, ``p7``/``s5_l`` as ``GK.layouts``, ``q_l`` the epilogue's
        ``[BN / 32, 32]`` (a row a 32-element block)."""
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[nw, 1], instr_shape=[16, 8])
        p7 = gl.BlockedLayout([1, 1, 1, 2, 2, 2, 2], [1, 1, 32, 1, 1, 1, 1], [nw, 1, 1, 1, 1, 1, 1],
                              [6, 5, 4, 3, 2, 1, 0])
        return dict(mma=mma, a_l=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
                    b_l=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
                    code_l=gl.BlockedLayout([1, 1, 1, 16], [1, 1, 32, 1], [nw, 1, 1, 1], [3, 2, 1, 0]), p7=p7,
                    s5_l=gl.SliceLayout(4, gl.SliceLayout(6, p7)),
                    q_l=gl.BlockedLayout([1, 1], [1, 32], [nw, 1], [1, 0]))

    def mma_layouts2(nw: int) -> dict:
        """gemv2's: ``mma_layouts`` less ``q_l``, with ``o_l`` the epilogue's ``[BN]``."""
        lay = mma_layouts(nw)
        del lay["q_l"]
        return dict(lay, o_l=gl.BlockedLayout([1], [32], [nw], [0]))

    @gluon.jit
    def _chunk_mma(codes, scales, xe, xo, acc, R: gl.constexpr, FOLD: gl.constexpr, a_l: gl.constexpr,
                   p7: gl.constexpr):
        """One 64-element chunk: its ``[G, 1, 32, 16]`` codes decoded with their scale bytes into the
        A fragments in place, then the two MMAs (even elements, odd elements) into ``acc``."""
        G: gl.constexpr = R // 16
        t = _to_operand(codes, G, 1, R, 32)
        sb = scales.to(gl.int32)
        if FOLD:
            sb = sb + 126
        sc = (sb << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)  # mxtl._ptx_scales
        sc = gl.expand_dims(gl.expand_dims(sc, 4), 6)
        sc = gl.broadcast(sc, gl.full([G, 1, 32, 2, 2, 2, 2], 0, gl.bfloat16, layout=p7))[0]
        sc = _to_operand(gl.reshape(sc, (G, 1, 32, 16)), G, 1, R, 32)
        sc = gl.convert_layout(sc, t.type.layout, assert_trivial=True)
        asm: gl.constexpr = _DECODE_PTX_FOLD if FOLD else _DECODE_PTX
        we, wo = gl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r,r", [t, sc], dtype=(gl.bfloat16, gl.bfloat16),
                                           is_pure=True, pack=4)
        acc = mma_v2(gl.convert_layout(we, a_l, assert_trivial=True), xe, acc)
        return mma_v2(gl.convert_layout(wo, a_l, assert_trivial=True), xo, acc)

    @gluon.jit
    def _row_operands(w_e, s_e, grow_c, gok_c, grow_s, gok_s, RED: gl.constexpr, code_l: gl.constexpr,
                      s5_l: gl.constexpr):
        """Pointers and masks of a program's chunk 0: ``[G, 1, 32, 16]`` codes of the 16-row groups whose
        first rows are ``grow_c`` (``gok_c``: which exist), ``[G, 1, 32, 2, 2]`` scale bytes of each
        lane's rows (r0 = lane // 4 and r0 + 8; the chunk's two blocks). ``RED``: the reduction length."""
        NQ: gl.constexpr = (RED // 2 + 31) // 32
        KS: gl.constexpr = RED // 32
        l_c = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, code_l))))
        b_c = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, code_l))))
        c_src = (w_e + (grow_c // 16).to(gl.int64)[:, None, None, None] * (NQ * 512)
                 + (l_c * 16)[None, None, :, None] + b_c[None, None, None, :])
        c_ok = gok_c[:, None, None, None] & (l_c >= 0)[None, None, :, None] & (b_c >= 0)[None, None, None, :]
        l_s = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, s5_l)))))
        s_s = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, s5_l)))))
        h_s = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, s5_l)))))
        srow = (grow_s[:, None, None, None, None] + (l_s // 4)[None, None, :, None, None]
                + 8 * h_s[None, None, None, None, :])
        s_src = s_e + srow * KS + s_s[None, None, None, :, None]
        s_ok = gok_s[:, None, None, None, None] & (s_s >= 0)[None, None, None, :, None] & (
            h_s >= 0)[None, None, None, None, :] & (l_s >= 0)[None, None, :, None, None]
        return c_src, c_ok, s_src, s_ok

    @gluon.jit
    def _load_codes(c_src, c_ok, s_src, s_ok, q0, RED: gl.constexpr, Q: gl.constexpr):
        """The codes and scale bytes of chunks ``q0 .. q0 + Q - 1``, every load issued before any is used
        (chunks past the reduction load nothing: zeros)."""
        NQ: gl.constexpr = (RED // 2 + 31) // 32
        codes = ()
        scales = ()
        for q in gl.static_range(Q):
            qq = q0 + q
            codes = codes + (gl.load(c_src + qq * 512, mask=c_ok & (qq < NQ)),)
            scales = scales + (gl.load(s_src + 2 * qq, mask=s_ok & (qq < NQ)),)
        return codes, scales

    @gluon.jit
    def _load_x(x_row, q0, RED: gl.constexpr, Q: gl.constexpr, b_l: gl.constexpr):
        """The activations' B fragments of chunks ``q0 ..``: column 0 (the other columns zeros); byte
        column i of a chunk meets elements 32 (i // 16) + i % 16 and 16 further of the split-order row
        ``x_row``. ``(even, odd)`` a chunk."""
        NQ: gl.constexpr = (RED // 2 + 31) // 32
        i_b = gl.arange(0, 32, layout=gl.SliceLayout(1, b_l))
        n_b = gl.arange(0, 8, layout=gl.SliceLayout(0, b_l))
        x_src = x_row + (32 * (i_b // 16) + i_b % 16)[:, None] + 0 * n_b[None, :]
        xs = ()
        for q in gl.static_range(Q):
            qq = q0 + q
            xm = (qq < NQ) & (i_b >= 0)[:, None] & (n_b == 0)[None, :]  # (RED is a multiple of 64)
            xs = xs + ((gl.load(x_src + 64 * qq, mask=xm, other=0.0).to(gl.bfloat16),
                        gl.load(x_src + 64 * qq + 16, mask=xm, other=0.0).to(gl.bfloat16)),)
        return xs

    @gluon.jit
    def _gdc(PDL: gl.constexpr):
        """With ``PDL``: wait for the previous kernel (its writes visible), then let the next one launch
        (``kernels.pdl_start``'s pair, placed here after the loads that read no earlier kernel's output)."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def gemv1_mma_kernel(
        xq_ptr, ids_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, part_ptr, cnt_ptr, S, stride_im, expert_offset, limit,
        K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr, E: gl.constexpr, UP_FIRST: gl.constexpr,
        HAS_LIMIT: gl.constexpr, HAS_GS: gl.constexpr, BN: gl.constexpr, Q: gl.constexpr, SPLIT: gl.constexpr,
        FOLD: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr, code_l: gl.constexpr,
        p7: gl.constexpr, s5_l: gl.constexpr, q_l: gl.constexpr, PDL: gl.constexpr = False,
    ):
        """Program (slot b, tile of BN columns, part of Q 64-element chunks): the tile's activations
        (``kernels.gemv1_kernel``'s, x from ``xq``) into row b of ``a``."""
        pid = gl.program_id(0)
        b = pid % S
        rest = pid // S
        part = rest % SPLIT
        pid_n = rest // SPLIT
        m = b // TOPK
        gid = gl.load(ids_ptr + m * stride_im + (b - m * TOPK)).to(gl.int64)
        e, ours = local_expert(gid, expert_offset, E)
        if ours:
            R: gl.constexpr = 2 * BN
            G: gl.constexpr = R // 16
            GH: gl.constexpr = BN // 16
            KH: gl.constexpr = K // 2
            KS: gl.constexpr = K // 32
            NQ: gl.constexpr = (KH + 31) // 32
            UP0: gl.constexpr = 0 if UP_FIRST else N
            GATE0: gl.constexpr = N if UP_FIRST else 0
            q0 = part * Q  # this part's first chunk
            # the tile's 16-row groups: gg < GH of its up rows, the rest of its gate rows
            g_c = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, code_l))))
            g_s = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, s5_l)))))
            row0_c = pid_n * BN + 16 * (g_c % GH)
            row0_s = pid_n * BN + 16 * (g_s % GH)
            c_src, c_ok, s_src, s_ok = _row_operands(
                w_ptr + e * (2 * N * NQ * 32), s_ptr + e * (2 * N * KS), gl.where(g_c < GH, UP0, GATE0) + row0_c,
                row0_c < N, gl.where(g_s < GH, UP0, GATE0) + row0_s, row0_s < N, K, code_l, s5_l)
            codes, scales = _load_codes(c_src, c_ok, s_src, s_ok, q0, K, Q)  # (the weights: no kernel writes them)
            _gdc(PDL)
            xs = _load_x(xq_ptr + m * K, q0, K, Q, b_l)
            acc = gl.zeros([R, 8], gl.float32, layout=mma)
            for q in gl.static_range(Q):
                acc = _chunk_mma(codes[q], scales[q], xs[q][0], xs[q][1], acc, R, FOLD, a_l, p7)
            v = gl.sum(acc, axis=1)  # (columns 1.. are zeros)
            # the parts' handshake: every part stores its sums, the last adds them in part order
            NT: gl.constexpr = (N + BN - 1) // BN
            tile = b.to(gl.int64) * NT + pid_n
            prow = part_ptr + tile * (SPLIT * R)
            r_v = gl.arange(0, R, layout=gl.SliceLayout(1, mma))
            gl.store(prow + part * R + r_v, v)
            _barrier()
            last = True
            if SPLIT > 1:
                done = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
                last = done == SPLIT - 1
            if last:
                BQ: gl.constexpr = BN // 32
                rq = gl.arange(0, BQ, layout=gl.SliceLayout(1, q_l))
                cq = gl.arange(0, 32, layout=gl.SliceLayout(0, q_l))
                o = 32 * rq[:, None] + cq[None, :]
                up = gl.zeros([BQ, 32], gl.float32, layout=q_l)
                gate = gl.zeros([BQ, 32], gl.float32, layout=q_l)
                for p in gl.static_range(SPLIT):
                    up += gl.load(prow + p * R + o, cache_modifier=".cg")
                    gate += gl.load(prow + p * R + BN + o, cache_modifier=".cg")
                if SPLIT > 1:
                    gl.store(cnt_ptr + tile, 0)
                act = _swiglu(up, gate, gs_ptr, e, limit, HAS_GS, HAS_LIMIT)
                pow2, inv = mxfp8_block_scale(gl.max(gl.abs(act), axis=1))
                act = mxfp8_apply(act, pow2[:, None], inv[:, None])
                offs_n = pid_n * BN + o
                gl.store(a_ptr + b.to(gl.int64) * N + split_col(offs_n), act.to(a_ptr.dtype.element_ty),
                         mask=offs_n < N)


    @gluon.jit
    def gemv2_mma_kernel(
        a_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr, M, expert_offset,
        K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr, E: gl.constexpr, HAS_GS: gl.constexpr,
        BN: gl.constexpr, Q: gl.constexpr, KP: gl.constexpr, FOLD: gl.constexpr, mma: gl.constexpr,
        a_l: gl.constexpr, b_l: gl.constexpr, code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr,
        o_l: gl.constexpr, PDL: gl.constexpr = False,
    ):
        """Program (token m, tile of BN outputs, slot j and part of its Q-chunk runs): ``wts * dq8(a) @
        W2[e_j]^T`` of the run (zeros for a slot not ours); the last of the tile's ``TOPK * KP``
        programs adds them in part order (slot, run) and writes the output row (``kernels.gemv2_kernel``'s
        sum)."""
        SPLIT: gl.constexpr = TOPK * KP
        R: gl.constexpr = BN
        G: gl.constexpr = BN // 16
        NQ: gl.constexpr = (N // 2 + 31) // 32
        NS: gl.constexpr = N // 32
        NT: gl.constexpr = (K + BN - 1) // BN
        pid = gl.program_id(0)
        m = pid % M
        rest = pid // M
        part = rest % SPLIT
        pid_n = rest // SPLIT
        j = part // KP
        gid = gl.load(ids_ptr + m * TOPK + j).to(gl.int64)
        e, ours = local_expert(gid, expert_offset, E)
        tile = m.to(gl.int64) * NT + pid_n
        prow = part_ptr + tile * (SPLIT * R)
        r_v = gl.arange(0, R, layout=gl.SliceLayout(1, mma))
        v = gl.zeros([R], gl.float32, layout=gl.SliceLayout(1, mma))
        # the weights' loads (nothing for a slot not ours) before the previous kernel's end: no kernel writes them
        g_c = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, code_l))))
        g_s = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, s5_l)))))
        row0_c = pid_n * BN + 16 * g_c
        row0_s = pid_n * BN + 16 * g_s
        c_src, c_ok, s_src, s_ok = _row_operands(w_ptr + e * (K * NQ * 32), s_ptr + e * (K * NS), row0_c,
                                                 (row0_c < K) & ours, row0_s, (row0_s < K) & ours, N, code_l, s5_l)
        codes, scales = _load_codes(c_src, c_ok, s_src, s_ok, (part % KP) * Q, N, Q)
        _gdc(PDL)
        if ours:
            xs = _load_x(a_ptr + (m * TOPK + j).to(gl.int64) * N, (part % KP) * Q, N, Q, b_l)
            acc = gl.zeros([R, 8], gl.float32, layout=mma)
            for q in gl.static_range(Q):
                acc = _chunk_mma(codes[q], scales[q], xs[q][0], xs[q][1], acc, R, FOLD, a_l, p7)
            y = gl.sum(acc, axis=1)  # (columns 1.. are zeros)
            if HAS_GS:
                y = y * gl.load(gs_ptr + e)
            v = y * gl.load(wts_ptr + m * TOPK + j)
        gl.store(prow + part * R + r_v, v)
        _barrier()
        done = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT - 1:
            o = gl.arange(0, BN, layout=o_l)
            total = gl.zeros([BN], gl.float32, layout=o_l)
            for p in gl.static_range(SPLIT):
                total += gl.load(prow + p * R + o, cache_modifier=".cg")
            gl.store(cnt_ptr + tile, 0)
            offs_o = pid_n * BN + o
            gl.store(out_ptr + m.to(gl.int64) * K + offs_o, total.to(out_ptr.dtype.element_ty), mask=offs_o < K)


def _pdl() -> dict:
    """``GEMV_MMA_PDL=1``: both kernels launched as programmatic dependent launches, their weights'
    loads before the wait (``_gdc``)."""
    on = os.environ.get("GEMV_MMA_PDL", "0") == "1"
    return dict(PDL=on, launch_pdl=True) if on else {}


def launch(st, xq, ids32, act, part, cnt, S, bn, q, nw):
    """One launch of ``gemv1_mma_kernel`` on handle state ``st`` for ``S`` slots."""
    g = st.plans.geometry
    K, N = g.hidden_size, g.intermediate_size
    split = -(-(K // 64) // q)
    grid = (S * split * -(-N // bn),)
    return gemv1_mma_kernel[grid](
        xq, ids32, st.w13, st.w13_scale, st.g13 if st.g13 is not None else xq, act, part, cnt, S, g.top_k,
        st.expert_offset, st.limit if st.limit is not None else 0.0,
        K=K, N=N, TOPK=g.top_k, E=g.num_experts, UP_FIRST=g.w13_layout == "w13",
        HAS_LIMIT=g.swiglu_limit is not None, HAS_GS=g.has_global_scales, BN=bn, Q=q, SPLIT=split,
        FOLD=st.plans.fold, num_warps=nw, **_pdl(), **mma_layouts(nw))


def launch2(st, act, ids32, wts, out, part, cnt, M, bn, q, nw):
    """One launch of ``gemv2_mma_kernel`` on handle state ``st`` for ``M`` tokens."""
    g = st.plans.geometry
    K, N = g.hidden_size, g.intermediate_size
    kp = -(-(N // 64) // q)
    grid = (M * g.top_k * kp * -(-K // bn),)
    return gemv2_mma_kernel[grid](
        act, ids32, wts, st.w2, st.w2_scale, st.g2 if st.g2 is not None else wts, out, part, cnt, M,
        st.expert_offset, K=K, N=N, TOPK=g.top_k, E=g.num_experts, HAS_GS=g.has_global_scales, BN=bn, Q=q, KP=kp,
        FOLD=st.plans.fold, num_warps=nw, **_pdl(), **mma_layouts2(nw))


def main():
    import torch

    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P
    from bench_moe import GEOMETRIES, experiment_handles, graph_time, layer_batches

    names = sys.argv[1].split(",")
    sizes = [int(m) for m in sys.argv[2].split(",")]
    forms1 = [tuple(map(int, f.split("/"))) for f in sys.argv[3].split(",")] if len(sys.argv) > 3 else [(64, 2, 4)]
    forms2 = [tuple(map(int, f.split("/"))) for f in sys.argv[4].split(",")] if len(sys.argv) > 4 else [(64, 2, 4)]
    for name in names:
        geo = GEOMETRIES[name]
        hs = experiment_handles(name, max(sizes), layers=4)
        for M in sizes:
            _point(name, geo, hs, M, forms1, forms2, torch, _launch_all, P, graph_time, layer_batches)
        hs = None  # (let the geometry's handles go before the next)
        torch.cuda.empty_cache()


def _point(name, geo, hs, M, forms1, forms2, torch, _launch_all, P, graph_time, layer_batches):
    """One token count: the plan's GEMV path, then each gemv1 form, then each gemv2 form (with the
    fastest gemv1 form, or the plan's gemv1 where none was faster)."""
    xs, idss, wss, outs = layer_batches(M, geo["E"], geo["K"], geo["top_k"], len(hs))
    ids32 = [i.to(torch.int32).contiguous() for i in idss]
    wts = [w.float().contiguous() for w in wss]
    layers = list(zip(hs, xs, idss, wss, outs, ids32, wts))
    st = hs[0]._state
    gp = st.plans
    base = P.default_config(M, gp.geometry)
    cx = dataclasses.replace(base, xq=True)
    gp.reserve(M, base)
    gp.reserve(M, cx)
    a = gp.arena.buffers
    S = M * geo["top_k"]
    K, N = geo["K"], geo["N"]
    dev = xs[0].device
    part = torch.empty(max(S * 4 * N * (K // 64), M * K * geo["top_k"] * (N // 64) * 2), device=dev,
                       dtype=torch.float32)
    cnt = torch.zeros(max(S * N, M * K), device=dev, dtype=torch.int32)
    print(f"{name} M={M}: plan gemv1 {(base.bn1, base.bk1, base.warps1, base.stages1, base.split1)} xq {base.xq}, "
          f"gemv2 {(base.bn2, base.bk2, base.warps2, base.stages2, base.split2)}", flush=True)

    def plan(stages):
        return [lambda h=h, x=x, i=i, w=w, o=o: _launch_all(h._state, base, x, i, w, o, stages=stages)
                for h, x, i, w, o, _, _ in layers]

    t1 = graph_time(plan(("prologue", "gemm1")), reps=20) * 1e6
    t2 = graph_time(plan(("gemm2",)), reps=20) * 1e6
    tw = graph_time(plan(("prologue", "gemm1", "gemm2", "finalize")), reps=20) * 1e6
    print(f"  plan: gemv1 {t1:.1f} us, gemv2 {t2:.1f} us, whole op {tw:.1f} us/layer", flush=True)
    _launch_all(st, base, xs[0], idss[0], wss[0], outs[0])
    want_act = a["act"][: S * N].clone()
    want_out = outs[0].clone()

    def gemv1(f):
        if f is None:
            return lambda h, x, i, w, o, i32, wt: _launch_all(h._state, base, x, i, w, o, stages=("prologue", "gemm1"))

        def run(h, x, i, w, o, i32, wt):
            _launch_all(h._state, cx, x, i, w, o, stages=("prologue",))
            launch(h._state, a["xq"], i32, a["act"], part, cnt, S, *f)
        return run

    def gemv2(f):
        if f is None:
            return lambda h, x, i, w, o, i32, wt: _launch_all(h._state, base, x, i, w, o, stages=("gemm2",))
        return lambda h, x, i, w, o, i32, wt: launch2(h._state, a["act"], i32, wt, o, part, cnt, M, *f)

    def timed(*parts):
        return graph_time([lambda L=L: [p(*L) for p in parts] for L in layers], reps=20) * 1e6

    def diff(got, want):
        got, want = got.float(), want.float()
        rel = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
        return f"rel L2 {rel:.1e} from the plan's, {(got != want).sum().item()} of {got.numel()} differ"

    best, best_us = None, tw
    for f in forms1:
        label = f"mma.sync gemv1 bn {f[0]} chunks {f[1]} warps {f[2]}"
        try:
            a["act"].zero_()
            gemv1(f)(*layers[0])
            ck = launch(st, a["xq"], ids32[0], a["act"], part, cnt, S, *f)  # (the same again: its kernel)
            torch.cuda.synchronize()
            d = diff(a["act"][: S * N], want_act)
            m1 = timed(gemv1(f))
            mw = timed(gemv1(f), gemv2(None))
            if mw < best_us:
                best, best_us = f, mw
            print(f"  {label}: gemv1 {m1:.1f} us, whole op {mw:.1f} us/layer; activations: {d}; "
                  f"{getattr(ck, 'n_regs', '?')} regs, {getattr(ck, 'n_spills', '?')} spills", flush=True)
        except Exception as ex:  # (a form that fails to compile or launch: say so, go on)
            print(f"  {label}: FAILED {type(ex).__name__}: {str(ex)[-600:]}", flush=True)
    for f in forms2:
        label = f"mma.sync gemv2 bn {f[0]} chunks {f[1]} warps {f[2]}"
        try:
            gemv1(None)(*layers[0])
            outs[0].zero_()
            ck = gemv2(f)(*layers[0])
            torch.cuda.synchronize()
            d = diff(outs[0], want_out)
            m2 = timed(gemv2(f))
            outs[0].zero_()
            mw = timed(gemv1(best), gemv2(f))
            torch.cuda.synchronize()
            dr = diff(outs[0], want_out)  # (layer 0's output as the graph replays left it)
            print(f"  {label}: gemv2 {m2:.1f} us, whole op {mw:.1f} us/layer (gemv1: "
                  f"{'the plan' if best is None else best}); output: {d}; after the replays: {dr}; "
                  f"{getattr(ck, 'n_regs', '?')} regs, {getattr(ck, 'n_spills', '?')} spills", flush=True)
        except Exception as ex:
            print(f"  {label}: FAILED {type(ex).__name__}: {str(ex)[-600:]}", flush=True)


if __name__ == "__main__":
    main()
