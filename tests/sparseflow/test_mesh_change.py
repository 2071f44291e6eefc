"""Resuming on another mesh, and converting checkpoints for one offline.

A run trains on 8 devices x 2 partitions (the small demo config) and saves;
the checkpoint is then resumed, or converted, for 4 devices x 2 partitions
and for 8 devices x 1 partition (a pipelined one for 4 devices x 4
partitions). The reference is the saved checkpoint read back on its own
mesh: its tables and slots gathered into logical tables
(`embedding.gather_tables` with the specs of the mesh that wrote them) must
equal, bitwise, the moved ones gathered with the specs of the new mesh. The
runs then train on, and their losses and tables must stay within float
rounding of a run that never moved: rounding moved a loss by 1e-7 of itself,
a batch in flight updating the rows of another batch by 6e-5; the tolerance
is 1e-5.

These runs share the 8 simulated devices of the test process: a run
configured for 4 devices gets the first 4 of them (`_train.make_mesh`
otherwise insists that JAX shows exactly the config's count). Runs of the
command line, in fresh processes, get their own devices: the two-process run
here, and those of test_devices.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from train_cases import cli, small_demo_config

import embedding
from sparseflow import _cli, _mesh_change, _train, load_config
from sparseflow._checkpoint import CheckpointMismatchError, Checkpoints
from sparseflow._convert_checkpoint import convert_checkpoint

WRITTEN = (8, 2)
OTHER_MESHES = [(4, 2), (8, 1)]
IDS = [f"{d}x{s}" for d, s in OTHER_MESHES]


def _first_devices(devices: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:devices]), ("devices",))


@pytest.fixture(autouse=True)
def _meshes_of_the_first_devices(monkeypatch):
    monkeypatch.setattr(_train, "make_mesh", _first_devices)


def _config(small_run, devices: int, partitions: int, **top):
    tmp, _, _, _ = small_run
    name = f"mesh-{devices}x{partitions}-{'-'.join(top) or 'same'}.yaml"
    mesh = {"devices": devices, "partitions_per_device": partitions}
    training = {"checkpoint_every": 2, "log_every": 2}
    return load_config(small_demo_config(tmp, training, name=name, mesh=mesh, **top))


def _options(data, checkpoints: Path | None, **overrides) -> _train.TrainOptions:
    options = dict(data=data, progress=False, checkpoint_dir=checkpoints, pipelined=False)
    return _train.TrainOptions(**(options | overrides))


def _copy(folder: Path, tmp_path: Path) -> Path:
    """A copy of a checkpoint folder for one test to resume (and write) into."""
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def _logical(tables, config) -> dict[str, np.ndarray]:
    """Every table and optimizer slot, gathered into logical `[vocabulary, ...]` order."""
    mesh = _first_devices(config.mesh.devices)
    out = {}
    for stack, variables in tables.items():
        fields = {"table": variables.table, **variables.slots._asdict()}
        for field, values in fields.items():
            gathered = embedding.gather_tables(
                {stack: values},
                config.feature_specs,
                mesh,
                num_sc_per_device=config.mesh.partitions_per_device,
            )
            out.update({f"{table}/{field}": v for table, v in gathered.items()})
    return out


def _saved(checkpoints: Path, config, like) -> tuple[int, dict, dict[str, np.ndarray]]:
    """`(step, arrays, logical tables)` of the newest checkpoint, read on its own mesh."""
    reader = Checkpoints(checkpoints, run=None, read_only=True)
    try:
        snapshot = reader.restore_latest(like)
    finally:
        reader.close()
    return snapshot.step, snapshot.arrays, _logical(snapshot.arrays["tables"], config)


def _assert_bitwise(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype, name
        assert got[name].tobytes() == expected[name].tobytes(), name


def _assert_state_bitwise(got, expected) -> None:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


class Written(NamedTuple):
    """A sequential run of 6 steps on 8 devices x 2 partitions, its checkpoints at 2 and 4 kept.

    Attributes:
      checkpoints: its checkpoint folder (the tests copy it before writing).
      like: its arrays, shaped as a checkpoint of it holds them.
      uninterrupted: the run, its 6 steps trained without stopping.
    """

    checkpoints: Path
    like: dict
    uninterrupted: _train.TrainResult


@pytest.fixture(scope="module")
def written(small_run) -> Written:
    """One sequential run of 6 steps: its checkpoint of step 6 removed, it is both
    the run that saved at 4 (a sequential step 4 is saved alike whatever steps
    follow) and the run that went on without stopping."""
    tmp, _, config, data = small_run
    checkpoints = tmp / "written_8x2"
    uninterrupted = _train.train(config, _options(data, checkpoints, steps=6))
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4", "6"]
    shutil.rmtree(checkpoints / "6")
    like = {"state": uninterrupted.train_state, "tables": uninterrupted.embedding_variables}
    return Written(checkpoints, like, uninterrupted)


@pytest.fixture(scope="module")
def pipelined_uninterrupted(small_run) -> _train.TrainResult:
    """A pipelined run of 6 steps on 8 devices x 2 partitions."""
    _, _, config, data = small_run
    return _train.train(config, _options(data, None, steps=6, pipelined=True))


@pytest.fixture(scope="module")
def pipelined(small_run) -> Path:
    """The checkpoints of a pipelined run of 6 steps on 8 devices x 2 partitions that
    crashed after 4 calls: batch 2 awaits its table update, batch 3 its dense step."""
    tmp, path, _, data = small_run
    checkpoints = tmp / "pipelined_8x2"
    crashed = cli(
        "train",
        "--config",
        str(path),
        "--data",
        data,
        "--steps",
        "6",
        "--no-progress",
        "--checkpoint-dir",
        str(checkpoints),
        "--stop-after",
        "4",
    )
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4"]
    return checkpoints


@pytest.mark.parametrize("mesh", OTHER_MESHES, ids=IDS)
def test_resume_on_another_mesh_restores_tables_slots_and_state_bitwise(
    small_run, written, mesh, tmp_path
):
    _, _, config, data = small_run
    step, arrays, saved = _saved(written.checkpoints, config, written.like)
    other = _config(small_run, *mesh)
    # Resuming at the checkpoint's own step trains nothing: what it restored.
    checkpoints = _copy(written.checkpoints, tmp_path)
    resumed = _train.train(other, _options(data, checkpoints, steps=step, resume=True))
    assert resumed.steps == step == 4
    _assert_bitwise(_logical(resumed.embedding_variables, other), saved)
    _assert_state_bitwise(resumed.train_state, arrays["state"])
    assert resumed.losses == written.uninterrupted.losses[:4]
    for leaf in jax.tree.leaves(resumed.embedding_variables):
        assert leaf.sharding.mesh.size == mesh[0]


def _assert_close_to(result, config, reference, reference_config, moved_at: int) -> None:
    """Losses after the move, and the tables at the end, as `reference` (which did not
    move) up to the order of float sums; the losses before it, bitwise."""
    assert len(result.losses) == len(reference.losses)
    assert all(math.isfinite(loss) for loss in result.losses)
    assert result.losses[:moved_at] == reference.losses[:moved_at]
    np.testing.assert_allclose(result.losses[moved_at:], reference.losses[moved_at:], rtol=1e-5)
    moved = _logical(result.embedding_variables, config)
    stayed = _logical(reference.embedding_variables, reference_config)
    for name in stayed:
        np.testing.assert_allclose(moved[name], stayed[name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("mesh", OTHER_MESHES, ids=IDS)
def test_training_goes_on_after_the_move(small_run, written, mesh, tmp_path, caplog):
    _, _, config, data = small_run
    other = _config(small_run, *mesh)
    checkpoints = _copy(written.checkpoints, tmp_path)
    with caplog.at_level("WARNING", logger="sparseflow._mesh_change"):
        resumed = _train.train(other, _options(data, checkpoints, steps=6, resume=True))
    assert "written on 8 devices x 2 partitions; its tables and slots are laid out" in caplog.text
    assert resumed.steps == 6
    _assert_close_to(resumed, other, written.uninterrupted, config, moved_at=4)
    # The new checkpoint is of the new mesh, and the next resume reads it as its own.
    run = json.loads((checkpoints / "6" / "metadata" / "metadata").read_text())["run"]
    assert (run["mesh"]["devices"], run["mesh"]["partitions_per_device"]) == mesh
    caplog.clear()
    again = _train.train(other, _options(data, checkpoints, steps=6, resume=True))
    assert again.losses == resumed.losses
    assert "laid out again" not in caplog.text


def test_a_pipelined_run_moves_with_its_batches_in_flight(
    small_run, pipelined, pipelined_uninterrupted, tmp_path
):
    _, _, config, data = small_run
    # 4 devices x 4 partitions keep 16 partitions of 32 samples each, so the
    # config's limits, set for 8 x 2, hold (with fewer partitions a pipelined
    # run needs limits of its own mesh: it cannot raise them mid-run); the
    # tables move all the same, their stack rotated by 4 partitions, not 2.
    other = _config(small_run, 4, 4)
    checkpoints = _copy(pipelined, tmp_path)
    resumed = _train.train(other, _options(data, checkpoints, steps=6, resume=True, pipelined=True))
    # The checkpoint after 4 calls holds the losses of batches 0-2.
    _assert_close_to(resumed, other, pipelined_uninterrupted, config, moved_at=3)


def test_other_stacks_on_another_mesh_are_refused_naming_the_stack(small_run, written, tmp_path):
    _, _, _, data = small_run
    unstacked = _config(small_run, 4, 2, stacks="none")
    checkpoints = _copy(written.checkpoints, tmp_path)
    with pytest.raises(CheckpointMismatchError, match=r"written by another run: .*stack_name"):
        _train.train(unstacked, _options(data, checkpoints, steps=6, resume=True))


def test_another_number_of_processes_is_refused_saying_why(small_run, written, tmp_path):
    _, _, _, data = small_run
    checkpoints = _copy(written.checkpoints, tmp_path)
    file = checkpoints / "4" / "metadata" / "metadata"
    metadata = json.loads(file.read_text())
    metadata["run"]["mesh"]["processes"] = 2
    file.write_text(json.dumps(metadata))
    with pytest.raises(
        CheckpointMismatchError,
        match=r"written by 2 processes and this run has 1: each process saved the input "
        r"position of its own share of every batch.*--num-processes 2",
    ):
        _train.train(_config(small_run, 4, 2), _options(data, checkpoints, steps=6, resume=True))


@pytest.mark.parametrize("mesh", OTHER_MESHES, ids=IDS)
def test_a_converted_checkpoint_holds_the_saved_tables_and_resumes(
    small_run, written, mesh, tmp_path
):
    _, _, config, data = small_run
    source = written.checkpoints
    before = {p.relative_to(source): p.stat().st_mtime_ns for p in source.rglob("*")}
    other = _config(small_run, *mesh)
    out = tmp_path / "converted"
    converted = convert_checkpoint(other, source, out)
    written_mesh = (converted.written.devices, converted.written.partitions_per_device)
    target = (converted.target.devices, converted.target.partitions_per_device)
    assert (converted.step, written_mesh, target) == (4, WRITTEN, mesh)
    assert sorted(p.name for p in out.iterdir()) == ["4"]
    assert {p.relative_to(source): p.stat().st_mtime_ns for p in source.rglob("*")} == before
    positions = sorted((source / "4" / "input").iterdir())
    assert [p.name for p in positions] == ["commit_success.txt", "process_0-of-1.json"]
    for position in positions:
        assert (out / "4" / "input" / position.name).read_bytes() == position.read_bytes()
    # Read back on the new mesh as a checkpoint of that mesh: bitwise the saved tables.
    step, arrays, saved = _saved(source, config, written.like)
    resumed = _train.train(other, _options(data, out, steps=step, resume=True))
    _assert_bitwise(_logical(resumed.embedding_variables, other), saved)
    _assert_state_bitwise(resumed.train_state, arrays["state"])
    metadata = json.loads((out / "4" / "metadata" / "metadata").read_text())
    assert metadata["run"]["mesh"]["devices"] == mesh[0] and metadata["limits"] is None
    going_on = _train.train(other, _options(data, out, steps=6, resume=True))
    _assert_close_to(going_on, other, written.uninterrupted, config, moved_at=4)


def test_the_command_line_converts_and_only_reads_the_run_s_folder(
    small_run, written, tmp_path, capsys
):
    _, path, _, _ = small_run
    source = _copy(written.checkpoints, tmp_path)
    # A step the run is still writing (or a crash left): not the converter's to remove.
    unfinished = source / "6.orbax-checkpoint-tmp-1234"
    unfinished.mkdir()
    out = tmp_path / "converted"
    argv = ["convert-checkpoint", "--config", str(path), "--devices", "4"]
    argv += ["--checkpoint-dir", str(source), "--out", str(out)]
    assert _cli.main(argv) == 0
    assert capsys.readouterr().out == (
        "Converted the checkpoint at step 4 from 8 devices x 2 partitions to 4 devices x 2 "
        f"partitions: {out / '4'}\n"
    )
    assert unfinished.is_dir()
    # A folder that is not empty is never written into.
    assert _cli.main(argv) == 2
    assert re.match(r"error: Checkpoint folder .* is not empty \(4\)", capsys.readouterr().err)


def test_the_converter_refuses_another_runs_checkpoint(small_run, written, tmp_path):
    other_seed = _config(small_run, 4, 2, seed=5)
    out = tmp_path / "out"
    with pytest.raises(CheckpointMismatchError, match=r"input_order\.seed: 0 in the checkpoint, 5"):
        convert_checkpoint(other_seed, written.checkpoints, out)
    assert not out.exists()


def test_the_converter_refuses_a_pipelined_checkpoint(small_run, pipelined, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(
        CheckpointMismatchError, match=r"is of a pipelined run: .*train --resume. on the new mesh"
    ):
        convert_checkpoint(_config(small_run, 4, 2), pipelined, out)
    assert not out.exists()


def test_two_processes_move_a_pipelined_run_to_other_devices(
    small_run, pipelined_uninterrupted, tmp_path
):
    """Each of 2 processes reads its own share of the batches in flight again, and
    keeps its own input position; the losses match a run that did not move."""
    tmp, path, _, data = small_run
    # 4 x 4 keeps the 16 partitions the config's limits are set for (see above).
    moved_path = small_demo_config(
        tmp,
        {"checkpoint_every": 2, "log_every": 2},
        name="two-processes-4x4.yaml",
        mesh={"devices": 4, "partitions_per_device": 4},
    )
    checkpoints = tmp_path / "two_processes"
    common = ["--data", data, "--steps", "6", "--no-progress", "--num-processes", "2"]
    common += ["--checkpoint-dir", str(checkpoints)]
    written = cli("train", "--config", str(path), *common, timeout=300)
    assert written.returncode == 0, written.stderr[-3000:]
    # As if the run had stopped after 4 calls, batches 2 and 3 in flight (ending
    # one process abruptly, --stop-after, would kill the other with it).
    assert sorted(p.name for p in checkpoints.iterdir()) == ["4", "6", "8"]
    for later in ("6", "8"):
        shutil.rmtree(checkpoints / later)
    resumed = cli("train", "--config", str(moved_path), *common, "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    moves = [line for line in resumed.stderr.splitlines() if "laid out again" in line]
    assert len(moves) == 2, resumed.stderr[-3000:]  # one per process
    metadata = json.loads((checkpoints / "8" / "metadata" / "metadata").read_text())
    assert metadata["run"]["mesh"]["devices"] == 4
    losses = pipelined_uninterrupted.losses
    # Before the move: 2 processes against 1, whose loss means may differ in the
    # last bit (seen with some initial parameters), then the moved run.
    np.testing.assert_allclose(metadata["losses"][:3], losses[:3], rtol=1e-6)
    np.testing.assert_allclose(metadata["losses"][3:], losses[3:], rtol=1e-5)


def test_several_processes_with_minibatching_keep_a_pipelined_run_on_its_mesh(
    small_run, monkeypatch
):
    _, _, config, _ = small_run
    preprocessing = dataclasses.replace(config.preprocessing, enable_minibatching=True)
    other = dataclasses.replace(_config(small_run, 4, 4), preprocessing=preprocessing)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    read_as = _mesh_change.OtherMesh(
        other, _first_devices(4), identity=lambda c: {}, in_flight=lambda *_: None
    )
    mesh = {"devices": 8, "partitions_per_device": 2, "processes": 2}
    reading = read_as({"run": {"mesh": mesh}}, {"pipeline": {}})
    assert reading.refusal == (
        "holds SC/TC pipelined batches in flight laid out for 8 devices x 2 partitions; "
        "laying them out again for this mesh would need the hosts to agree on their "
        "minibatches outside the input pipeline, which a run of several processes cannot: "
        "resume it on 8 devices x 2 partitions"
    )
