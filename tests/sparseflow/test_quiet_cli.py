"""The `sparseflow` command's stderr carries its own lines, not third-party import notices."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# TensorFlow's and Beam's import-time notices, each as it starts its line.
_NOISE = {
    "absl": re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\)", re.M),
    "oneDNN": re.compile(r"^I\d{4} .*oneDNN custom operations are on", re.M),
    "apitools": re.compile(r"^WARNING:root:apitools not found", re.M),
}


def _sparseflow(*argv: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -m sparseflow ARGV`, which imports the package as the console script does.

    The test process's own logging settings are not passed on (importing jax
    sets TF_CPP_MIN_LOG_LEVEL), so the command's defaults are what is tested.
    """
    child_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS")
    }
    child_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
    )
    child_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "sparseflow", *argv],
        cwd=cwd,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _noise(stderr: str) -> list[str]:
    return [name for name, pattern in _NOISE.items() if pattern.search(stderr)]


def test_a_command_prints_no_import_notices(tmp_path):
    result = _sparseflow(
        "make-data", "--config", "demo", "--examples", "16", "--out", "data", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "Wrote 16 synthetic examples" in result.stdout
    assert _noise(result.stderr) == [], result.stderr


def test_a_user_error_still_reaches_stderr(tmp_path):
    result = _sparseflow("stats", "--config", "missing.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert re.search(r"^error: .*missing\.yaml", result.stderr, re.M), result.stderr
    assert _noise(result.stderr) == [], result.stderr


def test_the_users_own_tensorflow_setting_wins(tmp_path):
    result = _sparseflow("--version", cwd=tmp_path, TF_ENABLE_ONEDNN_OPTS="1")
    assert result.returncode == 0, result.stderr
    assert "oneDNN" in _noise(result.stderr), result.stderr


def test_verbose_logs_info_in_the_commands_format(tmp_path):
    # Beam's import has given the root logger a handler by the time main() runs.
    code = (
        "import logging\n"
        "from sparseflow import _cli\n"
        "_cli.main(['-v', 'stats', '--config', 'missing.yaml'])\n"
        "logging.getLogger('sparseflow').info('a progress line')\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "INFO sparseflow: a progress line" in result.stderr.splitlines()
