"""The built wheel, installed into a fresh venv, runs from outside the checkout."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import sparseflow

REPO = Path(__file__).resolve().parents[1]
# What a wheel build does not read; copying it would only cost time.
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv*", "runs", "build", "*.egg-info", "__pycache__", "*.so", ".*_cache",
    ".hypothesis", "tests", "benchmarks",
)  # fmt: skip


def _run(*argv: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"{argv} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (the build writes beside them)."""
    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(REPO, tmp / "src", ignore=_NOT_SOURCES)
    _run(
        sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", tmp / "dist", tmp / "src", cwd=tmp,
    )  # fmt: skip
    (built,) = (tmp / "dist").glob("sparseflow-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A venv holding only the wheel; its dependencies come from this interpreter's venv."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", root, cwd=root.parent)
    python = root / "bin" / "python"
    # Installed before the dependencies are visible: pip would otherwise find
    # the test interpreter's own (editable) sparseflow and skip the wheel.
    _run(
        sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        "-q", wheel, cwd=root.parent,
    )  # fmt: skip
    purelib = _run(
        python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=root.parent
    ).stdout.strip()
    # A venv made by a venv's python sees the base interpreter's packages, not
    # the test interpreter's (so --system-site-packages would not help): a
    # .pth file adds those after the new venv's own, without processing their
    # .pth files (the editable install's finder among them).
    Path(purelib, "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return root


def test_wheel_holds_the_package_data_and_the_license(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = {
        f"embedding/_cpu_kernels/{path.name}"
        for path in (REPO / "embedding" / "_cpu_kernels").iterdir()
    }
    assert {*kernels, "sparseflow/configs/demo.yaml", "sparseflow/configs/benchmark.yaml"} <= names
    # Where PEP 639 puts the files of `project.license-files`.
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), sorted(names)


def test_installed_package_is_the_wheels(venv, tmp_path):
    out = _run(
        venv / "bin" / "python", "-c",
        "import importlib.metadata, sparseflow; "
        "print(sparseflow.__file__); print(importlib.metadata.version('sparseflow'))",
        cwd=tmp_path,
    ).stdout.split()  # fmt: skip
    assert Path(out[0]).is_relative_to(venv)
    assert out[1] == sparseflow.__version__
    version = _run(venv / "bin" / "sparseflow", "--version", cwd=tmp_path).stdout
    assert version == f"sparseflow {sparseflow.__version__}\n"


def test_demo_help_and_stats_run_on_the_shipped_config(venv, tmp_path):
    command = venv / "bin" / "sparseflow"
    assert "--config" in _run(command, "demo", "--help", cwd=tmp_path).stdout
    # A small dataset in the shipped config's place keeps the stats pass short.
    _run(command, "make-data", "--config", "demo", "--examples", "1024", cwd=tmp_path)
    assert (tmp_path / "runs" / "demo" / "data").is_dir()
    report = _run(command, "stats", cwd=tmp_path).stdout
    assert "demo: 8 devices x 2 partitions, global batch 512" in report
    assert "ads_advertisers" in report
    assert "2 batches, 1,024 examples" in report
