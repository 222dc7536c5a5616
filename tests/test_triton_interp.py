"""The Triton backend's index and quantization logic on the CPU, under the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before any Triton kernel is first launched, so the checks run in
a child pytest process of this same file (``test_interpreter_suite``); in that child the env var
is set and the ``interp_*`` tests run. Shapes are tiny: the interpreter executes kernels in numpy.
Under the interpreter the kernels take fp32 operands (its bf16 ``tl.dot`` is wrong) and its
fp32-to-bf16 conversion truncates instead of rounding, so whole-layer results are compared at the
contract's tolerance while the stages are compared bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from _samples import CASES, case, make_batch, make_layer, rel_l2

INNER = os.environ.get("TRITON_INTERPRET") == "1"
# Tests that only make sense inside the child; the parent deselects them (tests/conftest.py), so
# they are neither run nor reported as skipped there: test_interpreter_suite runs them.
inner = pytest.mark.interp_child


@pytest.mark.skipif(INNER, reason="this is the parent")
def test_interpreter_suite():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    # (the timeout only guards against a hang: on a slow 2-core machine the child has taken 15 minutes)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10",
                           __file__], cwd=root, env=env, capture_output=True, text=True, timeout=2700)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


if INNER:
    import triton
    import triton.language as tl

    import b12x_ops
    from b12x_ops.backends.reference import ep_remap as ep_remap_torch
    from b12x_ops.backends.triton import kernels as K_
    from b12x_ops.backends.triton import plan as P
    from b12x_ops.backends.triton.layout import repack_codes
    from b12x_ops.backends.triton.mxtl import (decode_repacked, decode_repacked_ops, load_repacked,
                                               quant_dequant_mxfp8_tile)
    from b12x_ops.backends.triton.remap import ep_remap
    from b12x_ops.mx import dequantize_mxfp4, quant_dequant_mxfp8

    @triton.jit
    def _qdq_kernel(x_ptr, y_ptr, C: tl.constexpr, R: tl.constexpr):
        r = tl.arange(0, R)
        c = tl.arange(0, C)
        v = tl.load(x_ptr + r[:, None] * C + c[None, :])
        tl.store(y_ptr + r[:, None] * C + c[None, :], quant_dequant_mxfp8_tile(v, R, C))

    @triton.jit
    def _decode_kernel(w_ptr, s_ptr, e_ptr, o_ptr, R: tl.constexpr, BKH: tl.constexpr, NQ: tl.constexpr,
                       SCALED: tl.constexpr):
        """A repacked ``[R, 2 * BKH]``-element tile decoded: unscaled by ``decode_repacked_ops``, or
        by ``decode_repacked`` (Triton ops) with its scale bytes ``[R, BKH // 16]``."""
        r = tl.arange(0, R)
        h = tl.arange(0, BKH)
        if SCALED:
            s = tl.arange(0, BKH // 16)
            sc = tl.load(s_ptr + r[:, None] * (BKH // 16) + s[None, :])
            ev, od = decode_repacked(load_repacked(w_ptr, tl.arange(0, R // 16) < R // 16, 0, NQ, R, BKH), sc, R, BKH,
                                     tl.float32, False, False)
        else:
            G: tl.constexpr = R // 16
            Q: tl.constexpr = BKH // 32
            t = tl.load(w_ptr + tl.arange(0, G * Q * 512))
            ev, od = decode_repacked_ops(tl.reshape(t, (G, Q, 32, 16)), R, BKH)
        tl.store(e_ptr + r[:, None] * BKH + h[None, :], ev)
        tl.store(o_ptr + r[:, None] * BKH + h[None, :], od)


def _awkward_values(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-30, 30, (rows, 1), generator=g).float())
    v[0, :32] = 0.0  # an all-zero block
    v[1, :32] = torch.linspace(-1, 1, 32) * 448 * 2.0**-8  # payload subnormals
    v[2, 5] = 3e38  # huge
    v[3, 32:64] = 1e-40  # fp32 subnormals
    # exact E4M3 midpoints: ties must go to even
    v[4, :32] = torch.tensor([448.0] + [1.0 + (2 * i + 1) / 16 for i in range(8)] * 3 + [0.0] * 7)
    return v


@inner
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_interp_mxfp8_quant_is_bit_exact(seed):
    v = _awkward_values(8, 64, seed)
    y = torch.empty_like(v)
    _qdq_kernel[(1,)](v, y, C=64, R=8)
    want = quant_dequant_mxfp8(v)
    assert torch.equal(y.view(torch.int32), want.view(torch.int32))


@inner
def test_interp_repacked_decode_every_code_exactly():
    # every code in every nibble of every byte position of a word (16 rows = one group, 2 chunks),
    # through the Triton-ops decode: the E2M1 values times 2^-14, -0 included, in operand order
    g = torch.Generator().manual_seed(5)
    codes = ((torch.arange(16)[:, None] * 17 + torch.arange(64)[None, :] * 5) % 256).to(torch.uint8)
    codes[:, 32:] = torch.randint(0, 256, (16, 32), generator=g, dtype=torch.uint8)
    ev = torch.empty(16, 64)
    od = torch.empty(16, 64)
    _decode_kernel[(1,)](repack_codes(codes[None]), codes, ev, od, R=16, BKH=64, NQ=2, SCALED=False)
    want = dequantize_mxfp4(codes, torch.full((16, 4), 127, dtype=torch.uint8))
    assert torch.equal(ev * 16384.0, want[:, 0::2]) and torch.equal(od * 16384.0, want[:, 1::2])
    assert torch.equal(torch.signbit(ev), torch.signbit(want[:, 0::2]))
    assert torch.equal(torch.signbit(od), torch.signbit(want[:, 1::2]))
    assert len(set((codes & 15).tolist()[0] + (codes >> 4).tolist()[0])) == 16  # (every code seen)


@inner
@pytest.mark.parametrize("lo, hi", [(2, 252), (1, 254)])
def test_interp_repacked_decode_with_scales_is_exact(lo, hi):
    # the Triton-ops form of the kernels' load-and-decode (what the interpreter and checkpoints
    # with scale bytes outside [2, 252] run): every code pair, scales over the whole range
    g = torch.Generator().manual_seed(3)
    codes = torch.cat([torch.arange(256, dtype=torch.uint8).reshape(4, 64)] * 8)  # [32, 64]
    scales = torch.randint(lo, hi + 1, (32, 4), generator=g, dtype=torch.uint8)
    scales[0, 0], scales[1, 1] = lo, hi
    ev = torch.empty(32, 64)
    od = torch.empty(32, 64)
    _decode_kernel[(1,)](repack_codes(codes[None]), scales, ev, od, R=32, BKH=64, NQ=2, SCALED=True)
    want = dequantize_mxfp4(codes, scales)
    assert torch.equal(ev, want[:, 0::2]) and torch.equal(od, want[:, 1::2])


def _check_routing(layer, x, ids, w, bm, rt=None, nbt=None, qk=None, qs=None, atomic=None):
    """The prologue of a blocked config of ``bm`` rows alone (its tiles replaced where given:
    small ones reach the many-program path and the loops at interpreter sizes; ``qk``/``qs`` the
    quantizing programs' column pieces), against ``route_torch``; the kernel's counters are left
    at zero."""
    from b12x_ops.backends.triton import _launch
    h = layer.prepare(backend="triton", max_tokens=max(64, x.shape[0]))
    st = h._state
    gp = st.plans
    cfg = gp.configs[gp.plan_for(x.shape[0])[0]]
    cfg = type(cfg)(**dict(cfg.as_dict(), bm=bm, gemv=False, **({} if atomic is None else {"atomic": atomic})))
    gp.reserve(max(64, x.shape[0]), cfg)
    rn = gp.runner(cfg, x.shape[0])
    ln = rn.prologue
    tiles = {k: v for k, v in dict(RT=rt, NBT=nbt, QK=qk, QS=qs).items() if v is not None}
    if tiles:
        ln = P.Launch(ln.fn, dict(ln.constexprs, **tiles), ln.num_warps, ln.num_stages)
        kt = -(-layer.K // ln.constexprs["QK"])
        rn = rn._replace(prologue=ln, route_slots=ln.constexprs["RT"],
                         prologue_pieces=-(-kt // ln.constexprs["QS"]))
    _launch(st, rn, x, ids, w, torch.empty_like(x), ("prologue",))
    a = gp.arena.buffers
    lid, wts, srt, be, br = K_.route_torch(ids, w, layer.offset, layer.E, bm)
    S = ids.numel()
    nb = K_.num_blocks(S, layer.E, bm)
    assert torch.equal(a["lid"][:S], lid)
    assert torch.equal(a["wts"][:S], wts)
    assert torch.equal(a["blk_expert"][:nb], be)
    assert torch.equal(a["blk_rows"][:nb], br)
    # each expert's slots as a set (their order, and so their blocks within the expert, is free)
    assert torch.equal(K_.routed_pairs(a["sorted"], be, br, bm), K_.routed_pairs(srt, be, br, bm))
    assert not a["route_cnt"].any()  # zero for the next call
    return a


@inner
@pytest.mark.parametrize("name", ["compact", "padding", "foreign_ep", "odd_sizes", "int64_bf16w", "strided"])
@pytest.mark.parametrize("bm", [16, 32])
def test_interp_routing_matches_twin(name, bm):
    layer, (x, ids, w) = case(name)
    a = _check_routing(layer, x, ids, w, bm)
    # quantized activations, bit exact (in the split column order the blocked GEMMs read)
    xq = a["xq"][: x.numel()].view(x.shape)
    assert torch.equal(K_.unsplit(xq), quant_dequant_mxfp8(x.float()))


@inner
@pytest.mark.parametrize("qs", [1, 2, 3])
@pytest.mark.parametrize("atomic", [False, True])
def test_interp_prologue_quantizes_x_in_pieces(qs, atomic):
    # K = 96 in QK = 32 column pieces: one a program, two (the last program of a row group with one)
    # or whole rows; 7 tokens in row groups of QR = 4 (a part group). With atomics each quantizing
    # program also zeroes its piece of the fp32 accumulator.
    from b12x_ops.backends.triton import plan as P_

    assert P_.quant_pieces(1, 96) == 1 and P_.quant_pieces(None, 96) == -(-96 // P_.PROLOGUE["QK"])
    assert P_.quant_pieces(P_.PROLOGUE["QR"] * P_.PROLOGUE_WHOLE_ROWS, 5120) == 10
    layer = make_layer(E=6, K=96, N=32, top_k=2, offset=2)
    x, ids, w = make_batch(layer, 7, seed=5, padding_rows=1)
    h = layer.prepare(backend="triton", max_tokens=64)
    gp = h._state.plans
    cfg = gp.configs[gp.plan_for(7)[0]]
    gp.reserve(64, type(cfg)(**dict(cfg.as_dict(), bm=16, gemv=False, atomic=atomic)))  # (as _check_routing)
    acc = gp.arena.buffers["acc"]
    acc.fill_(float("nan"))
    a = _check_routing(layer, x, ids, w, 16, qk=32, qs=qs, atomic=atomic)
    xq = a["xq"][: x.numel()].view(x.shape)
    assert torch.equal(K_.unsplit(xq), quant_dequant_mxfp8(x.float()))
    if atomic:
        assert acc.numel() >= x.numel() and not a["acc"][: x.numel()].any()


# (E, top_k, offset, M, padding rows, skew, RT, NBT): S = M * top_k on either side of the one-
# program bound RT, the many-program path (routing tiles, then as many placing programs) with the
# block table's loop over several steps, E = 384 top-6, EP offsets with foreign ids, padding rows,
# every slot on one expert (one expert's many blocks)
ROUTING_SIZES = [
    (384, 6, 0, 170, 0, False, None, None),  # S = 1020 <= RT = 1024: one program
    (384, 6, 384, 171, 5, False, None, None),  # S = 1026: two programs
    (8, 4, 0, 256, 0, False, None, None),  # S = 1024 = RT exactly
    (8, 4, 3, 257, 3, False, None, None),
    (128, 8, 0, 40, 2, False, 64, 16),  # 5 routing and 5 placing programs, the block table in several steps
    (384, 6, 100, 90, 7, False, 32, 64),  # 17 programs each, E = 384 > the blocks a step
    (8, 2, 0, 37, 0, True, 16, 16),  # every slot on one expert
    (5, 3, 7, 33, 4, True, 16, 32),
    (3, 3, 0, 6, 0, False, 16, 16),  # S = 18: two programs, the second of two slots
]


@inner
@pytest.mark.parametrize("E, top_k, offset, M, pad, skew, rt, nbt", ROUTING_SIZES)
@pytest.mark.parametrize("bm", [16, 64])
def test_interp_routing_sizes_match_twin(E, top_k, offset, M, pad, skew, rt, nbt, bm):
    layer = make_layer(E=E, K=64, N=32, top_k=top_k, offset=offset)
    for seed in range(2):  # twice: the second call sees the counters the first left
        x, ids, w = make_batch(layer, M, seed=seed, padding_rows=pad, id_dtype=torch.int64 if seed else torch.int32)
        if skew:
            ids[:, 0] = offset + E - 1
            ids[: M // 2, 1:] = offset + E - 1
        _check_routing(layer, x, ids, w, bm, rt, nbt)


@inner
@pytest.mark.parametrize("first_ours", [False, True])
def test_interp_placing_programs_with_no_slot_of_ours(first_ours):
    # several routing tiles (RT = 16) whose slots are all other EP ranks' or padding: the placing
    # programs place nothing and still lower the flag; with ``first_ours`` only the first tile has
    # slots of ours, so every other placer has none
    layer = make_layer(E=8, K=64, N=32, top_k=4, offset=8)
    for seed in range(2):
        x, ids, w = make_batch(layer, 19, seed=seed, padding_rows=3)
        ids[ids >= 0] = torch.where(ids[ids >= 0] % 2 == 0, 3, 17).to(ids.dtype)  # below and above our experts
        if first_ours:
            ids[:4] = (8 + torch.arange(16).view(4, 4) % 8).to(ids.dtype)
        _check_routing(layer, x, ids, w, 16, rt=16, nbt=16)


@inner
def test_interp_gemv_is_chosen_for_small_counts():
    layer = make_layer(E=8, K=64, N=32, top_k=4)
    h = layer.prepare(backend="triton", max_tokens=64)
    g = h._state.plans.geometry
    small = min(P.GEMV_MAX_SLOTS // g.top_k, P.GEMV_MAX_TOKENS)
    assert P.default_config(small, g).gemv and P.default_config(small, g).bm == 1
    assert not P.default_config(small + 1, g).gemv
    assert not P.default_config(small, g, gemv=False).gemv and P.default_config(1 << 20, g, gemv=True).gemv
    kinds = {c.gemv for c in P.candidate_configs(small, g)}
    assert kinds == {True, False}  # the tuner times both paths where GEMV may serve
    assert {c.gemv for c in P.candidate_configs(small + 1, g)} == {False}
    assert {c.gemv for c in P.candidate_configs(small + 1, g, gemv=True)} == {True}
    # (row groups of 16, K steps of whole 32-byte chunks: the repacked layout's units)
    assert all(c.bn1 % 16 == 0 and c.bn2 % 16 == 0 and c.bk1 % 64 == 0 and c.bk2 % 64 == 0
               for c in P.candidate_configs(1, g) + P.candidate_configs(64, g))
    assert h._state.plans.configs[1].gemv and not h._state.plans.configs[64].gemv
    with pytest.raises(ValueError, match="gemv"):
        layer.prepare(backend="triton", gemv="yes")


@inner
@pytest.mark.parametrize("variant", [
    dict(layout="w13", limit=None, global_scales=False),
    dict(layout="w31", limit=3.0, global_scales=True, offset=3),
])
@pytest.mark.parametrize("bk,split,xq", [(64, 1, False), (128, 1, False), (64, 2, False), (64, 3, False),
                                         (128, 3, False), (64, 4, False), (64, 6, False), (64, 1, True), (64, 3, True),
                                         (128, 1, True)])
def test_interp_gemv_stages_match_twins(variant, bk, split, xq):
    # K=96: a K step of 64 leaves a masked tail; N=96: a BN of 64 leaves a masked N tile
    layer = make_layer(E=5, K=96, N=96, top_k=3, seed=4, **variant)
    x, ids, w = make_batch(layer, 7, seed=3, padding_rows=2)  # foreign and padding slots too
    h = layer.prepare(backend="triton", max_tokens=8, gemv=True)
    st = h._state
    gp = st.plans
    # split: K steps shared by programs in gemv1 (K = 96 at bk = 64: a step and a half, one a
    # program at split 2, and none for the third at split 3; at bk = 128 one step, for the first
    # program), slots in gemv2 (top-3: 2 + 1 slots, or 1 each; at split 4 one each and a fourth
    # program with none; at split 6 one slot and one of its two N steps each)
    cfg = P.Config(1, 64, bk, 4, 1, 32, bk, 4, 1, False, gemv=True, split1=split, split2=split, xq=xq)
    gp.reserve(8, cfg)
    # no routing pass: two launches, or three with x quantized by a launch of its own
    assert (gp.stages(cfg)[0].fn is K_.xquant_kernel) if xq else gp.stages(cfg)[0] is None
    assert gp.stages(cfg)[3] is None
    out = torch.full_like(x, float("nan"))
    from b12x_ops.backends.triton import _launch_all
    act = gp.arena.buffers["act"]
    act.fill_(float("nan"))
    _launch_all(st, cfg, x, ids, w, out, stages=("prologue", "gemm1", "gemm2"))
    N, top_k = layer.N, layer.top_k
    xq = quant_dequant_mxfp8(x.float())  # gemv1 quantizes x (on the fly or first): bit-exact with this
    if cfg.xq:
        assert torch.equal(K_.unsplit(gp.arena.buffers["xq"][: x.numel()].view(x.shape)), xq)
    lid = ids.long() - layer.offset
    lid = torch.where((ids >= 0) & (lid >= 0) & (lid < layer.E), lid, -1)
    g13, g2 = layer.w13_global_scale, layer.w2_global_scale
    for s_ in range(ids.numel()):
        e = int(lid.view(-1)[s_])
        got = K_.unsplit(act[s_ * N: (s_ + 1) * N])  # (rows in the split column order)
        if e < 0:
            assert torch.isnan(got).all()  # foreign and padding slots cost no work
            continue
        want = K_.gemv1_torch(xq[s_ // top_k], layer.w13, layer.w13_scale, e, layer.layout, layer.limit, g13)
        assert (got != want).float().mean() < 0.02  # a sigmoid ulp may flip a rare MXFP8 rounding
        assert rel_l2(got, want) < 1e-3
    for m in range(x.shape[0]):
        a_rows = K_.unsplit(act[m * top_k * N: (m + 1) * top_k * N].view(top_k, N)).nan_to_num(0.0)
        y = K_.gemv2_torch(a_rows, layer.w2, layer.w2_scale, lid[m].tolist(), w[m].float(), g2)
        assert torch.isfinite(out[m]).all()
        # the kernel rounds its fp32 sum once: at most one bf16 ulp from the twin's
        assert torch.allclose(out[m].float(), y.to(x.dtype).float(), rtol=2 ** -7, atol=1e-30)
    # the split-K counts are back at zero for the next call
    assert not gp.arena.buffers["cnt1"].any() and not gp.arena.buffers["cnt2"].any()


@inner
def test_interp_gemm1_stage_matches_twin():
    layer, (x, ids, w) = case("int64_bf16w")
    h = layer.prepare(backend="triton", max_tokens=8, gemv=False)
    b12x_ops.moe_w4a8(x, ids, w, h)
    gp = h._state.plans
    a = gp.arena.buffers
    cfg = gp.configs[gp.plan_for(x.shape[0])[0]]
    assert not cfg.gemv
    N = layer.N
    nb = K_.num_blocks(ids.numel(), layer.E, cfg.bm)
    xq = quant_dequant_mxfp8(x.float())
    # the blocked GEMMs keep activations in the split column order
    assert torch.equal(K_.unsplit(a["xq"][: x.numel()].view(x.shape)), xq)
    checked = 0
    for b in range(nb):
        e, r = int(a["blk_expert"][b]), int(a["blk_rows"][b])
        if e < 0:
            continue
        slots = a["sorted"][b * cfg.bm: b * cfg.bm + r].long()
        want = K_.gemm1_torch(xq[slots // layer.top_k], layer.w13, layer.w13_scale, e, layer.layout, layer.limit)
        got = a["act"][b * cfg.bm * N: (b * cfg.bm + r) * N].view(r, N)
        got = K_.unsplit(got)
        assert (got != want).float().mean() < 0.01  # sigmoid ulps may flip a rare MXFP8 rounding
        assert rel_l2(got, want) < 1e-3
        checked += r
    assert checked == int((a["lid"][: ids.numel()] >= 0).sum())


@inner
def test_interp_split_layout_twin():
    perm = K_.split_perm(96)
    assert sorted(perm.tolist()) == list(range(96))  # a permutation within each 32 columns
    assert (perm // 32 == torch.arange(96) // 32).all()
    t = torch.arange(2 * 96).view(2, 96)
    split = torch.empty_like(t)
    split[:, perm] = t
    assert torch.equal(split[0, :16], torch.arange(0, 32, 2)) and torch.equal(split[0, 16:32], torch.arange(1, 32, 2))
    assert torch.equal(K_.unsplit(split), t)


@inner
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("gemv", [None, False])  # None: the default (GEMV at these sizes)
def test_interp_layer_matches_reference(name, deterministic, gemv):
    layer, (x, ids, w) = case(name)
    h = layer.prepare(backend="triton", max_tokens=16, deterministic=deterministic, gemv=gemv)
    ref = layer.prepare(backend="reference")
    got = b12x_ops.moe_w4a8(x, ids, w, h)
    want = b12x_ops.moe_w4a8(x, ids, w, ref)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert rel_l2(got, want) <= 1e-2


if INNER:
    from hypothesis import given, settings, strategies as st

    @inner
    @settings(max_examples=30, deadline=None)
    @given(
        E=st.integers(1, 6),
        K=st.sampled_from([32, 64, 160]),
        N=st.sampled_from([32, 64, 96]),
        top_k=st.integers(1, 4),
        M=st.integers(1, 20),
        layout=st.sampled_from(["w13", "w31"]),
        limit=st.sampled_from([None, 0.5, 7.0]),
        offset=st.sampled_from([0, 3]),
        padding_rows=st.integers(0, 2),
        global_scales=st.booleans(),
        scale_lo=st.sampled_from([1, 118]),  # 1: bytes outside [2, 252] take the exact-multiply decode
        gemv=st.sampled_from([None, False]),
        deterministic=st.booleans(),
        id_dtype=st.sampled_from([torch.int32, torch.int64]),
        w_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
        seed=st.integers(0, 2**16),
    )
    def test_interp_random_layers_match_reference(E, K, N, top_k, M, layout, limit, offset, padding_rows,
                                                  global_scales, scale_lo, gemv, deterministic, id_dtype,
                                                  w_dtype, seed):
        top_k = min(top_k, E)
        layer = make_layer(E=E, K=K, N=N, top_k=top_k, seed=seed, layout=layout, limit=limit, offset=offset,
                           global_scales=global_scales, scale_range=(scale_lo, scale_lo + 7))
        x, ids, w = make_batch(layer, M, seed=seed, id_dtype=id_dtype, w_dtype=w_dtype,
                               padding_rows=min(padding_rows, M))
        h = layer.prepare(backend="triton", max_tokens=32, gemv=gemv, deterministic=deterministic)
        cfg = h._state.plans.plan_for(M)[1]
        assert cfg.gemv == (gemv is None and P.use_gemv(M, h._state.plans.geometry))
        got = b12x_ops.moe_w4a8(x, ids, w, h)
        want = b12x_ops.moe_w4a8(x, ids, w, layer.prepare(backend="reference"))
        assert got.dtype == x.dtype and torch.isfinite(got).all()
        assert rel_l2(got, want) <= 1e-2, (cfg, rel_l2(got, want))


@inner
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_interp_every_input_dtype_through_one_kernel(w_dtype, id_dtype):
    layer = make_layer(E=4, K=64, N=32, top_k=3, offset=1)
    h = layer.prepare(backend="triton", max_tokens=8)
    ref = layer.prepare(backend="reference")
    for x_dtype in (torch.bfloat16, torch.float16):
        x, ids, w = make_batch(layer, 6, seed=2, x_dtype=x_dtype, w_dtype=w_dtype, id_dtype=id_dtype, strided=True)
        got = b12x_ops.moe_w4a8(x, ids, w, h)
        want = b12x_ops.moe_w4a8(x, ids, w, ref)
        assert got.dtype == x_dtype and rel_l2(got, want) <= 1e-2


@inner
@pytest.mark.parametrize("form", ["fused", "gemv", "gemv-xq", "blocked"])
def test_interp_compiled_launches_get_the_same_addresses_without_views(form, monkeypatch):
    """A launch that is not compiled yet gets x, out, the ids and the weights as the 16/32-bit views its
    kernel is compiled for, and the handle's weights and scales and the arena's buffers as tensors; a
    compiled one (after a GPU prepare) gets the caller's tensors themselves, since triton's launcher
    reads only their addresses, and the handle's and arena's as addresses made once (``_args``,
    ``_operands``). Both argument lists hold the same addresses and scalars, position by position,
    for every launch of each path (int64 ids, fp32 weights, strided: the words' strides are the
    views'). An arena grown by a later prepare gives the next call its new buffers' addresses."""
    from b12x_ops.backends import triton as TB
    layer = make_layer(E=4, K=64, N=32, top_k=3, offset=1)
    h = layer.prepare(backend="triton", max_tokens=8)
    gp = h._state.plans
    M = 4
    x, ids, w = make_batch(layer, M, seed=2, w_dtype=torch.float32, id_dtype=torch.int64, strided=True)
    base = P.default_config(M, gp.geometry, gemv=form != "blocked")
    if base.gemv:
        base = dataclasses.replace(base, xq=form == "gemv-xq", fused=form == "fused")
    cfg = base
    assert cfg.gemv == (form != "blocked") and cfg.fused == (form == "fused") and cfg.xq == (form == "gemv-xq")
    gp.reserve(M, cfg)
    rn = gp.runner(cfg)
    calls = []
    monkeypatch.setattr(P.Launch, "__call__", lambda self, grid, *args: calls.append((self, grid, args)))
    out = torch.empty_like(x)
    TB._launch(h._state, rn, x, ids, w, out, TB._ALL)
    fresh = list(calls)
    calls.clear()
    for ln, _, _ in fresh:
        monkeypatch.setattr(ln, "compiled", object())
    TB._launch(h._state, rn, x, ids, w, out, TB._ALL)
    assert len(fresh) == len(calls) == len(gp.kinds(cfg))
    callers = {x.data_ptr(): x, ids.data_ptr(): ids, w.data_ptr(): w, out.data_ptr(): out}
    st = h._state
    owned = {t.data_ptr() for t in list(gp.arena.buffers.values()) + [getattr(st, n) for n in TB._HANDLE_OPERANDS]}
    undone, addressed = set(), set()
    for (ln0, g0, a0), (ln1, g1, a1) in zip(fresh, calls):
        assert ln0 is ln1 and g0 == g1 and len(a0) == len(a1)
        for v, r in zip(a0, a1):
            if isinstance(v, torch.Tensor) and v.data_ptr() in owned:  # the handle's or the arena's
                assert type(r) is int and r == v.data_ptr()
                addressed.add(r)
            elif isinstance(v, torch.Tensor):
                assert isinstance(r, torch.Tensor) and v.data_ptr() == r.data_ptr()
                if r is not v:  # (a view made for the compile: the compiled launch takes the caller's own tensor)
                    assert r is callers[r.data_ptr()] and v.dtype in (torch.int16, torch.int32)
                    undone.add(r.data_ptr())
            else:
                assert type(v) is type(r) and v == r
    assert undone == set(callers)  # (every one of the four is viewed by some launch of every path)
    assert {st.w13.data_ptr(), st.w13_scale.data_ptr(), st.w2.data_ptr(), gp.arena.buffers["act"].data_ptr()} <= addressed
    # a prepare that grows the arena replaces its buffers: the next call takes the new ones' addresses
    old_act = gp.arena.buffers["act"]
    gp.arena.need("act", old_act.numel() * 2, old_act.dtype)
    assert gp.arena.buffers["act"].data_ptr() != old_act.data_ptr()
    calls.clear()
    TB._launch(h._state, rn, x, ids, w, out, TB._ALL)
    grown = {r for _, _, a in calls for r in a if type(r) is int}
    assert gp.arena.buffers["act"].data_ptr() in grown and old_act.data_ptr() not in grown


@inner
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("gemv", [None, True])
def test_interp_atomic_and_chunked_paths(deterministic, gemv):
    # 80 tokens x top-4 = 320 slots: the default mode takes the atomic reduction; max_tokens=32
    # makes the handle run it in chunks. gemv=True forces the GEMV kernels there (atomic mode too).
    layer = make_layer(E=6, K=64, N=32, top_k=4, limit=10.0, layout="w31", global_scales=True, offset=2)
    # (the interpreter runs GEMV's many small programs slowly: one size each for it, 65 tokens =
    # 260 slots for the atomic mode, 40 tokens in chunks of 32 for the slot mode)
    M = 80 if not gemv else (40 if deterministic else 65)
    x, ids, w = make_batch(layer, M, seed=4, w_dtype=torch.float16, padding_rows=3)
    want = b12x_ops.moe_w4a8(x, ids, w, layer.prepare(backend="reference"))
    for max_tokens in (128, 32) if not gemv else (32 if deterministic else 128,):
        h = layer.prepare(backend="triton", max_tokens=max_tokens, deterministic=deterministic, gemv=gemv)
        cfg = h._state.plans.plan_for(M)[1]
        assert cfg.gemv == bool(gemv)
        # the blocked path reduces with atomics unless deterministic; GEMV never needs them
        assert cfg.atomic == (not gemv and not deterministic)
        got = b12x_ops.moe_w4a8(x, ids, w, h)
        assert rel_l2(got, want) <= 1e-2


@inner
@pytest.mark.parametrize("bm", [32, 64])
def test_interp_half_tiles_write_what_full_tiles_write(bm, monkeypatch):
    """A block of at most half its rows runs the tl.dot GEMMs' half tile (``plan.half_tiles``), and
    from 64-row blocks one of at most a quarter the quarter tile (``plan.quarter_tiles``): the
    activations and per-slot rows are the full tile's, bit for bit, and the layer matches the
    reference. The routing gives blocks on both sides of half and of a quarter (experts of 10, 40,
    50 and 20 rows)."""
    from b12x_ops.backends.triton import _launch_all
    layer = make_layer(E=4, K=64, N=32, top_k=2, seed=5, limit=7.0)
    M = 60
    x, _, w = make_batch(layer, M, seed=6)
    pairs = [(0, 1)] * 10 + [(1, 2)] * 30 + [(2, 3)] * 20
    ids = torch.tensor(pairs, dtype=torch.int32) + layer.offset
    h = layer.prepare(backend="triton", max_tokens=64, gemv=False, deterministic=True)
    st, gp = h._state, h._state.plans
    cfg = dataclasses.replace(P.default_config(M, gp.geometry, gemv=False), bm=bm, atomic=False)
    written = {}
    monkeypatch.setattr(P, "HALF_MIN_BM", 32)  # (the kernels' half path from 32-row blocks, the default's 64)
    # (tail: 2 quarter and half tiles, 1 half tiles only, 0 the full tile always; the quarter tile of
    # 32-row blocks would be 8 rows, below tl.dot's 16, so QUARTER_MIN_BM = 64 leaves them at 1)
    for tail, half, quarter in ((2, "1", "1"), (1, "1", "0"), (0, "0", "1")):
        monkeypatch.setenv("B12X_OPS_TRITON_HALF", half)
        monkeypatch.setenv("B12X_OPS_TRITON_QUARTER", quarter)
        want_tail = min(tail, 1) if bm < P.QUARTER_MIN_BM else tail
        assert P.tail_tiles(bm) == want_tail and P.half_tiles(bm) == (tail > 0)
        gp.reserve(M, cfg)
        rn = gp.runner(cfg)
        assert rn.gemm1.constexprs["HALF"] == want_tail and rn.gemm2.constexprs["HALF"] == want_tail
        out = torch.empty_like(x)
        _launch_all(st, cfg, x, ids, w, out)
        a = gp.arena.buffers
        written[tail] = (out.clone(), a["act"].clone(), a["slots"].clone())
    rows = gp.arena.buffers["blk_rows"][:K_.num_blocks(ids.numel(), layer.E, bm)]
    assert ((rows > 0) & (rows <= bm // 2)).any() and (rows > bm // 2).any()
    assert ((rows > 0) & (rows <= bm // 4)).any() and ((rows > bm // 4) & (rows <= bm // 2)).any()
    for tail in (2, 1):
        for name, got, want in zip(("out", "act", "slots"), written[tail], written[0]):
            # (as bytes: the buffers' rows no call writes hold whatever was there, NaN patterns included)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (tail, name)
    ref = b12x_ops.moe_w4a8(x, ids, w, layer.prepare(backend="reference"))
    assert rel_l2(written[2][0], ref) <= 1e-2


@inner
@pytest.mark.parametrize("deterministic", [False, True])
def test_interp_gemv_and_blocked_paths_agree(deterministic):
    # the GEMV path (which rounds its own fp32 sums) and the blocked path's fp32 sums agree to a
    # bf16 rounding; the two blocked reduction modes' sums to fp32 summation order
    layer = make_layer(E=6, K=128, N=64, top_k=4, limit=7.0, seed=9)
    for M in (1, 6):
        x, ids, w = make_batch(layer, M, seed=M, padding_rows=1)
        outs = []
        for mode in (True, False):
            h = layer.prepare(backend="triton", max_tokens=16, gemv=mode, deterministic=deterministic)
            outs.append(b12x_ops.moe_w4a8(x, ids, w, h))
            cfg = h._state.plans.plan_for(M)[1]
            assert cfg.gemv == mode and not cfg.atomic  # (few slots: no atomics in either mode)
        a = h._state.plans.arena.buffers
        ok = (a["lid"][: ids.numel()] >= 0)[:, None]  # other slots' rows are never written
        slots = torch.where(ok, a["slots"][: ids.numel() * layer.K].view(-1, layer.K), 0.0)
        sums = slots.view(M, layer.top_k, layer.K).sum(1)
        assert rel_l2(outs[0], outs[1]) < 4e-3
        assert rel_l2(outs[1].float(), sums) < 4e-3  # the blocked output is its slots' sum, rounded once


@inner
@pytest.mark.parametrize("variant", [
    dict(layout="w13", limit=None, global_scales=False),
    dict(layout="w31", limit=3.0, global_scales=True, offset=3),
])
@pytest.mark.parametrize("bk,split1,split2", [(64, 1, 3), (64, 2, 6), (128, 3, 1), (64, 3, 2)])
def test_interp_gemv_fused_matches_two_launches(variant, bk, split1, split2):
    # the fused GEMV launch (gemv1 and gemv2 as ticketed roles of one grid) writes the same bits as
    # the two launches, for splits that give gemv2 one slot a program (3, 6 at top-3) or runs of
    # slots (1, 2), and leaves its tickets and counts at zero for the next call
    from b12x_ops.backends.triton import _launch_all
    layer = make_layer(E=5, K=96, N=96, top_k=3, seed=4, **variant)
    h = layer.prepare(backend="triton", max_tokens=8, gemv=True)
    st = h._state
    gp = st.plans
    two = P.Config(1, 64, bk, 4, 1, 32, bk, 4, 1, False, gemv=True, split1=split1, split2=split2)
    one = P.Config(1, 64, bk, 4, 1, 32, bk, 4, 1, False, gemv=True, split1=split1, split2=split2, fused=True)
    gp.reserve(8, two)
    gp.reserve(8, one)
    assert gp.stages(one)[0] is None and gp.stages(one)[2:] == (None, None)
    assert gp.stages(one)[1].fn is K_.gemv_fused_kernel
    for M, seed in ((7, 3), (1, 5), (7, 6)):  # (the third call sees what the first two left)
        x, ids, w = make_batch(layer, M, seed=seed, padding_rows=2 if M > 2 else 0)
        want = torch.full_like(x, float("nan"))
        got = torch.full_like(x, float("nan"))
        _launch_all(st, two, x, ids, w, want, stages=("prologue", "gemm1", "gemm2"))
        _launch_all(st, one, x, ids, w, got, stages=("prologue", "gemm1", "gemm2"))
        assert torch.isfinite(want).all() and torch.equal(got, want)
        sync = gp.arena.buffers["sync"]
        assert sync.numel() >= 2 + 8 and not sync.any()
        assert not gp.arena.buffers["cnt1"].any() and not gp.arena.buffers["cnt2"].any()


@inner
def test_interp_prepare_keeps_the_eager_form_only_where_it_timed_faster(monkeypatch):
    # _warm (run at prepare on a GPU) launches both forms, times eager calls of each and drops the
    # one launch where it is no faster; the timings are stubbed here (the interpreter does not warm)
    from b12x_ops.backends import triton as T
    layer = make_layer(E=6, K=64, N=32, top_k=2, seed=5)
    h = layer.prepare(backend="triton", max_tokens=2)
    st = h._state
    gp = st.plans
    assert sorted(gp.eager_runners) == [1, 2]
    launched = []
    monkeypatch.setattr(T, "_launch", lambda state, rn, *a: launched.append(rn.cfg.fused))
    for cap, (two, one), kept in ((1, (2.0, 1.0), True), (2, (1.0, 1.0), False)):
        times = iter((two, one))
        monkeypatch.setattr(T, "_eager_seconds", lambda fn: (fn(), next(times))[1])
        launched.clear()
        T._warm(st, cap)
        assert launched == [False, True, False, True]  # (both warmed, then each timed)
        assert (cap in gp.eager_runners) == kept
        assert gp.runner_for(cap, lambda: False).cfg.fused == kept


@inner
def test_interp_gemv_fused_is_the_eager_form_where_it_applies(monkeypatch):
    # plans stay separate launches (what graph capture records); the GEMV path also gets a one-launch
    # form (x quantized on the fly), which calls outside capture take, unless B12X_OPS_TRITON_GEMV_FUSED=0
    layer = make_layer(E=8, K=64, N=32, top_k=4)
    h = layer.prepare(backend="triton", max_tokens=8)
    g = h._state.plans.geometry
    for M in (1, 2, 3, 4, 8):
        cfg = P.default_config(M, g)
        assert not cfg.fused
        eager = P.eager_form(cfg)
        assert (eager is not None) == cfg.gemv, M
        assert eager is None or eager == dataclasses.replace(cfg, fused=True, xq=False)
    monkeypatch.setattr(P, "GEMV_FUSED_EAGER", False)
    assert not any(P.eager_form(P.default_config(M, g)) for M in (1, 2, 3, 4, 8))
    monkeypatch.setattr(P, "GEMV_FUSED_EAGER", True)
    # through the op (a geometry of its own: plans are shared per geometry): a call launches the
    # fused kernel at 1-4 tokens (x quantized first at 3-4 in the plan), a call under capture the
    # separate launches, with the same bits
    from b12x_ops.backends import triton as T
    layer = make_layer(E=7, K=64, N=32, top_k=3, seed=11, limit=5.0)
    h = layer.prepare(backend="triton", max_tokens=4)
    gp = h._state.plans
    assert sorted(gp.eager_runners) == [c for c in gp.caps if c <= 4]
    assert gp.runner_for(4).cfg.xq
    for M in (1, 2, 3, 4):
        assert gp.runner_for(M, lambda: False).cfg.fused
        assert not gp.runner_for(M, lambda: True).cfg.fused and not gp.runner_for(M).cfg.fused
        x, ids, w = make_batch(layer, M, seed=M, padding_rows=min(M - 1, 2))
        launched = []
        real = T._launch
        monkeypatch.setattr(T, "_launch", lambda st, rn, *a: (launched.append(rn.cfg.fused), real(st, rn, *a)))
        got = b12x_ops.moe_w4a8(x, ids, w, h)
        monkeypatch.setattr(T, "_capturing", lambda: True)
        monkeypatch.setattr(T, "_never", lambda: True)  # (as if captured)
        want = b12x_ops.moe_w4a8(x, ids, w, h)
        monkeypatch.setattr(T, "_never", lambda: False)
        monkeypatch.setattr(T, "_launch", real)
        assert launched == [True, False]
        assert torch.equal(got, want)


@inner
@pytest.mark.parametrize("name", ["compact", "padding", "foreign_ep", "int64_bf16w", "strided", "zero_tokens"])
def test_interp_ep_remap_matches_twin(name):
    layer, (x, ids, w) = case(name)
    got = ep_remap(ids, w, layer.offset, layer.E)
    want = ep_remap_torch(ids, w, layer.offset, layer.E)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].is_contiguous() and got[1].is_contiguous()


@inner
@pytest.mark.parametrize("cap", [4, 16])  # a count GEMV may serve (both paths timed), one it may not
def test_interp_tuner_runs_every_candidate_and_keeps_the_fastest(cap, monkeypatch):
    from b12x_ops.backends import triton as TB
    layer = make_layer(E=4, K=64, N=64, top_k=2, limit=7.0)
    h = layer.prepare(backend="triton", max_tokens=16)
    st = h._state
    ticks, failures = [], []

    def fake_time_ms(fn, flush, reps=15):
        fn()  # the stage really runs (under the interpreter); its "time" grows with every candidate
        ticks.append(len(ticks))
        return float(len(ticks))

    class _Log:
        def info(self, *args):
            failures.append(args)

    monkeypatch.setattr(TB, "_time_ms", fake_time_ms)
    monkeypatch.setattr(P, "log", _Log())
    g = st.plans.geometry
    cands = P.candidate_configs(cap, g)
    best = TB._tune_one(st, cap)
    assert not failures  # every candidate configuration ran
    groups = sorted({(c.bm, c.gemv) for c in cands})
    stage_runs = sum(len({c.tiles1() for c in cands if (c.bm, c.gemv) == grp}) +
                     len({c.tiles2() for c in cands if (c.bm, c.gemv) == grp})
                     for grp in groups)
    stage_runs += len(groups)  # (each block size's best pair, then, as the whole call)
    assert len(ticks) == stage_runs  # GEMM1 and GEMM2 tiles timed separately, each once
    # with times growing in timing order, the first group's first tiles win
    first = [c for c in cands if (c.bm, c.gemv) == groups[0]][0]
    assert best == first
    assert best.gemv == P.use_gemv(cap, g)  # (GEMV candidates sort first: bm 1)
    out = b12x_ops.moe_w4a8(*make_batch(layer, cap, seed=2)[:3], h)  # the handle still runs
    assert torch.isfinite(out).all()


@inner
@pytest.mark.parametrize("blocked_call, want_gemv", [(9.0, False), (11.0, True)])
def test_interp_tuner_compares_paths_by_the_whole_call(blocked_call, want_gemv, monkeypatch):
    """The tuner picks each block size's GEMM tiles by their stage times, then compares block sizes
    and the GEMV path by the time of the whole call with those tiles (a blocked call has two launches
    more, the routing prologue and the finalize; a sum of stage times would count a graph replay's
    fixed cost once a launch). Here the blocked GEMMs alone are faster than the GEMV kernels either
    way; the whole calls decide."""
    from b12x_ops.backends import triton as TB
    layer = make_layer(E=4, K=64, N=64, top_k=2, limit=7.0)
    h = layer.prepare(backend="triton", max_tokens=4)
    st = h._state
    launched = []
    real = TB._launch_all

    def spy(state, cfg, *args, stages=TB._ALL):
        launched.append((cfg.gemv, tuple(stages)))
        return real(state, cfg, *args, stages=stages)

    def fake_time_ms(fn, flush, reps=15):
        launched.clear()
        fn()
        gemv, stages = launched[-1]
        if stages == TB._ALL:  # (a whole call)
            return 10.0 if gemv else blocked_call
        return 5.0 if gemv else 4.0  # (each GEMM stage)

    monkeypatch.setattr(TB, "_launch_all", spy)
    monkeypatch.setattr(TB, "_time_ms", fake_time_ms)
    cands = P.candidate_configs(4, st.plans.geometry)
    assert any(c.gemv for c in cands) and any(not c.gemv for c in cands)
    assert TB._tune_one(st, 4).gemv == want_gemv


@inner
def test_interp_launch_argument_lists_put_constexprs_in_place():
    # the per-call path appends a kernel's constexprs to the runtime arguments: every stage kernel
    # must declare them last, in the order of its signature (the launcher takes the full list)
    layer = make_layer(E=4, K=64, N=64, top_k=2)
    for gemv in (True, False):
        gp = layer.prepare(backend="triton", max_tokens=32, gemv=gemv)._state.plans
        assert gp.launches
        for ln in gp.launches.values():
            assert ln._tail is not None, ln.fn.__name__
            args = tuple(f"arg{i}" for i in range(ln.n_args))
            rest = iter(args)
            want = [ln.constexprs[n] if n in ln.constexprs else next(rest) for n in ln.fn.arg_names]
            assert list(ln._full_args(args)) == want, ln.fn.__name__
            assert len(want) == len(ln.fn.arg_names)


@inner
def test_interp_options_are_checked():
    layer = make_layer()
    for bad in (dict(bogus=1), dict(fp8=True)):  # (fp8 GEMMs were an option once: now an unknown one)
        with pytest.raises(ValueError, match="options"):
            layer.prepare(backend="triton", **bad)
    for opt in ("gemv", "ptx"):
        with pytest.raises(ValueError, match=f"option {opt}: expected"):
            layer.prepare(backend="triton", **{opt: "yes"})
    h = layer.prepare(backend="triton", max_tokens=4, tune=False)
    assert h.backend == "triton" and h.memory["device_bytes"] == h.memory["checkpoint_bytes"]


@inner
@pytest.mark.parametrize("script, argv", [
    ("half_tiles", ["tiny", "40"]), ("reduction", ["tiny", "40"]), ("gluon_regimes", ["tiny", "200"]),
    ("gluon_gemms", ["tiny", "40"]), ("large_m", None), ("gemm2_tiles", ["tiny", "40", "128,128,4,3", "64,128,4,3"]),
    ("prologue_shapes", ["tiny", "40", "8,64,4"]), ("gluon_ws", ["tiny", "40"]),
    ("gemv_mma_forms", ["tiny", "1", "2/4,0/6/64/4/16/1,4/4@2", "2"]), ("gemm2_order", ["tiny", "40"]),
    ("gluon_persistent", ["tiny", "40"]), ("acc_zero", ["tiny", "40"]), ("fp8_probe", ["tiny", "40"]),
    ("fp8_gemm1", ["tiny", "40"])])
def test_interp_experiments_run(script, argv, monkeypatch, capsys):
    """Each experiment in ``benchmarks/experiments`` runs its loop to the end on a tiny geometry (CPU,
    interpreter): its layers prepared here, CUDA-graph timing replaced by one run of the calls. The
    experiments run on the GPU only between their device calls; this keeps them from rotting when
    the kernels' parameters change."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "benchmarks"))
    import bench_moe as B

    monkeypatch.setitem(B.GEOMETRIES, "tiny", dict(E=4, K=64, N=32, top_k=2, limit=7.0))

    def handles(name, max_tokens, layers=3, **options):
        g = B.GEOMETRIES[name]
        return [b12x_ops.prepare_experts(*B.random_layer(g["E"], g["K"], g["N"], "cpu", 100 + i), top_k=g["top_k"],
                                         swiglu_limit=g["limit"], backend="triton", tune=False, gemv=False,
                                         max_tokens=max_tokens, frozen=False, **options) for i in range(layers)]

    def one_run(calls, reps=20):
        for c in calls:
            c()
        return 1e-6

    batches = B.layer_batches
    monkeypatch.setattr(B, "experiment_handles", handles)
    monkeypatch.setattr(B, "layer_batches", lambda M, E, K, top_k, layers, device="cuda": batches(M, E, K, top_k,
                                                                                                 layers, "cpu"))
    monkeypatch.setattr(B, "graph_time", one_run)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setenv("B12X_OPS_TRITON_HALF", "1")  # (half_tiles.py sets it and B12X_OPS_TRITON_QUARTER)
    monkeypatch.setenv("B12X_OPS_TRITON_QUARTER", "1")
    path = os.path.join(root, "benchmarks", "experiments", script + ".py")
    spec = importlib.util.spec_from_file_location(script, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if hasattr(mod, "graph_time"):
        monkeypatch.setattr(mod, "graph_time", one_run)
    if argv is None:
        mod.main(["--geometries", "tiny", "--sizes", "40"])
    else:
        monkeypatch.setattr(sys, "argv", [script] + argv)
        mod.main()
    out = capsys.readouterr().out
    assert "tiny M=" in out
    if script not in ("gluon_gemms", "gluon_ws", "gemv_mma_forms"):  # (their Gluon forms do not run here: FAILED)
        assert "FAILED" not in out and "failed:" not in out, out


@inner
def test_interp_prepare_aligns_scale_bytes_given_at_an_odd_address():
    """A checkpoint's scale bytes may be a contiguous view at any address; the handle keeps them 16-byte
    aligned (a copy where they are not: the Gluon kernels load two at a time) and the call's result
    is the same as with the bytes where they were."""
    layer = make_layer(E=4, K=64, N=64, top_k=2)

    def odd(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype)
        v = buf[1:].view(t.shape)
        v.copy_(t)
        assert v.is_contiguous() and v.data_ptr() % 2 == 1
        return v

    shifted = dataclasses.replace(layer, w13_scale=odd(layer.w13_scale), w2_scale=odd(layer.w2_scale))
    h, h0 = shifted.prepare(backend="triton", max_tokens=8), layer.prepare(backend="triton", max_tokens=8)
    for name in ("w13_scale", "w2_scale"):
        kept = getattr(h._state, name)
        assert kept.data_ptr() % 16 == 0 and torch.equal(kept, getattr(layer, name)), name
    assert getattr(h0._state, "w13_scale").data_ptr() == layer.w13_scale.data_ptr()  # (aligned: no copy)
    x, ids, w = make_batch(layer, 5)
    assert torch.equal(b12x_ops.moe_w4a8(x, ids, w, h), b12x_ops.moe_w4a8(x, ids, w, h0))


@inner
def test_interp_eager_calls_go_straight_to_their_chain_until_the_plans_change(monkeypatch):
    """A call whose launches a chain makes, captured or not, leaves its chain in the handle's fast path
    (``State.fast``); the next call of that token count goes straight to it, with the values the first
    call passed (the routing as ``_raw_routing``'s words, the fallback for a routing tensor whose last
    dim is strided too). Triton launch hooks (a profiler) and chains turned off send it back through
    triton's launcher, and a change of the shared plans (a buffer grown, a plan added) empties the fast path. The C call is
    stubbed: no chain is built under the interpreter (``test_triton_chain.py`` checks the chain's bytes)."""
    import types

    import triton

    from b12x_ops.backends import triton as T

    layer = make_layer(E=6, K=64, N=32, top_k=3, seed=21)
    h = layer.prepare(backend="triton", max_tokens=4, gemv=True)
    st = h._state
    gp = st.plans
    gp.eager_runners.clear()  # (the one-launch eager form is not chained)
    gp.changed()
    calls = []
    monkeypatch.setattr(T, "_CH_MOD", types.SimpleNamespace(launch=lambda blob, *v: calls.append((blob,) + v) or True))
    monkeypatch.setattr(T, "_P", P)
    monkeypatch.setattr(T, "_KNOBS", P._RUNTIME_KNOBS)
    monkeypatch.setattr(P, "_raw_stream", lambda dev: 77)
    monkeypatch.setattr(P, "_current_device", lambda: 0)
    for M in (1, 2, 3):
        st.chains[id(gp.runner_for(M))] = (gp.runner_for(M), gp.arena.version, f"chain {M}".encode())
    routing = [(torch.int32, torch.float32, False), (torch.int64, torch.bfloat16, True),
               (torch.int64, torch.float32, False), (torch.int32, torch.float16, True)]
    for M in (1, 2, 3):
        for id_dtype, w_dtype, strided in routing:
            x, ids, w = make_batch(layer, M, seed=M, id_dtype=id_dtype, w_dtype=w_dtype, strided=strided)
            out = torch.empty_like(x)
            if M == 3 and not strided:  # (last dims strided: the words from a contiguous copy)
                ids, w = ids.t().contiguous().t(), w.t().contiguous().t()
            calls.clear()
            launched = []
            monkeypatch.setattr(T, "_launch", lambda *a: launched.append(a))
            b12x_ops.moe_w4a8_out(x, ids, w, h, out)
            assert st.fast.get(M) == (f"chain {M}".encode(), ())
            b12x_ops.moe_w4a8_out(x, ids, w, h, out)  # (by the fast path)
            assert not launched and len(calls) == 2
            i_w, (si0, si1), w_w, (sw0, sw1), kind = T._raw_routing(ids, w)
            want = (f"chain {M}".encode(), 77, x.data_ptr(), None, None, out.data_ptr(), M, x.stride(0), si0, si1, sw0,
                    sw1, kind, out.stride(0), 0, 0)
            for got in calls:
                assert got[:3] + got[5:] == want[:3] + want[5:], (M, id_dtype, w_dtype, strided)
                assert got[3] == ids.data_ptr() or i_w is not ids  # (a contiguous copy's address is its own)
                assert got[4] == w.data_ptr() or w_w is not w
    # a launch hook: back through the launcher (and the chain left alone)
    x, ids, w = make_batch(layer, 1, seed=9)
    out = torch.empty_like(x)
    calls.clear()
    launched = []
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    b12x_ops.moe_w4a8_out(x, ids, w, h, out)
    assert not calls and len(launched) == 1
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", None)
    b12x_ops.moe_w4a8_out(x, ids, w, h, out)
    assert len(calls) == 1
    # chains turned off (B12X_OPS_TRITON_CHAIN=0 at import; tests and benchmarks at run time): the fast path too
    monkeypatch.setattr(T._CH, "ENABLED", False)
    b12x_ops.moe_w4a8_out(x, ids, w, h, out)
    assert len(calls) == 1 and len(launched) == 2
    monkeypatch.setattr(T._CH, "ENABLED", True)
    # the plans change: the fast path is emptied, and refilled by the next call
    assert sorted(st.fast) == [1, 2, 3]
    big = dataclasses.replace(gp.configs[4], bn1=128)
    gp.reserve(64, big)
    assert st.fast == {}
    st.chains[id(gp.runner_for(1))] = (gp.runner_for(1), gp.arena.version, b"chain 1")  # (made again for the new buffers)
    b12x_ops.moe_w4a8_out(x, ids, w, h, out)
    assert sorted(st.fast) == [1]
    layer.prepare(backend="triton", max_tokens=5, gemv=True)  # (a plan for 5 tokens added to the shared plans)
    assert st.fast == {}


@inner
def test_interp_blocked_calls_pass_their_sizes_to_one_chain(monkeypatch):
    """On the blocked path one chain serves a runner's token counts: its grids and block count, not linear
    in M, are values of the call (``_blocked_sizes``, ``chain.SIZES``) that the chain takes after
    ``chain.VALUES``. Calls of 5 and of 6 tokens launch the same chain, each with its own sizes, and the
    fast path keeps them by token count (up to ``FAST_MAX_TOKENS``: a call of more goes by the chain without
    being kept); the chain is built once, from ``_blocked_launches`` with the
    sizes as placeholders. The chain's bytes and the C call are stubbed (``test_triton_chain.py``
    checks the bytes a blocked chain packs)."""
    import types

    from b12x_ops.backends import triton as T

    layer = make_layer(E=6, K=64, N=32, top_k=3, seed=22)
    h = layer.prepare(backend="triton", max_tokens=8, gemv=False)
    st = h._state
    gp = st.plans
    calls, built = [], []
    monkeypatch.setattr(T, "_CH_MOD", types.SimpleNamespace(launch=lambda blob, *v: calls.append((blob,) + v) or True))
    monkeypatch.setattr(T, "_P", P)
    monkeypatch.setattr(T, "_KNOBS", P._RUNTIME_KNOBS)
    monkeypatch.setattr(P, "_raw_stream", lambda dev: 77)
    monkeypatch.setattr(P, "_current_device", lambda: 0)

    def build(state, rn):
        assert not rn.cfg.gemv and state is st
        v = T._CH.placeholders()
        used = [rn.prologue, rn.gemm1, rn.gemm2, rn.finalize]
        saved = [ln.compiled for ln in used]
        try:  # (as compiled launches take them: the call's values as they are, the operands as addresses)
            for ln in used:
                ln.compiled = object()
            launches = T._blocked_launches(state, rn, *T._operands(state), *(v[n] for n in T._CH.VALUES),
                                           sizes=tuple(v[n] for n in T._CH.SIZES))
        finally:
            for ln, c in zip(used, saved):
                ln.compiled = c
        assert [ln for ln, _, _ in launches] == used
        assert [grid[0] for _, grid, _ in launches] == [v["g_pro"], v["g1"], v["g2"], v["g_fin"]]
        assert launches[3][2][2] is v["out"] and launches[0][2][13] is v["m"] and launches[2][2][-1] is v["nb"]
        built.append(rn)
        return b"blocked chain"

    monkeypatch.setattr(T, "_build_chain", build)
    launched = []
    monkeypatch.setattr(T, "_launch", lambda *a: launched.append(a[0:2]))
    st.chains.clear()
    st.fast.clear()
    rn = gp.runner_for(6)
    assert gp.runner_for(5) is rn and not rn.cfg.gemv
    n_values = len(T._CH.VALUES)
    for M in (5, 6, 5, 6):
        x, ids, w = make_batch(layer, M, seed=M)
        b12x_ops.moe_w4a8(x, ids, w, h)
        sizes = T._blocked_sizes(rn, M, 3)
        assert st.fast.get(M) == (b"blocked chain", sizes)
        got = calls[-1]
        assert got[0] == b"blocked chain" and got[1] == 77 and got[2] == x.data_ptr() and got[6] == M
        assert got[2 + n_values:] == sizes and len(sizes) == len(T._CH.SIZES)
    assert built == [rn] and not launched and len(calls) == 4
    monkeypatch.setattr(T, "FAST_MAX_TOKENS", 6)  # (a count above it: by the chain, not kept in the fast path)
    x, ids, w = make_batch(layer, 7, seed=7)
    b12x_ops.moe_w4a8(x, ids, w, h)
    assert 7 not in st.fast and len(calls) == 5 and calls[-1][2 + n_values:] == T._blocked_sizes(rn, 7, 3)
    assert built == [rn] and not launched
    assert T._blocked_sizes(rn, 5, 3) != T._blocked_sizes(rn, 6, 3)  # (the prologue's programs differ at least)
    nb, g_pro, g1, g2, zrows, g_fin = T._blocked_sizes(rn, 6, 3)
    assert (nb, g_pro, g1, g2, g_fin) == (rn.blocks(18), rn.prologue_programs(6, 3), nb * rn.n_tiles1,
                                          nb * rn.n_tiles2, -(-6 // rn.finalize_rows)) and zrows * g1 >= 6


@inner
def test_interp_split_race_experiment_runs(monkeypatch, capsys):
    """``benchmarks/experiments/split_race.py`` (the GPU's run-to-run check of the GEMV splits) runs its
    loop on the CPU under the interpreter, where every call gives the first call's bits."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "benchmarks", "experiments", "split_race.py")
    spec = importlib.util.spec_from_file_location("split_race", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["split_race", "--device", "cpu", "--reps", "2", "--geometries", "odd-ep",
                                      "--splits", "2,2", "1,3"])
    mod.main()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "differing calls" in ln]
    assert len(lines) == 6, lines  # (two split pairs, three token counts)
    assert all(ln.endswith("whole 0, act 0, out after stages 0, gemv2 on the first act 0") for ln in lines), lines
