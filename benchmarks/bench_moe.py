"""Side-by-side W4A8 MoE benchmark on any CUDA GPU: ours against the physical limit and the peers.

    python benchmarks/bench_moe.py [--triton-kernels DIR] [--out benchmarks/results]

Every point is timed as CUDA-graph replay over several layers' handles (each layer its own
weights and routing), so weights stream from HBM and not from L2. Per point it records our time,
the limit measured in the same run (bytes of the distinct experts' weights and scales plus the
activations over measured copy bandwidth; FLOPs over measured bf16 matmul rate; the larger of the
two), a bf16 MoE on dequantized weights, and triton_kernels' matmul_ogs MXFP4 MoE (if given).
Writes ``results.json``, ``results.md`` and ``results.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import b12x_ops  # noqa: E402
from b12x_ops.backends.triton.plan import SM_COUNT_DEFAULT  # noqa: E402
from b12x_ops.mx import dequantize_mxfp4  # noqa: E402
from peers import Bf16MoE, TritonKernelsMoE  # noqa: E402

GEOMETRIES = {
    "gpt-oss-120b": dict(E=128, K=2880, N=2880, top_k=4, limit=7.0),
    "dsv4.1-tp4": dict(E=384, K=5120, N=576, top_k=6, limit=10.0),
    "qwen3-30b-a3b": dict(E=128, K=2048, N=768, top_k=8, limit=None),
}
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192)
DEVICE = "cuda"  # (a dry run of --gemv-compare on the CPU interpreter sets "cpu")


def measure_copy_bandwidth(nbytes=2 << 30):
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_()
    for _ in range(3):
        b.copy_(a)
    t = time_events(lambda: b.copy_(a), reps=10)
    return 2 * nbytes / t  # bytes read + written per second


def measure_bf16_peak(n=8192):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    t = time_events(lambda: a @ b, reps=10)
    return 2 * n**3 / t


def time_events(fn, reps=20):
    """Median seconds of ``fn`` by CUDA events."""
    s = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    e = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        s[i].record()
        fn()
        e[i].record()
    torch.cuda.synchronize()
    ts = sorted(s[i].elapsed_time(e[i]) for i in range(reps))
    return ts[reps // 2] / 1e3


WARM_S = 0.02  # (graph_time's warm-up: about this much GPU time of replays before the timed ones)


def warm_graph(calls):
    """A CUDA graph that replays every call in ``calls`` once, after about ``WARM_S`` of untimed
    replays: a GPU left idle while the handles were prepared (tens of seconds of compiling) idles at
    a low clock, and a few replays of a small graph take far less than the time it needs to come up
    (the first point of a geometry would be timed slow)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    t = time.perf_counter()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    per = (time.perf_counter() - t) / 3
    for _ in range(min(2000, int(WARM_S / max(per, 1e-6)))):
        g.replay()
    return g


def graph_time(calls, reps=20):
    """Per-call seconds of a CUDA graph that replays every call in ``calls`` once (``warm_graph``)."""
    return time_events(warm_graph(calls).replay, reps) / len(calls)


def host_time(call, calls=10, runs=5):
    """The host's seconds to issue a call of ``call``: the median over ``runs`` of ``calls`` calls
    issued after a synchronization, timed without waiting for them (few enough calls that the
    launch queue never fills)."""
    out = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            call()
        out.append((time.perf_counter() - t) / calls)
    torch.cuda.synchronize()
    return sorted(out)[runs // 2]


def queued_gpu_share(call, replay, pairs):
    """Seconds of GPU time an eager call of ``call`` takes beyond a graph replay of the same call
    (``replay``): ``pairs`` adjacent pairs, replay then call, all queued behind a sleep kernel so that
    the host never starves the GPU, each timed by CUDA events; the median of the pairs' differences.
    That is what launching the kernels one by one outside a graph costs the GPU (the gaps between
    them), without the host's time. The two halves of a pair run back to back, so a drift of the GPU's
    clock between measurements (about 1 % of a millisecond call) cancels; a fifth as many untimed pairs
    run first, so the timed ones find the GPU busy, as graph replay does, not fresh out of an idle sleep."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3 * pairs)]
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # (tens of ms: longer than the host takes to issue the pairs)
    for _ in range(max(1, pairs // 5)):
        replay()
        call()
    for i in range(pairs):
        ev[3 * i].record()
        replay()
        ev[3 * i + 1].record()
        call()
        ev[3 * i + 2].record()
    ev[-1].synchronize()
    d = sorted(ev[3 * i + 1].elapsed_time(ev[3 * i + 2]) - ev[3 * i].elapsed_time(ev[3 * i + 1]) for i in range(pairs))
    return d[pairs // 2] / 1e3


def idle_pair_overhead(call, replay, pairs):
    """Seconds an eager call of ``call`` started on an idle GPU takes beyond a graph replay of the same
    call (``replay``) queued right behind it: ``pairs`` pairs, each after a synchronize, timed by CUDA
    events (before the call, between, after the replay); the median of the pairs' differences. The
    call's half holds what a caller who waits for each call sees above the kernels' GPU time: the host's
    time to its first launch, any wait of the GPU for a later one, and the gaps between the launches;
    the replay's half is GPU time alone wherever the call's kernels outlast the host's issue of the
    replay (the host issues faster than the GPU runs). The two halves are adjacent, so a drift of the
    GPU's clock between measurements cancels. Less ``queued_gpu_share`` (the gaps alone) it is the
    host's share of an idle start, free of the drift that the loop's share carries at long calls."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3 * pairs)]
    for i in range(pairs):
        torch.cuda.synchronize()
        ev[3 * i].record()
        call()
        ev[3 * i + 1].record()
        replay()
        ev[3 * i + 2].record()
    torch.cuda.synchronize()
    d = sorted(ev[3 * i].elapsed_time(ev[3 * i + 1]) - ev[3 * i + 1].elapsed_time(ev[3 * i + 2]) for i in range(pairs))
    return d[pairs // 2] / 1e3


def eager_and_graph(call, reps=10, rounds=5, loop=50):
    """``(eager, graph, overhead, host share, GPU share, idle overhead)`` seconds a call of ``call``: eagerly (the
    wall time a call of a synchronized loop of ``loop`` calls) and replayed from a CUDA graph
    (``time_events``, ``reps`` replays), timed in ``rounds`` alternating rounds, each the median over
    the rounds. ``overhead`` is the median of the rounds' eager - graph, split into the GPU's share
    (``queued_gpu_share``: the eagerly launched kernels' GPU time beyond graph replay, in the same
    rounds) and the host's (the rest: overhead - GPU share, the host's time above the kernels' GPU
    time). Timed side by side, a drift of the GPU's clock between the two (a few percent of a
    millisecond call) does not pass for host overhead; what drift is left lands in the host's share,
    the GPU's is free of it. ``idle overhead``: ``idle_pair_overhead`` in the same rounds (a call from an
    idle GPU against the replay queued behind it: drift-free where the host issues faster than the GPU
    runs)."""
    g = warm_graph([call])
    for _ in range(5):
        call()
    eager, graph, diff, host, gpu, idle = [], [], [], [], [], []
    for _ in range(rounds):
        gt = time_events(g.replay, reps)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(loop):
            call()
        torch.cuda.synchronize()
        et = (time.perf_counter() - t) / loop
        gs = queued_gpu_share(call, g.replay, loop)
        eager.append(et)
        graph.append(gt)
        diff.append(et - gt)
        gpu.append(gs)
        host.append(et - gt - gs)
        idle.append(idle_pair_overhead(call, g.replay, loop))
    return tuple(sorted(v)[rounds // 2] for v in (eager, graph, diff, host, gpu, idle))


def random_layer(E, K, N, device, gen_seed):
    torch.manual_seed(gen_seed)
    w13 = torch.randint(0, 256, (E, 2 * N, K // 2), dtype=torch.uint8, device=device)
    s13 = torch.randint(118, 126, (E, 2 * N, K // 32), dtype=torch.uint8, device=device)
    w2 = torch.randint(0, 256, (E, K, N // 2), dtype=torch.uint8, device=device)
    s2 = torch.randint(118, 126, (E, K, N // 32), dtype=torch.uint8, device=device)
    return w13, s13, w2, s2


def dequant_bf16(codes, scales):
    out = torch.empty(codes.shape[0], codes.shape[1], codes.shape[2] * 2, dtype=torch.bfloat16, device=codes.device)
    for e in range(codes.shape[0]):
        out[e] = dequantize_mxfp4(codes[e], scales[e]).to(torch.bfloat16)
    return out


def plan_geometry(geo, device="cpu", deterministic=False):
    """The backend's ``Geometry`` of benchmark geometry ``geo`` (a ``GEOMETRIES`` value) for planning
    without handles: its shapes and limit, the checkpoint's w13 layout, SiLU, no global scales."""
    from b12x_ops.handle import Geometry

    return Geometry(num_experts=geo["E"], hidden_size=geo["K"], intermediate_size=geo["N"], top_k=geo["top_k"],
                    w13_layout="w13", activation="silu", swiglu_limit=geo["limit"], has_global_scales=False,
                    deterministic=deterministic, device=torch.device(device))


def routing(M, E, top_k, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(M, E, device=device, generator=g)
    vals, ids = logits.topk(top_k, dim=1)
    return logits, ids.to(torch.int32), torch.softmax(vals, dim=1)


def markdown_log(path, title):
    """``emit(line)`` for the sweeps: prints the line and rewrites ``path`` with every line so far
    under ``title`` (a run cut short keeps its table)."""
    lines = [title, ""]

    def emit(line):
        print(line, flush=True)
        lines.append(line)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")

    return emit


def layer_batches(M, E, K, top_k, layers, device="cuda"):
    """Per layer, a batch of ``M`` tokens for the tile sweeps: ``(xs, ids, weights, outs)`` lists
    (bf16 inputs, routing of ``routing(..., seed 7 + layer)``, fp32 weights, bf16 output buffers)."""
    xs, idss, wss, outs = [], [], [], []
    for i in range(layers):
        _, ids, w = routing(M, E, top_k, device, 7 + i)
        xs.append(torch.randn(M, K, device=device).to(torch.bfloat16))
        idss.append(ids)
        wss.append(w.float())
        outs.append(torch.empty(M, K, device=device, dtype=torch.bfloat16))
    return xs, idss, wss, outs


def experiment_handles(name, max_tokens, layers=3, **options):
    """The experiments' layers: ``layers`` random layers of geometry ``name`` (seeds 100, 101, ...)
    prepared for the Triton backend, untuned and unfrozen (experiments add launches), with
    ``options``."""
    geo = GEOMETRIES[name]
    return [b12x_ops.prepare_experts(*random_layer(geo["E"], geo["K"], geo["N"], "cuda", 100 + i), top_k=geo["top_k"],
                                     swiglu_limit=geo["limit"], backend="triton", tune=False, max_tokens=max_tokens,
                                     frozen=False, **options) for i in range(layers)]


def experiment_points(names, sizes):
    """The experiments' loop: per geometry in ``names``, its ``experiment_handles`` (for the largest
    of ``sizes``), then per token count ``M`` in ``sizes`` a batch a layer (``layer_batches``):
    yields ``(name, handles, M, (xs, idss, wss, outs))``. A geometry's handles are let go (and the
    allocator's cache emptied) before the next geometry's are made."""
    for name in names:
        geo = GEOMETRIES[name]
        hs = experiment_handles(name, max(sizes))
        for M in sizes:
            yield name, hs, M, layer_batches(M, geo["E"], geo["K"], geo["top_k"], len(hs))
        del hs
        torch.cuda.empty_cache()


def whole_op_us(handles, cfg, xs, idss, wss, outs, reps=10):
    """us per layer of the whole op in ``cfg`` on each handle's batch, replayed from one CUDA graph."""
    from b12x_ops.backends.triton import _launch_all

    calls = [lambda h=h, x=x, ids=ids, w=w, o=o: _launch_all(h._state, cfg, x, ids, w, o)
             for h, x, ids, w, o in zip(handles, xs, idss, wss, outs)]
    return graph_time(calls, reps=reps) * 1e6


# sm_90's per-SM limits (H100, H200: ``plan.SM_COUNT_DEFAULT`` SMs), for results made before the benchmark
# recorded its GPU's
SM90_LIMITS = dict(sms=SM_COUNT_DEFAULT, regs=65536, threads=2048, smem=233472, blocks=32)


# resident blocks an SM holds where it is not 32 (CUDA's table by compute capability)
_SM_BLOCKS = {(8, 6): 16, (8, 7): 16, (8, 9): 24}


def sm_limits(device=None) -> dict:
    """The GPU's SM count and the per-SM limits that decide how many programs of a kernel run at once:
    registers, resident threads, shared memory, resident blocks."""
    p = torch.cuda.get_device_properties(device)
    return dict(sms=p.multi_processor_count, regs=getattr(p, "regs_per_multiprocessor", SM90_LIMITS["regs"]),
                threads=p.max_threads_per_multi_processor,
                smem=getattr(p, "shared_memory_per_multiprocessor", SM90_LIMITS["smem"]),
                blocks=_SM_BLOCKS.get((p.major, p.minor), 32))


def programs_per_sm(regs: int, warps: int, shared: int, limits: dict) -> int:
    """Programs of a kernel of ``regs`` registers a thread, ``warps`` warps and ``shared`` bytes of
    shared memory that one SM holds at once: a warp's registers come from one of the SM's four
    register files in units of 256 (a thread's count rounded up to 8), a block's shared memory with
    1 KiB the driver reserves, and the SM's threads and blocks bound the rest."""
    per_warp = -(-max(regs, 1) // 8) * 8 * 32
    by_regs = 4 * ((limits["regs"] // 4) // per_warp) // warps
    by_threads = limits["threads"] // (32 * warps)
    by_smem = limits["smem"] // (shared + 1024)
    return max(0, min(by_regs, by_threads, by_smem, limits["blocks"]))


def waves(programs: int, per_sm: int, sms: int) -> float:
    """A launch's programs over the programs all SMs hold at once (1.16: a full wave and a sixth; the
    last, part-full wave is the grid's tail)."""
    return programs / max(1, per_sm * sms)


def rel_l2(a, b) -> float:
    """Relative L2 distance of ``a`` from ``b``, in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def form_output_and_us(handles, cfg, xs, idss, wss, outs):
    """What the experiments compare a config by: its output on the first layer's batch (a clone,
    after reserving the config's scratch) and its whole op's us per layer (``whole_op_us``)."""
    from b12x_ops.backends.triton import _launch_all

    handles[0]._state.plans.reserve(xs[0].shape[0], cfg)
    _launch_all(handles[0]._state, cfg, xs[0], idss[0], wss[0], outs[0])
    out = outs[0].clone()
    return out, whole_op_us(handles, cfg, xs, idss, wss, outs)


def log_host_profile(call, log, n=200):
    """Where an eager call's host time goes: cProfile over ``n`` calls, the top functions by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(14)
    log(f"  host profile of {n} eager calls (cProfile adds its own cost per Python call):")
    for line in buf.getvalue().splitlines():
        if line.strip() and (".py:" in line or "{" in line or "ncalls" in line):
            log("    " + line.strip()[:160])


def load_variant(name):
    """``--variant``: a module under benchmarks/ with stage kernels under evaluation (None for no
    name). Each of ``gemm1_kernel``, ``gemm2_kernel``, ``gemv1_kernel``, ``gemv2_kernel`` it defines
    replaces the package's (launches read them when built); its optional ``PREPARE_OPTIONS`` (say
    ``gemv=False``) go to ``prepare_experts`` and ``on_prepare(handle)`` adapts each handle
    (``adapt_handles``)."""
    if not name:
        return None
    import importlib

    from b12x_ops.backends.triton import kernels as K_

    mod = importlib.import_module(name)
    for kernel in ("gemm1_kernel", "gemm2_kernel", "gemv1_kernel", "gemv2_kernel"):
        if hasattr(mod, kernel):
            setattr(K_, kernel, getattr(mod, kernel))
    return mod


def adapt_handles(variant, handles):
    """``handles``, each passed to ``variant``'s ``on_prepare`` if it has one (say, to repack them)."""
    for h in handles:
        getattr(variant, "on_prepare", lambda _: None)(h)
    return handles


def bench_geometry(name, geo, args, bw, peak, log, variant=None):
    E, K, N, top_k, limit = geo["E"], geo["K"], geo["N"], geo["top_k"], geo["limit"]
    L = args.layers
    dev = "cuda"
    expert_bytes = 2 * N * K // 2 + 2 * N * K // 32 + K * N // 2 + K * N // 32
    layers = [random_layer(E, K, N, dev, 100 + i) for i in range(L)]
    t0 = time.perf_counter()
    opts = dict(getattr(variant, "PREPARE_OPTIONS", {}), **prepare_options(args))
    handles = adapt_handles(variant, [b12x_ops.prepare_experts(*lw, top_k=top_k, swiglu_limit=limit, backend="triton",
                                                               tune=not args.no_tune, max_tokens=max(args.sizes),
                                                               decode_token_counts=planned_counts(args),
                                                               **opts)
                                      for lw in layers])
    prep_s = time.perf_counter() - t0
    log(f"{name}: prepared {L} layers in {prep_s:.1f}s; memory per layer {handles[0].memory}")
    ref = b12x_ops.prepare_experts(*layers[0], top_k=top_k, swiglu_limit=limit, backend="reference")
    bf16 = []
    for lw in layers[: args.bf16_layers]:
        bf16.append(Bf16MoE(dequant_bf16(lw[0], lw[1]), dequant_bf16(lw[2], lw[3]), top_k, limit))
    peer = []
    peer_err = None
    if args.triton_kernels:
        try:
            for lw in layers:
                peer.append(TritonKernelsMoE(args.triton_kernels, *lw, top_k, limit))
        except Exception as exc:  # noqa: BLE001 - the peer is optional; say why it did not run
            peer, peer_err = [], f"{type(exc).__name__}: {exc}"
            log(f"  triton_kernels peer unavailable: {peer_err}")
    points = []
    for M in args.sizes:
        rt = [routing(M, E, top_k, dev, 1000 * i + M) for i in range(L)]
        xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(L)]
        outs = [torch.empty_like(x) for x in xs]
        ours = graph_time([(lambda i=i: b12x_ops.moe_w4a8_out(xs[i], rt[i][1], rt[i][2], handles[i], outs[i]))
                           for i in range(L)], args.reps)
        want = b12x_ops.moe_w4a8(xs[0], rt[0][1], rt[0][2], ref) if M <= 2048 else None
        err = None
        if want is not None:
            err = float((outs[0].float() - want.float()).norm() / want.float().norm())
        distinct = sum(int(torch.unique(r[1]).numel()) for r in rt) / L
        nbytes = distinct * expert_bytes + 2 * M * K * 2
        flops = 2 * M * top_k * (K * 2 * N + N * K)
        t_hbm, t_flop = nbytes / bw, flops / peak
        limit_s = max(t_hbm, t_flop)
        # eager: wall time per call of a synchronized loop against one layer's graph, side by side
        # (``eager_and_graph``), and host time to issue one call
        h0, x0, i0, w0, o0 = handles[0], xs[0], rt[0][1], rt[0][2], outs[0]
        eager, single, overhead, host_share, gpu_share, idle = eager_and_graph(
            lambda: b12x_ops.moe_w4a8_out(x0, i0, w0, h0, o0), args.reps)
        # what an eager call launches: the GEMV path's one launch (kept at prepare where faster) or not
        eager_rn = h0._state.plans.runner_for(M, lambda: False)
        eager_fused = bool(eager_rn.cfg.fused)
        # ... and whether its launches went out by one C call (backends/triton/chain.py), as the calls above did
        eager_chained = bool((getattr(h0._state, "chains", {}).get(id(eager_rn)) or (None, 0, None))[2])
        # host cost of issuing one call: few enough calls that the launch queue never fills
        host = host_time(lambda: b12x_ops.moe_w4a8_out(x0, i0, w0, h0, o0))
        if args.diagnose and M == min(args.sizes):
            log_host_profile(lambda: b12x_ops.moe_w4a8_out(x0, i0, w0, h0, o0), log)
        p = dict(M=M, ours_us=ours * 1e6, limit_us=limit_s * 1e6, hbm_limit_us=t_hbm * 1e6, flop_limit_us=t_flop * 1e6,
                 bytes=nbytes, flops=flops, distinct_experts=distinct, rel_err_vs_ref=err,
                 pct_of_limit=100 * limit_s / ours, eager_us=eager * 1e6, host_us=host * 1e6,
                 single_graph_us=single * 1e6, eager_overhead_us=overhead * 1e6,
                 eager_host_share_us=host_share * 1e6, eager_gpu_share_us=gpu_share * 1e6,
                 eager_idle_overhead_us=idle * 1e6,
                 tflops=flops / ours / 1e12, pct_bf16_peak=100 * flops / ours / peak, eager_fused=eager_fused,
                 eager_chained=eager_chained)
        if bf16:
            p["bf16_us"] = graph_time([(lambda i=i: bf16[i](xs[i], rt[i][1], rt[i][2])) for i in range(len(bf16))],
                                      args.reps) * 1e6
        if peer:
            try:
                pr = [peer[i].route(rt[i][0]) for i in range(L)]
                inter = [torch.empty(1, M * top_k, N, device=dev, dtype=torch.bfloat16) for _ in range(L)]
                pout = [torch.empty(1, M, K, device=dev, dtype=torch.bfloat16) for _ in range(L)]
                p["triton_kernels_us"] = graph_time(
                    [(lambda i=i: peer[i](xs[i], pr[i][0], pr[i][1], pr[i][2], inter[i], pout[i])) for i in range(L)],
                    args.reps) * 1e6
            except Exception as exc:  # noqa: BLE001
                peer_err = f"{type(exc).__name__}: {exc}"
                log(f"  triton_kernels failed at M={M}: {peer_err}")
                peer = []
        log(f"  M={M:5d} ours {p['ours_us']:9.1f} us  limit {p['limit_us']:8.1f} ({p['pct_of_limit']:5.1f}%)  "
            f"bf16 {p.get('bf16_us', float('nan')):9.1f}  tk {p.get('triton_kernels_us', float('nan')):9.1f}  "
            f"eager {p['eager_us']:7.1f} (overhead {_overhead_cell(p)}, from idle {_idle_cell(p) or '-'}) "
            f"host {p['host_us']:6.1f} err {err}")
        points.append(p)
    diag = diagnose(handles, args, E, K, top_k, log) if args.diagnose else []
    plans = {str(c): cfg.as_dict() for c, cfg in handles[0]._state.plans.configs.items()}
    del handles, bf16, peer, layers
    torch.cuda.empty_cache()
    return dict(geometry=dict(geo, name=name), layers=L, prepare_s=prep_s, points=points, peer_error=peer_err,
                diagnosis=diag, plans=plans)


def diagnose(handles, args, E, K, top_k, log):
    """Per-stage times (each stage alone, replayed from a CUDA graph over every layer's handle, per
    layer: the weights come from HBM and the graph's own cost is shared, so the stages add up to
    about the whole op) and each stage kernel's registers, spills, shared memory and grid, for the
    diagnosis of misses. The GEMV path has two stages (gemv1, gemv2: reported as gemm1, gemm2)."""
    from b12x_ops.backends.triton import _launch
    from b12x_ops.backends.triton.kernels import num_blocks

    st = handles[0]._state
    gp = st.plans
    g = gp.geometry
    out = []
    for M in [m for m in (1, 4, 8, 16, 64, 512, 2048, 8192) if m in args.sizes]:
        _, ids, w = routing(M, E, top_k, "cuda", 7)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        o = torch.empty_like(x)
        _, cfg = gp.plan_for(M)
        b12x_ops.moe_w4a8_out(x, ids, w, handles[0], o)
        nb = M * top_k if cfg.gemv else num_blocks(M * top_k, E, cfg.bm)
        used = nb if cfg.gemv else used_blocks(ids, E, cfg.bm)  # (the blocks routing fills; the rest exit at once)
        rn = gp.runner_for(M)  # what the op launches
        grids = stage_programs(rn, cfg, M, top_k, g.hidden_size, nb)
        busy = stage_programs(rn, cfg, M, top_k, g.hidden_size, used)
        stages = {}
        for s_ in gp.kinds(cfg):
            ln = rn[1 + ("prologue", "gemm1", "gemm2", "finalize").index(s_)]
            t = graph_time([lambda s_=s_, h=h: _launch(h._state, rn, x, ids, w, o, (s_,)) for h in handles], 10) * 1e6
            ck = ln.compiled
            stages[s_] = dict(us=t, programs=grids[s_], busy=busy[s_], regs=getattr(ck, "n_regs", None),
                              spills=getattr(ck, "n_spills", None), shared=getattr(ck.metadata, "shared", None),
                              warps=ln.num_warps)
        active = int(torch.unique(ids).numel())
        log(f"  diag M={M} cfg={cfg} active experts={active} nblocks={nb}: " +
            "; ".join(f"{k} {v['us']:.1f}us grid={v['programs']} regs={v['regs']} spills={v['spills']} "
                      f"smem={v['shared']}" for k, v in stages.items()))
        out.append(dict(M=M, config=cfg.as_dict(), active_experts=active, nblocks=nb, used_blocks=used, stages=stages))
    return out


def stage_programs(rn, cfg, M: int, top_k: int, hidden_size: int, blocks: int) -> dict:
    """Each stage's programs for a call of ``M`` tokens by runner ``rn`` (``plan.Runner``, whose tile counts
    include the GEMV kernels' splits) of plan ``cfg``, the GEMMs' for ``blocks`` expert blocks (GEMV:
    slots), with their edge launches' programs."""
    from b12x_ops.backends.triton.plan import FINALIZE

    return {"prologue": M * rn.xquant_tiles if cfg.gemv else rn.prologue_programs(M, top_k),
            "gemm1": blocks * rn.n_tiles1 + (blocks if rn.edge1 is not None else 0),
            "gemm2": (M if cfg.gemv else blocks) * rn.n_tiles2 + (blocks if rn.edge2 is not None else 0),
            "finalize": -(-M // FINALIZE["BR"]) * -(-hidden_size // FINALIZE["BK"])}


def used_blocks(ids: torch.Tensor, E: int, bm: int) -> int:
    """The expert blocks of ``bm`` rows a routing ``ids`` (local expert ids, ``[M, top_k]``; others
    ignored) fills: each expert's rows in whole blocks. The launches' grids hold every block a call of
    that many slots could need (``kernels.num_blocks``); the programs of the others exit at once."""
    ids = ids.flatten().long()
    counts = torch.bincount(ids[(ids >= 0) & (ids < E)], minlength=E)
    return int(((counts + bm - 1) // bm).sum())


def _stage_cell(st: dict, limits: dict) -> str:
    """A stage's per-stage cell: time, grid (and how many of its programs have a block to work on, where
    fewer), registers, spills and, where the kernel's registers, warps and shared memory are known, the
    programs an SM holds and the waves of the working programs."""
    busy = st.get("busy", st["programs"])
    cell = f"{st['us']:.1f} (grid {st['programs']}{f', {busy} busy' if busy != st['programs'] else ''}, " \
           f"{st['regs']} regs, {st['spills']} spills"
    if st.get("regs") is not None and st.get("warps") and st.get("shared") is not None:
        per_sm = programs_per_sm(st["regs"], st["warps"], st["shared"], limits)
        cell += f", {per_sm}/SM, {waves(busy, per_sm, limits['sms']):.2f} waves"
    return cell + ")"


def _overhead_cell(p) -> str:
    """The eager overhead and, where measured, its host and GPU shares (medians each, so they need not
    add up exactly)."""
    cell = f"{p['eager_overhead_us']:.1f}"
    if p.get("eager_host_share_us") is not None:
        cell += f" ({p['eager_host_share_us']:.1f} + {p['eager_gpu_share_us']:.1f})"
    return cell


def _idle_cell(p) -> str:
    """The eager overhead of a call from an idle GPU (``idle_pair_overhead``) and its host share (less the
    GPU's, ``queued_gpu_share``), where the host issues a call faster than its graph replay runs, so that
    the replay in each pair is queued and the pair measures what it says; "-" where the host is slower
    (there the loop's share is the measure), blank for points made before it was measured."""
    if p.get("eager_idle_overhead_us") is None:
        return ""
    if p.get("single_graph_us") is None or p["host_us"] >= p["single_graph_us"]:
        return "-"
    idle, gpu = p["eager_idle_overhead_us"], p["eager_gpu_share_us"]
    return f"{idle:.1f} ({idle - gpu:.1f} + {gpu:.1f})"


def write_markdown(res, path):
    lines = [f"# W4A8 MoE benchmark ({res['device']}, torch {res['torch']}, triton {res['triton']})", "",
             f"Measured copy bandwidth {res['copy_bw'] / 1e12:.2f} TB/s, bf16 matmul {res['bf16_peak'] / 1e12:.0f} "
             f"TFLOP/s. Times are per layer, CUDA-graph replay over {res['geometries'][0]['layers']} layers, in us. "
             "limit = max(bytes / bandwidth, FLOPs / bf16 peak). eager: the wall time a call of a synchronized "
             "loop of calls on one layer; eager overhead: its median difference to that layer's graph replay, the "
             "two timed in alternating rounds, split into the host's share and the GPU's: the GPU's is the median "
             "difference between an eager call's GPU time and a graph replay's, in adjacent pairs queued behind a "
             "sleep kernel so that the host never starves the GPU (the gaps between separately launched kernels; free "
             "of the clock's drift), the host's the rest (the host's time above the kernels' GPU time, plus what the "
             "clock drifts between the eager loop and the graph replays); from idle (host + GPU): the median "
             "difference, in pairs each started after a synchronize, between an eager call's span on an idle GPU "
             "(from before its first launch to its last kernel's end) and a graph replay queued right behind it, so free "
             "of the drift, with the host's share (less the GPU's above), shown where the host issues a call faster "
             "than its graph replay runs (\"-\" where it does not: there the loop's share is the measure); host/call: "
             "the host's time to issue a call. Command: `"
             + res["command"] + "`", ""]
    for g in res["geometries"]:
        geo = g["geometry"]
        lines += [f"## {geo['name']} (E={geo['E']}, K={geo['K']}, N={geo['N']}, top-{geo['top_k']}, "
                  f"limit {geo['limit']})", ""]
        if g.get("peer_error"):
            lines += [f"triton_kernels: {g['peer_error']}", ""]
        lines += ["| M | ours | limit | % of limit | bf16 | triton_kernels | ours vs tk | % bf16 peak | eager | "
                  "eager overhead (host + GPU) | from idle (host + GPU) | host/call | rel err |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in g["points"]:
            tk = p.get("triton_kernels_us")
            tk_s = "" if tk is None else f"{tk:.1f}"
            ratio = "" if tk is None else f"{tk / p['ours_us']:.2f}x"
            err = "" if p["rel_err_vs_ref"] is None else f"{p['rel_err_vs_ref']:.1e}"
            lines.append(
                f"| {p['M']} | {p['ours_us']:.1f} | {p['limit_us']:.1f} | {p['pct_of_limit']:.0f}% | "
                f"{p.get('bf16_us', float('nan')):.1f} | {tk_s} | {ratio} | {p['pct_bf16_peak']:.0f}% | "
                f"{p['eager_us']:.1f} | {_overhead_cell(p)} | {_idle_cell(p)} | {p['host_us']:.1f} | {err} |")
        fused = [str(p["M"]) for p in g["points"] if p.get("eager_fused")]
        lines += ["", f"Eager calls launch the GEMV path as one kernel at M = {', '.join(fused)} (prepare timed it "
                  "faster there); every other eager call, and every graph, launches the stages apart."
                  if fused else "Eager calls launch the stages apart at every M (prepare timed the one-launch GEMV "
                  "no faster).", ""]
        chained = [str(p["M"]) for p in g["points"] if p.get("eager_chained")]
        if chained:
            lines += [f"Eager calls at M = {', '.join(chained)} launch their kernels by one C call "
                      "(`backends/triton/chain.py`); the others through triton's launcher, a launch at a time.", ""]
        if g.get("diagnosis"):
            lim = res.get("sm_limits") or SM90_LIMITS
            lines += ["Per-stage times a layer (us; each stage alone, CUDA-graph replay over the layers), with grid "
                      "(programs), registers/thread, spills, and the programs an SM holds at once (from registers, "
                      "warps and shared memory) with the waves of the busy programs on the GPU's "
                      f"{lim['sms']} SMs{'' if res.get('sm_limits') else ' (sm_90 taken: the run did not record its GPU)'} "
                      "(the grid holds a program for every block a call of that many slots could need; \"busy\": those "
                      "whose block the routing filled, where fewer; the others exit at once). bm: the blocked path's "
                      "block rows; GEMV: the small-M path (gemv1, gemv2 in the gemm columns; from a few tokens on, x's "
                      "quantization in the prologue column; no finalize):", "",
                      "| M | bm | active experts | blocks | prologue | gemm1 | gemm2 | finalize |", "|---|---|---|---|---|---|---|---|"]
            for d in g["diagnosis"]:
                st = d["stages"]
                cells = [_stage_cell(st[k], lim) if k in st else "-" for k in ("prologue", "gemm1", "gemm2", "finalize")]
                c = d["config"]
                kind = "GEMV" if c.get("gemv") else f"{c['bm']}"
                lines.append(f"| {d['M']} | {kind} | {d['active_experts']} | {d['nblocks']} | " + " | ".join(cells) + " |")
            lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gs = res["geometries"]
    fig, axes = plt.subplots(1, len(gs), figsize=(6 * len(gs), 4.5))
    for ax, g in zip(axes if len(gs) > 1 else [axes], gs):
        Ms = [p["M"] for p in g["points"]]
        ax.plot(Ms, [p["ours_us"] for p in g["points"]], "o-", label="ours (triton)")
        ax.plot(Ms, [p["limit_us"] for p in g["points"]], "k--", label="physical limit")
        if any("bf16_us" in p for p in g["points"]):
            ax.plot(Ms, [p.get("bf16_us", math.nan) for p in g["points"]], "s-", label="bf16 grouped_mm")
        if any("triton_kernels_us" in p for p in g["points"]):
            ax.plot(Ms, [p.get("triton_kernels_us", math.nan) for p in g["points"]], "^-", label="triton_kernels")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens M")
        ax.set_ylabel("us per layer")
        ax.set_title(g["geometry"]["name"])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _gemv_table(rows, sweep, args, bw):
    def f(v, fmt):
        return "failed" if v is None else format(v, fmt)
    out = []
    if sweep:
        out += ["GEMV tile sweep (whole op, us per layer; tiles: gemv1 (BN, BK, warps, stages) / gemv2 (BN, BK, "
                "warps, stages)):", "", "| geometry | M | tiles | us |", "|---|---|---|---|"]
        out += [f"| {name} | {M} | {tiles} | {f(t and t * 1e6, '.1f')} |" for name, M, tiles, t in sweep]
        out.append("")
    out += [f"GEMV vs blocked path, us per layer (CUDA-graph replay over {args.layers} layers, tune="
            f"{not args.no_tune}{', every size planned exactly' if args.exact_sizes else ''}); HBM limit = distinct experts' weight+scale bytes / {bw / 1e12:.2f} TB/s", "",
            "| geometry | M | HBM limit | GEMV | blocked | blocked/GEMV | GEMV % of limit | err GEMV | err blocked |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, M, lim, gv, bl in rows:
        out.append(f"| {name} | {M} | {lim * 1e6:.1f} | {f(gv and gv[0] * 1e6, '.1f')} | {f(bl and bl[0] * 1e6, '.1f')} | "
                   f"{f(gv and bl and bl[0] / gv[0], '.2f')} | {f(gv and 100 * lim / gv[0], '.0f')} | "
                   f"{f(gv and gv[1], '.1e')} | {f(bl and bl[1], '.1e')} |")
    return "\n".join(out)


def gemv_compare(args, log, bw=4.27e12):
    """GEMV path (gemv=True) against the blocked path (gemv=False) per geometry and M: CUDA-graph
    replay over ``--layers`` layers' handles, the HBM limit at ``bw`` bytes/s (distinct experts'
    weights and scales), and each path's error against the reference on layer 0; with
    ``--gemv-sweep M..`` also the whole op per pair of GEMV tile candidates at those M. The markdown table
    is rewritten to ``<out>/gemv_compare.md`` after every geometry (a run cut short keeps it)."""
    from b12x_ops.backends.triton import plan as P

    rows, sweep = [], []
    path = os.path.join(args.out, "gemv_compare.md")
    for name in args.geometries:
        geo = GEOMETRIES[name]
        E, K, N, top_k, limit = geo["E"], geo["K"], geo["N"], geo["top_k"], geo["limit"]
        L = args.layers
        expert_bytes = 2 * N * K // 2 + 2 * N * K // 32 + K * N // 2 + K * N // 32
        layers = [random_layer(E, K, N, DEVICE, 100 + i) for i in range(L)]
        handles = {}
        for mode in (True, False):
            t0 = time.perf_counter()
            try:
                handles[mode] = [b12x_ops.prepare_experts(*lw, top_k=top_k, swiglu_limit=limit, backend="triton",
                                                          tune=not args.no_tune, gemv=mode, max_tokens=max(args.sizes),
                                                          decode_token_counts=planned_counts(args),
                                                          frozen=not (mode and args.gemv_sweep), **prepare_options(args))
                                 for lw in layers]
            except Exception as exc:  # noqa: BLE001 - report and go on with the other path
                log(f"{name}: prepare gemv={mode} failed: {type(exc).__name__}: {exc}")
            log(f"{name}: prepared gemv={mode} in {time.perf_counter() - t0:.1f}s")
        ref = b12x_ops.prepare_experts(*layers[0], top_k=top_k, swiglu_limit=limit, backend="reference")
        inputs = {}
        for M in sorted(set(args.sizes) | set(args.gemv_sweep or ())):
            rt = [routing(M, E, top_k, DEVICE, 1000 * i + M) for i in range(L)]
            xs = [torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16) for _ in range(L)]
            inputs[M] = (rt, xs)

        def timed(hs, M):
            rt, xs = inputs[M]
            outs = [torch.empty_like(x) for x in xs]
            t = graph_time([(lambda i=i: b12x_ops.moe_w4a8_out(xs[i], rt[i][1], rt[i][2], hs[i], outs[i]))
                            for i in range(L)], args.reps)
            return t, outs[0]

        for M in args.sizes:
            rt, xs = inputs[M]
            want = b12x_ops.moe_w4a8(xs[0], rt[0][1], rt[0][2], ref).float()
            distinct = sum(int(torch.unique(r[1]).numel()) for r in rt) / L
            t_hbm = distinct * expert_bytes / bw
            res = {}
            for mode, hs in handles.items():
                try:
                    t, o = timed(hs, M)
                    res[mode] = (t, float((o.float() - want).norm() / want.norm()))
                except Exception as exc:  # noqa: BLE001
                    log(f"{name} M={M} gemv={mode} failed: {type(exc).__name__}: {exc}")
            gv, bl = res.get(True), res.get(False)
            rows.append((name, M, t_hbm, gv, bl))
            log(f"  {name} M={M}: limit {t_hbm * 1e6:.1f} us, gemv {gv[0] * 1e6 if gv else float('nan'):.1f} us "
                f"(err {gv[1] if gv else float('nan'):.1e}), blocked {bl[0] * 1e6 if bl else float('nan'):.1f} us "
                f"(err {bl[1] if bl else float('nan'):.1e})")
        with open(path, "w") as f:
            f.write(_gemv_table(rows, sweep, args, bw) + "\n")
        if args.gemv_sweep and True in handles:
            gp = handles[True][0]._state.plans
            for M in args.gemv_sweep:
                cap, base = gp.plan_for(M)
                t1, t2 = P.gemv_candidates(gp.geometry)
                for g1, g2 in [(g1, g2) for g1 in t1 for g2 in t2]:
                    cfg = P.Config.of(1, g1, g2, base.atomic, gemv=True)
                    gp.add(cap, cfg)
                    try:
                        t = timed(handles[True], M)[0]
                    except Exception as exc:  # noqa: BLE001
                        log(f"{name} M={M} sweep {g1}/{g2} failed: {type(exc).__name__}: {exc}")
                        t = None
                    sweep.append((name, M, f"{g1} / {g2}", t))
                    log(f"  sweep {name} M={M} {g1} / {g2}: {t and t * 1e6}")
                gp.add(cap, base)
            with open(path, "w") as f:
                f.write(_gemv_table(rows, sweep, args, bw) + "\n")
        del handles, layers, ref, inputs
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return _gemv_table(rows, sweep, args, bw)


def planned_counts(args) -> tuple[int, ...]:
    """``decode_token_counts`` for the handles: every size with ``--exact-sizes``, else none (the ladder of
    powers of two up to the largest size, so that a size between two runs the larger one's plan)."""
    return tuple(args.sizes) if args.exact_sizes else ()


def prepare_options(args) -> dict:
    """The backend options the command line sets for every prepare (``--ptx-off``: ``ptx=False``)."""
    return {"ptx": False} if args.ptx_off else {}


def stand_in(as_sm: int | None):
    """``--as-sm CC`` (``as_sm``): from here on the Triton backend's plans make the choices of a GPU of compute
    capability CC (``plan._capability`` answers CC for every CUDA device): the decode of the tl.dot kernels,
    the Gluon GEMMs, the GEMV on mma.sync, programmatic dependent launch. The kernels still compile for this
    GPU, so on sm_90 a large tl.dot tile still lowers to wgmma where that GPU gets MMA v2. Returns the
    previous answer's function (None where nothing changed), which the tests put back."""
    if as_sm is None:
        return None
    from b12x_ops.backends.triton import plan as P

    cc, real = (as_sm // 10, as_sm % 10), P._capability
    P._capability = lambda device: None if real(device) is None else cc
    return real


def command_line(args) -> str:
    """The command a table states it was made by: the options that change its numbers."""
    return ("python benchmarks/bench_moe.py" + ("" if not args.triton_kernels else " --triton-kernels <DIR>")
            + ("" if not args.no_tune else " --no-tune")
            + ("" if args.layers == 8 else f" --layers {args.layers}") + ("" if args.reps == 20 else f" --reps {args.reps}")
            + (" --exact-sizes" if args.exact_sizes else "") + (" --diagnose" if args.diagnose else "")
            + (f" --variant {args.variant}" if args.variant else "") + (" --ptx-off" if args.ptx_off else "")
            + (f" --as-sm {args.as_sm}" if args.as_sm is not None else ""))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometries", nargs="*", default=list(GEOMETRIES))
    ap.add_argument("--sizes", nargs="*", type=int, default=list(SIZES))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--bf16-layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--triton-kernels", default=None, help="folder holding the triton_kernels package (a peer)")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--exact-sizes", action="store_true",
                    help="plan every size of --sizes exactly (decode_token_counts); else a size between the "
                         "ladder's powers of two runs the next planned count's plan, as an engine that names none")
    ap.add_argument("--diagnose", action="store_true", help="per-stage times, registers, spills, grids")
    ap.add_argument("--ptx-off", action="store_true",
                    help="prepare with ptx=False: the Triton-operations decode in every kernel, no Gluon GEMMs, no "
                         "mma.sync GEMV (what any GPU runs for a checkpoint whose scale bytes leave [2, 252])")
    ap.add_argument("--as-sm", type=int, default=None, metavar="CC",
                    help="plan as a GPU of compute capability CC would (89: an L40 or RTX 4090, 80: an A100, 120: "
                         "an RTX 5090 on backend='triton'), on this GPU standing in for it (see stand_in)")
    ap.add_argument("--variant", default=None,
                    help="a module under benchmarks/ (say experiments.<name>) with stage kernels under evaluation: "
                         "timed in the package's place (see load_variant)")
    ap.add_argument("--gemv-compare", action="store_true",
                    help="only time the GEMV path against the blocked one (small M), print a table last")
    ap.add_argument("--gemv-sweep", nargs="*", type=int, default=None,
                    help="with --gemv-compare: also time every GEMV tile candidate at these M")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    if stand_in(args.as_sm) is not None:
        log(f"standing in for sm_{args.as_sm}: the plans make that GPU's choices, the kernels compile for this one")
    if args.gemv_compare:
        print("\n" + gemv_compare(args, log), flush=True)
        return

    import triton
    bw = measure_copy_bandwidth()
    peak = measure_bf16_peak()
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 peak {peak / 1e12:.0f} TFLOP/s")
    cmd = command_line(args)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               copy_bw=bw, bf16_peak=peak, sm_limits=sm_limits(), command=cmd, geometries=[])
    variant = load_variant(args.variant)
    for name in args.geometries:
        res["geometries"].append(bench_geometry(name, GEOMETRIES[name], args, bw, peak, log, variant))
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(res, f, indent=1)
        write_markdown(res, os.path.join(args.out, "results.md"))  # (a run cut short keeps its table)
    try:
        plot(res, os.path.join(args.out, "results.png"))
    except Exception as exc:  # noqa: BLE001
        log(f"plot failed: {exc}")
    print(open(os.path.join(args.out, "results.md")).read())


if __name__ == "__main__":
    main()
