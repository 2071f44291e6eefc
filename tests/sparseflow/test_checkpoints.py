"""Checkpoint folders of one run: never mixed with another run's, never losing a committed step."""

from __future__ import annotations

import gc
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import portpicker
import pytest
import yaml
from etils import epath
from memory_maps import status_bytes
from train_cases import assert_bitwise_equal_runs, cli, write_data

from sparseflow import _checkpoint, _train, load_config
from sparseflow._checkpoint import CheckpointMismatchError, Checkpoints, Snapshot

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RUN = {"tables": {"users": {"vocabulary_size": 100}}, "dataset": {"part-0": {"bytes": 7}}}


def _snapshot(step: int, value: float, shape=(64, 64)) -> Snapshot:
    arrays = {"w": jnp.full(shape, value, jnp.float32)}
    return Snapshot(step, arrays, b'{"next_batch": 1}', {"losses": [value]})


def _saved(directory: Path, steps: dict[int, float]) -> None:
    checkpoints = Checkpoints(directory, run=RUN)
    for step, value in steps.items():
        checkpoints.save(_snapshot(step, value))
    checkpoints.close()


def _restored(directory: Path, run=RUN, shape=(64, 64)) -> Snapshot:
    checkpoints = Checkpoints(directory, run=run)
    try:
        return checkpoints.restore_latest(_snapshot(0, 0.0, shape).arrays)
    finally:
        checkpoints.close()


def test_a_step_saved_again_is_kept_until_its_replacement_is_complete(tmp_path):
    directory = tmp_path / "checkpoints"
    _saved(directory, {1: 1.0, 2: 2.0})
    # Save step 2 again and die while orbax writes it.
    crashed = subprocess.run(
        [sys.executable, str(HERE / "checkpoint_process.py"), str(directory), "2", "20"],
        capture_output=True,
        text=True,
        timeout=120,
        # This checkout's packages, not those of the environment's install, and
        # the tests' helpers (this module imports `memory_maps`).
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
    )
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert any(".orbax-checkpoint-tmp" in p.name for p in directory.iterdir())

    snapshot = _restored(directory)
    assert snapshot.step == 2
    np.testing.assert_array_equal(np.asarray(snapshot.arrays["w"]), 2.0)
    # The crash's temporary folder and the set-aside step are gone.
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]


def test_a_step_saved_again_replaces_the_old_one(tmp_path):
    directory = tmp_path / "checkpoints"
    _saved(directory, {1: 1.0, 2: 2.0})
    _saved(directory, {2: 20.0})
    snapshot = _restored(directory)
    assert snapshot.step == 2
    np.testing.assert_array_equal(np.asarray(snapshot.arrays["w"]), 20.0)
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]


def _array_file_bytes(step_directory: Path) -> int:
    return sum(p.stat().st_size for p in (step_directory / "arrays").rglob("*") if p.is_file())


def test_the_arrays_are_written_uncompressed_and_restore_equal(tmp_path):
    # Zeros: what any compression shrinks most.
    directory = tmp_path / "checkpoints"
    _saved(directory, {1: 0.0})
    assert _stored_in_chunks(directory / "1")
    shape = (64, 64)
    assert _array_file_bytes(directory / "1") >= np.prod(shape) * 4
    np.testing.assert_array_equal(_restored(directory).arrays["w"], np.zeros(shape, np.float32))


def _saved_as_earlier(directory: Path, monkeypatch, **handler_options) -> None:
    """`_saved` steps 1 and 2 by orbax's arrays handler with `handler_options`."""
    with monkeypatch.context() as patched:
        handler = _checkpoint.ocp.PyTreeCheckpointHandler
        patched.setattr(
            _checkpoint.ocp,
            "PyTreeCheckpointHandler",
            lambda **kwargs: handler(**{**kwargs, **handler_options}),
        )
        _saved(directory, {1: 0.0, 2: 2.5})


def test_a_compressed_checkpoint_of_an_earlier_run_still_restores(tmp_path, monkeypatch):
    directory = tmp_path / "checkpoints"
    _saved_as_earlier(directory, monkeypatch, use_compression=True)
    assert _array_file_bytes(directory / "2") < 64 * 64 * 4 / 4  # the case: compressed
    restored = _restored(directory)
    assert restored.step == 2
    np.testing.assert_array_equal(restored.arrays["w"], np.full((64, 64), 2.5, np.float32))


def test_a_checkpoint_of_arrays_stored_whole_still_restores(tmp_path, monkeypatch):
    """Earlier versions stored each shard as one zarr2 chunk; orbax reads those."""
    directory = tmp_path / "checkpoints"
    _saved_as_earlier(directory, monkeypatch, use_zarr3=False)
    assert not _stored_in_chunks(directory / "2")  # the case
    restored = _restored(directory)
    assert restored.step == 2
    np.testing.assert_array_equal(restored.arrays["w"], np.full((64, 64), 2.5, np.float32))


def _stored_in_chunks(step_directory: Path) -> bool:
    """Whether the step's arrays are zarr3 (what `_array_blocks` reads)."""
    handler = _checkpoint.ocp.PyTreeCheckpointHandler()
    return handler.metadata(epath.Path(step_directory / "arrays")).use_zarr3


def test_a_restore_peaks_at_the_arrays_and_a_few_chunks(tmp_path):
    """Read a chunk at a time into its place, a 1 GiB array's restore holds little
    more than the array; read shard by shard (orbax), it held the shard twice."""
    directory, shape = tmp_path / "checkpoints", (16384, 16384)
    checkpoints = Checkpoints(directory, run=RUN)
    checkpoints.save(_snapshot(1, 1.5, shape))
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = {"w": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=one_device)}
    gc.collect()
    before = _resident_bytes()
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again here
    restored = checkpoints.restore_latest(like).arrays["w"]
    peak = status_bytes("VmHWM") - before
    checkpoints.close()
    assert float(restored[-1, -1]) == 1.5
    print(f"restore peak: {peak / (np.prod(shape) * 4):.3f} of the array")
    assert peak < 1.5 * np.prod(shape) * 4, peak / (np.prod(shape) * 4)


def test_a_restore_leaves_no_second_copy_of_the_arrays_resident(tmp_path):
    """The host copies orbax reads into are freed by the restore, not by the
    collector whenever it runs (it does not run here)."""
    directory, shape = tmp_path / "checkpoints", (4096, 16384)  # 256 MiB
    checkpoints = Checkpoints(directory, run=RUN)
    checkpoints.save(_snapshot(1, 1.5, shape))
    checkpoints.close()
    nbytes = np.prod(shape) * 4
    gc.collect()
    gc.disable()
    try:
        before = _resident_bytes()
        restored = _restored(directory, shape=shape).arrays["w"]
        grown = _resident_bytes() - before
    finally:
        gc.enable()
    assert float(restored[-1, -1]) == 1.5
    # The restored arrays and at most a tenth more; a second copy would be 2.
    assert grown < 1.1 * nbytes, grown / nbytes


def _resident_bytes() -> int:
    return status_bytes("VmRSS")


def test_a_checkpoint_of_other_arrays_is_an_error_not_damage(tmp_path):
    directory = tmp_path / "checkpoints"
    _saved(directory, {1: 1.0, 2: 2.0})
    with pytest.raises(
        CheckpointMismatchError,
        match=r"step 2 .* holds other arrays than this run: arrays\['w'\]: "
        r"'float32\[64, 64\]' in the checkpoint, 'float32\[64, 32\]' in this run",
    ):
        _restored(directory, shape=(64, 32))


def test_a_checkpoint_of_another_run_is_refused_naming_the_difference(tmp_path):
    directory = tmp_path / "checkpoints"
    _saved(directory, {1: 1.0, 2: 2.0})
    other = {"tables": {"users": {"vocabulary_size": 200}}, "dataset": RUN["dataset"]}
    with pytest.raises(
        CheckpointMismatchError,
        match=r"was written by another run: "
        r"tables\.users\.vocabulary_size: 100 in the checkpoint, 200 in this run\.",
    ):
        _restored(directory, run=other)


def test_the_input_position_is_saved_by_grains_handler_and_restored(tmp_path):
    directory = tmp_path / "checkpoints"
    _saved(directory, {3: 3.0})
    written = directory / "3" / "input" / "process_0-of-1.json"
    assert written.read_text() == '{"next_batch": 1}'
    assert "iterator_states" not in (directory / "3" / "metadata" / "metadata").read_text()
    assert _restored(directory).iterator_state == b'{"next_batch": 1}'


def test_a_checkpoint_of_the_earlier_format_is_refused_by_name(tmp_path):
    directory = tmp_path / "checkpoints"
    _saved(directory, {1: 1.0})
    # What earlier versions wrote: the positions in the metadata, no input item.
    metadata_file = directory / "1" / "metadata" / "metadata"
    metadata = json.loads(metadata_file.read_text())
    metadata["iterator_states"] = ["eyJuZXh0X2JhdGNoIjogMX0="]
    metadata_file.write_text(json.dumps(metadata))
    for entry in (directory / "1" / "input").iterdir():
        entry.unlink()
    (directory / "1" / "input").rmdir()
    with pytest.raises(CheckpointMismatchError, match="written by an earlier sparseflow"):
        _restored(directory)


def test_positions_saved_by_another_process_count_are_an_error_not_damage(tmp_path):
    directory = tmp_path / "checkpoints"
    _saved(directory, {1: 1.0})
    inputs = directory / "1" / "input"
    (inputs / "process_0-of-1.json").rename(inputs / "process_0-of-2.json")
    with pytest.raises(
        CheckpointMismatchError, match=r"input positions of \[2\] processes, not of 1"
    ):
        _restored(directory)


def test_a_missing_position_file_is_damage(tmp_path):
    directory = tmp_path / "checkpoints"
    _saved(directory, {1: 1.0, 2: 2.0})
    (directory / "2" / "input" / "process_0-of-1.json").unlink()
    assert _restored(directory).step == 1


def test_a_position_that_is_not_utf8_is_refused_before_saving(tmp_path):
    checkpoints = Checkpoints(tmp_path / "checkpoints", run=RUN)
    try:
        with pytest.raises(ValueError, match="must be UTF-8"):
            checkpoints.save(Snapshot(1, _snapshot(1, 1.0).arrays, b"\xff\xfe", {}))
    finally:
        checkpoints.close()


def _train_options(data: str, checkpoints: Path, **overrides) -> _train.TrainOptions:
    options = dict(data=data, steps=2, progress=False, pipelined=False, checkpoint_dir=checkpoints)
    return _train.TrainOptions(**(options | overrides))


def test_training_refuses_a_folder_of_earlier_checkpoints_without_resume(small_run):
    tmp, _, config, data = small_run
    checkpoints = tmp / "earlier_run"
    _train.train(config, _train_options(data, checkpoints))
    before = {p.name: p.stat().st_mtime_ns for p in checkpoints.rglob("*")}
    with pytest.raises(ValueError, match=r"is not empty \(2\).*Pass --resume to continue"):
        _train.train(config, _train_options(data, checkpoints))
    assert {p.name: p.stat().st_mtime_ns for p in checkpoints.rglob("*")} == before


def _files_up_to(limit: int):
    """For a child process: a write past `limit` bytes of a file fails (EFBIG), as
    on a full disk, instead of killing the process (SIGXFSZ)."""

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_save_that_fails_halfway_keeps_the_earlier_checkpoints_and_resume_goes_on(small_run):
    tmp, path, config, data = small_run
    checkpoints = tmp / "full_disk"
    argv = ["train", "--config", str(path), "--data", data, "--no-pipelined", "--no-progress"]
    argv += ["--checkpoint-dir", str(checkpoints)]
    first = cli(*argv, "--steps", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    before = _files(checkpoints)
    limit = 1 << 20
    assert max(len(content) for content in before.values()) > 2 * limit, "no case"

    full = cli(*argv, "--steps", "6", "--resume", preexec_fn=_files_up_to(limit))
    assert full.returncode == 2, full.stderr[-3000:]
    assert f"error: Writing the checkpoint of step 6 into {checkpoints} failed" in full.stderr
    assert "the checkpoints of steps 2, 4 are whole" in full.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4"]  # nothing of step 6
    assert _files(checkpoints) == before

    resumed = _train.train(config, _train_options(data, checkpoints, steps=6, resume=True))
    uninterrupted = _train.train(
        config, _train.TrainOptions(data=data, steps=6, progress=False, pipelined=False)
    )
    assert_bitwise_equal_runs(resumed, uninterrupted)


def _other_config(tmp: Path, config_path: Path):
    raw = yaml.safe_load(config_path.read_text())
    raw["tables"][0]["vocabulary_size"] = 100_016
    path = tmp / "other_tables.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path)


def _rewritten_at(folder: Path, delays: list[float]) -> threading.Thread:
    """A writer that creates a file in `folder` (and the folder) after each of `delays`."""

    def write():
        start = time.monotonic()
        for delay in delays:
            time.sleep(max(0.0, start + delay - time.monotonic()))
            (folder / "arrays").mkdir(parents=True, exist_ok=True)
            (folder / "arrays" / f"late_{delay}").write_bytes(b"x")

    writer = threading.Thread(target=write)
    writer.start()
    return writer


def test_a_failed_saves_folder_is_removed_again_when_late_writes_bring_it_back(tmp_path):
    folder = tmp_path / "6.orbax-checkpoint-tmp"
    (folder / "arrays").mkdir(parents=True)
    writer = _rewritten_at(folder, [0.3, 0.9])

    _checkpoint._remove_while_written(folder)
    writer.join()

    assert not folder.exists()


def test_a_folder_that_keeps_coming_back_is_named_in_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(_checkpoint, "_REMOVAL_LIMIT", 0.5)
    folder = tmp_path / "6.orbax-checkpoint-tmp"
    writer = _rewritten_at(folder, [0.05 * k for k in range(40)])

    with caplog.at_level("WARNING", logger=_checkpoint.__name__):
        _checkpoint._remove_while_written(folder)
    writer.join()

    assert f"{folder} could not be removed completely" in caplog.text


@pytest.mark.parametrize("change", ["tables", "dataset"])
def test_resume_refuses_the_checkpoints_of_another_run(small_run, change):
    tmp, path, config, data = small_run
    checkpoints = tmp / f"run_before_{change}_change"
    _train.train(config, _train_options(data, checkpoints))
    if change == "tables":
        config = _other_config(tmp, path)
        expected = r"tables\.users\.vocabulary_size: 100000 in the checkpoint, 100016 in this run"
    else:
        data = write_data(config, tmp / "other_data", seed=config.seed + 1)
        expected = r"dataset\.part-00000-of-00002\.array_record\.sampled_sha256: '[0-9a-f]+' in"
    with pytest.raises(CheckpointMismatchError, match=expected):
        _train.train(config, _train_options(data, checkpoints, steps=4, resume=True))
    assert sorted(int(p.name) for p in checkpoints.iterdir()) == [2]


def _train_two_processes(path: Path, data: str, checkpoints: Path, *extra: str):
    return cli(
        "train",
        "--config",
        str(path),
        "--data",
        data,
        "--no-pipelined",
        "--no-progress",
        "--num-processes",
        "2",
        "--checkpoint-dir",
        str(checkpoints),
        *extra,
        timeout=300,
    )


def test_a_two_process_run_resumes_past_a_damaged_checkpoint(small_run):
    tmp, path, _, data = small_run
    checkpoints = tmp / "two_processes"
    done = _train_two_processes(path, data, checkpoints, "--steps", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    # Damage the files process 1 wrote of step 4.
    damaged = [
        f for f in (checkpoints / "4" / "arrays" / "ocdbt.process_1").rglob("*") if f.is_file()
    ]
    assert damaged
    for file in damaged:
        file.write_bytes(b"")

    resumed = _train_two_processes(path, data, checkpoints, "--steps", "6", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    fallbacks = [line for line in resumed.stderr.splitlines() if "cannot be restored" in line]
    assert len(fallbacks) == 2, "\n".join(fallbacks)  # one per process
    losses = dict(re.findall(r"\[process (\d)\] .*?loss ([0-9.]+)", resumed.stdout))
    assert set(losses) == {"0", "1"} and losses["0"] == losses["1"], resumed.stdout
    assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [2, 4, 6]


def test_every_process_restores_the_same_step(tmp_path):
    coordinator = f"127.0.0.1:{portpicker.pick_unused_port()}"
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
    )
    processes = [
        subprocess.Popen(
            [sys.executable, str(HERE / "checkpoint_hosts_process.py"), str(tmp_path), str(i)]
            + [coordinator],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    try:
        outputs = [process.communicate(timeout=180) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr[-3000:]
    restored = [json.loads(stdout.splitlines()[-1]) for stdout, _ in outputs]
    # Process 0 reads step 4, but process 1 cannot: both restore step 2, each its own position.
    assert restored == [
        {"step": 2, "position": f"step 2 of process {i}", "value": 2.0} for i in range(2)
    ]
    assert "it does not restore on another process" in outputs[0][1]
