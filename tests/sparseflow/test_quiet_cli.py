"""The `sparseflow` command's stderr carries its own lines only, and its imports stay lean."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_config import tiny_config

REPO = Path(__file__).resolve().parents[2]
# A line of the command's own: one of our loggers in the command's format
# (sparseflow._logging.FORMAT), or its `error:` line.
_OWN_LINE = re.compile(
    r"^((DEBUG|INFO|WARNING|ERROR|CRITICAL) (embedding|parallel|pipelines|beam_jobs|sparseflow)"
    r"(\.\w+)*: |error: )"
)
COMMANDS = ["make-data", "demo", "stats", "fdo", "train"]


# The test process's own settings: importing jax sets TF_CPP_MIN_LOG_LEVEL, and
# tests/conftest.py forces 8 CPU devices; the command sets its own.
_TEST_SETTINGS = ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS", "XLA_FLAGS")


def _env(**extra: str) -> dict[str, str]:
    """The environment of a command run as a user would: the command's defaults apply."""
    env = {k: v for k, v in os.environ.items() if k not in _TEST_SETTINGS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _sparseflow(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m sparseflow ARGV`, which imports the package as the console script does."""
    return _run(["-m", "sparseflow", *argv], cwd)


def _foreign_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not _OWN_LINE.match(line)]


def test_the_line_check_tells_own_lines_from_foreign_ones():
    own = "WARNING pipelines._grain: slow\nINFO sparseflow._train: step 3\nerror: bad config"
    assert _foreign_lines(own) == []
    foreign = [
        "WARNING:root:apitools not found, and bigquery client libraries are not available",
        "I0000 00:00:1795604057.534252   22706 port.cc:153] oneDNN custom operations are on.",
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        "WARNING absl: a notice",
        "  warnings.warn(",
    ]
    assert _foreign_lines("\n".join(foreign)) == foreign


@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS)], ids=["top", *COMMANDS])
def test_help_writes_nothing_to_stderr(tmp_path, command):
    result = _sparseflow(*command, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "usage: sparseflow" in result.stdout
    assert result.stderr == ""


def test_make_data_fdo_and_train_write_only_their_own_lines(tmp_path):
    config = str(tiny_config(tmp_path))
    # Both formats: writing TFRecord files loads TensorFlow.
    steps = [
        ["make-data", "--config", config, "--formats", "arrayrecord,tfrecord"],
        ["fdo", "--config", config, "--out", "fdo"],
        ["train", "--config", config, "--fdo", "fdo", "--steps", "2", "--metrics-dir", "m"],
    ]
    for argv in steps:
        result = _sparseflow(*argv, cwd=tmp_path)
        assert result.returncode == 0, (argv, result.stderr)
        assert _foreign_lines(result.stderr) == [], (argv, result.stderr)
    assert "trained 2 steps of 32 examples" in result.stdout


def test_a_user_error_is_one_own_line(tmp_path):
    result = _sparseflow("stats", "--config", "missing.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert re.fullmatch(r"error: .*missing\.yaml.*\n", result.stderr), result.stderr


@pytest.mark.parametrize(
    "user_setting, expected", [(None, "0"), ("1", "1")], ids=["default", "the user's"]
)
def test_the_tensorflow_logging_default_yields_to_the_users_setting(
    tmp_path, user_setting, expected
):
    code = "import os, sparseflow; print(os.environ['TF_ENABLE_ONEDNN_OPTS'])"
    env = {} if user_setting is None else {"TF_ENABLE_ONEDNN_OPTS": user_setting}
    result = _run(["-c", code], tmp_path, **env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


@pytest.mark.parametrize(
    "module, absent",
    [
        ("pipelines", ["tensorflow", "matplotlib", "optax"]),
        ("parallel", ["tensorflow", "matplotlib", "optax", "parallel.pipeshard"]),
        ("beam_jobs", ["tensorflow", "matplotlib", "optax"]),
        ("sparseflow._cli", ["tensorflow", "matplotlib", "apache_beam.io.gcp.pubsub"]),
    ],
)
def test_importing_a_package_leaves_the_heavy_libraries_unloaded(tmp_path, module, absent):
    code = f"import sys, {module}; print(sorted(set({absent!r}) & set(sys.modules)))"
    result = _run(["-c", code], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_lazy_public_name_loads_when_used(tmp_path):
    code = (
        "import sys, parallel, beam_jobs\n"
        "print(parallel.pipeshard.parallelize.__name__, beam_jobs.plot_fdo_stats.__name__)\n"
        "print('matplotlib' in sys.modules, 'optax' in sys.modules)\n"
    )
    result = _run(["-c", code], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["parallelize plot_fdo_stats", "True True"]


def test_verbose_logs_info_in_the_commands_format(tmp_path):
    code = (
        "import logging\n"
        "from sparseflow import _cli\n"
        "_cli.main(['-v', 'stats', '--config', 'missing.yaml'])\n"
        "logging.getLogger('sparseflow').info('a progress line')\n"
        "logging.getLogger('absl').info('a library notice')\n"
        "logging.getLogger('absl').warning('a library warning')\n"
    )
    result = _run(["-c", code], tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert "INFO sparseflow: a progress line" in lines
    assert "WARNING absl: a library warning" in lines
    assert not any("a library notice" in line for line in lines)


def test_by_default_other_libraries_show_only_errors(tmp_path):
    code = (
        "import logging, warnings\n"
        "from sparseflow import _cli\n"
        "_cli.main(['stats', '--config', 'missing.yaml'])\n"
        "logging.getLogger('sparseflow.x').warning('our warning')\n"
        "logging.getLogger('absl').warning('a library warning')\n"
        "logging.getLogger('absl').error('a library error')\n"
        "warnings.warn('a library deprecation', DeprecationWarning)\n"
    )
    result = _run(["-c", code], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[1:] == [
        "WARNING sparseflow.x: our warning",
        "ERROR absl: a library error",
    ]
