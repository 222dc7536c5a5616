"""Host cost of one eager op call, the kernels left out.

Times ``torch.ops.b12x.moe_w4a8_out`` on a handle whose backend launch is replaced by a no-op, so
what remains is the dispatcher, argument checks and the plan lookup: the per-call overhead this
package adds above the kernels. For scale it also times an empty op registered with
``torch.library.custom_op`` and one with ``Library.define`` + ``impl``, and a bare Python call.

    python benchmarks/dispatch_overhead.py [--device cpu|cuda] [--calls 20000] [--triton]

``--triton`` (CPU) also times the Triton backend's own per-call Python: a handle prepared under
``TRITON_INTERPRET=1`` whose launches are marked compiled, so that ``Launch.__call__`` runs as after a
GPU prepare up to the launcher's C function, which is replaced by a no-op (the stream lookup too), on
its small-M (GEMV at one token: the one launch an eager call takes there, see ``plan.eager_form``)
and blocked (4 launches) paths. What the no-op leaves out is triton's launcher itself: parsing the
arguments, ``data_ptr()`` and a driver query for each tensor argument (the handle's own tensors go
as addresses, ``_operands``), and the driver's launch. Then the GEMV path's launches apart (no
one-launch form) twice: through the launcher (chains off) and by their chain (``chain.py``), whose
one C call is a no-op here: the Python left of an eager GEMV call.
"""

from __future__ import annotations

import argparse
import json
import time
import types

import torch

import b12x_ops


def _per_call_us(fn, calls: int) -> float:
    for _ in range(min(1000, calls)):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def measure(device: str = "cpu", calls: int = 20000) -> dict[str, float]:
    E, K, N, top_k, M = 8, 256, 128, 4, 4
    w13, s13 = b12x_ops.quantize_mxfp4(torch.randn(E, 2 * N, K) * 0.05)
    w2, s2 = b12x_ops.quantize_mxfp4(torch.randn(E, K, N) * 0.05)
    h = b12x_ops.prepare_experts(w13.to(device), s13.to(device), w2.to(device), s2.to(device), top_k=top_k,
                                 backend="reference")
    h._run = lambda state, x, ids, w, out: None  # the launch left out: what remains is our overhead
    x = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    ids = torch.randint(0, E, (M, top_k), dtype=torch.int32, device=device)
    w = torch.rand(M, top_k, device=device)
    out = torch.empty_like(x)

    lib = torch.library.Library("b12x_ops_bench", "FRAGMENT")
    lib.define("noop_out(Tensor x, Tensor(a!) out) -> ()")
    lib.impl("noop_out", lambda x, out: None, "CPU")
    lib.impl("noop_out", lambda x, out: None, "CUDA")

    @torch.library.custom_op("b12x_ops_bench::noop_custom", mutates_args=("out",))
    def noop_custom(x: torch.Tensor, out: torch.Tensor) -> None:
        return None

    def bare(x, ids, w, h, out):
        return None

    op = torch.ops.b12x.moe_w4a8_out.default
    results = {
        "bare python call": _per_call_us(lambda: bare(x, ids, w, h, out), calls),
        "Library.define + impl, empty": _per_call_us(lambda: torch.ops.b12x_ops_bench.noop_out.default(x, out), calls),
        "torch.library.custom_op, empty": _per_call_us(lambda: noop_custom(x, out), calls),
        "b12x::moe_w4a8_out, launch left out": _per_call_us(lambda: op(x, ids, w, h, out), calls),
    }
    return results


def measure_triton(calls: int = 20000, data_ptr: bool = False) -> dict[str, float]:
    """The Triton backend's per-call Python, triton's launcher left out (CPU, interpreter). With
    ``data_ptr`` the left-out launcher calls ``data_ptr()`` on each tensor argument, as triton's does
    (in C; here in a Python loop, so it overstates that part). Also runs a tree whose ``Launch`` calls
    triton's launcher object and reads the stream at call time (``experiments/host_cpu_trees.py``)."""
    import os
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is first launched
    from b12x_ops.backends.triton import plan as P

    E, K, N, top_k = 8, 256, 128, 4
    torch.manual_seed(0)
    w13, s13 = b12x_ops.quantize_mxfp4(torch.randn(E, 2 * N, K) * 0.05)
    w2, s2 = b12x_ops.quantize_mxfp4(torch.randn(E, K, N) * 0.05)
    h = b12x_ops.prepare_experts(w13, s13, w2, s2, top_k=top_k, backend="triton", max_tokens=64)

    class Compiled:  # (what Launch.__call__ reads of a compiled kernel: only with a launch hook set)
        def launch_metadata(self, grid, stream, *args):
            return None

    def c_launch(*args):  # triton's launcher, left out
        if data_ptr:
            for v in args:
                if type(v) is torch.Tensor:
                    v.data_ptr()

    torch._C._cuda_getCurrentRawStream = lambda device: 0  # (no CUDA here)
    torch._C._cuda_getDevice = lambda: 0
    P._raw_stream, P._current_device = torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice
    for ln in h._state.plans.launches.values():  # (as after a GPU prepare: every launch compiled, which
        ln.compiled = Compiled()                  # the interpreter never records)
        ln._function, ln._packed, ln._direct = 0, (4, 1, 0), (c_launch, 0, 0)
        ln._run = lambda gx, gy, gz, stream, function, *args: c_launch(*args)  # (the launcher object's path)
    import b12x_ops.backends.triton as T

    res = {}
    for M, path in ((1, "small-M GEMV path, its one-launch eager form"), (32, "blocked path, 4 launches")):
        x = torch.randn(M, K, dtype=torch.bfloat16)
        ids = torch.randint(0, E, (M, top_k), dtype=torch.int32)
        w = torch.rand(M, top_k)
        out = torch.empty_like(x)
        assert h._state.plans.plan_for(M)[1].gemv == (M == 1)
        T._CH.ENABLED = False  # (through triton's launcher, a launch at a time)
        res[f"b12x::moe_w4a8_out on the triton backend, {path}, launcher left out"] = _per_call_us(
            lambda: torch.ops.b12x.moe_w4a8_out.default(x, ids, w, h, out), calls)
        T._CH.ENABLED = True
    # the GEMV path's launches apart (no one-launch eager form), through triton's launcher (chains off)
    # and by its chain (``backends/triton/chain.py``), the C call left out
    st = h._state
    gp = st.plans
    gp.eager_runners.clear()
    rn = gp.runner_for(1, lambda: False)
    assert rn.cfg.gemv and not rn.cfg.fused
    x, ids, w = torch.randn(1, K, dtype=torch.bfloat16), torch.randint(0, E, (1, top_k), dtype=torch.int32), torch.rand(1, top_k)
    out = torch.empty_like(x)
    path = f"small-M GEMV path, its {len(gp.kinds(rn.cfg))} launches"
    T._CH.ENABLED = False
    res[f"b12x::moe_w4a8_out on the triton backend, {path}, launcher left out"] = _per_call_us(
        lambda: torch.ops.b12x.moe_w4a8_out.default(x, ids, w, h, out), calls)
    T._CH.ENABLED = True
    # (what _build_chain sets; the C call left out; the first call fills the handle's fast path, ``State.fast``)
    T._P, T._KNOBS, T._CH_MOD = P, P._RUNTIME_KNOBS, types.SimpleNamespace(launch=lambda *args: True)
    st.chains[id(rn)] = (rn, gp.arena.version, b"(a chain)")
    res[f"b12x::moe_w4a8_out on the triton backend, {path} by their chain, the C call left out"] = _per_call_us(
        lambda: torch.ops.b12x.moe_w4a8_out.default(x, ids, w, h, out), calls)
    # the blocked path's four launches by their chain (one a runner, the count's sizes as values), the C call left out
    M = 32
    rn = gp.runner_for(M, lambda: False)
    assert not rn.cfg.gemv
    x, ids, w = torch.randn(M, K, dtype=torch.bfloat16), torch.randint(0, E, (M, top_k), dtype=torch.int32), torch.rand(M, top_k)
    out = torch.empty_like(x)
    st.chains[id(rn)] = (rn, gp.arena.version, b"(a chain)")
    res["b12x::moe_w4a8_out on the triton backend, blocked path, 4 launches by their chain, the C call left out"] = (
        _per_call_us(lambda: torch.ops.b12x.moe_w4a8_out.default(x, ids, w, h, out), calls))
    # ... and a call above the fast path's bound (``FAST_MAX_TOKENS``): the same chain through the plan lookup
    bound, T.FAST_MAX_TOKENS = T.FAST_MAX_TOKENS, 0
    st.fast.clear()
    res["b12x::moe_w4a8_out on the triton backend, blocked path, 4 launches by their chain outside the fast path, "
        "the C call left out"] = _per_call_us(lambda: torch.ops.b12x.moe_w4a8_out.default(x, ids, w, h, out), calls)
    T.FAST_MAX_TOKENS = bound
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--json", help="also write the numbers here")
    p.add_argument("--triton", action="store_true", help="also the Triton backend's per-call Python (CPU)")
    a = p.parse_args()
    res = measure(a.device, a.calls)
    if a.triton:
        res.update(measure_triton(a.calls))
    print(f"| per-call host time on {a.device} (torch {torch.__version__}) | us |")
    print("| --- | --- |")
    for k, v in res.items():
        print(f"| {k} | {v:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": a.device, "torch": torch.__version__, "us_per_call": res}, f, indent=2)


if __name__ == "__main__":
    main()
