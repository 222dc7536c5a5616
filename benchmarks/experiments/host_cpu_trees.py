"""The op's per-call Python on this machine's CPU for several source trees, in alternating processes
(an experiment: ``benchmarks/NOTES.md`` says what it found).

    python benchmarks/experiments/host_cpu_trees.py base=DIR new=DIR [--rounds 6] [--calls 5000]

Each ``LABEL=DIR`` is a folder holding a ``b12x_ops`` package (a commit exported with
``git archive <rev> b12x_ops | tar -x -C DIR``). Per round, each tree runs in a process of its own
(``--child``): a small layer prepared under ``TRITON_INTERPRET=1`` whose launches are marked
compiled, so that the tree's own ``Launch.__call__`` runs as after a GPU prepare; the launcher it
ends in (triton's C function, or triton's launcher object where the tree has no direct path) is
replaced by a no-op and the CUDA stream lookup by a constant. What is timed is
``torch.ops.b12x.moe_w4a8_out`` at one token (the GEMV path's one launch) and at 32 (the blocked
path's four). With ``--data-ptr`` the no-op calls ``data_ptr()`` on every tensor argument, as
triton's launcher does (in C; here in a Python loop, so it overstates that part). The table gives
each tree's best round (this machine's neighbours make single rounds vary by up to 2x).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def child(tree: str, calls: int, data_ptr: bool) -> dict:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, tree)
    import torch

    import b12x_ops
    from b12x_ops.backends.triton import plan as P

    assert os.path.dirname(os.path.dirname(os.path.abspath(b12x_ops.__file__))) == os.path.abspath(tree)
    E, K, N, top_k = 8, 256, 128, 4
    torch.manual_seed(0)
    w13, s13 = b12x_ops.quantize_mxfp4(torch.randn(E, 2 * N, K) * 0.05)
    w2, s2 = b12x_ops.quantize_mxfp4(torch.randn(E, K, N) * 0.05)
    h = b12x_ops.prepare_experts(w13, s13, w2, s2, top_k=top_k, backend="triton", max_tokens=64)
    T = torch.Tensor

    def c_launch(*args):
        if data_ptr:
            for v in args:
                if type(v) is T:
                    v.data_ptr()

    class Compiled:
        def launch_metadata(self, *args):
            return None

    torch._C._cuda_getCurrentRawStream = lambda device: 0  # (older trees look these up at call time)
    torch._C._cuda_getDevice = lambda: 0
    if hasattr(P, "_raw_stream"):
        P._raw_stream, P._current_device = (lambda device: 0), (lambda: 0)
    for ln in h._state.plans.launches.values():
        ln.compiled, ln._function, ln._packed = Compiled(), 0, (4, 1, 0)
        ln._run = lambda gx, gy, gz, stream, function, *args: c_launch(*args)
        if hasattr(ln, "_direct"):
            ln._direct = (c_launch, 0, 0)
    op = torch.ops.b12x.moe_w4a8_out.default
    res = {}
    for M in (1, 32):
        x = torch.randn(M, K, dtype=torch.bfloat16)
        ids = torch.randint(0, E, (M, top_k), dtype=torch.int32)
        w = torch.rand(M, top_k)
        out = torch.empty_like(x)
        for _ in range(1000):
            op(x, ids, w, h, out)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                op(x, ids, w, h, out)
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        res[M] = best
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="*", help="LABEL=DIR")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--data-ptr", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.calls, a.data_ptr)))
        return
    trees = [t.split("=", 1) for t in a.trees]
    best: dict[str, dict[int, float]] = {label: {} for label, _ in trees}
    for _ in range(a.rounds):
        for label, tree in trees:
            cmd = [sys.executable, __file__, "--child", tree, "--calls", str(a.calls)] + (["--data-ptr"] if a.data_ptr else [])
            env = dict(os.environ, PYTHONPATH="")
            got = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout)
            for m, us in got.items():
                best[label][int(m)] = min(best[label].get(int(m), float("inf")), us)
    print(f"us per call, best of {a.rounds} rounds (each the best of 5 x {a.calls} calls)"
          + (", the no-op launcher calling data_ptr()" if a.data_ptr else ""))
    print("| tree | 1 token (GEMV, 1 launch) | 32 tokens (blocked, 4 launches) |")
    print("|---|---|---|")
    for label, _ in trees:
        print(f"| {label} | {best[label][1]:.2f} | {best[label][32]:.2f} |")


if __name__ == "__main__":
    main()
