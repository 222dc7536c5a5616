"""The command line (``python -m b12x_ops`` / ``b12x-ops``) and the demo's model, on the CPU."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import b12x_ops
from b12x_ops import cli
from b12x_ops.models import MoELayer, TinyMoE

REPO = pathlib.Path(__file__).resolve().parent.parent


def _cli(*argv: str, timeout=240) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, on any machine
    proc = subprocess.run([sys.executable, "-m", "b12x_ops", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"b12x-ops {' '.join(argv)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _field(text: str, pattern: str) -> re.Match:
    match = re.search(pattern, text, flags=re.M)
    assert match, f"no line matching {pattern!r} in:\n{text}"
    return match


# ----------------------------------------------------------------------------------------- info
@pytest.fixture(scope="module")
def info() -> str:
    return _cli("info", "--device", "cpu").stdout


def test_info_prints_versions(info):
    assert _field(info, r"^torch\s+(\S+)$").group(1) == torch.__version__
    assert _field(info, r"^b12x-ops\s+(\S+)$").group(1) == b12x_ops.__version__
    _field(info, r"^triton\s+\S+")
    _field(info, r"^b12x\s+\S+")


def test_info_prints_the_device(info):
    _field(info, r"^device\s+cpu: \S+")
    assert _field(info, r"^compute capability: (.*)$").group(1) == "n/a"


def test_info_auto_picks_reference_on_cpu(info):
    assert _field(info, r"^auto picks: (\S+)$").group(1) == "reference"
    _field(info, r"^\s+reference\s+can run$")


def test_info_says_how_triton_launches_and_why(info, monkeypatch):
    # programmatic dependent launch: on by default where it can run, so off here with the reason;
    # off when asked
    line = r"^triton programmatic dependent launch: (.*)$"
    monkeypatch.delenv("B12X_OPS_TRITON_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    default = _cli("info", "--device", "cpu").stdout
    assert _field(default, line).group(1) == "off: needs a CUDA device of sm_90 or newer (got cpu)"
    monkeypatch.setenv("B12X_OPS_TRITON_PDL", "0")
    assert _field(_cli("info", "--device", "cpu").stdout, line).group(1) == "off (B12X_OPS_TRITON_PDL=0)"
    monkeypatch.delenv("B12X_OPS_TRITON_PDL")
    # the one-launch GEMV for calls outside graph capture: on by default, off when asked
    fused = r"^triton one-launch GEMV for eager calls: (.*)$"
    assert _field(info, fused).group(1).startswith("on: calls of the GEMV path outside CUDA-graph capture")
    monkeypatch.setenv("B12X_OPS_TRITON_GEMV_FUSED", "0")
    assert _field(_cli("info", "--device", "cpu").stdout, fused).group(1) == "off (B12X_OPS_TRITON_GEMV_FUSED=0)"
    # the Gluon GEMMs (wgmma on sm_90, mma.sync on other GPUs from sm_80): on by default where they can run (not
    # here, and the line says why); off when asked
    gluon = r"^triton Gluon GEMMs: (.*)$"
    from b12x_ops.backends.triton import gluon_kernels as GK

    monkeypatch.setenv("B12X_OPS_TRITON_GLUON", "0")
    assert _field(_cli("info", "--device", "cpu").stdout, gluon).group(1) == "off (B12X_OPS_TRITON_GLUON=0)"
    why = ("off: TRITON_INTERPRET=1 (the interpreter does not run Gluon)" if os.environ.get("TRITON_INTERPRET") == "1"
           else "off: needs a CUDA device (got cpu)" if GK.HAS_GLUON
           else "off: this triton has no Gluon with Hopper's wgmma and mma_v2")
    assert _field(info, gluon).group(1) == why
    # the GEMV on mma.sync: on by default on sm_80 and newer (not here, and the line says why); off when asked
    mma = r"^triton GEMV on mma.sync: (.*)$"
    from b12x_ops.backends.triton import gluon_gemv as GG

    assert _field(_cli("info", "--device", "cpu").stdout, mma).group(1) == "off (B12X_OPS_TRITON_GLUON=0)"
    why = ("off: TRITON_INTERPRET=1 (the interpreter does not run Gluon)" if os.environ.get("TRITON_INTERPRET") == "1"
           else "off: needs a CUDA device (got cpu)" if GG.HAS_GLUON_MMA
           else "off: this triton has no Gluon with mma_v2")
    assert _field(info, mma).group(1) == why
    # half tiles for part-empty blocks: on by default (from 64-row blocks), off when asked
    half = r"^triton half tiles for part-empty blocks: (.*)$"
    assert _field(info, half).group(1).startswith("on: in plans of 64-row blocks or more, a block holding at most half")
    assert "from 64-row blocks one holding at most a quarter the tile of a quarter" in _field(info, half).group(1)
    monkeypatch.setenv("B12X_OPS_TRITON_QUARTER", "0")
    assert "; quarter tiles off (" in _field(_cli("info", "--device", "cpu").stdout, half).group(1)
    monkeypatch.setenv("B12X_OPS_TRITON_HALF", "0")
    assert _field(_cli("info", "--device", "cpu").stdout, half).group(1) == "off (B12X_OPS_TRITON_HALF=0)"
    # the Gluon GEMMs' part-empty last column tiles in a narrower launch: off by default, on when asked
    edge = r"^triton narrower last column tiles: (.*)$"
    assert _field(info, edge).group(1).startswith("off by default (B12X_OPS_TRITON_EDGE=1 runs a Gluon GEMM's")
    monkeypatch.setenv("B12X_OPS_TRITON_EDGE", "1")
    assert _field(_cli("info", "--device", "cpu").stdout, edge).group(1).startswith(
        "on: a Gluon GEMM whose outputs are not a multiple of its tile")
    # where GEMM2's accumulator is zeroed: the prologue by default, the Gluon GEMM1 when asked, and a
    # place it does not know named
    acc = r"^triton GEMM2 accumulator zeroed by: (.*)$"
    assert _field(info, acc).group(1).startswith("the prologue (B12X_OPS_TRITON_ACC_ZERO=gemm1 or gemm1_last")
    monkeypatch.setenv("B12X_OPS_TRITON_ACC_ZERO", "gemm1_last")
    assert _field(_cli("info", "--device", "cpu").stdout, acc).group(1).startswith(
        "the Gluon GEMM1, after its epilogue, where a plan has it")
    monkeypatch.setenv("B12X_OPS_TRITON_ACC_ZERO", "epilogue")
    assert "invalid B12X_OPS_TRITON_ACC_ZERO='epilogue'" in _field(_cli("info", "--device", "cpu").stdout, acc).group(1)
    # how a compiled launch reaches the driver: the launcher's C function on the triton versions it
    # was checked against, else (or when asked) the launcher object, the line saying which and why
    import triton
    from b12x_ops.backends.triton import plan as P

    direct = r"^triton compiled launches: (.*)$"
    if triton.__version__.startswith(P.DIRECT_LAUNCH_VERSIONS):
        assert _field(info, direct).group(1).startswith("the launcher's C function called directly")
    else:
        assert _field(info, direct).group(1).endswith(f"only; this is {triton.__version__})")
    monkeypatch.setenv("B12X_OPS_TRITON_DIRECT_LAUNCH", "0")
    assert _field(_cli("info", "--device", "cpu").stdout, direct).group(1) == (
        "through triton's launcher object (B12X_OPS_TRITON_DIRECT_LAUNCH=0)")
    # an eager call's kernels: one C call (a chain) unless turned off
    chained = r"^triton eager calls: (.*)$"
    assert _field(info, chained).group(1).startswith("one C call launches the call's kernels")
    monkeypatch.setenv("B12X_OPS_TRITON_CHAIN", "0")
    assert _field(_cli("info", "--device", "cpu").stdout, chained).group(1) == (
        "through triton's launcher, a launch at a time (B12X_OPS_TRITON_CHAIN=0)")


@pytest.mark.parametrize("backend", ["b12x", "triton"])
def test_info_says_why_gpu_backends_cannot_run(info, backend):
    reason = _field(info, rf"^\s+{backend}\s+cannot run on cpu: (.+)$").group(1)
    assert "cpu" in reason, reason  # the backend's own reason names the device it was asked about


def test_info_lists_every_backend_fastest_first(info):
    listed = re.findall(r"^\s+(\w+)\s+(?:can run|cannot run)", info, flags=re.M)
    assert listed == [s.name for s in b12x_ops.available_backends("cpu")]


# ----------------------------------------------------------------------------------------- demo
def test_info_reports_bytes_per_layer_for_a_geometry():
    out = _cli("info", "--device", "cpu", "--geometry", "128,2880,2880,4", "--max-tokens", "4096").stdout
    E, K, N = 128, 2880, 2880
    ckpt = E * (2 * N * K // 2 + K * N // 2 + 2 * N * K // 32 + K * N // 32) / 2**20
    got = float(_field(out, r"^memory per layer \(E=128, K=2880, N=2880, top-4, MXFP4\): checkpoint (\S+) MiB").group(1))
    assert abs(got - ckpt) < 0.05
    for backend in ("reference", "b12x", "triton"):
        assert abs(float(_field(out, rf"^\s+{backend}\s+(\S+) MiB on the device").group(1)) - ckpt) < 0.05
    pytest.importorskip("triton")
    from b12x_ops.backends.triton import scratch_estimate
    from b12x_ops.handle import Geometry, plan_capacities
    geo = Geometry(E, K, N, 4, "w13", "silu", None, False, torch.device("cpu"), False)
    want = scratch_estimate(geo, plan_capacities(4096, ())) / 2**20
    scratch = float(_field(out, r"^\s+triton .* \+ (\S+) MiB of scratch shared by all layers .*max_tokens 4096").group(1))
    assert abs(scratch - want) < 0.05 and scratch > 0
    # more tokens planned, more scratch; the bytes a layer keeps do not change
    assert scratch_estimate(geo, plan_capacities(8192, ())) > scratch_estimate(geo, plan_capacities(4096, ()))


@pytest.mark.parametrize("bad", ["128,2880,2880", "128,2880,2881,4", "4,64,64,8", "a,b,c,d"])
def test_info_rejects_a_bad_geometry_first(bad):
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "b12x_ops", "info", "--device", "cpu", "--geometry", bad], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and "--geometry" in proc.stderr and bad in proc.stderr
    assert proc.stdout == ""  # nothing printed before the error


@pytest.fixture(scope="module")
def demo() -> str:
    return _cli("demo", "--device", "cpu", "--layers", "3", "--tokens", "12").stdout


@pytest.mark.slow
def test_demo_runs_the_reference_backend_on_cpu(demo):
    _field(demo, r"^b12x-ops demo: TinyMoE 3 layers, .* 12 tokens bf16 on cpu, backend reference \(asked: auto\)$")


@pytest.mark.slow
def test_demo_reports_memory_per_layer(demo):
    m = _field(demo, r"^memory per layer: device_bytes (\S+) MiB, checkpoint_bytes (\S+) MiB$")
    assert float(m.group(1)) == float(m.group(2)) > 0  # the reference keeps the checkpoint's bytes only


@pytest.mark.slow
def test_demo_graph_has_one_b12x_node_per_layer(demo):
    match = _field(demo, r"^b12x nodes in the graph: (\d+) for (\d+) layers")
    assert int(match.group(1)) == int(match.group(2)) == 3
    assert demo.count("torch.ops.b12x.moe_w4a8.default(") == 3  # in the printed FX code


@pytest.mark.slow
def test_demo_compiles_once_for_every_token_count(demo):
    assert int(_field(demo, r"^graphs compiled: (\d+) for token counts").group(1)) == 1


@pytest.mark.slow
def test_demo_errors_are_small(demo):
    compiled = float(_field(demo, r"^rel\. L2 error, compiled vs eager: (\S+)$").group(1))
    reference = float(_field(demo, r"^rel\. L2 error, eager vs reference backend: (\S+)").group(1))
    assert compiled <= 1e-2
    assert reference <= 5e-3
    _field(demo, r"^CUDA graph: skipped \(device cpu")


# ----------------------------------------------------------------------------- in-process parts
def test_bench_points_to_benchmarks(capsys):
    assert cli.main(["bench"]) == 0
    assert "benchmarks/" in capsys.readouterr().out


def test_unknown_command_is_an_error():
    with pytest.raises(SystemExit) as exc:
        cli.main(["nope"])
    assert exc.value.code != 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_device_without_cuda_says_so():
    with pytest.raises(SystemExit, match="no CUDA device"):
        cli.main(["info", "--device", "cuda"])


# ---------------------------------------------------------------------------- the demo's model
def test_tiny_moe_layer_is_router_plus_op_plus_residual():
    model = TinyMoE(num_layers=1, hidden_size=64, intermediate_size=64, num_experts=4, top_k=2, backend="reference")
    layer = model.layers[0]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        ids, weights = layer.route(x)
        want = x + b12x_ops.moe_w4a8(x, ids, weights, layer.experts)
        got = model(x)
    assert ids.shape == (5, 2) and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_tiny_moe_weights_depend_only_on_the_seed():
    a, b = (TinyMoE(num_layers=2, hidden_size=64, intermediate_size=32, num_experts=4, backend="reference", seed=7)
            for _ in range(2))
    x = torch.randn(4, 64).to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    assert a.handles[0] != b.handles[0]  # distinct handles (a compiled model guards on them)


def test_moe_layer_checks_its_router():
    model = TinyMoE(num_layers=1, hidden_size=64, intermediate_size=32, num_experts=4, backend="reference")
    with pytest.raises(ValueError, match="router_weight"):
        MoELayer(model.handles[0], torch.zeros(4, 32))


def test_readme_info_sample_has_the_lines_info_prints(info):
    """The README's ``b12x-ops info --device cpu`` sample names the same "triton ...:" lines, in the
    same order, as the command prints (what each says may differ with the machine)."""
    readme = (REPO / "README.md").read_text()
    sample = readme.split("$ b12x-ops info --device cpu\n", 1)[1].split("$ ", 1)[0]

    def labels(text):
        return re.findall(r"^(triton [^:\n]+):", text, flags=re.M)

    assert labels(sample) and labels(sample) == labels(info)
