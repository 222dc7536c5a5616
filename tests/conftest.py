import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def offline():
    """``benchmarks/compile_offline.py``: the package's launches compiled for a GPU this machine lacks
    (triton's wheel carries ptxas); needs the compiler, not the interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("compile tests need the compiler, not the interpreter (unset TRITON_INTERPRET)")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import compile_offline
    finally:
        sys.path.pop(0)
    return compile_offline


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET") != "1":
        # interpreter-only tests run in test_interpreter_suite's child process, not here
        child_only = [item for item in items if "interp_child" in item.keywords]
        if child_only:
            config.hook.pytest_deselected(items=child_only)
            items[:] = [item for item in items if "interp_child" not in item.keywords]
    has_gpu = torch.cuda.is_available()
    sm12x = has_gpu and torch.cuda.get_device_capability()[0] == 12
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none here)"))
        if "sm12x" in item.keywords and not sm12x:
            item.add_marker(pytest.mark.skip(reason="needs an SM120/SM121 GPU (none here)"))
