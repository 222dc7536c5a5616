"""The blocked GEMMs in Gluon (``triton.experimental.gluon``): on Hopper the MMAs of one K step run while
the next step's weights are decoded; on other GPUs from sm_80 the same kernels on ``mma.sync`` (the last
paragraph).

``kernels.gemm1_kernel`` and ``gemm2_kernel`` compute the same tiles with ``tl.dot``. There each
step's MMAs finish before the next step's decode, so the decode and the tensor cores take turns;
at large M that bounds them (``benchmarks/NOTES.md``). Gluon spells out what ``tl.dot`` does not
express:

* **asynchronous wgmma with the decoded operand in registers.** Step k's two MMAs (even and odd
  elements) are issued and left in flight (``warpgroup_mma_wait`` with 2 outstanding) while step
  k + 1 is decoded. An in-flight MMA reads its operand registers until a wait covers it, so
  consecutive steps decode into two register sets, alternately, and every wait lists both sets;
  with one set the next decode rewrote registers an MMA still read, which ptxas
  did not catch across the loop (wrong bits in some H200 runs).
  ``compile_offline.wgmma_operand_hazards`` checks the SASS (``tests/test_compile_sm90.py``).
  Launches capped below what both sets need (``plan.GLUON_BM64_MAXNREG``) compile to a wait for
  each step's MMAs instead: ptxas keeps the operands live by waiting;
* **explicit copies, one barrier a step.** The codes and the activations of step k + STAGES - 2
  are copied asynchronously (``cp.async``) into a ring of STAGES buffers (an even count) while step
  k is decoded and multiplied. A buffer is refilled only after every warp has waited for the MMAs
  that read it (the barrier at the top of a step). Each stage's buffers are allocations of their
  own and the loop is unrolled by STAGES, so every step's buffers are known when compiling and the
  compiler's barrier analysis adds no barrier of its own between a step's copies and its reads
  (with one allocation for the ring and a computed index it added two a step). The ring is drained
  (a wait and a barrier) before the epilogue reuses its shared memory;
* **warpgroups of one tile.** A program's ``R / 16`` warps each take a 16-row group of the
  operand's ``R`` rows (a warpgroup 64 rows), or its ``R / 32`` warps two groups each (a warpgroup two
  64-row MMAs a step: the plans' GEMM1 of 16-row blocks, ``plan.GLUON_GEMM1_16``). In GEMM1 the first
  half of the row groups holds the up rows and the rest the gate rows; both read the same
  activations, and the epilogue meets up and gate in shared memory;
* **scale bytes two at a time.** A lane needs the scale bytes of its rows r0 and r0 + 8 for a chunk's
  two 32-element blocks, adjacent in each row: where a row has an even count of blocks they are one
  aligned 16-bit load a row (``_load_scales``), and one register of both rows' loads gives each
  block's two bf16 scales in two instructions (``_scale_pairs``): 9 instructions a step where the
  bytes took 16 (4 loads, each zeroed first for its mask, masked to a byte and shifted into place);
* **wide writes out of the epilogues.** In the accumulator's layout a thread's outputs are 8 rows
  apart, so written from there every element is its own 2-byte store (GEMM1) or 4-byte atomic
  (GEMM2). GEMM1 puts each 32 rows into shared memory in the split layout's order, so a thread's
  elements are adjacent in ``a`` (16-byte stores); GEMM2 converts its tile to 4 adjacent outputs a
  thread (16-byte atomics, ``_out_layout``). H200: 5-7 % off the whole op at 2048-8192 tokens
  (``benchmarks/results/epilogue_writes.md``).

The layouts are the ones ``tl.dot`` is compiled to: the loaded ``[groups, chunks, 32, 16]`` code tile
(a warp a group) becomes the wgmma's first operand after ``mxtl.repacked_to_operand``'s reshape and
permute, and ``convert_layout(..., assert_trivial=True)`` fails the compilation unless that moves no
data. The products, their order within a step and the epilogues' arithmetic are the ``tl.dot``
kernels', so for the same tile and K step both write the same bits (``tests/test_triton_gpu.py``
checks it on the GPU; Triton's CPU interpreter does not run Gluon).

**Other GPUs** (``layouts(..., sync=True)``: an ``mma.sync.m16n8k16`` accumulator, whose layout over the
``[R, BM]`` tile is wgmma's): the decode writes the same A fragments in place (as ``gluon_gemv``'s), each
step loads its activations from the ring into mma.sync's B operand registers, and its MMAs are
synchronous, so one register set serves every step and there is no wait to list. The ring, the copies,
the barrier a step and the epilogues are the ones above. The kernels branch on the layout they are given
(``_sync``).

This module imports where the installed triton has Gluon with Hopper's wgmma and mma_v2 (``HAS_GLUON``);
the plans take the GEMMs from here on sm_90, and on mma.sync on other GPUs from sm_80 where the GEMV runs
there (``plan.gluon_status``), in the forms ``plan.gluon_forms`` picks for a plan's block size
(``Config.gluon``, ``Config.gluon2``).
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait
    # (triton 3.6's name for cp.async into shared memory; later versions call it async_load)
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    # (and its thread_barrier: a CTA barrier, later ``barrier``)
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    HAS_GLUON = True
except ImportError:  # pragma: no cover - a triton without Gluon
    HAS_GLUON = False

from .kernels import _block_tile, _swiglu
from .mxtl import (_DECODE_PTX, _DECODE_PTX_FOLD, _SCALE_PAIRS_PTX, _SCALE_PAIRS_PTX_FOLD, mxfp8_apply,
                   mxfp8_block_scale)

if HAS_GLUON:

    def layouts(rows: int, bm: int, nw: int | None = None, sync: bool = False) -> dict:
        """The layouts of a program of ``rows`` operand rows and ``bm`` block rows in ``nw`` warps (default
        ``rows / 16``): warp w takes the 16-row groups w, w + nw, .. (a warpgroup 64 rows of an MMA, ``rows
        / (4 nw)`` MMAs a step): the kernels' last constexprs. ``mma`` the accumulator (Hopper's wgmma, or
        with ``sync`` sm_80's ``mma.sync.m16n8k16``: the same registers of the same ``[rows, bm]`` tile,
        the kernels branch on it), ``a_l`` the MMA's register operand (what the decode's asm produces in
        place), ``code_l`` the
        loaded ``[G, Q, 32, 16]`` code tile (a lane 16 contiguous bytes a chunk, as
        ``mxtl.load_repacked``), ``p7`` that tile split ``[g, q, lane, s, kh, rh, kk]`` and ``s5_l``
        its scale bytes ``[g, q, lane, s, rh]`` (rows r0 and r0 + 8 of a lane, a chunk's two
        32-element blocks), ``x_l`` the activation copies' ``[bm, bk / 2]`` (16 bytes a thread);
        ``mma_h``, ``a_l_h`` the accumulator and operand of the half tile (``HALF``: bm / 2 rows)."""
        nw = nw or rows // 16
        if (nw % 4 and not sync) or (rows // 16) % nw:
            raise ValueError(f"gluon_kernels.layouts: {nw} warps for {rows} rows (whole warpgroups, whole 16-row "
                             "groups a warp)")
        if sync:  # (``m16n8k16`` tiles: the same layout for any count of columns)
            mma = mma_h = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[nw, 1], instr_shape=[16, 8])
        else:
            mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1], instr_shape=[16, bm, 16])
            mma_h = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                              instr_shape=[16, max(bm // 2, 8), 16])
        p7 = gl.BlockedLayout([1, 1, 1, 2, 2, 2, 2], [1, 1, 32, 1, 1, 1, 1], [nw, 1, 1, 1, 1, 1, 1],
                              [6, 5, 4, 3, 2, 1, 0])
        return dict(mma=mma, a_l=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
                    code_l=gl.BlockedLayout([1, 1, 1, 16], [1, 1, 32, 1], [nw, 1, 1, 1], [3, 2, 1, 0]), p7=p7,
                    s5_l=gl.SliceLayout(4, gl.SliceLayout(6, p7)),
                    x_l=gl.BlockedLayout([1, 8], [4, 8], [nw, 1], [1, 0]),
                    mma_h=mma_h, a_l_h=gl.DotOperandLayout(operand_index=0, parent=mma_h, k_width=2))

    @gluon.constexpr_function
    def _mma_of(mma, rows):
        """``mma`` (the full tile's accumulator layout) for a tile of ``rows`` block rows: the quarter
        tile's (``HALF`` 2), built where it is used so that the kernels' layout arguments stay those of
        ``layouts``. (mma.sync's ``m16n8k16`` tiles hold any count of columns: the same layout.)"""
        if _sync(mma):
            return mma
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=list(mma.warps_per_cta),
                                         instr_shape=[16, max(rows, 8), 16])

    @gluon.constexpr_function
    def _sync(layout):
        """Whether accumulator layout ``layout`` (or an operand layout of one) is mma.sync's (``layouts(...,
        sync=True)``), not wgmma's."""
        return (layout.parent if isinstance(layout, gl.DotOperandLayout) else layout).version[0] == 2

    @gluon.constexpr_function
    def _lead(stages, layout):
        """How many steps ahead of the one multiplied a ring of ``stages`` buffers copies (for MMAs of
        ``layout``, ``_sync``). A step refills the buffers of a step every warp is done with, as the barrier
        at its top shows: wgmma's MMAs of the previous step may still read theirs (``stages - 2``);
        mma.sync's have read their operands before any warp reaches the barrier (``stages - 1``)."""
        return stages - 1 if _sync(layout) else stages - 2

    @gluon.constexpr_function
    def _b_operand_of(a_l):
        """mma.sync's second operand layout beside first operand layout ``a_l`` (loaded from shared memory)."""
        return gl.DotOperandLayout(operand_index=1, parent=a_l.parent, k_width=2)

    @gluon.constexpr_function
    def _operand_of(mma):
        """The wgmma's register operand layout of accumulator layout ``mma`` (``layouts``' ``a_l``)."""
        return gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)

    @gluon.jit
    def _gdc(PDL: gl.constexpr):
        """With ``PDL`` (the launch lets the next kernel start before this one ends): wait until the
        previous kernel has finished and its writes are visible, then let the next one launch
        (``kernels.pdl_start``'s pair). The blocked GEMMs call it first of all; the mma.sync GEMV after the
        loads of its weights, which no kernel writes, and before any other memory access."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _split_order(acc, R: gl.constexpr, BM: gl.constexpr):
        """The ``[R, BM]`` tile with each 32 rows in the split layout's order (``kernels.split_col``:
        the even rows, then the odd ones); a re-indexing of the registers, no data moves."""
        t = gl.reshape(acc, (R // 32, 16, 2, BM))
        return gl.reshape(gl.permute(t, (0, 2, 1, 3)), (R, BM))

    @gluon.constexpr_function
    def _out_layout(rows, bm, nw):
        """GEMM2's ``[rows, bm]`` output tile for its global writes: 4 adjacent outputs a thread, a warp's
        32 lanes along the outputs (128 of one token), the warps along the tokens (as many as there
        are tokens, the rest along the outputs). No element is held twice (``rows >= 128 * nw / bm``
        for the Gluon GEMM2's tiles), so no atomic is issued twice."""
        wt = min(nw, bm)
        assert rows >= 128 * (nw // wt), (rows, bm, nw)
        return gl.BlockedLayout([4, 1], [32, 1], [nw // wt, wt], [0, 1])

    @gluon.jit
    def _to_operand(t, G: gl.constexpr, Q: gl.constexpr, R: gl.constexpr, BKH: gl.constexpr):
        """``mxtl.repacked_to_operand``: a ``[G, Q, 32, 16]`` tile as the ``[R, BKH]`` operand tile."""
        t = gl.reshape(t, (G, Q, 8, 4, 2, 2, 2, 2))  # g, q, r0, c, s, kh, rh, kk
        t = gl.permute(t, (0, 6, 2, 1, 4, 5, 3, 7))  # g, rh, r0, q, s, kh, c, kk
        return gl.reshape(t, (R, BKH))

    @gluon.jit
    def _tile_index(R: gl.constexpr, BK: gl.constexpr, code_l: gl.constexpr, s5_l: gl.constexpr):
        """Index vectors of the code tile (``g, q, lane, byte``) and of its scale bytes
        (``g, q, lane, s, rh``), each in its slice of the kernel's layouts."""
        G: gl.constexpr = R // 16
        Q: gl.constexpr = BK // 64
        g_c = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, code_l))))
        q_c = gl.arange(0, Q, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, code_l))))
        l_c = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, code_l))))
        b_c = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, code_l))))
        g_s = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, s5_l)))))
        q_s = gl.arange(0, Q, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, s5_l)))))
        l_s = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, s5_l)))))
        s_s = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, s5_l)))))
        h_s = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, s5_l)))))
        return g_c, q_c, l_c, b_c, g_s, q_s, l_s, s_s, h_s

    @gluon.jit
    def _mainloop(w_g, gvalid, s_row, s_ok, x_rows, rvalid_x, RED: gl.constexpr, R: gl.constexpr, BM: gl.constexpr,
                  BK: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr,
                  code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr, x_l: gl.constexpr):
        """``W tile @ rows^T`` over the reduction (length ``RED``), fp32 ``[R, BM]`` in the wgmma layout.

        ``w_g``: ``[G]`` pointers to the tile's repacked row groups (``gvalid``: which exist);
        ``s_row``: ``[G, 1, 32, 1, 2]`` pointers to the scale bytes of each lane's rows (``s_ok``:
        which exist); ``x_rows``: ``[BM, BKH]`` pointers to the activations a step's even elements
        start at (split layout; the odd ones are 16 further), ``rvalid_x`` which rows are real.
        In three parts a persistent kernel can also call apart: the ring (``_ring``), its first
        copies (``_prefill``) and the steps (``_steps``)."""
        ring = _ring(R, BM, BK, STAGES)
        c_src, c_ok, s_src, sblk = _operand_sources(w_g, gvalid, s_row, R, BK, code_l, s5_l)
        _prefill(ring, c_src, c_ok, x_rows, rvalid_x, RED, BK, STAGES, code_l, x_l, _lead(STAGES, mma))
        return _steps(ring, c_src, c_ok, s_src, s_ok, sblk, x_rows, rvalid_x, RED, R, BM, BK, STAGES, FOLD, mma, a_l,
                      code_l, p7, x_l)

    @gluon.jit
    def _ring(R: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
        """``_mainloop``'s ring of STAGES (codes, even activations, odd activations) buffers.

        One allocation a stage and a buffer kind, so that every buffer a step touches is known at
        compile time (the loop is unrolled by a multiple of STAGES) and the compiler's barrier
        analysis sees that a step's copies (into step k + D's buffers) and its reads (step k's)
        touch different allocations: one barrier a step, the one in ``_step``."""
        BKH: gl.constexpr = BK // 2
        x_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, BKH * 2), element_bitwidth=16, rank=2)
        c_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
        ring = ()
        for i0 in gl.static_range(STAGES):
            ring = ring + ((gl.allocate_shared_memory(gl.uint8, [R // 16, BK // 64, 32, 16], c_sl),
                            gl.allocate_shared_memory(gl.bfloat16, [BM, BKH], x_sl),
                            gl.allocate_shared_memory(gl.bfloat16, [BM, BKH], x_sl)),)
        return ring

    @gluon.jit
    def _operand_sources(w_g, gvalid, s_row, R: gl.constexpr, BK: gl.constexpr, code_l: gl.constexpr,
                         s5_l: gl.constexpr):
        """The code tile's copy sources and their mask, and the scale bytes' (a step's first 32-element
        blocks): ``(c_src, c_ok, s_src, sblk)`` (``_mainloop``'s arguments)."""
        g_c, q_c, l_c, b_c, g_s, q_s, l_s, s_s, h_s = _tile_index(R, BK, code_l, s5_l)
        c_src = (w_g[:, None, None, None] + (q_c[None, :, None, None] * 32 + l_c[None, None, :, None]) * 16
                 + b_c[None, None, None, :])
        c_ok = gvalid[:, None, None, None] & (l_c >= 0)[None, None, :, None] & (b_c >= 0)[None, None, None, :]
        sblk = 2 * q_s[None, :, None, None, None] + s_s[None, None, None, :, None]  # 32-element block of the step
        return c_src, c_ok, s_row + sblk, sblk

    @gluon.jit
    def _prefill(ring, c_src, c_ok, x_rows, rvalid_x, RED: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                 code_l: gl.constexpr, x_l: gl.constexpr, D: gl.constexpr):
        """The first ``D`` steps' copies (``_lead``) into the ring's first buffers, a group each (an empty
        group past the reduction's end)."""
        BKH: gl.constexpr = BK // 2
        KH: gl.constexpr = RED // 2
        NQ: gl.constexpr = (KH + 31) // 32
        offs_hx = gl.arange(0, BKH, layout=gl.SliceLayout(0, x_l))
        q_c = gl.arange(0, BK // 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, code_l))))
        for i0 in gl.static_range(D):
            if i0 * BK < RED:
                _copies(i0 * BK, ring[i0], c_src, c_ok, x_rows, rvalid_x, offs_hx, q_c, KH, NQ)
            async_copy.commit_group()

    @gluon.jit
    def _steps(ring, c_src, c_ok, s_src, s_ok, sblk, x_rows, rvalid_x, RED: gl.constexpr, R: gl.constexpr,
               BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr, mma: gl.constexpr,
               a_l: gl.constexpr, code_l: gl.constexpr, p7: gl.constexpr, x_l: gl.constexpr):
        """``_mainloop``'s steps once ``_prefill``'s copies are out: the fp32 ``[R, BM]`` accumulator,
        the ring drained (every copy landed, every warp past its reads)."""
        BKH: gl.constexpr = BK // 2
        KS: gl.constexpr = RED // 32
        D: gl.constexpr = _lead(STAGES, mma)
        NSTEP: gl.constexpr = (RED + BK - 1) // BK
        sb = _load_scales(s_src, s_ok & (sblk < KS), KS % 2 == 0)  # (scale bytes: a step ahead)
        acc = gl.zeros([R, BM], gl.float32, layout=mma)
        gl.static_assert(STAGES % 2 == 0)
        K1: gl.constexpr = NSTEP % STAGES
        if _sync(mma):
            # mma.sync: each step's MMAs read their registers before the next instruction that writes
            # them may issue, so one register set serves every step (the tensor cores still run under the
            # next step's decode: nothing there waits for the accumulator)
            for p in gl.static_range(K1):
                acc, sb, _, _ = _step(p * BK, acc, sb, ring[p], ring[(p + D) % STAGES], c_src, c_ok, s_src, s_ok,
                                      sblk, x_rows, rvalid_x, RED, R, BM, BK, STAGES, FOLD, a_l, code_l, p7, x_l)
            for kk in range(NSTEP // STAGES):
                for s in gl.static_range(STAGES):
                    acc, sb, _, _ = _step((K1 + STAGES * kk + s) * BK, acc, sb, ring[(K1 + s) % STAGES],
                                          ring[(K1 + s + D) % STAGES], c_src, c_ok, s_src, s_ok, sblk, x_rows,
                                          rvalid_x, RED, R, BM, BK, STAGES, FOLD, a_l, code_l, p7, x_l)
        else:
            # Step k's MMAs read its operands from registers until the wait after step k + 1's MMAs, so
            # consecutive steps decode into two register sets (A, B, A, ...), and each wait lists both
            # sets, so that neither is dead (free for the other step's decode) while its MMAs may run.
            # The loop takes STAGES steps a trip (an even count: every step's buffers and register set
            # are known at compile time); the NSTEP % STAGES steps left over run first, before the loop,
            # in the sets that end on B. (``compile_offline.wgmma_operand_hazards`` checks the SASS.)
            we_a = gl.zeros([R, BKH], gl.bfloat16, layout=a_l)
            wo_a = gl.zeros([R, BKH], gl.bfloat16, layout=a_l)
            we_b = gl.zeros([R, BKH], gl.bfloat16, layout=a_l)
            wo_b = gl.zeros([R, BKH], gl.bfloat16, layout=a_l)
            for p in gl.static_range(K1):
                acc, sb, we_a, wo_a, we_b, wo_b = _step_in_set(
                    (K1 - p) % 2 == 1, p * BK, acc, sb, we_a, wo_a, we_b, wo_b, ring[p], ring[(p + D) % STAGES], c_src,
                    c_ok, s_src, s_ok, sblk, x_rows, rvalid_x, RED, R, BM, BK, STAGES, FOLD, a_l, code_l, p7, x_l)
            for kk in range(NSTEP // STAGES):
                for s in gl.static_range(STAGES):
                    acc, sb, we_a, wo_a, we_b, wo_b = _step_in_set(
                        s % 2 == 1, (K1 + STAGES * kk + s) * BK, acc, sb, we_a, wo_a, we_b, wo_b,
                        ring[(K1 + s) % STAGES], ring[(K1 + s + D) % STAGES], c_src, c_ok, s_src, s_ok, sblk, x_rows,
                        rvalid_x, RED, R, BM, BK, STAGES, FOLD, a_l, code_l, p7, x_l)
            acc, we_a, wo_a, we_b, wo_b = warpgroup_mma_wait(num_outstanding=0, deps=[acc, we_a, wo_a, we_b, wo_b])
        # every thread's copies (those past the last step write zeros) have landed and every warp is
        # past its last read of the ring before the caller's shared memory may reuse it
        async_copy.wait_group(0)
        _barrier()
        return acc

    @gluon.jit
    def _step_in_set(B: gl.constexpr, k0, acc, sb, we_a, wo_a, we_b, wo_b, cur, nxt, c_src, c_ok, s_src, s_ok, sblk,
                     x_rows, rvalid_x, RED: gl.constexpr, R: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
                     STAGES: gl.constexpr, FOLD: gl.constexpr, a_l: gl.constexpr, code_l: gl.constexpr,
                     p7: gl.constexpr, x_l: gl.constexpr):
        """``_step`` decoding into register set B (else A), then the wait that leaves its two MMAs and
        the previous step's in flight, listing both sets: ``(acc, sb, we_a, wo_a, we_b, wo_b)``."""
        acc, sb, we, wo = _step(k0, acc, sb, cur, nxt, c_src, c_ok, s_src, s_ok, sblk, x_rows, rvalid_x, RED, R, BM,
                                BK, STAGES, FOLD, a_l, code_l, p7, x_l)
        if B:
            we_b, wo_b = we, wo
        else:
            we_a, wo_a = we, wo
        acc, we_a, wo_a, we_b, wo_b = warpgroup_mma_wait(num_outstanding=2, deps=[acc, we_a, wo_a, we_b, wo_b])
        return acc, sb, we_a, wo_a, we_b, wo_b

    @gluon.jit
    def _copies(kd, bufs, c_src, c_ok, x_rows, rvalid_x, offs_hx, q_c, KH: gl.constexpr, NQ: gl.constexpr):
        """The asynchronous copies of the step starting at reduction element ``kd`` into ``bufs``
        (codes, even and odd activations); past the reduction's end every element is masked: no
        global read, but the copy still writes its zeros."""
        xm = rvalid_x[:, None] & ((kd // 2 + offs_hx) < KH)[None, :]
        _cp_async(bufs[1], x_rows + kd, mask=xm)
        _cp_async(bufs[2], x_rows + kd + 16, mask=xm)
        _cp_async(bufs[0], c_src + (kd // 64) * 512, mask=c_ok & ((kd // 64 + q_c) < NQ)[None, :, None, None])

    @gluon.jit
    def _step(k0, acc, sb, cur, nxt, c_src, c_ok, s_src, s_ok, sblk, x_rows, rvalid_x,
              RED: gl.constexpr, R: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              FOLD: gl.constexpr, a_l: gl.constexpr, code_l: gl.constexpr, p7: gl.constexpr, x_l: gl.constexpr):
        """``_mainloop``'s step at reduction element ``k0``: wait for its copies (in ``cur``), start the
        copies of the step ``_lead`` ahead (into ``nxt``, the buffers of the step two back on wgmma, the
        previous step's on mma.sync), decode
        (the previous step's MMAs still run), issue the two MMAs on the decoded registers, load the
        next step's scale bytes. Returns ``(acc, next scale bytes, even operand, odd operand)``: the
        caller keeps the operands live until a wait covers the MMAs."""
        BKH: gl.constexpr = BK // 2
        G: gl.constexpr = R // 16
        Q: gl.constexpr = BK // 64
        KH: gl.constexpr = RED // 2
        KS: gl.constexpr = RED // 32
        NQ: gl.constexpr = (KH + 31) // 32
        D: gl.constexpr = _lead(STAGES, a_l)
        offs_hx = gl.arange(0, BKH, layout=gl.SliceLayout(0, x_l))
        q_c = gl.arange(0, Q, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, code_l))))
        # this step's copies have landed once every thread's have (a thread waits for its own, the
        # barrier for the others'). The barrier also means every warp has waited for the MMAs of the
        # step two back (the wait after the previous step), whose buffers ``nxt`` are, so the copies
        # may refill them now (on mma.sync: every warp has read the previous step's, ``_lead``).
        # (cp.async writes need no proxy fence before wgmma reads them once waited for and met at a
        # barrier: Triton's own tl.dot pipelines do the same.)
        async_copy.wait_group(D - 1)
        _barrier()
        _copies(k0 + D * BK, nxt, c_src, c_ok, x_rows, rvalid_x, offs_hx, q_c, KH, NQ)
        async_copy.commit_group()
        we, wo = _decode_operands(cur[0].load(code_l), sb, G, Q, R, BKH, FOLD, a_l, p7)
        kn = k0 + BK
        sb = _load_scales(s_src + kn // 32, s_ok & ((kn // 32 + sblk) < KS), KS % 2 == 0)
        if _sync(a_l):  # (the activations from shared memory into registers, then mma.sync)
            acc = mma_v2(we, cur[1].permute((1, 0)).load(_b_operand_of(a_l)), acc)
            acc = mma_v2(wo, cur[2].permute((1, 0)).load(_b_operand_of(a_l)), acc)
        else:
            acc = warpgroup_mma(we, cur[1].permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(wo, cur[2].permute((1, 0)), acc, is_async=True)
        return acc, sb, we, wo

    @gluon.jit
    def _load_scales(src, ok, PAIRED: gl.constexpr):
        """A step's scale bytes: ``src`` the ``[G, Q, 32, 2, 2]`` pointers of a lane's (rows r0 and r0 + 8
        of each chunk's two 32-element blocks), ``ok`` which to load (the others 0). Returns them as
        loaded (uint8), or with ``PAIRED`` (a row's blocks an even count; the handle keeps the bytes
        16-byte aligned, ``backends.triton.prepare``) as ``[G, Q, 32, 2]`` uint16, a row's two blocks
        of a chunk in one load (``_scale_pairs``): half the loads, and half the registers held until
        the decode."""
        if PAIRED:
            src = gl.split(gl.permute(src, (0, 1, 2, 4, 3)))[0]  # (a chunk's first block)
            ok = gl.split(gl.permute(ok, (0, 1, 2, 4, 3)))[0]
            return gl.load(src.to(gl.pointer_type(gl.uint16), bitcast=True), mask=ok, other=0)
        else:
            return gl.load(src, mask=ok, other=0)

    @gluon.jit
    def _scale_pairs(sb, FOLD: gl.constexpr, s5_l: gl.constexpr):
        """``_load_scales``' uint16 pairs ``[G, Q, 32, 2 rh]`` (a row's block s in byte s) as the bf16
        scales ``[G, Q, 32, 2 s, 2 rh]`` of ``mxtl._ptx_scales``: a lane's two rows' words side by side
        (one 32-bit register), each block's bytes of both rows masked out and placed as two exponent
        fields at once."""
        asm: gl.constexpr = _SCALE_PAIRS_PTX_FOLD if FOLD else _SCALE_PAIRS_PTX
        s0, s1 = gl.inline_asm_elementwise(asm, "=r,=r,r", [sb], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True,
                                           pack=2)
        return gl.convert_layout(gl.permute(gl.join(s0, s1), (0, 1, 2, 4, 3)), s5_l, assert_trivial=True)

    @gluon.jit
    def _decode_operands(codes, sb, G: gl.constexpr, Q: gl.constexpr, R: gl.constexpr, BKH: gl.constexpr,
                         FOLD: gl.constexpr, a_l: gl.constexpr, p7: gl.constexpr):
        """A loaded ``[G, Q, 32, 16]`` code tile and its int32 scale bytes ``[G, Q, 32, 2, 2]`` (a lane's rows
        r0 and r0 + 8, a chunk's two blocks) decoded by ``mxtl``'s asm into the MMA's first operands
        ``(even, odd)`` ``[R, BKH]`` in ``a_l`` (the wgmma's or mma.sync's: the same registers), every
        conversion checked to move no data."""
        t = _to_operand(codes, G, Q, R, BKH)
        if sb.dtype == gl.uint16:
            sc = _scale_pairs(sb, FOLD, gl.SliceLayout(4, gl.SliceLayout(6, p7)))
        else:
            b = sb.to(gl.int32)
            if FOLD:
                b = b + 126
            sc = (b << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)  # mxtl._ptx_scales
        sc = gl.expand_dims(gl.expand_dims(sc, 4), 6)
        sc = gl.broadcast(sc, gl.full([G, Q, 32, 2, 2, 2, 2], 0, gl.bfloat16, layout=p7))[0]
        sc = _to_operand(gl.reshape(sc, (G, Q, 32, 16)), G, Q, R, BKH)
        sc = gl.convert_layout(sc, t.type.layout, assert_trivial=True)
        asm: gl.constexpr = _DECODE_PTX_FOLD if FOLD else _DECODE_PTX
        we, wo = gl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r,r", [t, sc], dtype=(gl.bfloat16, gl.bfloat16),
                                           is_pure=True, pack=4)
        return gl.convert_layout(we, a_l, assert_trivial=True), gl.convert_layout(wo, a_l, assert_trivial=True)

    @gluon.jit
    def _x_rows(ptr, row, RED: gl.constexpr, BK: gl.constexpr, x_l: gl.constexpr):
        """``_mainloop``'s activation pointers: row ``row`` (``[BM]`` int64) of a ``[., RED]`` split-layout
        matrix, the even elements of a step's first ``BK``."""
        BKH: gl.constexpr = BK // 2
        offs_hx = gl.arange(0, BKH, layout=gl.SliceLayout(0, x_l))
        return ptr + row[:, None] * RED + (32 * (offs_hx // 16) + offs_hx % 16)[None, :]

    @gluon.jit
    def _zero_rows(acc_ptr, zrows, M, K: gl.constexpr):
        """Zero rows ``[pid * zrows, (pid + 1) * zrows)`` of the ``[M, K]`` fp32 ``acc``, 16 bytes a
        store by each of the program's threads: the share of a GEMM1 program (``ZERO_ACC``)."""
        NW: gl.constexpr = gl.num_warps()
        CH: gl.constexpr = 4 * 32 * NW
        z_l: gl.constexpr = gl.BlockedLayout([4], [32], [NW], [0])
        offs = gl.arange(0, CH, layout=z_l)
        zero = gl.zeros([CH], gl.float32, z_l)
        r0 = gl.program_id(0) * zrows
        for r in range(r0, gl.minimum(r0 + zrows, M)):
            row = acc_ptr + r.to(gl.int64) * K
            for c in gl.static_range(0, K, CH):
                gl.store(row + c + offs, zero, mask=(c + offs) < K)

    @gluon.jit(do_not_specialize=("nblocks", "zrows", "M"))
    def gemm1_gluon_kernel(
        xq_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, acc_ptr,
        nblocks, limit, zrows, M,
        K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr, UP_FIRST: gl.constexpr,
        HAS_LIMIT: gl.constexpr, HAS_GS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
        BK: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr,
        code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr, x_l: gl.constexpr, mma_h: gl.constexpr,
        a_l_h: gl.constexpr, HALF: gl.constexpr, ZERO_ACC: gl.constexpr, PDL: gl.constexpr = False,
        C0: gl.constexpr = 0, C1: gl.constexpr = 0,
    ):
        """``kernels.gemm1_kernel``'s program (expert block, tile of BN columns of up and of gate), BN / 8
        or BN / 16 warps (BN = 64 or 128: the first half of the 16-row groups the up rows, the rest the gate rows),
        an even STAGES >= 4 (the copies run STAGES - 2 steps ahead); its layouts from ``layouts(2 BN, BM, warps)``.
        ``HALF``: a block of at most BM / 2 rows runs the tile of BM / 2 (``kernels.gemm1_kernel``'s), and with
        ``HALF`` 2 one of at most BM / 4 rows the tile of BM / 4.
        ``ZERO_ACC`` 1 or 2: every program zeroes its ``zrows`` rows of GEMM2's fp32 accumulator
        ``acc`` (``[M, K]``) first (1) or last (2), in the prologue's place: fire-and-forget stores
        beside a compute-bound kernel instead of the prologue's largest write. ``PDL``: launched as a
        programmatic dependent launch (``_gdc``, before anything else). ``C0``, ``C1``: the launch covers the
        columns ``[C0, C1)`` of up and of gate (``kernels._block_tile``; default all)."""
        _gdc(PDL)
        if ZERO_ACC == 1:
            _zero_rows(acc_ptr, zrows, M, K)
        pid_m, pid_n, e = _block_tile(blk_expert_ptr, N, BN, C0, C1)
        if e < 0:
            if ZERO_ACC == 2:
                _zero_rows(acc_ptr, zrows, M, K)
            return
        nrow = gl.load(blk_rows_ptr + pid_m)
        if HALF:
            if HALF >= 2 and nrow <= BM // 4:
                _gemm1_block(pid_m, pid_n, e, nrow, xq_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, K, N, TOPK,
                             UP_FIRST, HAS_LIMIT, HAS_GS, BM, BM // 4, BN, BK, STAGES, FOLD, _mma_of(mma, BM // 4),
                             _operand_of(_mma_of(mma, BM // 4)), code_l, p7, s5_l, x_l)
            elif nrow <= BM // 2:
                _gemm1_block(pid_m, pid_n, e, nrow, xq_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, K, N, TOPK,
                             UP_FIRST, HAS_LIMIT, HAS_GS, BM, BM // 2, BN, BK, STAGES, FOLD, mma_h, a_l_h, code_l, p7,
                             s5_l, x_l)
            else:
                _gemm1_block(pid_m, pid_n, e, nrow, xq_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, K, N, TOPK,
                             UP_FIRST, HAS_LIMIT, HAS_GS, BM, BM, BN, BK, STAGES, FOLD, mma, a_l, code_l, p7, s5_l,
                             x_l)
        else:
            _gemm1_block(pid_m, pid_n, e, nrow, xq_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, K, N, TOPK,
                         UP_FIRST, HAS_LIMIT, HAS_GS, BM, BM, BN, BK, STAGES, FOLD, mma, a_l, code_l, p7, s5_l, x_l)
        if ZERO_ACC == 2:
            _zero_rows(acc_ptr, zrows, M, K)

    @gluon.jit
    def _gemm1_block(pid_m, pid_n, e, nrow, xq_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, a_ptr, limit, K: gl.constexpr,
                     N: gl.constexpr, TOPK: gl.constexpr, UP_FIRST: gl.constexpr, HAS_LIMIT: gl.constexpr,
                     HAS_GS: gl.constexpr, BLK: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                     STAGES: gl.constexpr, FOLD: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr,
                     code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr, x_l: gl.constexpr):
        """``gemm1_gluon_kernel``'s program on the first ``BM`` rows of its ``BLK``-row block."""
        R: gl.constexpr = 2 * BN  # the operand's rows: BN of up (the first half of the warps), then BN of gate
        offs_r = gl.arange(0, BM, layout=gl.SliceLayout(1, x_l))
        rvalid_x = offs_r < nrow
        slot_x = gl.load(sorted_ptr + pid_m * BLK + offs_r, mask=rvalid_x, other=0)
        x_rows = _x_rows(xq_ptr, (slot_x // TOPK).to(gl.int64), K, BK, x_l)
        w_g, gvalid, s_row, s_ok = _gemm1_sources(pid_n, e, w_ptr, s_ptr, K, N, UP_FIRST, BN, BK, code_l, s5_l)
        acc = _mainloop(w_g, gvalid, s_row, s_ok, x_rows, rvalid_x, K, R, BM, BK, STAGES, FOLD, mma, a_l, code_l, p7,
                        s5_l, x_l)
        _gemm1_epilogue(acc, pid_m * BLK, pid_n, e, nrow, gs_ptr, a_ptr, limit, N, HAS_LIMIT, HAS_GS, BM, BN)

    @gluon.jit
    def _gemm1_sources(pid_n, e, w_ptr, s_ptr, K: gl.constexpr, N: gl.constexpr, UP_FIRST: gl.constexpr,
                       BN: gl.constexpr, BK: gl.constexpr, code_l: gl.constexpr, s5_l: gl.constexpr):
        """A GEMM1 tile's weight sources for ``_mainloop`` (columns ``pid_n * BN ..`` of up and of gate of
        expert ``e``: the first ``BN / 16`` row groups of up, the rest of gate):
        ``(w_g, gvalid, s_row, s_ok)``."""
        R: gl.constexpr = 2 * BN
        G: gl.constexpr = R // 16
        KS: gl.constexpr = K // 32
        NQ: gl.constexpr = (K // 2 + 31) // 32
        UP0: gl.constexpr = 0 if UP_FIRST else N
        GATE0: gl.constexpr = N if UP_FIRST else 0
        g_c, q_c, l_c, b_c, g_s, q_s, l_s, s_s, h_s = _tile_index(R, BK, code_l, s5_l)
        gh = g_c % (G // 2)
        gw = gl.where(g_c < G // 2, (pid_n * BN + UP0) // 16, (pid_n * BN + GATE0) // 16) + gh
        w_g = w_ptr + e.to(gl.int64) * (2 * N * NQ * 32) + gw * (NQ * 512)
        gvalid = (pid_n * BN + 16 * gh) < N
        r_s = (pid_n * BN + 16 * (g_s % (G // 2)))[:, None, None, None, None] + 8 * h_s[None, None, None, None, :] \
            + (l_s // 4)[None, None, :, None, None]  # the lane's intermediate columns
        s_row = s_ptr + e.to(gl.int64) * (2 * N * KS) \
            + (r_s + gl.where(g_s < G // 2, UP0, GATE0)[:, None, None, None, None]) * KS
        return w_g, gvalid, s_row, r_s < N

    @gluon.jit
    def _gemm1_epilogue(acc, row0, pid_n, e, nrow, gs_ptr, a_ptr, limit, N: gl.constexpr, HAS_LIMIT: gl.constexpr,
                        HAS_GS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
        """GEMM1's epilogue (``kernels._store_act``): the ``[2 BN, BM]`` accumulator (up rows, then gate) of
        the block's rows from ``row0`` (``nrow`` real) to ``dq8(silu(gate) * up)`` in ``a``'s rows. Up and
        gate meet in shared memory; 32 columns at a time, a thread takes EPT of one token's (SwiGLU, then
        the MXFP8 quant-dequant of the 32, the split layout)."""
        R: gl.constexpr = 2 * BN
        NW: gl.constexpr = gl.num_warps()
        EPT: gl.constexpr = BM // NW  # (BM // NW divides 32)
        ep_l: gl.constexpr = gl.BlockedLayout([EPT, 1], [32 // EPT, EPT], [1, NW], [0, 1])
        acc_s = gl.allocate_shared_memory(gl.float32, [R, BM], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        # (each 32 rows in the split layout's order, so that a thread's EPT elements land side by side in
        # a: one store of them, not EPT of 2 bytes; SwiGLU, the block maximum and the quant-dequant
        # do not depend on the order)
        acc_s.store(_split_order(acc, R, BM))
        _barrier()
        offs_m = gl.arange(0, BM, layout=gl.SliceLayout(0, ep_l))
        rvalid = offs_m < nrow
        rows = (row0 + offs_m).to(gl.int64)
        offs_c = gl.arange(0, 32, layout=gl.SliceLayout(1, ep_l))  # the split layout's column in a block
        for jn in gl.static_range(BN // 32):
            # (the tl.dot kernel's own helpers, compiled here in Gluon: the same arithmetic)
            act = _swiglu(acc_s.slice(32 * jn, 32).load(ep_l), acc_s.slice(BN + 32 * jn, 32).load(ep_l), gs_ptr, e,
                          limit, HAS_GS, HAS_LIMIT)
            pow2, inv = mxfp8_block_scale(gl.max(gl.abs(act), axis=0))
            q = mxfp8_apply(act, pow2[None, :], inv[None, :])
            # (N is a multiple of 32, MX blocks, so a 32-block is in or out whole: the mask by split
            # column is the mask by element)
            offs_s = pid_n * BN + 32 * jn + offs_c
            gl.store(a_ptr + rows[None, :] * N + offs_s[:, None], q, mask=rvalid[None, :] & (offs_s < N)[:, None])

    @gluon.jit(do_not_specialize=("nblocks",))
    def gemm2_gluon_kernel(
        a_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr,
        nblocks,
        K: gl.constexpr, N: gl.constexpr, TOPK: gl.constexpr, HAS_GS: gl.constexpr, ATOMIC: gl.constexpr,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, FOLD: gl.constexpr,
        mma: gl.constexpr, a_l: gl.constexpr, code_l: gl.constexpr, p7: gl.constexpr, s5_l: gl.constexpr,
        x_l: gl.constexpr, mma_h: gl.constexpr, a_l_h: gl.constexpr, HALF: gl.constexpr, PDL: gl.constexpr = False,
        C0: gl.constexpr = 0, C1: gl.constexpr = 0,
    ):
        """``kernels.gemm2_kernel``'s program (expert block, tile of BN outputs), BN / 16 or BN / 32 warps
        (BN = 128 or 256: a warp 16 or 32 of the W2 rows), an even STAGES >= 4; its layouts from
        ``layouts(BN, BM, warps)``.
        ``HALF``: a block of at most BM / 2 rows runs the tile of BM / 2, and with ``HALF`` 2 one of at most
        BM / 4 rows the tile of BM / 4. ``PDL``, ``C0``, ``C1`` (of the K outputs): as ``gemm1_gluon_kernel``'s."""
        _gdc(PDL)
        pid_m, pid_n, e = _block_tile(blk_expert_ptr, K, BN, C0, C1)
        if e < 0:
            return
        nrow = gl.load(blk_rows_ptr + pid_m)
        if HALF:
            if HALF >= 2 and nrow <= BM // 4:
                _gemm2_block(pid_m, pid_n, e, nrow, a_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr, K, N,
                             TOPK, HAS_GS, ATOMIC, BM, BM // 4, BN, BK, STAGES, FOLD, _mma_of(mma, BM // 4),
                             _operand_of(_mma_of(mma, BM // 4)), code_l, p7, s5_l, x_l)
            elif nrow <= BM // 2:
                _gemm2_block(pid_m, pid_n, e, nrow, a_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr, K, N,
                             TOPK, HAS_GS, ATOMIC, BM, BM // 2, BN, BK, STAGES, FOLD, mma_h, a_l_h, code_l, p7, s5_l,
                             x_l)
            else:
                _gemm2_block(pid_m, pid_n, e, nrow, a_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr, K, N,
                             TOPK, HAS_GS, ATOMIC, BM, BM, BN, BK, STAGES, FOLD, mma, a_l, code_l, p7, s5_l, x_l)
        else:
            _gemm2_block(pid_m, pid_n, e, nrow, a_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr, K, N, TOPK,
                         HAS_GS, ATOMIC, BM, BM, BN, BK, STAGES, FOLD, mma, a_l, code_l, p7, s5_l, x_l)

    @gluon.jit
    def _gemm2_block(pid_m, pid_n, e, nrow, a_ptr, sorted_ptr, w_ptr, s_ptr, gs_ptr, wts_ptr, dst_ptr, K: gl.constexpr,
                     N: gl.constexpr, TOPK: gl.constexpr, HAS_GS: gl.constexpr, ATOMIC: gl.constexpr,
                     BLK: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                     FOLD: gl.constexpr, mma: gl.constexpr, a_l: gl.constexpr, code_l: gl.constexpr,
                     p7: gl.constexpr, s5_l: gl.constexpr, x_l: gl.constexpr):
        """``gemm2_gluon_kernel``'s program on the first ``BM`` rows of its ``BLK``-row block."""
        w_g, gvalid, s_row, s_ok, x_rows, rvalid_x = _gemm2_sources(pid_m, pid_n, e, nrow, a_ptr, w_ptr, s_ptr, K, N,
                                                                    BLK, BM, BN, BK, code_l, s5_l, x_l)
        acc = _mainloop(w_g, gvalid, s_row, s_ok, x_rows, rvalid_x, N, BN, BM, BK, STAGES, FOLD, mma, a_l, code_l, p7,
                        s5_l, x_l)
        _gemm2_epilogue(acc, pid_m * BLK, pid_n, e, nrow, sorted_ptr, gs_ptr, wts_ptr, dst_ptr, K, TOPK, HAS_GS, ATOMIC,
                        BM, BN)

    @gluon.jit
    def _gemm2_sources(pid_m, pid_n, e, nrow, a_ptr, w_ptr, s_ptr, K: gl.constexpr, N: gl.constexpr,
                       BLK: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, code_l: gl.constexpr,
                       s5_l: gl.constexpr, x_l: gl.constexpr):
        """A GEMM2 tile's ``_mainloop`` sources (the first ``BM`` rows of block ``pid_m`` of ``BLK``,
        ``nrow`` real; outputs ``pid_n * BN ..`` of expert ``e``):
        ``(w_g, gvalid, s_row, s_ok, x_rows, rvalid_x)``."""
        NS: gl.constexpr = N // 32
        NQ: gl.constexpr = (N // 2 + 31) // 32
        # the block's rows of a (block-ordered: rows pid_m * BLK ..)
        offs_r = gl.arange(0, BM, layout=gl.SliceLayout(1, x_l))
        x_rows = _x_rows(a_ptr, (pid_m * BLK + offs_r).to(gl.int64), N, BK, x_l)
        g_c, q_c, l_c, b_c, g_s, q_s, l_s, s_s, h_s = _tile_index(BN, BK, code_l, s5_l)
        w_g = w_ptr + e.to(gl.int64) * (K * NQ * 32) + (pid_n * BN // 16 + g_c) * (NQ * 512)
        r_s = (pid_n * BN + 16 * g_s)[:, None, None, None, None] + 8 * h_s[None, None, None, None, :] \
            + (l_s // 4)[None, None, :, None, None]  # the lane's output rows
        s_row = s_ptr + e.to(gl.int64) * (K * NS) + r_s * NS
        return w_g, (pid_n * BN + 16 * g_c) < K, s_row, r_s < K, x_rows, offs_r < nrow

    @gluon.jit
    def _gemm2_epilogue(acc, row0, pid_n, e, nrow, sorted_ptr, gs_ptr, wts_ptr, dst_ptr, K: gl.constexpr,
                        TOPK: gl.constexpr, HAS_GS: gl.constexpr, ATOMIC: gl.constexpr, BM: gl.constexpr,
                        BN: gl.constexpr):
        """GEMM2's epilogue (``kernels._reduce_rows``): the ``[BN, BM]`` tile (any layout) of the block's rows
        from ``row0`` (``nrow`` real) times the global scale and the router weights, added into the fp32
        ``[M, K]`` accumulator (ATOMIC) or stored in the slots' rows, 16 bytes a thread (``_out_layout``)."""
        # (from the accumulator's layout, where a thread's outputs are 8 apart, to 4 adjacent outputs a
        # thread: one 16-byte atomic or store where there were four of 4 bytes)
        out_l: gl.constexpr = _out_layout(BN, BM, gl.num_warps())
        acc = gl.convert_layout(acc, out_l)
        offs_m = gl.arange(0, BM, layout=gl.SliceLayout(0, out_l))
        rvalid = offs_m < nrow
        slot = gl.load(sorted_ptr + row0 + offs_m, mask=rvalid, other=0)
        offs_o = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, out_l))
        if HAS_GS:
            acc = acc * gl.load(gs_ptr + e)
        acc = acc * gl.load(wts_ptr + slot, mask=rvalid, other=0.0)[None, :]
        msk = (offs_o < K)[:, None] & rvalid[None, :]
        if ATOMIC:
            tok = (slot // TOPK).to(gl.int64)
            gl.atomic_add(dst_ptr + tok[None, :] * K + offs_o[:, None], acc, mask=msk, sem="relaxed")
        else:
            gl.store(dst_ptr + slot.to(gl.int64)[None, :] * K + offs_o[:, None], acc, mask=msk)
