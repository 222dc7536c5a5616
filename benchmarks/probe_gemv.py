"""Where gemv1's time goes at gpt-oss M = 1: the kernel against probes of its memory access alone.

    python benchmarks/probe_gemv.py
    NCU=1 ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats python benchmarks/probe_gemv.py

Times (CUDA-graph replay over 4 layers' handles, us per layer): gemv1 and gemv2 alone with the
default GEMV config and with a 3-stage, 2-way split one; ``probe_codes``, a kernel that reads exactly
the code bytes (and optionally the scale bytes) gemv1 reads, with its program-to-tile mapping
(programs of one 64-row, ``bk``-element step), summing them; ``probe_flat``, a plain read of the same
experts' codes. With ``NCU=1`` the measured launches run once more between profiler start and stop
(for ncu's ``--profile-from-start off``).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import b12x_ops  # noqa: E402
from b12x_ops.backends.triton import _launch_all  # noqa: E402
from b12x_ops.backends.triton import plan as P  # noqa: E402
from bench_moe import graph_time, layer_batches, random_layer  # noqa: E402


@triton.jit
def probe_codes(ids_ptr, w_ptr, s_ptr, out_ptr, S, K: tl.constexpr, N: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, SPLIT: tl.constexpr, SCALES: tl.constexpr):
    """Program (slot, K part, N tile) as gemv1's: the sum of the up and gate code words (and scale
    bytes) of its one step, so that every byte gemv1 reads is read once."""
    pid = tl.program_id(0)
    b = pid % S
    rest = pid // S
    part = rest % SPLIT
    pid_n = rest // SPLIT
    e = tl.load(ids_ptr + b).to(tl.int64)
    NQ: tl.constexpr = (K // 2 + 31) // 32
    G: tl.constexpr = BN // 16
    Q: tl.constexpr = BK // 64
    w_e = (w_ptr + e * (2 * N * NQ * 32)).to(tl.pointer_type(tl.int32))
    q0 = part * Q
    g = tl.arange(0, G)
    q = tl.arange(0, Q)
    lw = tl.arange(0, 128)  # a (group, chunk)'s 512 bytes as words
    acc = tl.zeros((G, Q, 128), dtype=tl.int32)
    for half in tl.static_range(2):  # up, then gate rows
        base = w_e + ((pid_n * BN + half * N) // 16) * (NQ * 128)
        off = (g[:, None, None] * NQ + q0 + q[None, :, None]) * 128 + lw[None, None, :]
        acc += tl.load(base + off, mask=((q0 + q) < NQ)[None, :, None], other=0)
    tot = tl.sum(tl.reshape(acc, (G * Q * 128,)), axis=0)
    if SCALES:
        KS: tl.constexpr = K // 32
        r = pid_n * BN + tl.arange(0, BN)
        j = part * (BK // 32) + tl.arange(0, BK // 32)
        s_e = s_ptr + e * (2 * N * KS)
        su = tl.load(s_e + r[:, None] * KS + j[None, :], mask=(j < KS)[None, :], other=0).to(tl.int32)
        sg = tl.load(s_e + (r + N)[:, None] * KS + j[None, :], mask=(j < KS)[None, :], other=0).to(tl.int32)
        tot += tl.sum(tl.sum(su + sg, axis=1), axis=0)
    tl.store(out_ptr + pid, tot)


@triton.jit
def probe_flat(src_ptr, out_ptr, n_words, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + pid, tl.sum(tl.load(src_ptr + offs, mask=offs < n_words, other=0), axis=0))


def main():
    E, K, N, top_k, L = 128, 2880, 2880, 4, 4  # gpt-oss-120b
    layers = [random_layer(E, K, N, "cuda", 100 + i) for i in range(L)]
    hs = [b12x_ops.prepare_experts(*lw, top_k=top_k, swiglu_limit=7.0, backend="triton", tune=False, gemv=True,
                                   max_tokens=4, frozen=False) for lw in layers]
    xs, idss, wss, outs = layer_batches(1, E, K, top_k, L)
    g = hs[0]._state.plans.geometry
    base = P.default_config(1, g, gemv=True)
    split = dataclasses.replace(base, bk1=256, stages1=3, split1=2, bk2=256, stages2=3, split2=top_k)
    res = {}
    for tag, cfg in (("default", base), ("3 stages, split 2 / top_k", split)):
        hs[0]._state.plans.reserve(1, cfg)
        for stage, name in (("gemm1", "gemv1"), ("gemm2", "gemv2")):
            calls = [lambda h=h, x=x, i=i, w=w, o=o: _launch_all(h._state, cfg, x, i, w, o, (stage,))
                     for h, x, i, w, o in zip(hs, xs, idss, wss, outs)]
            res[f"{name} {cfg.tiles1() if name == 'gemv1' else cfg.tiles2()} ({tag})"] = graph_time(calls, 20) * 1e6
    out = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    ids = [i.view(-1).to(torch.int32).contiguous() for i in idss]
    codes = [h._state.w13 for h in hs]
    scales = [h._state.w13_scale for h in hs]
    for bn, bk in ((64, 256), (64, 128), (64, 512), (128, 256)):
        parts = -(-K // bk)
        for sc in (False, True):
            grid = (top_k * (N // bn) * parts,)
            calls = [lambda c=c, s=s, i=i: probe_codes[grid](i, c, s, out, top_k, K, N, bn, bk, parts, sc, num_warps=4)
                     for c, s, i in zip(codes, scales, ids)]
            res[f"probe_codes bn {bn} bk {bk} ({parts} parts){' + scales' if sc else ''}"] = graph_time(calls, 20) * 1e6
    flats = [torch.cat([c[int(e)].reshape(-1).view(torch.int32) for e in i[:top_k].tolist()]) for c, i in zip(codes, ids)]
    calls = [lambda t=t: probe_flat[(triton.cdiv(t.numel(), 4096),)](t, out, t.numel(), 4096, num_warps=4)
             for t in flats]
    res[f"probe_flat ({flats[0].numel() * 4 / 1e6:.1f} MB a layer)"] = graph_time(calls, 20) * 1e6
    for k, v in res.items():
        print(f"{k:64s} {v:8.2f} us")
    if os.environ.get("NCU"):
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for cfg in (base, split):
            _launch_all(hs[0]._state, cfg, xs[0], idss[0], wss[0], outs[0], ("gemm1", "gemm2"))
        parts = -(-K // 256)
        probe_codes[(top_k * (N // 64) * parts,)](ids[0], codes[0], scales[0], out, top_k, K, N, 64, 256, parts, True,
                                                   num_warps=4)
        probe_flat[(triton.cdiv(flats[0].numel(), 4096),)](flats[0], out, flats[0].numel(), 4096, num_warps=4)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
