"""The chain launcher (``backends/triton/chain.py``) on this CPU-only machine.

An eager GEMV call's kernels are launched by one C call from a chain: their parameters written down
once, fixed or taken from the call's own values. What a GPU test cannot cheaply cover is checked
here: the C module builds, and for kernels compiled offline for sm_90 (as ``test_compile_sm90.py``
does) the bytes it would pass the driver are, parameter by parameter, triton's launcher's: the
compiled signature in order, constexprs left out, two null scratch pointers last. The expected bytes
are packed here from the compiled signature and the argument lists the backend itself launches
with concrete values (``_gemv_launches``).
"""

from __future__ import annotations

import random
import struct
import types

import pytest
from test_compile_sm90 import GEOMETRIES


@pytest.fixture(scope="module")
def chain_mod():
    from b12x_ops.backends.triton import chain

    mod = chain.module()
    assert mod is not None, "the chain's C module did not build (gcc and Python's headers are needed)"
    return mod


def _words(*ws):
    return struct.pack(f"<{len(ws)}q", *ws)


def test_chain_module_packs_fixed_and_call_values(chain_mod):
    # one kernel: function 77, 128 threads, 1024 bytes of shared memory, PDL on, grid (m * 3, 2, 1);
    # parameters: a fixed pointer, the call's value 1 (8 bytes), value 0 times 4 (4 bytes), a fixed
    # -5 as 4 bytes, a fixed 1-byte 200
    blob = _words(1, 77, 128, 1024, 1, 0, 3, 2, 1, 5,
                  8, -1, 0x7F00_1234_5678, 8, 1, 1, 4, 0, 4, 4, -1, -5 & 0xFFFFFFFF, 1, -1, 200)
    (fn, grid, threads, shared, pdl, params), = chain_mod.pack(blob, 6, 0x7E00_0000_0100)
    assert (fn, grid, threads, shared, pdl) == (77, (18, 2, 1), 128, 1024, 1)
    assert params == struct.pack("<QQiiB", 0x7F00_1234_5678, 0x7E00_0000_0100, 24, -5, 200)


@pytest.mark.parametrize("blob", [
    _words(1, 77, 128, 0, 0, 5, 1, 1, 1, 0),  # grid from value 5 of 2
    _words(1, 77, 128, 0, 0, -1, 1, 1, 1, 1, 3, -1, 0),  # a 3-byte parameter
    _words(1, 77, 128, 0, 0, -1, 1, 1, 1, 2, 8, -1, 0),  # a parameter missing
    _words(2, 77, 128, 0, 0, -1, 1, 1, 1, 0),  # a kernel missing
    _words(1, 77, 128, 0, 0, -1, 1, 1, 1, 49) + bytes(8 * 3 * 49),  # more parameters than the C side holds
])
def test_chain_module_rejects_a_malformed_chain(chain_mod, blob):
    with pytest.raises(ValueError, match="malformed chain"):
        chain_mod.pack(blob, 1, 2)


def test_chain_var_placeholders_scale():
    from b12x_ops.backends.triton import chain

    v = chain.placeholders()
    assert list(v) == list(chain.VALUES + chain.SIZES)
    s = v["m"] * 8 * 3
    assert (s.i, s.k) == (chain.VALUES.index("m"), 24)
    assert chain._word(s) == (chain.VALUES.index("m"), 24)
    assert chain._word(-5, 4) == (-1, 0xFFFFFFFB) and chain._word(7) == (-1, 7)
    with pytest.raises(chain._Unsupported):
        chain._word(True)


class _Addresses(dict):
    """The handle's and arena's operands as made-up addresses, one per name asked for."""

    def __missing__(self, name):
        self[name] = 0x7000_0000_0000 + 0x100_0000 * (len(self) + 1)
        return self[name]


def _expected(sig, names, full) -> bytes:
    """Triton's launcher's parameter bytes: the compiled signature in order, constexprs left out,
    then the global and profile scratch pointers (null)."""
    out = b""
    for name, a in zip(names, full):
        ty = sig[name]
        if ty == "constexpr":
            continue
        fmt = "<Q" if ty.startswith("*") else {"i32": "<i", "i64": "<q", "fp32": "<f"}[ty]
        out += struct.pack(fmt, a)
    return out + bytes(16)


def _compile_as_on_gpu(offline, launches, fn0):
    """The launches as after a GPU prepare: compiled for sm_90, each kernel's handle kept (made-up, from ``fn0``)."""
    for k, ln in enumerate(launches):
        ln.compiled = offline.compile_launch(ln, 90)
        ln._function = fn0 + k


def _random_call(rng, g, m) -> dict:
    """A call's ``chain.VALUES`` of ``m`` tokens on geometry ``g``: made-up aligned addresses, strides, dtypes."""
    return dict(x=0x7100_0000_0000 + 16 * rng.randrange(1 << 20), ids=0x7200_0000_0000 + 4 * rng.randrange(1 << 20),
                w=0x7300_0000_0000 + 2 * rng.randrange(1 << 20), out=0x7400_0000_0000 + 16 * rng.randrange(1 << 20),
                m=m, sx=rng.choice([g.hidden_size, 2 * g.hidden_size + 64]),
                si0=rng.choice([g.top_k, 2 * g.top_k, 3]), si1=rng.choice([1, 2]), sw0=rng.choice([g.top_k, 7]),
                sw1=rng.choice([1, 2]), w_kind=rng.randrange(3), so=rng.choice([g.hidden_size, 4 * g.hidden_size]),
                x_fp16=rng.randrange(2), out_fp16=rng.randrange(2))


def _assert_packed(got, want, what):
    """``pack``'s kernels (``got``) are the launches' (``want``: ``(launch, grid, args)``), kernel by kernel:
    function, grid, block, shared memory, PDL flag and the parameter bytes triton's launcher would pass."""
    for (fn, grid, threads, shared, pdl, params), (ln, wgrid, args) in zip(got, want):
        ck = ln.compiled
        assert fn == ln._function and grid == tuple(wgrid), (what, ln.fn.__name__)
        assert (threads, shared, pdl) == (32 * ck.metadata.num_warps, ck.metadata.shared,
                                          int(bool(ck.metadata.launch_pdl)))
        assert params == _expected(ck.src.signature, ln.fn.arg_names, tuple(args) + ln._tail), (what, ln.fn.__name__)


@pytest.mark.slow
@pytest.mark.parametrize("name,tokens,mma,pdl", [("qwen3-30b-a3b", 1, False, False), ("dsv4.1-tp4", 4, True, True),
                                                 ("gpt-oss-120b", 3, True, False), ("qwen3-30b-a3b", 5, False, True)])
def test_chain_passes_what_the_launches_pass(chain_mod, offline, name, tokens, mma, pdl):
    import triton

    from b12x_ops.backends.triton import _gemv_launches, chain
    from b12x_ops.backends.triton import plan as P

    g = offline._geometry(GEOMETRIES[name])
    gp = P.GeometryPlans(g, True, None, ptx=True, dry=True, fold=True, pdl=pdl)
    gp.ptx, gp.fold, gp.dot_dtype, gp.mma_pdl = True, True, triton.language.bfloat16, pdl
    gp.mma = gp.mma_fold = True  # (as an sm_90 prepare sets them)
    cfg = P.default_config(tokens, g, gemv=True)
    if mma:
        cfg = P.mma_config(cfg, g, *P.gemv_mma_form(tokens, g))
    rn = gp.runner(cfg, tokens)
    launches = [ln for ln in (rn.prologue, rn.gemm1, rn.gemm2) if ln is not None]
    assert len(launches) == (3 if cfg.xq else 2)
    _compile_as_on_gpu(offline, launches, 0x5000)
    state = types.SimpleNamespace(plans=gp, expert_offset=37, limit=float(g.swiglu_limit or 0.0))
    addr = _Addresses()
    v = chain.placeholders()
    blob = chain.build(_gemv_launches(state, rn, {}, addr, *(v[n] for n in chain.VALUES[:4]),
                                      *(v[n] for n in ("m", "sx", "si0", "si1", "sw0", "sw1", "w_kind", "so",
                                                       "x_fp16", "out_fp16"))))
    assert blob is not None
    rng = random.Random(tokens)
    for _ in range(25):
        call = _random_call(rng, g, rng.randint(1, tokens))
        got = chain_mod.pack(blob, *(call[n] for n in chain.VALUES))
        want = _gemv_launches(state, rn, {}, addr, call["x"], call["ids"], call["w"], call["out"], call["m"],
                              call["sx"], call["si0"], call["si1"], call["sw0"], call["sw1"], call["w_kind"],
                              call["so"], call["x_fp16"], call["out_fp16"])
        assert len(got) == len(want) and all(k[4] == pdl for k in got), (tokens, pdl)
        _assert_packed(got, want, tokens)


@pytest.mark.slow
@pytest.mark.parametrize("name,tokens,gluon,atomic,pdl", [
    ("qwen3-30b-a3b", 16, False, None, True), ("dsv4.1-tp4", 37, False, False, False),
    ("gpt-oss-120b", 512, True, None, True), ("qwen3-30b-a3b", 2048, True, None, False),
    ("dsv4.1-tp4", 300, True, False, True), ("gpt-oss-120b", 4096, True, None, True),
    ("dsv4.1-tp4", 8192, True, False, False)])
def test_chain_passes_what_the_blocked_launches_pass(chain_mod, offline, monkeypatch, name, tokens, gluon, atomic, pdl):
    """The blocked path's chain packs, kernel by kernel, the bytes triton's launcher would pass for
    ``_blocked_launches``' arguments, at every token count its plan serves: the grids and the block
    count come from the call's sizes (``_blocked_sizes``, after ``chain.VALUES``); the tl.dot GEMMs
    and the Gluon ones (sm_90's), atomic and row-a-slot GEMM2s, as programmatic dependent launches
    (the default on sm_90) or not, with the Gluon GEMMs' last column tiles in launches of their own
    (``plan.edge_split``, asked for here: gpt-oss's GEMM1 and GEMM2, DSv4's GEMM1, at 128-row blocks)."""
    import dataclasses

    import triton

    from b12x_ops.backends.triton import _blocked_launches, _blocked_sizes, chain
    from b12x_ops.backends.triton import gluon_kernels as GK
    from b12x_ops.backends.triton import plan as P

    if gluon and not GK.HAS_GLUON:
        pytest.skip("this triton has no Gluon with Hopper's wgmma")
    monkeypatch.setenv("B12X_OPS_TRITON_EDGE", "1")
    g = offline._geometry(GEOMETRIES[name])
    gp = P.GeometryPlans(g, True, False, ptx=True, dry=True, fold=True, pdl=pdl)
    gp.ptx, gp.fold, gp.dot_dtype = True, True, triton.language.bfloat16
    gp.gluon = gluon
    cfg = gp.with_gluon(P.default_config(tokens, g, gemv=False), tokens)
    if atomic is not None:
        cfg = dataclasses.replace(cfg, atomic=atomic)
    assert not cfg.gemv and cfg.gluon == gluon
    rn = gp.runner(cfg, tokens)
    edges = rn.edges
    assert len(edges) == (2 if name == "gpt-oss-120b" and cfg.bm == 128 else int(name.startswith("dsv4") and cfg.bm == 128))
    launches = [rn.prologue, rn.gemm1, rn.gemm2, rn.finalize] + edges
    _compile_as_on_gpu(offline, launches, 0x6000)
    state = types.SimpleNamespace(plans=gp, expert_offset=11, limit=float(g.swiglu_limit or 0.0))
    addr = _Addresses()
    v = chain.placeholders()
    blob = chain.build(_blocked_launches(state, rn, {}, addr, *(v[n] for n in chain.VALUES),
                                         sizes=tuple(v[n] for n in chain.SIZES)))
    assert blob is not None
    rng = random.Random(tokens)
    for m in sorted({1, 2, tokens // 3 + 1, tokens - 1, tokens} | {rng.randint(1, tokens) for _ in range(5)}):
        call = _random_call(rng, g, m)
        sizes = _blocked_sizes(rn, m, g.top_k)
        with pytest.raises(ValueError, match="malformed chain"):  # (a blocked chain needs the sizes)
            chain_mod.pack(blob, *(call[n] for n in chain.VALUES))
        got = chain_mod.pack(blob, *(call[n] for n in chain.VALUES), *sizes)
        want = _blocked_launches(state, rn, {}, addr, *(call[n] for n in chain.VALUES))
        names = [f"gemm{i}_{'gluon_' if on else ''}kernel" for i, on in ((1, cfg.gluon), (2, cfg.gluon2))]
        assert [ln for ln, _, _ in want] == ([rn.prologue, rn.gemm1] + [rn.edge1] * (rn.edge1 is not None) + [rn.gemm2]
                                             + [rn.edge2] * (rn.edge2 is not None) + [rn.finalize])
        assert [ln.fn.__name__ for ln in (rn.gemm1, rn.gemm2)] == names
        assert len(got) == len(want) == 4 + len(edges) and all(k[4] == pdl for k in got), (m, pdl)
        assert all(min(grid) >= 1 for _, grid, *_ in got), m
        _assert_packed(got, want, m)
