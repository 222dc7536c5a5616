"""csrc_stubs/ declares the same schemas in C++ as b12x_ops/ops.py does in Python.

The C++ file is built with ``torch.utils.cpp_extension.load`` in a fresh Python process that never
imports b12x_ops (so nothing but the C++ file defines the ops there), which prints the schemas the
dispatcher holds; this process imports b12x_ops and compares them op by op.

An opaque type prints as ``PyObject`` in a parsed schema, whatever its name, so the handle's type
name is pinned separately: the child process checks the C++ library registers exactly
``b12x_ops.handle.HANDLE_TYPE`` as an opaque type, and the C++ schema literals are compared with
``SCHEMAS`` as text.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import b12x_ops
from b12x_ops.handle import HANDLE_TYPE

REPO = pathlib.Path(__file__).resolve().parent.parent
STUBS = REPO / "csrc_stubs"
SOURCES = sorted(STUBS.glob("*.cpp"))

pytestmark = pytest.mark.slow

# Runs in the child: build, load, report. It must not import b12x_ops.
_CHILD = textwrap.dedent(
    r"""
    import json, sys
    import torch
    from torch.utils import cpp_extension

    handle_type, build_dir, *sources = sys.argv[1:]
    before = set(torch._C._dispatch_get_all_op_names())
    registered_before = torch._C._is_opaque_type_registered(handle_type)
    cpp_extension.load(
        name="b12x_ops_csrc_stubs", sources=sources, build_directory=build_dir,
        is_python_module=False, verbose=False,
    )
    new = sorted(n for n in set(torch._C._dispatch_get_all_op_names()) - before if n.startswith("b12x::"))
    schemas = {}
    for qualified in new:
        name = qualified.split("::", 1)[1]
        schemas[name] = str(getattr(torch.ops.b12x, name).default._schema)
    print(json.dumps({
        "schemas": schemas,
        "registered_before": registered_before,
        "registered_after": torch._C._is_opaque_type_registered(handle_type),
        "b12x_ops_imported": any(m == "b12x_ops" or m.startswith("b12x_ops.") for m in sys.modules),
    }))
    """
)


def _child_env() -> dict[str, str]:
    """The child's environment: ninja findable (the pip package's binary may be off PATH)."""
    env = dict(os.environ)
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except ImportError:
        pass
    env["PATH"] = os.pathsep.join(dirs + [env.get("PATH", "")])
    env.pop("PYTHONPATH", None)  # the child needs torch only; keep b12x_ops out of its reach
    env.setdefault("MAX_JOBS", "2")
    return env


def _require_toolchain(env) -> None:
    try:
        subprocess.run(["ninja", "--version"], env=env, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        if os.environ.get("CI"):
            raise  # CI installs the test extra (ninja): missing it is a failure there
        pytest.skip("ninja is not installed: pip install -e .[test]")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    assert SOURCES, "csrc_stubs/ holds no .cpp file"
    env = _child_env()
    _require_toolchain(env)
    build_dir = tmp_path_factory.mktemp("csrc_stubs_build")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, HANDLE_TYPE, str(build_dir), *map(str, SOURCES)],
        cwd=build_dir, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"building csrc_stubs failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _python_schema(name: str) -> str:
    return str(getattr(torch.ops.b12x, name).default._schema)


def test_child_never_imported_b12x_ops(built):
    assert not built["b12x_ops_imported"]


def test_cpp_declares_exactly_the_python_ops(built):
    assert set(built["schemas"]) == set(b12x_ops.SCHEMAS)


@pytest.mark.parametrize("name", sorted(b12x_ops.SCHEMAS))
def test_cpp_schema_equals_python_registration(built, name):
    assert built["schemas"][name] == _python_schema(name)


def test_cpp_registers_the_handle_type_by_its_python_name(built):
    assert not built["registered_before"]
    assert built["registered_after"]


def _cpp_schema_literals() -> dict[str, str]:
    """Every ``m.def("..." "...")`` in the C++ sources, adjacent literals joined, by op name."""
    found = {}
    for src in SOURCES:
        text = src.read_text()
        for call in re.finditer(r"\bm\.def\((.*?)\);", text, flags=re.S):
            schema = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', call.group(1)))
            found[schema.split("(", 1)[0]] = schema
    return found


def test_cpp_schema_text_names_the_handle_type():
    # The parsed schemas cannot tell opaque type names apart (both print PyObject): compare text.
    assert _cpp_schema_literals() == b12x_ops.SCHEMAS
