"""The README's usage example runs as written, and its test command is what CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_usage_example_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = next(b for b in blocks if "prepare_experts(w13, w13_scale" in b and "torch.compile" in b)
    exec(compile(example, "README.md", "exec"), {})


def test_ci_calls_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/run.sh test" in readme and "scripts/run.sh test" in ci
