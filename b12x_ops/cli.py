"""``b12x-ops`` / ``python -m b12x_ops``: what runs here, and a small model end to end.

    b12x-ops info  [--device DEV] [--geometry E,K,N,TOP_K [--max-tokens M]]
    b12x-ops demo  [--device DEV] [--backend NAME] [--tokens M] [--layers L] [--compile-backend B]
    b12x-ops bench

``info`` prints the versions, the device, and for every backend whether it can run there and if
not, why; ``auto`` takes the first that can; with ``--geometry`` also the device bytes a layer
keeps on each backend against the checkpoint's size. ``demo`` runs a small MoE model (``models.TinyMoE``)
eagerly and under ``torch.compile(fullgraph=True, dynamic=True)``, prints the captured graph (one
``b12x`` node per layer) and the errors against eager and against the reference backend; on a CUDA
device it also captures the eager model in a CUDA graph and replays it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import platform
import sys
import time

import torch


# ------------------------------------------------------------------------------------- helpers
def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"b12x-ops: --device {name}: no CUDA device here (torch {torch.__version__})")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _version(dist: str, module) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return getattr(module, "__version__", None) if module is not None else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def describe_device(device: torch.device) -> tuple[str, str]:
    """``(name, compute capability)`` of ``device``; the capability is ``n/a`` off CUDA."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return torch.cuda.get_device_name(device), f"{major}.{minor} (sm_{major}{minor})"
    if device.type == "cpu":
        return _cpu_name(), "n/a"
    return device.type, "n/a"


def backend_statuses(device: torch.device):
    """``b12x_ops.available_backends(device)``; a backend whose check itself fails is reported, not fatal."""
    from . import backends

    try:
        return backends.available_backends(device)
    except Exception:  # one broken backend module must not hide the others
        statuses = []
        for name in backends.CANDIDATES:
            try:
                statuses.append(backends.status(name, device))
            except Exception as exc:
                statuses.append(backends.BackendStatus(name, False, f"its availability check failed: {exc!r}"))
        return statuses


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    denom = want.norm()
    return float((got - want).norm() / denom) if denom > 0 else float(got.norm())


# ---------------------------------------------------------------------------------------- info
def cmd_info(args) -> int:
    import b12x_ops
    from . import _compat

    if args.geometry:
        _parse_geometry(args.geometry)  # a bad --geometry fails before anything is printed
    device = _resolve_device(args.device)
    from .backends import load

    lib = load("b12x").library()
    print(f"b12x-ops {b12x_ops.__version__}")
    print(f"torch    {torch.__version__}")
    print(f"triton   {_compat.triton_version() or 'not installed'}")
    if lib is None:
        print("b12x     not installed (pip install b12x-ops[b12x])")
    else:
        print(f"b12x     {_version(lib.__name__.replace('_', '-'), lib) or 'unknown version'} (module {lib.__name__})")
    name, cc = describe_device(device)
    print(f"device   {device}: {name}")
    print(f"compute capability: {cc}")
    statuses = backend_statuses(device)
    print(f"backends on {device}, fastest first:")
    width = max(len(s.name) for s in statuses)
    for s in statuses:
        verdict = "can run" if s.available else f"cannot run on {device}: {s.reason}"
        print(f"  {s.name:<{width}}  {verdict}")
    chosen = next((s.name for s in statuses if s.available), None)
    if chosen is None:
        print(f"auto picks: nothing (no backend can run on {device})")
        return 1
    print(f"auto picks: {chosen}")
    _print_triton_launch(device)
    if args.geometry:
        _print_memory(args, chosen)
    return 0


def _print_triton_launch(device) -> None:
    """How the Triton backend launches its kernels here (where triton is installed)."""
    try:
        from .backends.triton import plan
    except ImportError:  # no triton: its backend line above says so
        return
    _, why = plan.pdl_status(device)
    print(f"triton programmatic dependent launch: {why}")
    print(f"triton one-launch GEMV for eager calls: {plan.gemv_fused_status()}")
    print(f"triton inline-PTX decode: {plan.ptx_status(device)[1]}")
    print(f"triton Gluon GEMMs: {plan.gluon_status(device)[1]}")
    print(f"triton GEMV on mma.sync: {plan.gemv_mma_status(device)[1]}")
    print(f"triton half tiles for part-empty blocks: {plan.half_tiles_status()}")
    print(f"triton narrower last column tiles: {plan.edge_status()}")
    print(f"triton GEMM2 accumulator zeroed by: {plan.acc_zero_status()}")
    print(f"triton compiled launches: {plan.direct_launch_status()}")
    from .backends.triton import chain

    print(f"triton eager calls: {chain.status()}")


def _parse_geometry(text: str) -> tuple[int, int, int, int]:
    try:
        e, k, n, top_k = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"b12x-ops info: --geometry: expected E,K,N,TOP_K (four integers), got {text!r}")
    if min(e, k, n, top_k) < 1 or k % 32 or n % 32 or top_k > e:
        raise SystemExit(f"b12x-ops info: --geometry: expected E, K, N, TOP_K >= 1 with K and N multiples of 32 "
                         f"and TOP_K <= E, got {text!r}")
    return e, k, n, top_k


def _print_memory(args, chosen: str) -> None:
    """Device bytes a layer of ``--geometry`` keeps against its checkpoint's, computed, not allocated."""
    from .handle import Geometry, plan_capacities

    e, k, n, top_k = _parse_geometry(args.geometry)
    codes = e * (2 * n * k // 2 + k * n // 2)
    scales = e * (2 * n * k // 32 + k * n // 32)
    mib = 2.0 ** -20
    ckpt = codes + scales
    print(f"memory per layer (E={e}, K={k}, N={n}, top-{top_k}, MXFP4): checkpoint {ckpt * mib:.1f} MiB "
          f"(codes {codes * mib:.1f} + scales {scales * mib:.1f})")
    print(f"  reference  {ckpt * mib:.1f} MiB on the device (the checkpoint's tensors as given)")
    print(f"  b12x       {ckpt * mib:.1f} MiB on the device (repacked in the checkpoint's own storage) "
          f"+ b12x's scratch arena, shared by the geometry's layers (sized at prepare)")
    try:
        from .backends.triton import scratch_estimate
        geo = Geometry(e, k, n, top_k, "w13", "silu", None, False, torch.device("cpu"), False)
        caps = plan_capacities(args.max_tokens, ())
        scratch = f"{scratch_estimate(geo, caps) * mib:.1f} MiB"
    except ImportError:
        scratch = "(triton is not installed)"
    # (the triton backend's code layout pads each row to whole 32-byte chunks: K and N to multiples of 64)
    from .backends.triton.layout import repacked_shape
    tri = math.prod(repacked_shape((e, 2 * n, k // 2))) + math.prod(repacked_shape((e, k, n // 2))) + scales
    print(f"  triton     {tri * mib:.1f} MiB on the device (the MXFP4 bytes only, repacked for its kernels in place of "
          f"the checkpoint's: no bf16 copy) + {scratch} of scratch shared by all layers of the geometry "
          f"(max_tokens {args.max_tokens})")
    print(f"  auto ({chosen}) keeps {ckpt * mib:.1f} MiB a layer: 1.00x the checkpoint")


# ---------------------------------------------------------------------------------------- demo
class _GraphCapture:
    """A dynamo backend that keeps every FX graph it is given, then compiles it with ``inner``."""

    def __init__(self, inner: str):
        self.inner = inner
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        if self.inner == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            return aot_eager(gm, example_inputs)
        return gm.forward  # "eager": the captured graph, run as is


def b12x_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The graph's calls of ``b12x`` ops."""
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "b12x"]


def _cuda_graph_replay(model, x: torch.Tensor, want: torch.Tensor) -> float:
    """Capture ``model(x)`` eagerly in a CUDA graph, replay on fresh data, return the replay error."""
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the capture, as torch.cuda.graph asks
            model(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
    static_x.zero_()
    graph.replay()  # on zeros: the replay below must not see this result
    static_x.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    return rel_l2(static_y, want)


def cmd_demo(args) -> int:
    import b12x_ops  # noqa: F401  (registers the ops)
    from .models import TinyMoE

    device = _resolve_device(args.device)
    shape = dict(num_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.intermediate,
                 num_experts=args.experts, top_k=args.top_k)
    t0 = time.perf_counter()
    model = TinyMoE(**shape, device=device, seed=args.seed, backend=args.backend, max_tokens=max(args.tokens, 1))
    backend = model.handles[0].backend
    print(f"b12x-ops demo: TinyMoE {args.layers} layers, K={args.hidden} N={args.intermediate} "
          f"E={args.experts} top_k={args.top_k}, {args.tokens} tokens bf16 on {device}, "
          f"backend {backend} (asked: {args.backend})")
    mem = model.handles[0].memory
    if mem:
        print("memory per layer: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in mem.items()))

    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16).to(device)
    with torch.no_grad():
        eager = model(x)

        capture = _GraphCapture(args.compile_backend)
        compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=capture)
        t1 = time.perf_counter()
        got = compiled(x)
        compile_s = time.perf_counter() - t1
        # Other token counts reuse the dynamic graph: no recompilation.
        other_counts = sorted({max(args.tokens // 2, 2), args.tokens + 3} - {args.tokens})
        for m in other_counts:
            compiled(torch.randn(m, args.hidden, generator=g).to(torch.bfloat16).to(device))

        gm = capture.graphs[0]
        nodes = b12x_nodes(gm)
        print(f"\ncaptured FX graph (torch.compile fullgraph=True dynamic=True, then {args.compile_backend}):")
        print(gm.code.strip())
        print(f"\nb12x nodes in the graph: {len(nodes)} for {args.layers} layers "
              f"({', '.join(str(n.target) for n in nodes)})")
        print(f"graphs compiled: {len(capture.graphs)} for token counts {[args.tokens] + other_counts} "
              f"(first compile {compile_s:.1f} s)"
              + ("; torch specializes 0 and 1 tokens, so they get a graph of their own" if args.tokens < 2 else ""))
        print(f"rel. L2 error, compiled vs eager: {rel_l2(got, eager):.3e}")

        # The same weights (same seed) on the reference backend.
        reference = TinyMoE(**shape, device=device, seed=args.seed, backend="reference",
                            max_tokens=max(args.tokens, 1))
        print(f"rel. L2 error, eager vs reference backend: {rel_l2(eager, reference(x)):.3e}"
              + (" (eager is the reference backend here)" if backend == "reference" else ""))

        if device.type != "cuda":
            print(f"CUDA graph: skipped (device {device} is not a CUDA device)")
        elif backend == "reference":
            print("CUDA graph: skipped (the reference backend reads the routing on the host: not capturable)")
        else:
            print(f"CUDA graph replay, rel. L2 error vs eager: {_cuda_graph_replay(model, x, eager):.3e}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


# --------------------------------------------------------------------------------------- bench
def cmd_bench(args) -> int:
    print("b12x-ops bench: not built into the CLI yet. The side-by-side benchmark and its latest "
          "results live in benchmarks/ of the source repository: python benchmarks/bench_moe.py --help "
          "(and benchmarks/dispatch_overhead.py for the per-call host overhead).")
    return 0


# ---------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="b12x-ops", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,demo,bench}")

    info = sub.add_parser("info", help="versions, device, and which backend runs here and why")
    info.add_argument("--device", default=_default_device(), help="default: cuda if present, else cpu")
    info.add_argument("--geometry", default=None, metavar="E,K,N,TOP_K",
                      help="also print the device bytes a layer of this geometry keeps against its checkpoint's "
                           "(e.g. 128,2880,2880,4 for gpt-oss-120b)")
    info.add_argument("--max-tokens", type=int, default=8192, help="with --geometry: the planned maximum (default 8192)")
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser("demo", help="a small MoE model, eager and compiled")
    demo.add_argument("--device", default=_default_device(), help="default: cuda if present, else cpu")
    demo.add_argument("--backend", default="auto", choices=("auto", "b12x", "triton", "reference"))
    demo.add_argument("--tokens", type=int, default=16, help="tokens in the batch (default 16)")
    demo.add_argument("--layers", type=int, default=2, help="MoE layers (default 2)")
    demo.add_argument("--hidden", type=int, default=128, help="hidden size K, a multiple of 32")
    demo.add_argument("--intermediate", type=int, default=128, help="intermediate size N, a multiple of 32")
    demo.add_argument("--experts", type=int, default=8, help="experts per layer")
    demo.add_argument("--top-k", type=int, default=2, help="experts per token")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--compile-backend", default="inductor", choices=("inductor", "aot_eager", "eager"),
                      help="what compiles the captured graph (default inductor)")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="points to benchmarks/")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "tokens", 0) < 0:
        raise SystemExit("b12x-ops demo: --tokens: expected an int >= 0")
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
