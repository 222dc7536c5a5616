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

Run on a GPU (Gluon does not run in Triton's interpreter):

    python benchmarks/experiments/gemv_mma.py qwen3-30b-a3b,gpt-oss-120b,dsv4.1-tp4 1,2 64/4/4,64/2/4,32/4/2

A form is ``BN/KP chunks/warps``. Each line: the form's gemv1 alone (x's quantizing launch included)
and the whole op with it (xquant, this gemv1, the plan's gemv2), us per layer from CUDA-graph replay
over 4 layers, against the plan's; its activations against the plan's gemv1's.
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

    @gluon.jit
    def gemv1_mma_kernel(
        xq_ptr, ids_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, part_ptr, cnt_ptr, S, stride_im, expert_offset, limit,
        K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr, E: gl.constexpr, UP_FIRST: gl.constexpr,
        HAS_LIMIT: gl.constexpr, HAS_GS: gl.constexpr, BN: gl.constexpr, Q: gl.constexpr, SPLIT: gl.constexpr,
        FOLD: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr, code_l: gl.constexpr,
        p7: gl.constexpr, s5_l: gl.constexpr, q_l: gl.constexpr,
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
            # the codes: group gg < GH of the tile's up rows, the rest its gate rows
            g_c = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, code_l))))
            l_c = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, code_l))))
            b_c = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, code_l))))
            row0_c = pid_n * BN + 16 * (g_c % GH)  # the group's first column
            grow_c = gl.where(g_c < GH, UP0, GATE0) + row0_c  # its first W13 row
            w_e = w_ptr + e * (2 * N * NQ * 32)
            c_src = (w_e + (grow_c // 16).to(gl.int64)[:, None, None, None] * (NQ * 512)
                     + (l_c * 16)[None, None, :, None] + b_c[None, None, None, :])
            c_ok = (row0_c < N)[:, None, None, None] & (l_c >= 0)[None, None, :, None] & (b_c >= 0)[None, None, None, :]
            # the scale bytes of each lane's rows (r0 = lane // 4 and r0 + 8), a chunk's two blocks
            g_s = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, s5_l)))))
            l_s = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, s5_l)))))
            s_s = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, s5_l)))))
            h_s = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, s5_l)))))
            row0_s = pid_n * BN + 16 * (g_s % GH)
            grow_s = gl.where(g_s < GH, UP0, GATE0) + row0_s
            srow = (grow_s[:, None, None, None, None] + (l_s // 4)[None, None, :, None, None]
                    + 8 * h_s[None, None, None, None, :])
            s_src = s_ptr + e * (2 * N * KS) + srow * KS + s_s[None, None, None, :, None]
            s_ok = (row0_s < N)[:, None, None, None, None] & (s_s >= 0)[None, None, None, :, None] & (
                h_s >= 0)[None, None, None, None, :] & (l_s >= 0)[None, None, :, None, None]
            # x's B fragments: byte column i of a chunk meets elements 32 (i // 16) + i % 16 (even) and
            # 16 further (odd) in the split order; column 0 only
            i_b = gl.arange(0, 32, layout=gl.SliceLayout(1, b_l))
            n_b = gl.arange(0, 8, layout=gl.SliceLayout(0, b_l))
            x_src = xq_ptr + m * K + (32 * (i_b // 16) + i_b % 16)[:, None] + 0 * n_b[None, :]
            # every load first: codes, scale bytes and x of all Q chunks
            codes = ()
            scales = ()
            xs = ()
            for q in gl.static_range(Q):
                qq = q0 + q
                codes = codes + (gl.load(c_src + qq * 512, mask=c_ok & (qq < NQ)),)
                scales = scales + (gl.load(s_src + 2 * qq, mask=s_ok & (qq < NQ)),)
                xm = (qq < NQ) & (i_b >= 0)[:, None] & (n_b == 0)[None, :]  # (K is a multiple of 64)
                xs = xs + ((gl.load(x_src + 64 * qq, mask=xm, other=0.0).to(gl.bfloat16),
                            gl.load(x_src + 64 * qq + 16, mask=xm, other=0.0).to(gl.bfloat16)),)
            acc = gl.zeros([R, 8], gl.float32, layout=mma)
            asm: gl.constexpr = _DECODE_PTX_FOLD if FOLD else _DECODE_PTX
            for q in gl.static_range(Q):
                t = _to_operand(codes[q], G, 1, R, 32)
                sb = scales[q].to(gl.int32)
                if FOLD:
                    sb = sb + 126
                sc = (sb << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)  # mxtl._ptx_scales
                sc = gl.expand_dims(gl.expand_dims(sc, 4), 6)
                sc = gl.broadcast(sc, gl.full([G, 1, 32, 2, 2, 2, 2], 0, gl.bfloat16, layout=p7))[0]
                sc = _to_operand(gl.reshape(sc, (G, 1, 32, 16)), G, 1, R, 32)
                sc = gl.convert_layout(sc, t.type.layout, assert_trivial=True)
                we, wo = gl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r,r", [t, sc],
                                                   dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
                we = gl.convert_layout(we, a_l, assert_trivial=True)
                wo = gl.convert_layout(wo, a_l, assert_trivial=True)
                acc = mma_v2(we, xs[q][0], acc)
                acc = mma_v2(wo, xs[q][1], acc)
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
        FOLD=st.plans.fold, num_warps=nw, **mma_layouts(nw))


def main():
    import torch

    from b12x_ops.backends.triton import _launch_all
    from b12x_ops.backends.triton import plan as P
    from bench_moe import GEOMETRIES, experiment_handles, graph_time, layer_batches

    names = sys.argv[1].split(",")
    sizes = [int(m) for m in sys.argv[2].split(",")]
    forms = [tuple(map(int, f.split("/"))) for f in sys.argv[3].split(",")] if len(sys.argv) > 3 else [(64, 4, 4)]
    for name in names:
        geo = GEOMETRIES[name]
        hs = experiment_handles(name, max(sizes), layers=4)
        for M in sizes:
            xs, idss, wss, outs = layer_batches(M, geo["E"], geo["K"], geo["top_k"], len(hs))
            ids32 = [i.to(torch.int32).contiguous() for i in idss]
            st = hs[0]._state
            gp = st.plans
            base = P.default_config(M, gp.geometry)
            cx = dataclasses.replace(base, xq=True)
            gp.reserve(M, base)
            gp.reserve(M, cx)
            a = gp.arena.buffers
            S = M * geo["top_k"]
            N = geo["N"]
            part = torch.empty(S * 4 * N * (geo["K"] // 64), device=xs[0].device, dtype=torch.float32)
            cnt = torch.zeros(S * N, device=xs[0].device, dtype=torch.int32)
            print(f"{name} M={M}: plan gemv1 {(base.bn1, base.bk1, base.warps1, base.stages1, base.split1)} "
                  f"xq {base.xq}", flush=True)

            def plan_calls(stage):
                return [lambda h=h, x=x, i=i, w=w, o=o: _launch_all(h._state, base, x, i, w, o, stages=stage)
                        for h, x, i, w, o in zip(hs, xs, idss, wss, outs)]

            t1 = graph_time(plan_calls(("prologue", "gemm1")), reps=20) * 1e6
            tw = graph_time(plan_calls(("prologue", "gemm1", "gemm2", "finalize")), reps=20) * 1e6
            print(f"  plan: gemv1 {t1:.1f} us, whole op {tw:.1f} us/layer", flush=True)
            _launch_all(st, base, xs[0], idss[0], wss[0], outs[0], stages=("prologue", "gemm1"))
            want = a["act"][: S * N].clone()
            for bn, q, nw in forms:
                label = f"mma.sync gemv1 bn {bn} chunks {q} warps {nw}"
                try:
                    def mine(h, x, i, w, o, i32, whole):
                        _launch_all(h._state, cx, x, i, w, o, stages=("prologue",))
                        launch(h._state, a["xq"], i32, a["act"], part, cnt, S, bn, q, nw)
                        if whole:
                            _launch_all(h._state, base, x, i, w, o, stages=("gemm2",))

                    a["act"].zero_()
                    mine(hs[0], xs[0], idss[0], wss[0], outs[0], ids32[0], False)
                    ck = launch(st, a["xq"], ids32[0], a["act"], part, cnt, S, bn, q, nw)  # (the same again)
                    torch.cuda.synchronize()
                    got = a["act"][: S * N].float()
                    w_ = want.float()
                    rel = ((got - w_).norm() / w_.norm().clamp_min(1e-30)).item()
                    ndiff = (got != w_).sum().item()
                    c1 = [lambda h=h, x=x, i=i, w=w, o=o, i32=i32: mine(h, x, i, w, o, i32, False)
                          for h, x, i, w, o, i32 in zip(hs, xs, idss, wss, outs, ids32)]
                    cw = [lambda h=h, x=x, i=i, w=w, o=o, i32=i32: mine(h, x, i, w, o, i32, True)
                          for h, x, i, w, o, i32 in zip(hs, xs, idss, wss, outs, ids32)]
                    m1 = graph_time(c1, reps=20) * 1e6
                    mw = graph_time(cw, reps=20) * 1e6
                    print(f"  {label}: gemv1 {m1:.1f} us, whole op {mw:.1f} us/layer; activations: "
                          f"rel L2 {rel:.1e} from the plan's, {ndiff} of {S * N} differ; {getattr(ck, 'n_regs', '?')} regs, "
                          f"{getattr(ck, 'n_spills', '?')} spills", flush=True)
                except Exception as ex:  # (a form that fails to compile or launch: say so, go on)
                    print(f"  {label}: FAILED {type(ex).__name__}: {str(ex)[-600:]}", flush=True)
        hs = None  # (let the geometry's handles go before the next)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
