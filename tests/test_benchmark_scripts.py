"""The device-call scripts in ``benchmarks/`` against the test suite they run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_COLLECT = r"""
import json, sys
import pytest

class Ids:
    ids = None

    def pytest_collection_finish(self, session):
        self.ids = [item.nodeid for item in session.items]

found = []
for k in [None] + sys.argv[1:]:
    ids = Ids()
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_triton_gpu.py"] + (["-k", k] if k else [])
    assert pytest.main(args, plugins=[ids]) in (0, 5), k
    found.append(ids.ids)
print(json.dumps(found))
"""


def test_ptests_groups_run_every_gpu_test_exactly_once():
    """``h200_session.sh ptests`` splits the GPU suite among parallel processes by ``-k``
    expressions: together they must select every test of ``tests/test_triton_gpu.py``, none twice,
    so that a new GPU test cannot go unrun on the device (or run twice at once)."""
    with open(os.path.join(ROOT, "benchmarks", "h200_session.sh")) as f:
        src = f.read()
    block = re.search(r"groups=\((.*?)\)\n", src, re.S)
    assert block is not None, "h200_session.sh has no groups=( ... ) array"
    groups = re.findall(r'"([^"]*)"', block.group(1))
    assert len(groups) >= 2
    run = subprocess.run([sys.executable, "-c", _COLLECT, *groups], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    everything, *selected = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(everything) > 40  # (the GPU suite itself was collected)
    picked = [nodeid for ids in selected for nodeid in ids]
    twice = sorted({n for n in picked if picked.count(n) > 1})
    assert not twice, f"tests selected by more than one group: {twice}"
    missing = sorted(set(everything) - set(picked))
    assert not missing, f"tests no group selects: {missing}"
    assert all(selected), [g for g, ids in zip(groups, selected) if not ids]  # (no group selects nothing)


def test_variant_trees_still_apply(tmp_path):
    """``experiments/variant_trees.py`` edits copies of the package by exact text: each edit
    must still find its text once in the current kernels (or the script stops, naming it), and
    each edited tree must still compile as Python, so the results it made can be remade."""
    import importlib.util
    import py_compile

    path = os.path.join(ROOT, "benchmarks", "experiments", "variant_trees.py")
    spec = importlib.util.spec_from_file_location("variant_trees", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(str(tmp_path))
    for name, edits in mod.VARIANTS.items():
        for rel, old, new in edits:
            edited = os.path.join(tmp_path, name, rel)
            with open(edited) as f:
                text = f.read()
            assert new in text and old not in text, (name, rel)
            py_compile.compile(edited, doraise=True)
            with open(os.path.join(ROOT, rel)) as f:
                assert f.read().count(old) == 1, (name, rel)  # (the package keeps the original)


def test_fp8_gemm1_layout_and_decode_on_the_emulator(capsys, monkeypatch):
    """``experiments/fp8_gemm1.py check``: its code layout puts every checkpoint code where the decode
    reads it (a tile with a padded chunk), and its asm (``prmt`` tables built by ``mad``) decodes every
    code to its exact E4M3 value at each block exponent of the window, on the PTX emulator of
    ``tests/test_ptx_decode.py``; a table one step off is caught."""
    import importlib.util

    import pytest

    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, "benchmarks")] + list(sys.path))
    path = os.path.join(ROOT, "benchmarks", "experiments", "fp8_gemm1.py")
    spec = importlib.util.spec_from_file_location("fp8_gemm1", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.check()
    out = capsys.readouterr().out
    assert "every code of a 2 x 32 x 160 tile in place" in out and "7680 decoded weights exact" in out
    monkeypatch.setattr(mod, "_T1_ADD", mod._T1_ADD + 0x08080808)  # (codes 4..7 one binade up)
    with pytest.raises(AssertionError):
        mod.check()


def test_bench_plans_every_size_exactly_only_when_asked(monkeypatch):
    """``bench_moe.py --exact-sizes`` plans each size (``decode_token_counts``); without it the handles plan
    the ladder up to the largest size, so a size between two planned counts runs the larger one's plan. A
    table made with exact plans says so in its command."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_moe as B
    from b12x_ops.handle import plan_capacities

    ap = B.build_parser()
    exact = ap.parse_args(["--exact-sizes", "--sizes", "3", "4", "5", "6", "--no-tune", "--layers", "4"])
    ladder = ap.parse_args(["--sizes", "3", "4", "5", "6", "--no-tune", "--layers", "4"])
    assert B.planned_counts(exact) == (3, 4, 5, 6) and B.planned_counts(ladder) == ()
    assert plan_capacities(max(exact.sizes), B.planned_counts(exact)) == (1, 2, 3, 4, 5, 6)
    assert plan_capacities(max(ladder.sizes), B.planned_counts(ladder)) == (1, 2, 4, 6)
    assert B.command_line(exact) == "python benchmarks/bench_moe.py --no-tune --layers 4 --exact-sizes"
    assert B.command_line(ladder) == "python benchmarks/bench_moe.py --no-tune --layers 4"


def test_bench_ptx_off_prepares_the_other_gpus_plans_and_says_so(monkeypatch):
    """``bench_moe.py --ptx-off`` prepares every handle with ``ptx=False`` (on sm_90 the plans other GPUs
    take) and its table's command says so; without it no option is added."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_moe as B

    ap = B.build_parser()
    off, on = ap.parse_args(["--no-tune", "--ptx-off"]), ap.parse_args(["--no-tune"])
    assert B.prepare_options(off) == {"ptx": False} and B.prepare_options(on) == {}
    assert B.command_line(off) == "python benchmarks/bench_moe.py --no-tune --ptx-off"
    assert B.command_line(on) == "python benchmarks/bench_moe.py --no-tune"


def test_bench_as_sm_plans_as_that_gpu_and_says_so(monkeypatch):
    """``bench_moe.py --as-sm CC`` makes the Triton plans answer CC for every CUDA device (and still None
    for the CPU), so a GPU stands in for another in timing; its table's command says so; without it nothing
    changes."""
    import torch

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_moe as B
    from b12x_ops.backends.triton import plan as P

    ap = B.build_parser()
    args = ap.parse_args(["--no-tune", "--as-sm", "89"])
    assert B.command_line(args) == "python benchmarks/bench_moe.py --no-tune --as-sm 89"
    assert B.stand_in(ap.parse_args(["--no-tune"]).as_sm) is None
    monkeypatch.setattr(P, "_capability", lambda device: (9, 0) if torch.device(device).type == "cuda" else None)
    real = B.stand_in(args.as_sm)
    try:
        assert P._capability("cuda") == (8, 9) and P._capability("cuda:1") == (8, 9) and P._capability("cpu") is None
        assert real("cuda") == (9, 0)
    finally:
        P._capability = real


def test_bench_markdown_says_which_eager_calls_were_chained(tmp_path, monkeypatch):
    """The benchmark's table names the token counts whose eager calls launched by one C call
    (``backends/triton/chain.py``), from each point's ``eager_chained``, and says nothing where none did."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_moe as B

    def point(M, chained):
        return dict(M=M, ours_us=10.0, limit_us=5.0, pct_of_limit=50.0, pct_bf16_peak=1.0, eager_us=11.0,
                    eager_overhead_us=1.0, host_us=9.0, rel_err_vs_ref=None, eager_fused=False, eager_chained=chained)

    geo = dict(name="tiny", E=4, K=64, N=32, top_k=2, limit=None)
    res = dict(device="cpu", torch="t", triton="t", copy_bw=1e12, bf16_peak=1e14, command="bench",
               geometries=[dict(geometry=geo, layers=2, points=[point(1, True), point(2, True), point(16, False)]),
                           dict(geometry=dict(geo, name="other"), layers=2, points=[point(16, False)])])
    path = tmp_path / "results.md"
    B.write_markdown(res, str(path))
    text = path.read_text()
    assert text.count("launch their kernels by one C call") == 1
    assert "Eager calls at M = 1, 2 launch their kernels by one C call" in text


def test_bench_markdown_splits_eager_overhead_into_host_and_gpu_shares(tmp_path, monkeypatch):
    """The eager overhead cell gives the host's and the GPU's shares where the point has them
    (``bench_moe.eager_and_graph``), and the overhead alone for points made before they were measured."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_moe as B

    base = dict(ours_us=10.0, limit_us=5.0, pct_of_limit=50.0, pct_bf16_peak=1.0, eager_us=11.0, eager_overhead_us=1.5,
                host_us=9.0, rel_err_vs_ref=None, eager_fused=False, eager_chained=False)
    geo = dict(name="tiny", E=4, K=64, N=32, top_k=2, limit=None)
    pts = [dict(base, M=1, eager_host_share_us=0.25, eager_gpu_share_us=1.25), dict(base, M=2)]
    res = dict(device="cpu", torch="t", triton="t", copy_bw=1e12, bf16_peak=1e14, command="bench",
               geometries=[dict(geometry=geo, layers=2, points=pts)])
    path = tmp_path / "results.md"
    B.write_markdown(res, str(path))
    rows = [ln for ln in path.read_text().splitlines() if ln.startswith("| 1 |") or ln.startswith("| 2 |")]
    assert rows[0].split(" | ")[9] == "1.5 (0.2 + 1.2)" and rows[1].split(" | ")[9] == "1.5", rows
    assert "eager overhead (host + GPU)" in path.read_text()


def test_programs_per_sm_follows_registers_threads_shared_memory_and_blocks(monkeypatch):
    """``bench_moe.programs_per_sm``: a warp's registers in units of 256 from one of four register files, a
    block's shared memory with the driver's 1 KiB, and the SM's threads and blocks (sm_90's limits)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_moe as B

    lim = B.SM90_LIMITS
    assert B.programs_per_sm(96, 4, 4, lim) == 5  # (3072 registers a warp: 5 warps a register file)
    assert B.programs_per_sm(143, 4, 36864, lim) == 3  # (rounded up to 144: 3 warps a file, 12 warps)
    assert B.programs_per_sm(128, 16, 1024, lim) == 1  # (16 warps of 128: the whole register file)
    assert B.programs_per_sm(64, 8, 0, lim) == 4
    assert B.programs_per_sm(24, 4, 0, lim) == 16  # (registers for 21: the 2048 threads bound it)
    assert B.programs_per_sm(32, 4, 100 * 1024, lim) == 2  # (shared memory: 2 x (100 + 1) KiB of 228)
    assert B.programs_per_sm(16, 1, 0, lim) == 32  # (one-warp programs: the SM's 32 blocks)
    assert B.programs_per_sm(255, 32, 0, lim) == 0  # (more registers than an SM has: none fits)
    assert B.waves(768, 5, 132) == 768 / 660


def test_sm_limits_reads_the_device_and_its_block_bound(monkeypatch):
    """``bench_moe.sm_limits``: SMs, registers, threads and shared memory from the device's properties, the
    resident blocks by compute capability (16 on sm_86, 24 on sm_89, else 32)."""
    import types

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_moe as B

    def props(major, minor):
        return types.SimpleNamespace(multi_processor_count=84, regs_per_multiprocessor=65536, major=major, minor=minor,
                                     max_threads_per_multi_processor=1536, shared_memory_per_multiprocessor=102400)

    for (major, minor), blocks in (((8, 6), 16), ((8, 9), 24), ((9, 0), 32), ((12, 0), 32)):
        monkeypatch.setattr(B.torch.cuda, "get_device_properties", lambda device=None, p=props(major, minor): p)
        assert B.sm_limits() == dict(sms=84, regs=65536, threads=1536, smem=102400, blocks=blocks)
    assert B.programs_per_sm(32, 4, 0, B.sm_limits()) == 12  # (1536 threads: 12 four-warp programs)


def test_used_blocks_counts_each_experts_rows_in_whole_blocks(monkeypatch):
    """``bench_moe.used_blocks``: the blocks of ``bm`` rows the routing fills, an expert's rows rounded up to
    whole blocks, ids outside ``[0, E)`` (padding, other ranks) left out."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_moe as B
    import torch

    ids = torch.tensor([[0, 1], [0, 2], [0, -1], [5, 1]], dtype=torch.int32)  # (expert 0: 3 rows; 5 not ours)
    assert B.used_blocks(ids, 4, 2) == 2 + 1 + 1
    assert B.used_blocks(ids, 4, 16) == 3
    assert B.used_blocks(ids, 8, 1) == 7


def test_bench_markdown_gives_each_stage_its_programs_an_sm_and_waves(tmp_path, monkeypatch):
    """The per-stage cells add the programs an SM holds and the grid's waves, from the kernel's registers,
    warps and shared memory and the run's recorded SM limits (sm_90's for a run that recorded none)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_moe as B

    base = dict(ours_us=10.0, limit_us=5.0, pct_of_limit=50.0, pct_bf16_peak=1.0, eager_us=11.0, eager_overhead_us=1.5,
                host_us=9.0, rel_err_vs_ref=None, eager_fused=False, eager_chained=False)
    geo = dict(name="tiny", E=4, K=64, N=32, top_k=2, limit=None)
    stages = dict(gemm1=dict(us=17.0, programs=1024, busy=768, regs=96, spills=0, shared=4, warps=4),
                  gemm2=dict(us=9.0, programs=1024, regs=64, spills=0))  # (a stage from before warps were kept)
    diag = [dict(M=4, config=dict(gemv=True), active_experts=8, nblocks=8, stages=stages)]
    for limits, sms, cell in ((None, 132, "5/SM, 1.16 waves"), (dict(B.SM90_LIMITS, sms=66), 66, "5/SM, 2.33 waves")):
        res = dict(device="cpu", torch="t", triton="t", copy_bw=1e12, bf16_peak=1e14, command="bench",
                   geometries=[dict(geometry=geo, layers=2, points=[dict(base, M=4)], diagnosis=diag)])
        if limits:
            res["sm_limits"] = limits
        path = tmp_path / "results.md"
        B.write_markdown(res, str(path))
        text = path.read_text()
        row = next(ln for ln in text.splitlines() if ln.startswith("| 4 | GEMV |"))
        assert f"17.0 (grid 1024, 768 busy, 96 regs, 0 spills, {cell})" in row, row  # (waves of the busy ones)
        assert "9.0 (grid 1024, 64 regs, 0 spills) |" in row, row
        assert f"on the GPU's {sms} SMs" in text
        assert ("sm_90 taken" in text) == (limits is None)


def test_bench_markdown_gives_the_idle_start_overhead_where_the_host_runs_ahead(tmp_path, monkeypatch):
    """The idle-start cell (``bench_moe.idle_pair_overhead``) gives the overhead and its host share (less
    the queued GPU share) only where the host issues a call faster than its graph replay runs, "-" where
    it does not, and nothing for points made before it was measured."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_moe as B

    base = dict(ours_us=10.0, limit_us=5.0, pct_of_limit=50.0, pct_bf16_peak=1.0, eager_us=11.0, eager_overhead_us=1.5,
                host_us=30.0, rel_err_vs_ref=None, eager_fused=False, eager_chained=False, eager_host_share_us=0.5,
                eager_gpu_share_us=5.5)
    geo = dict(name="tiny", E=4, K=64, N=32, top_k=2, limit=None)
    pts = [dict(base, M=1, single_graph_us=1000.0, eager_idle_overhead_us=8.25),
           dict(base, M=2, single_graph_us=20.0, eager_idle_overhead_us=8.25), dict(base, M=4)]
    res = dict(device="cpu", torch="t", triton="t", copy_bw=1e12, bf16_peak=1e14, command="bench",
               geometries=[dict(geometry=geo, layers=2, points=pts)])
    path = tmp_path / "results.md"
    B.write_markdown(res, str(path))
    rows = {ln.split(" | ")[0]: ln.split(" | ") for ln in path.read_text().splitlines() if ln.startswith("| ")}
    assert rows["| 1"][10] == "8.2 (2.8 + 5.5)", rows["| 1"]
    assert rows["| 2"][10] == "-" and rows["| 4"][10] == "", (rows["| 2"], rows["| 4"])
    assert rows["| 1"][11] == "30.0" and "from idle (host + GPU)" in path.read_text()


def test_issued_work_counts_each_blocks_tile_and_the_last_column_tile(monkeypatch):
    """``experiments/issued_work.py``: a block issues the rows of its tile (the whole block, or half or a
    quarter where ``HALF`` allows and the block is that empty), and a GEMM's last column tile counts whole."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks", "experiments"))
    import issued_work as W

    counts = [0, 1, 16, 17, 32, 33, 64, 65]
    assert W.issued(counts, 64, 0) == 0 + 64 * 5 + 64 + 128
    assert W.issued(counts, 64, 1) == 0 + 32 * 4 + 64 + 64 + (64 + 32)
    assert W.issued(counts, 64, 2) == 0 + 16 * 2 + 32 * 2 + 64 + 64 + (64 + 16)
    w = W.work("dsv4.1-tp4", 8192)
    assert w["slots"] == 8192 * 6 <= w["rows"] and w["rows"] % 16 == 0
    assert w["col1"] == 576 / (-(-576 // w["bn1"]) * w["bn1"]) and w["col2"] == 1.0
    assert abs(w["gemm1"] - w["row_share"] * w["col1"]) < 1e-12 and w["gemm2"] == w["row_share"]
    assert min(w["gemm1"], w["gemm2"]) <= w["both"] <= max(w["gemm1"], w["gemm2"])


class _FakeClock:
    """A stand-in for CUDA events on the CPU: ``record`` stamps the clock, which the timed functions move."""

    def __init__(self):
        self.now = 0.0
        self.syncs = 0
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = clock.now

            def synchronize(self):
                clock.syncs += 1

            def elapsed_time(self, other):
                return other.t - self.t

        self.Event = Event

    def synchronize(self):
        self.syncs += 1


def test_eager_pair_measurements_subtract_the_right_halves(monkeypatch):
    """``bench_moe.idle_pair_overhead`` is the median of (call - replay) over its pairs, each pair after a
    synchronize; ``queued_gpu_share`` the median of (call - replay) with the replay first. Fed a clock that
    each call and replay move by known amounts (ms), both give the call's excess in seconds."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_moe as B
    import torch

    clock = _FakeClock()
    monkeypatch.setattr(torch.cuda, "Event", clock.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", clock.synchronize)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None, raising=False)
    extra = iter([0.004, 0.001, 0.009, 0.002, 0.003] * 100)  # the call's excess over the replay, ms

    def call():
        clock.now += 1.0 + next(extra)

    def replay():
        clock.now += 1.0

    syncs = clock.syncs
    assert abs(B.idle_pair_overhead(call, replay, 5) - 0.003e-3) < 1e-12
    assert clock.syncs - syncs >= 5  # (each pair starts from an idle GPU)
    assert abs(B.queued_gpu_share(call, replay, 5) - 0.003e-3) < 1e-12
