"""GEMM1 on e4m3 wgmma, exact weights: a code layout of its own, a table decode, per-row folds.

    python benchmarks/experiments/fp8_gemm1.py check                                             # CPU
    python benchmarks/experiments/fp8_gemm1.py qwen3-30b-a3b,gpt-oss-120b,dsv4.1-tp4 2048,8192   # a CUDA GPU

``fp8_probe.py`` timed the Gluon GEMMs on e4m3 wgmma with a stand-in decode (wrong values): GEMM1
0.70-0.78x of the package's at 128-row blocks. This is the real thing for GEMM1, as an experiment
(its own copy of W13's codes beside the handle's):

* **The layout** (``repack_fp8``): a lane's 16 bytes of a 64-element chunk are 4 words, word
  ``(b, h)`` for the chunk's 32-element block ``b`` and half ``h``. A word holds elements
  ``32 b + 16 h + 4 c + i`` (``c`` the lane's quad, ``i`` 0..3) of rows r0 (quad A) and r0 + 8
  (quad B): A's magnitudes ``e1 e0 m`` at bits ``4 i .. 4 i + 2``, B's at ``16 + 4 i ..``, A's signs
  at bit ``8 i + 7``, B's at ``8 i + 3``. Those are e4m3 wgmma's A fragments as they are (registers
  a0..a3 of a k32 block: A of h = 0, B of h = 0, A of h = 1, B of h = 1), so the operand is the
  elements in their natural order and x needs no permutation.
* **The decode** (``_DECODE_FP8``, two words a block and lane): a magnitude is a ``prmt`` selector
  into an 8-byte table of its e4m3 values for the row's block, the sign an OR: 8 instructions for
  8 weights, and 6 a block for the two rows' tables (a byte each out of the scale word, two
  ``mad`` each). Row ``r``'s block with scale byte ``s`` is decoded as the E2M1 value times
  ``2^t``, ``t = s - ref_r + 6``, ``ref_r`` the row's largest scale byte: every value of
  ``t`` in [-5, 6] is exact in e4m3 (0.5 * 2^-5 is its smallest normal, 6 * 2^6 = 384 below 448).
  So a row whose blocks span more than 11 binades cannot take this path (prepare would check it;
  ``check_weights`` here).
* **x** as e4m3 bytes of ``dq8(x) / 2^X``, ``2^X`` the token's largest MXFP8 block scale: each
  payload moved down by its block's distance to the largest, exact unless it leaves e4m3's range
  (values below 2^-9 of the token's largest block scale are rounded).
* **The epilogue** multiplies the accumulator by ``2^(ref_r - 133)`` a row and ``2^X`` a token
  before the package's SwiGLU and MXFP8 quant-dequant of the intermediate.

The hardware's e4m3 wgmma keeps fewer bits in its accumulation than fp32 (about 14 are reported
for Hopper), so the outputs are close to the package's, not equal: the run prints the relative L2
of the whole op against the package's. Timing: GEMM1 alone and the whole op (whose prologue still
writes the package's bf16 x, which this GEMM1 does not read; x's fold is made by torch before the
timed calls), CUDA-graph replay over the layers, alternating rounds.

Knobs (environment): ``FP8_GEMM1_PROMOTE=n`` the wgmma's ``max_num_imprecise_acc`` (the compiler's
own promotion to fp32 every n elements of K); ``FP8_GEMM1_PSTEPS=n`` this kernel's promotion (a
partial accumulator, added to the fp32 one after every n K steps of 64); ``FP8_GEMM1_BN1`` the fp8
kernel's columns of up and of gate a program (bn1 / 8 warps) and ``FP8_GEMM1_UNCAP=1`` no register
cap at 64-row blocks (the promotions' second accumulator spills in the package's forms).
Results: ``benchmarks/results/fp8_mma.md``.
"""

from __future__ import annotations

import dataclasses
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402

from b12x_ops.backends.triton import gluon_kernels as GK  # noqa: E402

ROUNDS = 5
REPS = 10
# the e4m3 tables of a block: T0 = bytes of codes 0..3, T1 of codes 4..7, for t = u - 5:
# T0 = u * 0x08080800 + 0x14100800, T1 = u * 0x08080808 + 0x24201C18 (u = t + 5 in [0, 11])
_T0_MUL, _T0_ADD, _T1_MUL, _T1_ADD = 0x08080800, 0x14100800, 0x08080808, 0x24201C18
WINDOW = 11  # a row's scale bytes within this many of its largest: the decode is exact


def _decode_fp8_source() -> str:
    """The asm, two words of one block and lane: ``$4``/``$5`` the words of h = 0/1, ``$6`` a word
    whose bytes 0 and 1 are ``u`` of rows r0 and r0 + 8 (``$7`` unused); ``$0``/``$1`` quad A of
    h = 0/1 (row r0), ``$2``/``$3`` quad B (row r0 + 8)."""
    lines = ["{", ".reg .b32 ua, ub, a0, a1, b0, b1, s, m;",
             "prmt.b32 ua, $6, 0, 0x4440;", "prmt.b32 ub, $6, 0, 0x4441;",
             f"mad.lo.u32 a0, ua, {_T0_MUL:#x}, {_T0_ADD:#x};", f"mad.lo.u32 a1, ua, {_T1_MUL:#x}, {_T1_ADD:#x};",
             f"mad.lo.u32 b0, ub, {_T0_MUL:#x}, {_T0_ADD:#x};", f"mad.lo.u32 b1, ub, {_T1_MUL:#x}, {_T1_ADD:#x};"]
    for w, qa, qb in (("$4", "$0", "$2"), ("$5", "$1", "$3")):
        lines += [f"and.b32 s, {w}, 0x7777;", "prmt.b32 m, a0, a1, s;", f"lop3.b32 {qa}, m, {w}, 0x80808080, 0xF8;",
                  f"shr.b32 s, {w}, 16;", "and.b32 s, s, 0x7777;", "prmt.b32 m, b0, b1, s;",
                  f"shl.b32 s, {w}, 4;", f"lop3.b32 {qb}, m, s, 0x80808080, 0xF8;"]
    return "\n".join(lines + ["}", ""])


def repack_fp8(codes: torch.Tensor) -> torch.Tensor:
    """``[E, R, KH]`` MXFP4 code bytes (``R`` a multiple of 16) in the layout above:
    ``[E, R / 16, ceil(KH / 32), 32, 16]`` uint8."""
    E, R, KH = codes.shape
    G, Q = R // 16, -(-KH // 32)
    c = codes
    if Q * 32 != KH:
        c = torch.nn.functional.pad(c, (0, Q * 32 - KH))
    c = c.to(torch.int64)
    nib = torch.stack((c & 15, c >> 4), dim=-1).view(E, G, 2, 8, Q, 2, 2, 4, 4)  # e, g, rh, r0, q, b, h, c, i
    mag, sign = nib & 7, nib >> 3
    i = torch.arange(4, device=codes.device)
    a = ((mag[:, :, 0] << (4 * i)) | (sign[:, :, 0] << (8 * i + 7))).sum(-1)
    b = ((mag[:, :, 1] << (16 + 4 * i)) | (sign[:, :, 1] << (8 * i + 3))).sum(-1)
    word = a | b  # [e, g, r0, q, b, h, c], every bit set once
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
    # -> [e, g, q, r0, c, b, h]: lane (r0, c), its words (b, h); little-endian bytes
    return word.permute(0, 1, 3, 2, 6, 4, 5).contiguous().view(torch.uint8).view(E, G, Q, 32, 16)


def row_refs(scales: torch.Tensor):
    """``(ref, fw, ok)`` of ``[E, R, KS]`` scale bytes: each row's largest byte (int32), its
    epilogue factor ``2^(ref - 133)`` (fp32), and whether every byte is within ``WINDOW`` of it."""
    s = scales.to(torch.int32)
    ref = s.amax(-1)
    fw = torch.exp2((ref - 133).float())
    return ref.contiguous(), fw.contiguous(), bool(((ref[..., None] - s) <= WINDOW).all())


def fold_x(x: torch.Tensor):
    """``(x8, fx)``: x's MXFP8 quant-dequant over its token's largest block scale as e4m3 bytes, and that scale."""
    from b12x_ops.mx import quant_dequant_mxfp8

    xf = x.float()
    dq = quant_dequant_mxfp8(xf)
    amax = xf.abs().amax(-1) * (1.0 / 448.0)
    bits = amax.view(torch.int32)
    up = torch.where((bits & 0x7FFFFF) != 0, (bits + 0x800000) & 0x7F800000, bits)
    fx = torch.where(up == 0, torch.ones_like(amax), up.view(torch.float32))
    return (dq / fx[:, None]).to(torch.float8_e4m3fn).contiguous(), fx.contiguous()


def check():
    """On the CPU: the layout against the checkpoint's codes, and the asm (on the PTX emulator of
    ``tests/test_ptx_decode.py``) against the e4m3 value of every code at every ``t`` in the window."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(_HERE)), "tests"))
    from test_ptx_decode import run_asm

    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (2, 32, 80), dtype=torch.uint8, generator=g)  # K = 160: a padded chunk
    packed = repack_fp8(codes)
    words = packed.view(2, 2, 3, 32, 4, 4).view(torch.int32).view(2, 2, 3, 8, 4, 2, 2)  # e, g, q, r0, c, b, h
    k = torch.arange(160)
    nib = torch.stack((codes.to(torch.int64) & 15, codes.to(torch.int64) >> 4), -1).view(2, 32, 160)
    bad = 0
    for e in range(2):
        for row in range(32):
            gg, rh, r0 = row // 16, (row // 8) % 2, row % 8
            for kk in k.tolist():
                q, b, h, c, i = kk // 64, (kk // 32) % 2, (kk // 16) % 2, (kk // 4) % 4, kk % 4
                w = int(words[e, gg, q, r0, c, b, h]) & 0xFFFFFFFF
                mag = (w >> (16 * rh + 4 * i)) & 7
                sign = (w >> (8 * i + (3 if rh else 7))) & 1
                bad += (mag | (sign << 3)) != int(nib[e, row, kk])
    assert bad == 0, f"layout: {bad} codes misplaced"
    src = _decode_fp8_source()
    fp8 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    checked = 0
    for u in range(WINDOW + 1):
        t = u - 5
        for trial in range(40):
            w0, w1 = (int(torch.randint(0, 1 << 32, (1,), generator=g)) for _ in range(2))
            ub = int(torch.randint(0, WINDOW + 1, (1,), generator=g)) if trial % 2 else u
            regs = run_asm(src, {"$4": w0, "$5": w1, "$6": u | (ub << 8), "$7": 0})
            for w, qa, qb in ((w0, "$0", "$2"), (w1, "$1", "$3")):
                for i in range(4):
                    for quad, rh, tt in ((qa, 0, t), (qb, 1, ub - 5)):
                        code = (((w >> (16 * rh + 4 * i)) & 7) | (((w >> (8 * i + (3 if rh else 7))) & 1) << 3))
                        want = (-1.0 if code & 8 else 1.0) * e2m1[code & 7] * 2.0 ** tt
                        got = float(fp8[(regs[quad] >> (8 * i)) & 0xFF])
                        assert got == want and (got != 0 or (regs[quad] >> (8 * i)) & 0x80 == (code & 8) << 4), \
                            (u, ub, hex(w), i, rh, got, want)
                        checked += 1
    print(f"layout: every code of a 2 x 32 x 160 tile in place; asm: {checked} decoded weights exact "
          f"(t = -5 .. 6, both rows)")


if GK.HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from b12x_ops.backends.triton.gluon_kernels import (_barrier, _operand_sources, _split_order, _tile_index,
                                                        warpgroup_mma, warpgroup_mma_wait)
    from b12x_ops.backends.triton.kernels import _block_tile, _swiglu
    from b12x_ops.backends.triton.mxtl import mxfp8_apply, mxfp8_block_scale
    from experiments.fp8_probe import _a8, _copies8, _mma8, _ring8, _x8

    _DECODE_FP8 = gl.constexpr(_decode_fp8_source())
    # FP8_GEMM1_PROMOTE=n: the wgmma's ``max_num_imprecise_acc`` (n elements of K accumulated in the
    # tensor cores' reduced precision, then added to the fp32 accumulator by the compiler's partial
    # accumulator); unset: sm_90's default (never)
    PROMOTE = gl.constexpr(int(os.environ.get("FP8_GEMM1_PROMOTE", "0")))
    # FP8_GEMM1_PSTEPS=n (1, 2 or 4): the kernel's own promotion, every n K steps of 64: a step's MMAs
    # accumulate into a partial accumulator (the first of n steps overwriting it), and after the n-th
    # the program waits for them and adds the partial sums to its fp32 accumulator
    PSTEPS = gl.constexpr(int(os.environ.get("FP8_GEMM1_PSTEPS", "0")))

    @gluon.jit
    def _decode(codes, sb, off, G: gl.constexpr, Q: gl.constexpr, R: gl.constexpr, BM: gl.constexpr,
                BK: gl.constexpr, code_l: gl.constexpr):
        """A loaded ``[G, Q, 32, 16]`` code tile (``code_l``), its scale bytes ``[G, Q, 32, 2 b, 2 rh]``
        and the rows' ``off = 11 - ref`` (``[G, 1, 32, 1, 2]``) -> the e4m3 operand ``[R, BK]``."""
        NW: gl.constexpr = R // 16
        u = sb + off  # (t + 5 of each row and block)
        u0, u1 = gl.split(u)  # rows r0, r0 + 8: [G, Q, 32, 2 b]
        p6: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2, 2, 4], [1, 1, 32, 1, 1, 1], [NW, 1, 1, 1, 1, 1],
                                            [5, 4, 3, 2, 1, 0])
        s4: gl.constexpr = gl.SliceLayout(4, gl.SliceLayout(5, p6))
        u0 = gl.expand_dims(gl.expand_dims(gl.convert_layout(u0, s4), 4), 5)
        u1 = gl.expand_dims(gl.expand_dims(gl.convert_layout(u1, s4), 4), 5)
        jj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, p6))))))
        jj = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(jj, 0), 0), 0), 0), 0)
        z = gl.full([G, Q, 32, 2, 2, 4], 0, gl.int32, layout=p6)
        uu = gl.where(jj == 0, u0 + z, gl.where(jj == 1, u1 + z, z))
        uu = gl.convert_layout(gl.reshape(uu.to(gl.uint8), (G, Q, 32, 16)), code_l)
        qa, qb = gl.inline_asm_elementwise(_DECODE_FP8, "=r,=r,=r,=r,r,r,r,r", [codes, uu],
                                           dtype=(gl.float8e4nv, gl.float8e4nv), is_pure=True, pack=8)
        w = gl.reshape(gl.join(qa, qb), (G, Q, 8, 4, 2, 2, 4, 2))  # g, q, r0, c, b, h, i, rh
        w = gl.reshape(gl.permute(w, (0, 7, 2, 1, 4, 5, 3, 6)), (R, BK))  # g, rh, r0 | q, b, h, c, i
        return gl.convert_layout(w, _a8(R, BM))

    @gluon.jit
    def _step(k0, acc, part, sb, off, cur, nxt, c_src, c_ok, s_src, s_ok, sblk, x_rows, rvalid_x, RED: gl.constexpr,
              R: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, code_l: gl.constexpr,
              FIRST: gl.constexpr, LAST: gl.constexpr):
        G: gl.constexpr = R // 16
        Q: gl.constexpr = BK // 64
        KS: gl.constexpr = RED // 32
        NQ: gl.constexpr = (RED // 2 + 31) // 32
        D: gl.constexpr = STAGES - 2
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, _x8(R, BK)))
        q_c = gl.arange(0, Q, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, code_l))))
        async_copy.wait_group(D - 1)
        _barrier()
        _copies8(k0 + D * BK, nxt, c_src, c_ok, x_rows, rvalid_x, offs_k, q_c, RED, NQ)
        async_copy.commit_group()
        w8 = _decode(cur[0].load(code_l), sb, off, G, Q, R, BM, BK, code_l)
        kn = k0 + BK
        sb = gl.load(s_src + kn // 32, mask=s_ok & ((kn // 32 + sblk) < KS), other=0).to(gl.int32)
        # (triton 3.6's wait takes no 8-bit operands in its list: see ``fp8_probe``; the SASS check
        # ``compile_offline.wgmma_operand_hazards`` tells whether ptxas kept the registers apart)
        if PSTEPS:
            part = warpgroup_mma(w8, cur[1].permute((1, 0)), part, use_acc=not FIRST, is_async=True)
            if LAST:
                part = warpgroup_mma_wait(num_outstanding=0, deps=[part])
                acc = acc + part
            else:
                part = warpgroup_mma_wait(num_outstanding=1, deps=[part])
        else:
            if PROMOTE:
                acc = warpgroup_mma(w8, cur[1].permute((1, 0)), acc, is_async=True, max_num_imprecise_acc=PROMOTE)
            else:
                acc = warpgroup_mma(w8, cur[1].permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        return acc, part, sb, w8

    @gluon.jit
    def _mainloop(w_g, gvalid, s_row, s_ok, off, x_rows, rvalid_x, RED: gl.constexpr, R: gl.constexpr,
                  BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, code_l: gl.constexpr, s5_l: gl.constexpr):
        KS: gl.constexpr = RED // 32
        NQ: gl.constexpr = (RED // 2 + 31) // 32
        D: gl.constexpr = STAGES - 2
        NSTEP: gl.constexpr = (RED + BK - 1) // BK
        ring = _ring8(R, BM, BK, STAGES)
        c_src, c_ok, s_src, sblk = _operand_sources(w_g, gvalid, s_row, R, BK, code_l, s5_l)
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, _x8(R, BK)))
        q_c = gl.arange(0, BK // 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, code_l))))
        for i0 in gl.static_range(STAGES - 2):
            if i0 * BK < RED:
                _copies8(i0 * BK, ring[i0], c_src, c_ok, x_rows, rvalid_x, offs_k, q_c, RED, NQ)
            async_copy.commit_group()
        sb = gl.load(s_src, mask=s_ok & (sblk < KS), other=0).to(gl.int32)
        acc = gl.zeros([R, BM], gl.float32, layout=_mma8(R, BM))
        part = gl.zeros([R, BM], gl.float32, layout=_mma8(R, BM))
        K1: gl.constexpr = NSTEP % STAGES
        P: gl.constexpr = max(PSTEPS, 1)
        gl.static_assert(STAGES % P == 0)
        for p in gl.static_range(K1):  # (a group of their own)
            acc, part, sb, w8 = _step(p * BK, acc, part, sb, off, ring[p], ring[(p + D) % STAGES], c_src, c_ok, s_src,
                                      s_ok, sblk, x_rows, rvalid_x, RED, R, BM, BK, STAGES, code_l, p == 0,
                                      p == K1 - 1)
        for kk in range(NSTEP // STAGES):
            for s in gl.static_range(STAGES):
                acc, part, sb, w8 = _step((K1 + STAGES * kk + s) * BK, acc, part, sb, off, ring[(K1 + s) % STAGES],
                                          ring[(K1 + s + D) % STAGES], c_src, c_ok, s_src, s_ok, sblk, x_rows,
                                          rvalid_x, RED, R, BM, BK, STAGES, code_l, s % P == 0, s % P == P - 1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        async_copy.wait_group(0)
        _barrier()
        return acc

    @gluon.jit
    def _block(pid_m, pid_n, e, nrow, x8_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, fw_ptr, fx_ptr, ref_ptr,
               K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr, UP_FIRST: gl.constexpr,
               HAS_LIMIT: gl.constexpr, HAS_GS: gl.constexpr, BLK: gl.constexpr, BM: gl.constexpr,
               BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, code_l: gl.constexpr, s5_l: gl.constexpr):
        """``gluon_kernels._gemm1_block`` on e4m3: x's folded bytes, the fp8 layout's codes, the folds undone
        in the epilogue."""
        R: gl.constexpr = 2 * BN
        G: gl.constexpr = R // 16
        KS: gl.constexpr = K // 32
        NQ: gl.constexpr = (K // 2 + 31) // 32
        UP0: gl.constexpr = 0 if UP_FIRST else N
        GATE0: gl.constexpr = N if UP_FIRST else 0
        NW: gl.constexpr = R // 16
        x_l: gl.constexpr = _x8(R, BK)
        offs_r = gl.arange(0, BM, layout=gl.SliceLayout(1, x_l))
        rvalid_x = offs_r < nrow
        slot_x = gl.load(sorted_ptr + pid_m * BLK + offs_r, mask=rvalid_x, other=0)
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, x_l))
        x_rows = x8_ptr.to(gl.pointer_type(gl.float8e4nv)) + (slot_x // TOPK).to(gl.int64)[:, None] * K + offs_k[None, :]
        g_c, q_c, l_c, b_c, g_s, q_s, l_s, s_s, h_s = _tile_index(R, BK, code_l, s5_l)
        gh = g_c % (G // 2)
        gw = gl.where(g_c < G // 2, (pid_n * BN + UP0) // 16, (pid_n * BN + GATE0) // 16) + gh
        w_g = w_ptr + e.to(gl.int64) * (2 * N * NQ * 32) + gw * (NQ * 512)
        gvalid = (pid_n * BN + 16 * gh) < N
        r_s = (pid_n * BN + 16 * (g_s % (G // 2)))[:, None, None, None, None] + 8 * h_s[None, None, None, None, :] \
            + (l_s // 4)[None, None, :, None, None]
        w_row = r_s + gl.where(g_s < G // 2, UP0, GATE0)[:, None, None, None, None]
        s_row = s_ptr + e.to(gl.int64) * (2 * N * KS) + w_row * KS
        off = 11 - gl.load(ref_ptr + e * (2 * N) + w_row, mask=r_s < N, other=0)
        acc = _mainloop(w_g, gvalid, s_row, r_s < N, off, x_rows, rvalid_x, K, R, BM, BK, STAGES, code_l, s5_l)
        EPT: gl.constexpr = BM // NW
        ep_l: gl.constexpr = gl.BlockedLayout([EPT, 1], [32 // EPT, EPT], [1, NW], [0, 1])
        acc_s = gl.allocate_shared_memory(gl.float32, [R, BM], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        acc_s.store(_split_order(acc, R, BM))
        _barrier()
        offs_m = gl.arange(0, BM, layout=gl.SliceLayout(0, ep_l))
        rvalid = offs_m < nrow
        rows = (pid_m * BLK + offs_m).to(gl.int64)
        fx = gl.load(fx_ptr + gl.load(sorted_ptr + pid_m * BLK + offs_m, mask=rvalid, other=0) // TOPK, mask=rvalid,
                     other=0.0)
        offs_c = gl.arange(0, 32, layout=gl.SliceLayout(1, ep_l))
        orig = gl.where(offs_c < 16, 2 * offs_c, 2 * (offs_c - 16) + 1)  # (acc_s's split order: the row each holds)
        for jn in gl.static_range(BN // 32):
            col = pid_n * BN + 32 * jn + orig
            cok = col < N
            fu = gl.load(fw_ptr + e * (2 * N) + UP0 + col, mask=cok, other=0.0)
            fg = gl.load(fw_ptr + e * (2 * N) + GATE0 + col, mask=cok, other=0.0)
            up = acc_s.slice(32 * jn, 32).load(ep_l) * fu[:, None] * fx[None, :]
            gate = acc_s.slice(BN + 32 * jn, 32).load(ep_l) * fg[:, None] * fx[None, :]
            act = _swiglu(up, gate, gs_ptr, e, limit, HAS_GS, HAS_LIMIT)
            pow2, inv = mxfp8_block_scale(gl.max(gl.abs(act), axis=0))
            q = mxfp8_apply(act, pow2[None, :], inv[None, :])
            offs_s = pid_n * BN + 32 * jn + offs_c
            gl.store(a_ptr + rows[None, :] * N + offs_s[:, None], q, mask=rvalid[None, :] & (offs_s < N)[:, None])

    @gluon.jit(do_not_specialize=("nblocks", "zrows", "M"))
    def gemm1_fp8_kernel(
        xq_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, acc_ptr,
        nblocks, limit, zrows, M, fw_ptr, fx_ptr, ref_ptr,
        K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr, UP_FIRST: gl.constexpr,
        HAS_LIMIT: gl.constexpr, HAS_GS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
        BK: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr,
        code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr, x_l: gl.constexpr, mma_h: gl.constexpr,
        a_l_h: gl.constexpr, HALF: gl.constexpr, ZERO_ACC: gl.constexpr,
    ):
        """``gluon_kernels.gemm1_gluon_kernel``'s program on e4m3 (its arguments, and three more: the rows'
        epilogue factors and largest scale bytes, the tokens' x factors; ``xq_ptr`` x's folded e4m3 bytes,
        ``w_ptr`` the codes in ``repack_fp8``'s layout)."""
        gl.static_assert(ZERO_ACC == 0)
        pid_m, pid_n, e = _block_tile(blk_expert_ptr, N, BN)
        if e < 0:
            return
        nrow = gl.load(blk_rows_ptr + pid_m)
        if HALF:
            if nrow <= BM // 2:
                _block(pid_m, pid_n, e, nrow, xq_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, fw_ptr, fx_ptr,
                       ref_ptr, K, N, TOPK, UP_FIRST, HAS_LIMIT, HAS_GS, BM, BM // 2, BN, BK, STAGES, code_l, s5_l)
            else:
                _block(pid_m, pid_n, e, nrow, xq_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, fw_ptr, fx_ptr,
                       ref_ptr, K, N, TOPK, UP_FIRST, HAS_LIMIT, HAS_GS, BM, BM, BN, BK, STAGES, code_l, s5_l)
        else:
            _block(pid_m, pid_n, e, nrow, xq_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, fw_ptr, fx_ptr,
                   ref_ptr, K, N, TOPK, UP_FIRST, HAS_LIMIT, HAS_GS, BM, BM, BN, BK, STAGES, code_l, s5_l)


def use(layers):
    """Make the plans launch ``gemm1_fp8_kernel`` where they would launch the Gluon GEMM1, with each
    layer's fp8 operands: ``layers`` maps the handle's W13 code pointer to ``(w13 in repack_fp8's
    layout, fw, ref, x8, fx)``. Returns the undo."""
    from b12x_ops.backends.triton import plan as P

    original, call = GK.gemm1_gluon_kernel, P.Launch.__call__

    def swapped(self, grid, *args):
        if self.fn is gemm1_fp8_kernel:
            w13 = args[4]  # (a compiled launch gets the handle's tensors as addresses: backends.triton._operands)
            w8, fw, ref, x8, fx = layers[w13 if isinstance(w13, int) else w13.data_ptr()]
            args = (x8,) + args[1:4] + (w8,) + args[5:] + (fw, fx, ref)
        return call(self, grid, *args)

    GK.gemm1_gluon_kernel, P.Launch.__call__ = gemm1_fp8_kernel, swapped

    def undo():
        GK.gemm1_gluon_kernel, P.Launch.__call__ = original, call

    return undo


def main():
    if sys.argv[1] == "check":
        check()
        return
    from b12x_ops.backends.triton import _ALL, _launch_all
    from b12x_ops.backends.triton import layout as L
    from b12x_ops.backends.triton import plan as P
    from bench_moe import experiment_points, rel_l2, time_events, warm_graph

    names = sys.argv[1].split(",")
    sizes = [int(m) for m in sys.argv[2].split(",")]
    parts = (("gemm1",), _ALL)
    for name, hs, M, (xs, idss, wss, outs) in experiment_points(names, sizes):
        gp = hs[0]._state.plans
        cfg = gp.with_gluon(P.default_config(M, gp.geometry), M)
        print(f"{name} M={M} bm={cfg.bm} GEMM1 {'Gluon' if cfg.gluon else 'tl.dot'} {(cfg.bn1, cfg.bk1, cfg.stages1)}"
              f" max_num_imprecise_acc={(PROMOTE.value or None) if GK.HAS_GLUON else None}"
              f" promotion every {(PSTEPS.value or None) if GK.HAS_GLUON else None} steps", flush=True)
        if not cfg.gluon or cfg.atomic and P.acc_zero_in_gemm1(cfg):
            print("  skipped: not a Gluon GEMM1 plan with the zeros in the prologue", flush=True)
            continue
        gp.reserve(M, cfg)
        layers, ok = {}, True
        for h, x in zip(hs, xs):
            st = h._state
            w13, s13 = st.w13, st.w13_scale
            ref, fw, inside = row_refs(s13)
            ok = ok and inside
            codes = L.unpack_codes(w13, gp.geometry.hidden_size // 2)
            x8, fx = fold_x(x)
            layers[w13.data_ptr()] = (repack_fp8(codes), fw, ref, x8, fx)
        if not ok:
            print(f"  skipped: a row's scale bytes span more than {WINDOW}", flush=True)
            continue
        rows = list(zip(hs, xs, idss, wss, outs))
        graphs, got = {}, {}

        def forget():
            for k in [k for k in gp.launches if k[0] == "gemm1_gluon"]:
                del gp.launches[k]

        # the fp8 kernel's tile (FP8_GEMM1_BN1: columns of up and of gate a program, bn1 / 8 warps) and
        # register cap (FP8_GEMM1_UNCAP=1: none at 64-row blocks): its promotion's second accumulator
        # spills in the package's forms
        cfg8 = cfg
        if os.environ.get("FP8_GEMM1_BN1"):
            bn1 = int(os.environ["FP8_GEMM1_BN1"])
            cfg8 = dataclasses.replace(cfg, bn1=bn1, warps1=bn1 // 8)
        gp.reserve(M, cfg8)
        cap = P.GLUON_BM64_MAXNREG
        for label in ("package", "fp8"):
            undo = use(layers) if label == "fp8" else (lambda: None)
            c = cfg8 if label == "fp8" else cfg
            if label == "fp8" and os.environ.get("FP8_GEMM1_UNCAP") == "1":
                P.GLUON_BM64_MAXNREG = None
            forget()
            try:
                h, x, i, w, o = rows[0]
                _launch_all(h._state, c, x, i, w, o)
                torch.cuda.synchronize()
                got[label] = o.clone()
                for st in parts:
                    calls = [lambda h=h, x=x, i=i, w=w, o=o, st=st, c=c: _launch_all(h._state, c, x, i, w, o, stages=st)
                             for h, x, i, w, o in rows]
                    graphs[label, st] = warm_graph(calls)
                ck = gp.stages(c, M)[1].compiled
                print(f"  {label}: GEMM1 (bn1 {c.bn1}, {c.warps1} warps) {getattr(ck, 'n_regs', '?')} regs, "
                      f"{getattr(ck, 'n_spills', '?')} spills", flush=True)
            except Exception as ex:  # (a form that fails to compile or launch: say so, go on)
                print(f"  {label}: FAILED {type(ex).__name__}: {str(ex)[-600:]}", flush=True)
            finally:
                undo()
                P.GLUON_BM64_MAXNREG = cap
                forget()
        times = {k: [] for k in graphs}
        for _ in range(ROUNDS):
            for k, g in graphs.items():
                times[k].append(time_events(g.replay, REPS) / len(hs) * 1e6)
        med = {k: sorted(t)[ROUNDS // 2] for k, t in times.items()}
        for label in ("package", "fp8"):
            if (label, _ALL) not in med:
                continue
            cols = [f"{'whole op' if st is _ALL else st[0]} {med[label, st]:8.1f} us "
                    f"({med[label, st] / med['package', st]:5.3f}x)" for st in parts]
            err = f"; whole op rel L2 against the package's {rel_l2(got[label], got['package']):.1e}" \
                if label != "package" else ""
            print(f"  {label:>8}: " + ", ".join(cols) + err, flush=True)
        del graphs
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
