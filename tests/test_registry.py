"""The op registry, with no GPU: our ops coexist with the b12x library's, collisions fail loudly,
and every op has a fake, a CPU kernel and sample inputs.

The b12x library registers about 45+ private ops in the same ``b12x`` namespace, lazily, from the
modules that hold its kernels. The coexistence tests import every such module (found by scanning
the installed package for ``"b12x::`` registrations) beside b12x_ops in a child process, in both
orders, so this process's registry stays as b12x_ops alone makes it.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._library import simple_registry
from torch._subclasses.fake_tensor import FakeTensorMode

import b12x_ops
from b12x_ops.backends import load as load_backend
from b12x_ops.backends import reference

import _samples

TESTS = pathlib.Path(__file__).resolve().parent
REPO = TESTS.parent
OURS = sorted(b12x_ops.SCHEMAS)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _run_child(code: str, *args: str, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO,
                          env=_child_env(), capture_output=True, text=True, timeout=timeout)


def _b12x_library():
    mod = load_backend("b12x").library()
    if mod is None:
        if os.environ.get("CI"):
            raise AssertionError("CI installs the b12x extra: the b12x library must be importable")
        pytest.skip("the b12x library is not installed: pip install -e .[b12x]")
    return mod


# ---------------------------------------------------------------------------- (a) coexistence
_COEXIST = r"""
import importlib, json, pathlib, sys
import torch

order, lib_name = sys.argv[1:]

def b12x_names():
    return {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("b12x::")}

def import_theirs():
    # Every module of the library that registers a b12x:: op (the library loads them lazily).
    root = pathlib.Path(importlib.import_module(lib_name).__file__).parent
    failed = {}
    for path in sorted(root.rglob("*.py")):
        if '"b12x::' not in path.read_text(encoding="utf-8", errors="replace"):
            continue
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        try:
            importlib.import_module(module)
        except ImportError as exc:
            failed[module] = repr(exc)
    return failed

def import_ours():
    import b12x_ops  # noqa: F401

before = b12x_names()
if order == "theirs_first":
    failed = import_theirs(); mid = b12x_names(); import_ours()
    theirs, ours = mid - before, b12x_names() - mid
else:
    import_ours(); mid = b12x_names(); failed = import_theirs()
    ours, theirs = mid - before, b12x_names() - mid

import b12x_ops, _samples
schemas = {n: str(torch._C._get_schema(n, "")) for n in sorted(theirs | ours)}
resolved = {n: str(getattr(torch.ops.b12x, n.split("::")[1]).default._schema) for n in sorted(theirs | ours)}

# Our ops still run on the CPU after theirs registered: the reference backend against the oracle.
errors = {}
for case in _samples.CASES:
    layer, (x, ids, w) = _samples.case(case)
    experts = layer.prepare(backend="reference")
    want = _samples.oracle(layer, x, ids, w)
    got = torch.ops.b12x.moe_w4a8(x, ids, w, experts)
    out = torch.full_like(x, float("nan"))
    torch.ops.b12x.moe_w4a8_out(x, ids, w, experts, out)
    rid, rw = torch.ops.b12x.ep_remap(ids, w, layer.offset, layer.E)
    errors[case] = {
        "moe_w4a8": _samples.rel_l2(got, want),
        "moe_w4a8_out": _samples.rel_l2(out, want),
        "ep_remap_ids_in_range": bool(((rid >= 0) & (rid < layer.E)).all()),
    }
print(json.dumps({"ours": sorted(ours), "theirs": sorted(theirs), "failed_imports": failed,
                  "schemas": schemas, "resolved": resolved, "errors": errors}))
"""


@pytest.fixture(scope="module", params=["theirs_first", "ours_first"])
def coexisting(request) -> dict:
    lib = _b12x_library()
    proc = _run_child(_COEXIST, request.param, lib.__name__)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_both_op_sets_are_registered(coexisting):
    ours, theirs = set(coexisting["ours"]), set(coexisting["theirs"])
    assert ours == {f"b12x::{n}" for n in OURS}
    assert "b12x::tp_moe_dynamic_launch" in theirs, coexisting["failed_imports"]
    assert len(theirs) >= 40, (sorted(theirs), coexisting["failed_imports"])
    assert not ours & theirs


def test_every_op_has_a_schema_by_name(coexisting):
    names = set(coexisting["ours"]) | set(coexisting["theirs"])
    assert set(coexisting["schemas"]) == names
    for name in names:
        schema = coexisting["schemas"][name]
        assert schema.startswith(f"{name}("), schema
        assert coexisting["resolved"][name] == schema  # torch.ops.b12x.<op>.default finds the same op


def test_our_schemas_are_unchanged_by_theirs(coexisting):
    for name in OURS:
        assert coexisting["schemas"][f"b12x::{name}"] == str(getattr(torch.ops.b12x, name).default._schema)


def test_our_ops_still_run_on_cpu(coexisting):
    assert set(coexisting["errors"]) == set(_samples.CASES)
    for case, err in coexisting["errors"].items():
        assert err["moe_w4a8"] <= 5e-3, (case, err)
        assert err["moe_w4a8_out"] <= 5e-3, (case, err)
        assert err["ep_remap_ids_in_range"], (case, err)


# ---------------------------------------------------------------------------- (b) collisions
_COLLIDE = r"""
import sys
import torch

name = sys.argv[1]
squatter = torch.library.Library("b12x", "FRAGMENT")
squatter.define(f"{name}(Tensor x) -> Tensor")
try:
    import b12x_ops  # noqa: F401
except RuntimeError as exc:
    print("RuntimeError:", exc)
    sys.exit(0)
except BaseException as exc:
    print(f"wrong exception {type(exc).__name__}: {exc}")
    sys.exit(2)
print("imported without error")
sys.exit(1)
"""


@pytest.mark.parametrize("name", OURS)
def test_a_name_taken_first_fails_loudly(name):
    proc = _run_child(_COLLIDE, name)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert f"b12x::{name}" in proc.stdout, proc.stdout


# ---------------------------------------------------------------------------- (c) completeness
def _moe_args(layer, batch):
    x, ids, w = batch
    return (x, ids, w, layer.prepare(backend="reference"))


def _moe_out_args(layer, batch):
    x, ids, w = batch
    return (x, ids, w, layer.prepare(backend="reference"), torch.empty_like(x))


def _remap_args(layer, batch):
    _, ids, w = batch
    return (ids, w, layer.offset, layer.E)


# How each op is fed from a tests/_samples.py case. A new op must add its line here.
SAMPLE_ARGS = {
    "moe_w4a8": _moe_args,
    "moe_w4a8_out": _moe_out_args,
    "ep_remap": _remap_args,
}


def test_every_op_has_sample_inputs():
    assert set(SAMPLE_ARGS) == set(b12x_ops.SCHEMAS)
    assert _samples.CASES


@pytest.mark.parametrize("name", OURS)
def test_every_op_has_a_fake_and_cpu_kernel(name):
    qualified = f"b12x::{name}"
    entry = simple_registry.singleton.find(qualified)
    assert entry.fake_impl.kernel is not None, f"{qualified} has no fake (torch.library.register_fake)"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU"), f"{qualified} has no CPU kernel"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "Meta"), f"{qualified} has no Meta kernel"


def _flat(result):
    if result is None:
        return []
    return list(result) if isinstance(result, (tuple, list)) else [result]


@pytest.mark.parametrize("case", sorted(_samples.CASES))
@pytest.mark.parametrize("name", OURS)
def test_fake_agrees_with_cpu_kernel(name, case):
    layer, batch = _samples.case(case)
    op = getattr(torch.ops.b12x, name).default
    args = SAMPLE_ARGS[name](layer, batch)
    mode = FakeTensorMode()
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    real = _flat(op(*args))
    with mode:
        fake = _flat(op(*fake_args))  # the handle goes in as is: a fake never reads it
    assert len(fake) == len(real)
    for f, r in zip(fake, real):
        assert (f.shape, f.dtype, f.device) == (r.shape, r.dtype, r.device)


def test_reference_backend_runs_anywhere():
    # The CPU kernels above are the reference backend: it must be the last candidate, never refused.
    from b12x_ops import backends

    assert backends.CANDIDATES[-1] == "reference"
    assert reference.unavailable_reason(torch.device("cpu")) is None
    assert reference.unavailable_reason(torch.device("meta")) is None
