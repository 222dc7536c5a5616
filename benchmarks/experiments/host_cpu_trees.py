"""The op's per-call Python on this machine's CPU for several source trees, in alternating processes
(an experiment: ``benchmarks/NOTES.md`` says what it found).

    python benchmarks/experiments/host_cpu_trees.py base=DIR new=DIR [--rounds 6] [--calls 5000]

Each ``LABEL=DIR`` is a folder holding a ``b12x_ops`` package (a commit exported with
``git archive <rev> b12x_ops | tar -x -C DIR``). Per round, each tree runs in a process of its own
(``--child``) ``dispatch_overhead.measure_triton`` (this checkout's) on the tree's package: a small
layer prepared under ``TRITON_INTERPRET=1`` whose launches are marked compiled, so that the tree's
own ``Launch.__call__`` runs as after a GPU prepare, up to triton's launcher (its C function or its
launcher object, whichever the tree calls), which is a no-op; timed at one token (the GEMV path's
one launch) and at 32 (the blocked path's four). ``--data-ptr``: the no-op calls ``data_ptr()`` on
every tensor argument, as triton's launcher does. The table gives each tree's best round (this
machine's neighbours make single rounds vary by up to 2x).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def child(tree: str, calls: int, data_ptr: bool) -> list[float]:
    sys.path.insert(0, os.path.abspath(tree))
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import b12x_ops
    from dispatch_overhead import measure_triton

    assert os.path.dirname(os.path.dirname(os.path.abspath(b12x_ops.__file__))) == os.path.abspath(tree)
    return list(measure_triton(calls, data_ptr).values())  # (one token, 32; where the tree has them, the GEMV's
    # launches apart through the launcher and by their chain)


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
    best: dict[str, dict[str, float]] = {label: {} for label, _ in trees}
    for _ in range(a.rounds):
        for label, tree in trees:
            cmd = [sys.executable, __file__, "--child", tree, "--calls", str(a.calls)] + (["--data-ptr"] if a.data_ptr else [])
            env = dict(os.environ, PYTHONPATH="")
            got = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout)
            for m, us in zip(COLUMNS, got):
                best[label][m] = min(best[label].get(m, float("inf")), us)
    print(f"us per call, best of {a.rounds} rounds (each the best of 5 x {a.calls} calls)"
          + (", the no-op launcher calling data_ptr()" if a.data_ptr else ""))
    print("| tree | " + " | ".join(COLUMNS.values()) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for label, _ in trees:
        print(f"| {label} | " + " | ".join(f"{best[label][c]:.2f}" if c in best[label] else "-" for c in COLUMNS) + " |")


COLUMNS = {"1": "1 token (GEMV, 1 launch)", "32": "32 tokens (blocked, 4 launches)",
           "1/launcher": "1 token, GEMV launches apart, triton's launcher", "1/chain": "the same by their chain"}


if __name__ == "__main__":
    main()
