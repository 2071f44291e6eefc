"""`model.pipeshard`: the dense tower as a pipeshard pipeline inside pipelined training.

Training with the tower pipelined over device groups and microbatches gives
the losses of training without it (up to the order of microbatch sums), and
resumes bitwise after a crash, like training without it.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
import yaml
from train_cases import cli, small_demo_config, write_data

from parallel import pipeshard
from sparseflow import ConfigError, _train, load_config

# Long enough to cross the pipeline's fill and drain and a checkpoint; short
# enough that the microbatch sums' other order stays at rounding level: the
# runs drift apart as they go on (DCN-v2's largest parameter difference 1e-8
# after 3 steps and after 20, 3e-4 after 50, from some initial parameters).
STEPS = 20
DCN_V2 = {"type": "dcn_v2", "cross_layers": 2, "mlp": [32, 16]}


def _config(tmp, name, model, training=None):
    path = small_demo_config(
        tmp,
        {"checkpoint_every": 4, "log_every": 5, "pipelined": True, "epochs": 5, **(training or {})},
        name=name,
        model=model,
    )
    return path, load_config(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeshard_train")
    _, config = _config(tmp, "plain.yaml", {})
    return tmp, write_data(config, tmp / "data")


def _train_losses(config, data, **options):
    return _train.train(
        config, _train.TrainOptions(data=data, steps=STEPS, progress=False, **options)
    )


def _leaves(result):
    return [
        np.asarray(x) for x in jax.tree.leaves((result.train_state, result.embedding_variables))
    ]


_PLAIN: dict[str, _train.TrainResult] = {}


def _plain_run(data, tower):
    """Training without pipeshard, once per tower."""
    if tower not in _PLAIN:
        tmp, records = data
        model = {} if tower == "dlrm" else {"tower": DCN_V2}
        _PLAIN[tower] = _train_losses(_config(tmp, f"{tower}.yaml", model)[1], records)
    return _PLAIN[tower]


def _assert_matches_plain(got, want, caplog):
    assert len(got.losses) == STEPS
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-5)
    for a, b in zip(_leaves(got), _leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # The tower really ran as a pipeline.
    assert any("Pipeshard:" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("tower", "pipeshard_section"),
    [
        ("dlrm", {"stages": 2, "microbatches": 4, "schedule": "1f1b", "layers": "manual"}),
        (
            "dcn_v2",
            {
                "stages": 2,
                "microbatches": 2,
                "schedule": "interleaved_1f1b",
                "virtual_stages": 2,
                "layers": "auto",
            },
        ),
    ],
    ids=["dlrm-1f1b-manual", "dcn_v2-interleaved-auto"],
)
def test_pipeshard_training_matches_training_without_it(data, tower, pipeshard_section, caplog):
    caplog.set_level(logging.INFO, logger="parallel.pipeshard")
    tmp, records = data
    model = {} if tower == "dlrm" else {"tower": DCN_V2}
    _, piped = _config(tmp, f"{tower}-piped.yaml", {**model, "pipeshard": pipeshard_section})
    _assert_matches_plain(_train_losses(piped, records), _plain_run(data, tower), caplog)


def test_pipeshard_training_resumes_bitwise_after_a_crash(data, caplog):
    """Zero bubble on 4 stages: equal to training without it, and resumed bitwise."""
    caplog.set_level(logging.INFO, logger="parallel.pipeshard")
    tmp, records = data
    section = {"stages": 4, "microbatches": 4, "schedule": "zero_bubble", "layers": "manual"}
    path, config = _config(tmp, "resume.yaml", {"tower": DCN_V2, "pipeshard": section})
    uninterrupted = _train_losses(config, records)
    _assert_matches_plain(uninterrupted, _plain_run(data, "dcn_v2"), caplog)
    checkpoints = tmp / "checkpoints"
    crashed = cli(
        "train", "--config", str(path), "--data", records, "--steps", str(STEPS),
        "--no-progress", "--checkpoint-dir", str(checkpoints), "--stop-after", "6",
    )  # fmt: skip
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [4]
    resumed = _train_losses(config, records, checkpoint_dir=checkpoints, resume=True)
    assert resumed.losses == uninterrupted.losses
    for a, b in zip(_leaves(resumed), _leaves(uninterrupted), strict=True):
        np.testing.assert_array_equal(a, b)


def test_pipeshard_needs_pipelined_training(data):
    tmp, records = data
    section = {"stages": 2, "microbatches": 2}
    _, config = _config(tmp, "sequential.yaml", {"pipeshard": section}, {"pipelined": False})
    with pytest.raises(ValueError, match="training.pipelined: true"):
        _train_losses(config, records)


def test_too_many_stages_for_the_tower_is_an_error(data):
    tmp, records = data
    section = {"stages": 8, "microbatches": 2}
    _, config = _config(tmp, "deep.yaml", {"pipeshard": section})
    with pytest.raises(ValueError, match="tower has 5 layers"):
        _train_losses(config, records)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"stages": 2}, "missing required key 'microbatches'"),
        ({"stages": 2, "microbatches": 2, "schedule": "zb"}, "unknown schedule 'zb'"),
        ({"stages": 0, "microbatches": 2}, "stages must be a positive integer"),
        ({"stages": 2, "microbatches": 2, "virtual_stages": 2}, "needs schedule: interleaved"),
        ({"stages": 2, "microbatches": 2, "layers": "by_hand"}, "manual or auto"),
        ({"stages": 2, "microbatches": 2, "depth": 3}, "unknown key"),
    ],
)
def test_bad_pipeshard_sections_name_the_entry(tmp_path, section, message):
    path = small_demo_config(tmp_path, {}, model={"pipeshard": section})
    with pytest.raises(ConfigError, match=message) as error:
        load_config(path)
    assert "model.pipeshard" in str(error.value)


def test_tower_section_is_read(tmp_path):
    path = small_demo_config(tmp_path, {}, model={"tower": DCN_V2})
    tower = load_config(path).model.tower
    assert (tower.cross_layers, tower.mlp) == (2, (32, 16))
    raw = yaml.safe_load(path.read_text())
    raw["model"]["tower"] = {"type": "wide"}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="unknown tower 'wide'"):
        load_config(path)


def test_schedule_names_are_the_library_s():
    assert {s.value for s in pipeshard.PipelineSchedule} == {
        "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble",
    }  # fmt: skip
