"""Every ```python example in README.md and docs/ runs against the current API.

Each example runs in its own interpreter, in an empty folder, as a user runs
it: without the eight virtual CPU devices the test suite forces (conftest.py's
XLA_FLAGS), so an example that needs more devices than a machine has says so
itself. An example that drifts from the API fails here.
Shell blocks (``` without a language) are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_examples(text: str) -> list[str]:
    return _PYTHON_BLOCK.findall(text)


def _documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


_CASES = [
    pytest.param(code, id=f"{path.relative_to(REPO)}:{index}")
    for path in _documents()
    for index, code in enumerate(python_examples(path.read_text()))
]


def test_only_fenced_python_blocks_are_examples():
    text = "text\n```python\nx = 1\n```\n```\nmake demo\n```\n```python\ny = 2\n```\n"
    assert python_examples(text) == ["x = 1\n", "y = 2\n"]


def test_the_reference_pages_hold_examples():
    pages = {case.id.split(":")[0] for case in _CASES}
    assert {"docs/preprocessing.md", "docs/lookup.md"} <= pages


@pytest.mark.parametrize("code", _CASES)
def test_example_runs(code: str, tmp_path: Path):
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_FLAG)]
    env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, f"the example failed:\n{code}\n{result.stderr[-4000:]}"
