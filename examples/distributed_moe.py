"""Expert (EP) and tensor (TP) parallel b12x-ops MoE layers on the ranks of torch.distributed.

Launch one process per GPU with torchrun:

    torchrun --standalone --nproc-per-node 2 examples/distributed_moe.py --mode ep --check
    torchrun --standalone --nproc-per-node 2 examples/distributed_moe.py --mode tp --bench --out results/
    torchrun --standalone --nproc-per-node 2 examples/distributed_moe.py --mode both --device cpu --tiny --check

Every rank builds the same layer (same seed), takes its share with ``b12x_ops.distributed``
(``--mode ep``: a contiguous range of experts; ``--mode tp``: a 32-aligned slice of the intermediate
dim) and runs ``moe_w4a8_out`` on the SAME tokens and GLOBAL top-k ids as every other rank; an
all-reduce (sum) of the partial outputs is the layer's output.

``--check``: the all-reduced output against the single-GPU layer over all experts (rank 0 builds it)
and the CPU reference for small M; padding rows stay zero; a ``DistributedMoE`` (router + op +
functional all-reduce) compiled with ``fullgraph=True`` has one b12x node and one all-reduce and
matches eager; on CUDA the layer step replays as a CUDA graph (``torch.cuda.graph``) and under
``torch.compile(mode="reduce-overhead")`` with no cudagraph skip.

``--bench``: per-rank time of the op and of op + all-reduce, replayed as CUDA graphs, at M = 16,
512 and 4096 for the three geometries, against the single-GPU layer; JSON and a markdown table go to
``--out``. On the CPU (``--device cpu --tiny``) the same path runs with gloo, the reference backend
and wall-clock timing of eager calls, to prove the code, not to measure anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time

# NVLink multicast stays off on shared hosts (NCCL, PyTorch symmetric memory, NVSHMEM), also when
# this program is started without the launcher script's environment.
for _var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_var, "0" if _var == "NCCL_NVLS_ENABLE" else "1")

import torch
import torch.distributed as dist

try:
    import b12x_ops
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import b12x_ops
from b12x_ops.distributed import DistributedMoE, count_moe_nodes, prepare_ep_rank, prepare_tp_rank


@dataclasses.dataclass(frozen=True)
class Geometry:
    E: int  # global experts
    K: int  # hidden size
    N: int  # intermediate size (whole layer; TP splits it)
    top_k: int
    limit: float | None  # swiglu_limit


GEOMETRIES = {
    "gpt-oss-120b": Geometry(E=128, K=2880, N=2880, top_k=4, limit=7.0),
    "deepseek-v4.1-tp4": Geometry(E=384, K=5120, N=576, top_k=6, limit=10.0),
    "qwen3-30b-a3b": Geometry(E=128, K=2048, N=768, top_k=8, limit=None),
    "tiny": Geometry(E=8, K=128, N=128, top_k=2, limit=7.0),
}
BENCH_GEOMETRIES = ("gpt-oss-120b", "deepseek-v4.1-tp4", "qwen3-30b-a3b")
GPU_TOL = 1e-2  # the contract's bound for GPU kernels against the oracle (rel L2)
CPU_REF_MAX_M = 16  # the CPU reference is slow: compare against it for small M only


# ------------------------------------------------------------------------------------ setup
@dataclasses.dataclass
class Ctx:
    rank: int
    world: int
    device: torch.device
    group: object
    args: argparse.Namespace

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def log(self, msg: str, all_ranks: bool = False) -> None:
        if all_ranks or self.rank == 0:
            print(f"[rank {self.rank}] {msg}" if all_ranks else msg, flush=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def init(args) -> Ctx:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", rank))
    want = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if want == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        # a failure on one rank must not leave the other waiting forever in a collective
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=args.timeout_s))
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))  # for the CPU reference on rank 0
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    return Ctx(rank, world, device, dist.group.WORLD, args)


@dataclasses.dataclass
class Layer:
    geo: Geometry
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    router: torch.Tensor  # bf16 [E, K], replicated

    def weights(self) -> dict:
        return dict(w13=self.w13, w13_scale=self.w13_scale, w2=self.w2, w2_scale=self.w2_scale)


def _scale_byte(fan_in: int, target_rms: float) -> int:
    """The E8M0 byte that gives a random-code MXFP4 row of ``fan_in`` an output of about ``target_rms``."""
    code_rms = 2.93  # rms of the 16 E2M1 values drawn uniformly
    return 127 + round(math.log2(target_rms / (code_rms * math.sqrt(fan_in))))


def build_layer(geo: Geometry, device, seed: int = 0) -> Layer:
    """Random MXFP4 experts and a router, identical on every rank (same seed, same device kind)."""
    g = torch.Generator(device=device).manual_seed(seed)
    E, K, N = geo.E, geo.K, geo.N

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=g, device=device, dtype=torch.uint8)

    def scales(byte, *shape):
        return torch.randint(byte - 1, byte + 2, shape, generator=g, device=device, dtype=torch.uint8)

    w13 = codes(E, 2 * N, K // 2)
    w13_scale = scales(_scale_byte(K, 2.0), E, 2 * N, K // 32)
    w2 = codes(E, K, N // 2)
    w2_scale = scales(_scale_byte(N, 1.0), E, K, N // 32)
    router = (torch.randn(E, K, generator=g, device=device) / math.sqrt(K)).to(torch.bfloat16)
    return Layer(geo, w13, w13_scale, w2, w2_scale, router)


def tokens(ctx: Ctx, K: int, M: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=ctx.device).manual_seed(10_000 + seed)
    return torch.randn(M, K, generator=g, device=ctx.device).to(torch.bfloat16)


def prepare(ctx: Ctx, layer: Layer, mode: str, token_counts=()) -> b12x_ops.PreparedExperts:
    """This rank's handle: ``mode`` "ep" or "tp" takes its share; "single" is the whole layer."""
    common = dict(top_k=layer.geo.top_k, swiglu_limit=layer.geo.limit, w13_layout="w13",
                  backend=ctx.args.backend, max_tokens=ctx.args.max_tokens,
                  decode_token_counts=tuple(m for m in token_counts if m < ctx.args.max_tokens),
                  **ctx.args.backend_options)
    if mode == "ep":
        return prepare_ep_rank(**layer.weights(), rank=ctx.rank, world_size=ctx.world, **common)
    if mode == "tp":
        return prepare_tp_rank(**layer.weights(), rank=ctx.rank, world_size=ctx.world, **common)
    return b12x_ops.prepare_experts(**layer.weights(), **common)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    d = float(want.norm())
    return float((got - want).norm()) / d if d else float(got.norm())


def gather(ctx: Ctx, obj) -> list:
    out = [None] * ctx.world
    dist.all_gather_object(out, obj)
    return out


def capturable(handle) -> bool:
    # the reference backend reads the routing on the host: correct on a GPU, but not capturable
    return handle.backend != "reference"


class Report:
    def __init__(self, ctx: Ctx):
        self.ctx = ctx
        self.checks: list[dict] = []

    def check(self, name: str, ok: bool, detail: str = "", all_ranks: bool = False) -> bool:
        self.checks.append({"rank": self.ctx.rank, "check": name, "ok": bool(ok), "detail": detail})
        self.ctx.log(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", all_ranks=all_ranks)
        return ok

    def error(self, name: str, exc: BaseException) -> None:
        self.check(name, False, f"{type(exc).__name__}: {exc}", all_ranks=True)

    @property
    def failures(self) -> int:
        return sum(not c["ok"] for c in self.checks)


# ------------------------------------------------------------------------------------ check
def step(ctx: Ctx, handle, x, ids, w) -> torch.Tensor:
    """One layer step on this rank: the partial output, then the sum over ranks (in place)."""
    out = torch.empty_like(x)
    b12x_ops.moe_w4a8_out(x, ids, w, handle, out)
    dist.all_reduce(out, group=ctx.group)
    return out


def check_geometry(ctx: Ctx, rep: Report, name: str, layer: Layer, modes, compile_checks: bool) -> None:
    geo = layer.geo
    t0 = time.perf_counter()
    sums = torch.stack([t.sum(dtype=torch.int64) for t in layer.weights().values()]).tolist()
    same = all(s == sums for s in gather(ctx, sums))
    rep.check(f"{name}: every rank built the same weights", same, f"checksums {sums}")
    single = prepare(ctx, layer, "single") if ctx.rank == 0 else None
    cpu_ref = None
    if ctx.rank == 0:
        cpu_ref = (single if not ctx.cuda else b12x_ops.prepare_experts(
            **{k: v.cpu() for k, v in layer.weights().items()}, top_k=geo.top_k, swiglu_limit=geo.limit,
            backend="reference"))
        ctx.log(f"{name}: single-GPU handle {single}")
    for mode in modes:
        handle = prepare(ctx, layer, mode, ctx.args.check_tokens)
        ctx.log(f"{name} {mode}: {handle}", all_ranks=True)
        moe = DistributedMoE(handle, layer.router, group=ctx.group)
        for M in ctx.args.check_tokens:
            x = tokens(ctx, geo.K, M, seed=M)
            ids, w = moe.route(x)
            pad = min(3, M // 4)
            if pad:
                ids[M - pad:] = -1  # CUDA-graph padding rows
            out = step(ctx, handle, x, ids, w)
            if ctx.rank != 0:
                continue
            tag = f"{name} {mode}={ctx.world} M={M}"
            want = b12x_ops.moe_w4a8(x, ids, w, single)
            rep.check(f"{tag}: all-reduced partials == single-GPU layer", rel_l2(out, want) <= GPU_TOL,
                      f"rel L2 {rel_l2(out, want):.2e}")
            if pad:
                rep.check(f"{tag}: padding rows are zero", bool((out[M - pad:] == 0).all()))
            if M <= CPU_REF_MAX_M:
                ref = b12x_ops.moe_w4a8(x.cpu(), ids.cpu(), w.cpu(), cpu_ref)
                rep.check(f"{tag}: == CPU reference", rel_l2(out, ref) <= GPU_TOL, f"rel L2 {rel_l2(out, ref):.2e}")
        if ctx.cuda and capturable(handle):
            try:
                check_cuda_graph(ctx, rep, f"{name} {mode}", handle, moe, geo)
            except Exception as exc:  # noqa: BLE001 - report and go on; the other rank times out if stuck
                rep.error(f"{name} {mode}: CUDA graph", exc)
        elif ctx.cuda:
            ctx.log(f"{name} {mode}: backend {handle.backend!r} is not capturable: CUDA-graph checks skipped")
        if compile_checks:
            try:
                check_compiled(ctx, rep, f"{name} {mode}", moe, single, layer)
            except Exception as exc:  # noqa: BLE001
                rep.error(f"{name} {mode}: compile", exc)
        del moe, handle
    ctx.log(f"{name}: checks took {time.perf_counter() - t0:.1f} s")


def check_cuda_graph(ctx: Ctx, rep: Report, tag: str, handle, moe, geo) -> None:
    """The eager step (op + NCCL all-reduce) captured with torch.cuda.graph, replayed on new inputs."""
    M = 16
    x = tokens(ctx, geo.K, M, seed=1)
    ids, w = moe.route(x)
    out = torch.empty_like(x)

    def run():
        b12x_ops.moe_w4a8_out(x, ids, w, handle, out)
        dist.all_reduce(out, group=ctx.group)

    graph = capture(ctx, run)
    x2 = tokens(ctx, geo.K, M, seed=2)
    ids2, w2 = moe.route(x2)
    want = step(ctx, handle, x2, ids2, w2)
    x.copy_(x2), ids.copy_(ids2), w.copy_(w2)
    graph.replay()
    ctx.sync()
    err = rel_l2(out, want)
    rep.check(f"{tag}: torch.cuda.graph replay (op + all-reduce) == eager", err <= 2e-3, f"rel L2 {err:.2e}",
              all_ranks=True)


def check_compiled(ctx: Ctx, rep: Report, tag: str, moe: DistributedMoE, single, layer: Layer) -> None:
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters

    x = tokens(ctx, layer.geo.K, 16, seed=3)
    eager = moe(x)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    traced = torch.compile(moe, fullgraph=True, backend=aot_autograd(fw_compiler=record))(x)
    counts = [count_moe_nodes(gm) for gm in graphs]
    rep.check(f"{tag}: fullgraph has one b12x node and one all-reduce", counts == [{"b12x": 1, "all_reduce": 1}],
              f"graphs {counts}", all_ranks=True)
    rep.check(f"{tag}: traced == eager", rel_l2(traced, eager) <= 2e-3, f"rel L2 {rel_l2(traced, eager):.2e}")
    if ctx.rank == 0:
        ctx.log("\n".join("    " + line for line in graphs[0].print_readable(print_output=False).splitlines()
                          if "b12x" in line or "all_reduce" in line or "wait_tensor" in line))

    torch._dynamo.reset()
    t0 = time.perf_counter()
    compiled = torch.compile(moe, fullgraph=True)
    got = compiled(x)
    got_odd = compiled(x[:7])  # another M: one recompile with M dynamic, then none
    rep.check(f"{tag}: inductor fullgraph == eager", rel_l2(got, eager) <= GPU_TOL,
              f"rel L2 {rel_l2(got, eager):.2e}, compiled in {time.perf_counter() - t0:.1f} s")
    rep.check(f"{tag}: inductor at another M == eager", rel_l2(got_odd, moe(x[:7])) <= GPU_TOL)
    if ctx.rank == 0:
        full = DistributedMoE(single, layer.router)(x)
        rep.check(f"{tag}: compiled layer == single-GPU layer", rel_l2(got, full) <= GPU_TOL,
                  f"rel L2 {rel_l2(got, full):.2e}")
    if not (ctx.cuda and capturable(moe.experts)):
        return
    torch._dynamo.reset()
    skips_before = counters["inductor"]["cudagraph_skips"]
    ro = torch.compile(moe, fullgraph=True, mode="reduce-overhead")
    for _ in range(4):  # warm-up, record, replay
        got = ro(x).clone()
    ctx.sync()
    skips = counters["inductor"]["cudagraph_skips"] - skips_before
    rep.check(f"{tag}: reduce-overhead records a CUDA graph (no cudagraph skip)", skips == 0, f"skips {skips}",
              all_ranks=True)
    rep.check(f"{tag}: reduce-overhead replay == eager", rel_l2(got, eager) <= GPU_TOL,
              f"rel L2 {rel_l2(got, eager):.2e}")
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------ bench
def capture(ctx: Ctx, fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream(device=ctx.device)
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(ctx.device).wait_stream(side)
    ctx.sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ctx.sync()
    return graph


def time_us(ctx: Ctx, fn, collective: bool) -> float:
    """Microseconds a call: CUDA-graph replays timed with events on CUDA, wall clock on the CPU.

    With ``collective`` (``fn`` holds an all-reduce) every rank must call this, and they run the same
    number of calls; without it only this rank does, with no collective."""
    budget = ctx.args.seconds_per_point
    if not ctx.cuda:
        t0 = time.perf_counter()
        fn()  # warm-up and probe
        probe = time.perf_counter() - t0
        if collective:  # the ranks agree on the count, so their all-reduces pair up
            probe = max(gather(ctx, probe))
        n = int(min(50, max(3, budget / max(probe, 1e-6))))
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) * 1e6 / n
    graph = capture(ctx, fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    ctx.sync()
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    ctx.sync()
    probe = start.elapsed_time(end) / 3 / 1e3  # seconds a replay
    iters = int(min(200, max(5, budget / max(probe, 1e-6))))
    if collective:
        iters = max(gather(ctx, iters))  # also lines the ranks up before the timed replays
    ctx.sync()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    ctx.sync()
    return start.elapsed_time(end) * 1e3 / iters


def bench_geometry(ctx: Ctx, name: str, layer: Layer, modes) -> list[dict]:
    geo, rows = layer.geo, []
    t0 = time.perf_counter()
    handles = {"single": prepare(ctx, layer, "single", ctx.args.bench_tokens) if ctx.rank == 0 else None}
    for mode in modes:
        handles[mode] = prepare(ctx, layer, mode, ctx.args.bench_tokens)
    t_prep = time.perf_counter() - t0
    backends = gather(ctx, {m: h.backend for m, h in handles.items() if h is not None})
    ctx.log(f"{name}: prepared in {t_prep:.1f} s, backends {backends}")
    if ctx.cuda and not all(capturable(h) for h in handles.values() if h is not None):
        ctx.log(f"{name}: a reference backend cannot be captured or timed fairly on a GPU: skipped")
        return rows
    router_moe = DistributedMoE(handles[modes[0]], layer.router)
    for M in ctx.args.bench_tokens:
        x = tokens(ctx, geo.K, M, seed=M)
        ids, w = router_moe.route(x)
        out = torch.empty_like(x)
        row = {"geometry": name, "M": M, "E": geo.E, "K": geo.K, "N": geo.N, "top_k": geo.top_k,
               "world_size": ctx.world, "backend": backends[0]}
        # one GPU, the whole layer: rank 0 alone, the others wait at the barrier
        single_us = None
        if ctx.rank == 0:
            single_us = time_us(ctx, lambda: b12x_ops.moe_w4a8_out(x, ids, w, handles["single"], out), False)
        dist.barrier()
        row["single_us"] = single_us
        for mode in modes:
            h = handles[mode]

            def op(h=h):
                b12x_ops.moe_w4a8_out(x, ids, w, h, out)

            def op_all_reduce(h=h):
                b12x_ops.moe_w4a8_out(x, ids, w, h, out)
                dist.all_reduce(out, group=ctx.group)

            op_us = gather(ctx, time_us(ctx, op, False))
            layer_us = gather(ctx, time_us(ctx, op_all_reduce, True))
            row[f"{mode}_op_us_per_rank"] = op_us
            row[f"{mode}_layer_us_per_rank"] = layer_us
            row[f"{mode}_layer_us"] = max(layer_us)  # the slowest rank sets the layer's time
            row[f"{mode}_speedup"] = single_us / max(layer_us) if single_us else None
        if ctx.rank == 0:
            ctx.log(json.dumps(row))
        rows.append(row)
    ctx.log(f"{name}: bench took {time.perf_counter() - t0:.1f} s")
    return rows


def markdown(rows: list[dict], modes, world: int, device: str, cuda: bool) -> str:
    head = ["geometry", "M", "1 GPU (us)"]
    for m in modes:
        head += [f"{m.upper()}={world} op (us, max rank)", f"{m.upper()}={world} op+all-reduce (us)",
                 f"{m.upper()} speed-up"]
    how = "CUDA-graph replay" if cuda else "eager calls, wall clock (a code-path check, not a measurement)"
    lines = [f"Per-rank time of one MoE layer call on {world} x {device}: {how}, routing excluded; the "
             f"op+all-reduce column is the slowest rank's; speed-up = 1-GPU time / that.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["geometry"], str(r["M"]), f"{r['single_us']:.1f}" if r["single_us"] else "-"]
        for m in modes:
            sp = r.get(f"{m}_speedup")
            cells += [f"{max(r[f'{m}_op_us_per_rank']):.1f}", f"{r[f'{m}_layer_us']:.1f}",
                      f"{sp:.2f}x" if sp else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ main
def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("ep", "tp", "both"), required=True)
    p.add_argument("--backend", default="auto", help="prepare_experts backend (auto, b12x, triton, reference)")
    p.add_argument("--backend-options", type=json.loads, default={},
                   help='JSON of backend-only prepare_experts options, e.g. \'{"tune": false}\' for triton')
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when there is one")
    p.add_argument("--tiny", action="store_true", help="one tiny geometry (E=8, K=N=128): for the CPU")
    p.add_argument("--geometry", nargs="+", choices=sorted(GEOMETRIES), help="default: the three benchmark ones")
    p.add_argument("--check", action="store_true")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--check-tokens", type=int, nargs="+", default=[1, 16, 77])
    p.add_argument("--bench-tokens", type=int, nargs="+", default=[16, 512, 4096])
    p.add_argument("--max-tokens", type=int, default=None,
                   help="prepare_experts max_tokens (default: the largest M this run uses)")
    p.add_argument("--seconds-per-point", type=float, default=0.2)
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new geometry after this many seconds (results so far are still written)")
    p.add_argument("--timeout-s", type=int, default=300, help="collective timeout (a stuck rank fails, not hangs)")
    p.add_argument("--out", default=None, help="folder for the JSON and markdown results (rank 0)")
    args = p.parse_args(argv)
    if not (args.check or args.bench):
        p.error("nothing to do: pass --check and/or --bench")
    if args.max_tokens is None:
        args.max_tokens = max((args.check_tokens if args.check else []) + (args.bench_tokens if args.bench else []))
    return args


def main(argv=None) -> int:
    args = parse(argv)
    ctx = init(args)
    modes = ["ep", "tp"] if args.mode == "both" else [args.mode]
    names = ["tiny"] if args.tiny else (args.geometry or list(BENCH_GEOMETRIES))
    rep = Report(ctx)
    ctx.log(f"b12x_ops {b12x_ops.__version__}, torch {torch.__version__}, {ctx.world} ranks on {ctx.device.type} "
            f"({dist.get_backend()}), modes {modes}, geometries {names}, backends here: "
            f"{[(s.name, s.available) for s in b12x_ops.available_backends(ctx.device)]}")
    results = {"world_size": ctx.world, "device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu",
               "torch": torch.__version__, "b12x_ops": b12x_ops.__version__, "modes": modes, "bench": []}
    t_start = time.perf_counter()
    for i, name in enumerate(names):
        if args.budget_s is not None and i:
            over = gather(ctx, time.perf_counter() - t_start > args.budget_s)
            if any(over):
                ctx.log(f"time budget of {args.budget_s:.0f} s spent: skipping {names[i:]}")
                results["skipped"] = names[i:]
                break
        layer = build_layer(GEOMETRIES[name], ctx.device, seed=i)
        if args.check:
            check_geometry(ctx, rep, name, layer, modes, compile_checks=(i == 0))
        if args.bench:
            results["bench"] += bench_geometry(ctx, name, layer, modes)
        del layer
        if ctx.cuda:
            torch.cuda.empty_cache()
    failures = sum(gather(ctx, rep.failures))
    results["checks"] = [c for per_rank in gather(ctx, rep.checks) for c in per_rank]
    results["failures"] = failures
    if ctx.rank == 0:
        ran = sum(1 for c in results["checks"])
        ctx.log(f"{'OK' if not failures else 'FAILED'}: {ran - failures} of {ran} checks passed "
                f"in {time.perf_counter() - t_start:.1f} s" if args.check else f"done in {time.perf_counter() - t_start:.1f} s")
        if results["bench"]:
            table = markdown(results["bench"], modes, ctx.world, results["device"], ctx.cuda)
            print(table, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            kind = "_".join(k for k in ("check", "bench") if getattr(args, k))
            stem = os.path.join(args.out, f"distributed_{args.mode}_{kind}")
            with open(stem + ".json", "w") as f:
                json.dump(results, f, indent=1)
            if results["bench"]:
                with open(stem + ".md", "w") as f:
                    f.write(table)
            ctx.log(f"wrote {stem}.json" + (" and .md" if results["bench"] else ""))
    dist.barrier()  # no rank tears its transport down while a peer still talks to it
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
