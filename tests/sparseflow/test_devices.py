"""`mesh.devices: auto` and `--devices N`: the count every device-dependent check uses.

The commands that start fresh processes run with XLA_FLAGS unset, as a
user's shell would: JAX on this CPU then sees one device.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import yaml
from tiny_config import tiny_config

import embedding
import pipelines
from sparseflow import (
    ConfigError,
    _cli,
    _fdo_run,
    _launch,
    _run_identity,
    _train,
    load_config,
    shipped_config,
)
from sparseflow._command_config import CommandConfig
from sparseflow.config._mesh import DeviceCount, devices_noun

REPO = Path(__file__).resolve().parents[2]


def _auto_config(tmp_path: Path, **changes) -> Path:
    """The tiny config (2 partitions per device) with `mesh.devices: auto` and its data."""
    path = tiny_config(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["mesh"]["devices"] = "auto"
    raw.update(changes)
    path.write_text(yaml.safe_dump(raw))
    return path


def _write_data(path: Path) -> None:
    config = load_config(path, devices=1)
    pipelines.write_synthetic_dataset(
        config.synthetic.dataset, config.dataset.dir, num_examples=150, seed=0, num_shards=2
    )


def _sparseflow(*argv: str, cwd: Path, xla_flags: str | None = None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    return subprocess.run(
        [sys.executable, "-m", "sparseflow", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=cwd,
    )


# A count the user's XLA_FLAGS set is the one `auto` finds, on any machine.
_ONE_DEVICE = "--xla_force_host_platform_device_count=1"
_SHOWN = re.compile(r"^tiny: (\d+) devices? x 2 partitions", re.MULTILINE)


@pytest.mark.parametrize(
    "xla_flags, flags, expected",
    [
        (None, [], 1),
        ("--xla_force_host_platform_device_count=2", [], 2),
        (None, ["--devices", "8"], 8),
    ],
    ids=["auto, one CPU device", "auto, XLA_FLAGS for 2", "--devices 8 over auto"],
)
def test_auto_is_the_devices_jax_sees_unless_devices_is_given(tmp_path, xla_flags, flags, expected):
    path = _auto_config(tmp_path)
    _write_data(path)
    result = _sparseflow(
        "stats", "--config", str(path), "--batches", "1", *flags, cwd=tmp_path, xla_flags=xla_flags
    )
    assert result.returncode == 0, result.stderr
    assert [int(n) for n in _SHOWN.findall(result.stdout)] == [expected], result.stdout


def test_auto_in_this_process_is_jax_device_count(tmp_path):
    config = load_config(_auto_config(tmp_path))
    assert config.mesh.devices == jax.device_count() == 8
    assert config.devices_origin == "mesh.devices: auto resolved to 8 devices, the devices JAX sees"
    assert load_config(tiny_config(tmp_path)).devices_origin is None


@pytest.mark.parametrize("written", ["auto", 4])
def test_devices_takes_the_place_of_the_configs_count(tmp_path, capsys, written):
    path = _auto_config(tmp_path, mesh={"devices": written, "partitions_per_device": 2})
    _write_data(path)
    assert _cli.main(["stats", "--config", str(path), "--devices", "2", "--batches", "1"]) == 0
    assert _SHOWN.findall(capsys.readouterr().out) == ["2"]
    config = CommandConfig(path, 2).load()
    assert config.mesh.devices == 2
    assert config.devices_origin == f"--devices 2 in place of mesh.devices: {written}"


def test_the_launch_forces_a_device_count_only_when_one_is_asked_for(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
    assert _launch._env_with_devices(None)["XLA_FLAGS"] == "--xla_cpu_use_thunk_runtime=true"
    assert _launch._env_with_devices(4)["XLA_FLAGS"] == (
        "--xla_cpu_use_thunk_runtime=true --xla_force_host_platform_device_count=4"
    )


@pytest.mark.parametrize(
    "value, shown", [("many", "a string 'many'"), (0, "int 0"), (-1, "int -1"), (2.0, "float 2.0")]
)
def test_an_invalid_device_count_is_a_config_error_naming_the_node(tmp_path, capsys, value, shown):
    path = _auto_config(tmp_path, mesh={"devices": value, "partitions_per_device": 2})
    message = f"{path}: mesh.devices: expected an integer >= 1 or 'auto', got {shown}"
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path)
    # The commands read the count before anything else, with the same message.
    for command in ("train", "stats", "demo", "fdo"):
        assert _cli.main([command, "--config", str(path)]) == 2
        assert capsys.readouterr().err == f"error: {message}\n"


def _user_error(capsys, argv: list[str]) -> str:
    assert _cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_a_batch_the_resolved_partitions_do_not_divide_names_the_count(tmp_path, capsys):
    # jax.device_count() is 8 here: 16 partitions, which 40 is no multiple of.
    path = _auto_config(tmp_path, global_batch_size=40)
    err = _user_error(capsys, ["stats", "--config", str(path)])
    assert err == (
        f"error: {path}: global_batch_size: 40 is not divisible by devices x "
        "partitions_per_device = 16; every partition slot takes an equal share "
        "(mesh.devices: auto resolved to 8 devices, the devices JAX sees)\n"
    )
    # With 4 devices (8 partitions) 40 divides evenly; with --devices 16 (32) it does not.
    assert load_config(path, devices=4).global_batch_size == 40
    err = _user_error(capsys, ["stats", "--config", str(path), "--devices", "16"])
    assert "partitions_per_device = 32; every partition slot takes an equal share " in err
    assert err.endswith("(--devices 16 in place of mesh.devices: auto)\n")


def test_partitions_must_be_a_power_of_two_for_the_resolved_count(tmp_path, capsys):
    path = _auto_config(tmp_path)
    err = _user_error(capsys, ["fdo", "--config", str(path), "--devices", "3"])
    assert err == (
        f"error: {path}: mesh: devices (3) x partitions_per_device (2) = 6 partitions; this "
        "must be a power of two (--devices 3 in place of mesh.devices: auto)\n"
    )


def test_fdo_stats_carry_the_resolved_count(tmp_path):
    path = _auto_config(tmp_path)
    for devices in (1, 8):
        config = load_config(path, devices=devices)
        geometry = _fdo_run.job_config(config).geometry
        assert (geometry.devices, _train.fdo_geometry(config).devices) == (devices, devices)
    assert load_config(path, devices=1).fdo_layout != load_config(path, devices=8).fdo_layout


def test_fdo_stats_of_8_devices_are_refused_on_1_naming_where_the_count_came_from(tmp_path, capsys):
    path = _auto_config(tmp_path)
    _write_data(path)
    fdo = tmp_path / "fdo"
    argv = ["fdo", "--config", str(path), "--devices", "8", "--out", str(fdo)]
    assert _cli.main(argv) == 0, capsys.readouterr()
    stats = embedding.load_fdo_stats(fdo, expected_config_hash=None, expected_geometry=None)
    assert stats.geometry.devices == 8
    result = _sparseflow(
        "train", "--config", str(path), "--fdo", str(fdo), cwd=tmp_path, xla_flags=_ONE_DEVICE
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert (
        "computed for another batch layout" in line
        and "geometry.devices: 8 in the stats, 1 now" in line
    )
    assert line.endswith(
        "Devices of this run: mesh.devices: auto resolved to 1 device, the devices JAX sees."
    )


def test_the_run_identity_holds_the_resolved_count(tmp_path):
    path = _auto_config(tmp_path)
    _write_data(path)
    data = str(tmp_path / "data" / "arrayrecord")
    one, eight = (
        _run_identity.run_identity(load_config(path, devices=n), data, pipelined=True, processes=1)
        for n in (1, 8)
    )
    found = _run_identity.differences(eight, one)
    # First, so that a message showing the first differences shows it.
    assert found[0] == "mesh.devices: 8 in the checkpoint, 1 in this run"
    # The rest follows from the count: the table stack's layout over the partitions.
    others = [d for d in found if not d.startswith("mesh.")]
    assert others and all(d.startswith("features.") for d in others), found


@pytest.mark.parametrize(
    "flags, xla_flags, devices",
    [([], _ONE_DEVICE, 1), (["--devices", "16"], None, 16)],
    ids=["auto, one CPU device", "--devices 16"],
)
def test_a_checkpoint_of_8_devices_resumes_on_another_count(tmp_path, flags, xla_flags, devices):
    path = _auto_config(tmp_path)
    _write_data(path)
    checkpoints = tmp_path / "checkpoints"
    argv = ["train", "--config", str(path), "--no-progress", "--checkpoint-dir", str(checkpoints)]
    written = _sparseflow(*argv, "--devices", "8", "--steps", "2", "--no-pipelined", cwd=tmp_path)
    assert written.returncode == 0, written.stderr[-3000:]
    resumed = _sparseflow(
        *argv,
        *flags,
        "--resume",
        "--steps",
        "3",
        "--no-pipelined",
        cwd=tmp_path,
        xla_flags=xla_flags,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (line,) = resumed.stderr.splitlines()
    assert line.startswith("WARNING sparseflow._mesh_change: The checkpoint at step 2 was written ")
    assert (
        "on 8 devices x 2 partitions; its tables and slots are laid out again for "
        f"{devices_noun(devices)} x 2 partitions" in line
    )
    assert resumed.stdout.startswith("trained 3 steps of 32 examples")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "3"]
    run = json.loads((checkpoints / "3" / "metadata" / "metadata").read_text())["run"]
    assert (run["mesh"]["devices"], run["mesh"]["partitions_per_device"]) == (devices, 2)


def test_the_criteo_config_asks_for_the_devices_jax_sees_and_its_limits_hold_on_any_count():
    raw = yaml.safe_load(shipped_config("criteo").read_text())
    assert raw["mesh"]["devices"] == "auto"
    for devices in (1, 2, 4, 8, 16):
        config = load_config(shipped_config("criteo"), devices=devices)
        mesh = config.mesh
        prepared = embedding.prepare_feature_specs_for_training(
            config.feature_specs, mesh.devices, mesh.partitions_per_device
        )
        # Every categorical column holds at most one value per example.
        per_slot = config.global_batch_size // mesh.num_partitions
        for name, spec in embedding.get_stacked_table_specs(prepared).items():
            assert spec.max_ids_per_partition >= per_slot, (devices, name)
            assert spec.max_unique_ids_per_partition >= per_slot, (devices, name)


def test_a_device_count_given_by_itself_names_its_origin(tmp_path):
    config = load_config(_auto_config(tmp_path), devices=DeviceCount(2, "two, as asked"))
    assert (config.mesh.devices, config.devices_origin) == (2, "two, as asked")
