"""`sparseflow predict`: a checkpoint's scores of every record, against the trainer's
evaluation forward on the same records."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow.csv
import pyarrow.parquet
import pytest
import tensorflow as tf
import yaml
from predict_cases import PREDICTED_RECORDS as RECORDS
from predict_cases import evaluation_scores, with_feature, write_records
from train_cases import cli

import pipelines
import sparseflow
from sparseflow import _predict, _train, load_config


def test_predict_scores_every_record_in_order_as_the_trainers_evaluation(
    trained, records, tmp_path
):
    config, result, checkpoints = trained
    data = write_records(tmp_path / "data" / "part-0.array_record", records)
    predictions = _predict.predict(
        config, _predict.PredictOptions(checkpoint_dir=checkpoints, data=data, progress=False)
    )
    assert predictions.step == result.steps + 2  # pipelined: 4 batches in 6 calls
    assert predictions.scores.shape == (RECORDS,)
    assert predictions.bad_records == []
    assert predictions.examples_per_s > 0  # 3 batches: 2 timed after the first
    # The evaluation drops the tail that does not fill a batch: it scores the
    # records again after the first ones, so that the tail falls in a batch.
    padded = records + records[: 3 * 512 - RECORDS]
    reference = evaluation_scores(
        config, result, write_records(tmp_path / "ref" / "part-0.array_record", padded)
    )
    np.testing.assert_allclose(predictions.scores, reference[:RECORDS], rtol=0, atol=1e-6)
    labels = pipelines.parse_examples(records, config.layout).labels
    np.testing.assert_array_equal(predictions.labels, labels)


def test_predict_sees_a_checkpoint_that_is_not_there_as_a_user_error(small_run, tmp_path):
    _, _, config, data = small_run
    with pytest.raises(sparseflow.UsageError, match="holds no checkpoint"):
        _predict.predict(
            config, _predict.PredictOptions(checkpoint_dir=tmp_path, data=data, progress=False)
        )


def test_a_record_without_a_label_is_scored_as_with_one(trained, records, tmp_path):
    """Records whose label was removed get the same scores, and label -1."""
    config, _, checkpoints = trained
    unlabelled = [with_feature(record, "label", None) for record in records[:600]]
    data = write_records(tmp_path / "data" / "part-0.array_record", unlabelled + records[600:])
    both = [
        _predict.predict(
            config, _predict.PredictOptions(checkpoint_dir=checkpoints, data=d, progress=False)
        )
        for d in (data, write_records(tmp_path / "all" / "part-0.array_record", records))
    ]
    np.testing.assert_array_equal(both[0].scores, both[1].scores)
    assert (both[0].labels[:600] == -1).all()
    np.testing.assert_array_equal(both[0].labels[600:], both[1].labels[600:])


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_bad_records_follow_the_configs_policy(trained, records, tmp_path, policy):
    config, _, checkpoints = trained
    config = dataclasses.replace(
        config,
        preprocessing=dataclasses.replace(config.preprocessing, on_bad_record=policy),
    )
    bad = [*records[:5], b"not an example", *records[5:700]]
    data = write_records(tmp_path / "data" / "part-0.array_record", bad)
    options = _predict.PredictOptions(checkpoint_dir=checkpoints, data=data, progress=False)
    if policy == "raise":
        with pytest.raises(pipelines.InputRecordError, match="record 5 of .*part-0.array_record"):
            _predict.predict(config, options)
        return
    with_bad = _predict.predict(config, options)
    without = _predict.predict(
        config,
        dataclasses.replace(
            options, data=write_records(tmp_path / "good" / "part-0.array_record", records[:700])
        ),
    )
    assert with_bad.bad_records == [5]
    assert np.isnan(with_bad.scores[5]) and with_bad.labels[5] == -1
    kept = np.delete(np.arange(701), 5)
    np.testing.assert_array_equal(with_bad.scores[kept], without.scores)


def test_a_batch_over_the_checkpoints_limits_raises_them_and_drops_no_id(
    trained, records, tmp_path
):
    """Records with 100 clicked items (the data has at most 20) need more ids per
    partition than the checkpoint's limits; they are scored as the evaluation forward
    scores them under limits large enough."""
    config, result, checkpoints = trained
    many = tf.train.Feature(int64_list=tf.train.Int64List(value=range(1000, 1100)))
    crowded = [with_feature(r, "clicked_items", many) for r in records[:512]]
    data = write_records(tmp_path / "data" / "part-0.array_record", crowded)
    predictions = _predict.predict(
        config, _predict.PredictOptions(checkpoint_dir=checkpoints, data=data, progress=False)
    )
    # The reference's limits need only be large enough, which it checks (a batch over
    # them raises): limits of every id of the batch (512 x 100) held 16 GB.
    reference = evaluation_scores(config, result, data, room=2048)
    np.testing.assert_allclose(predictions.scores, reference, rtol=0, atol=1e-6)


def test_a_larger_prediction_batch_scores_every_record_as_the_training_batch(
    trained, records, tmp_path
):
    """Twice the config's batch (the records then fill one batch and part of another):
    the same scores, as the evaluation forward's of the training batch."""
    config, _, checkpoints = trained
    data = write_records(tmp_path / "data" / "part-0.array_record", records)
    scored = {
        size: _predict.predict(
            config,
            _predict.PredictOptions(
                checkpoint_dir=checkpoints, data=data, batch_size=size, progress=False
            ),
        )
        for size in (None, 2 * config.global_batch_size)
    }
    assert RECORDS % (2 * config.global_batch_size) != 0
    default, larger = scored.values()
    np.testing.assert_allclose(larger.scores, default.scores, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(larger.labels, default.labels)
    assert not np.isnan(larger.scores).any()


@pytest.mark.parametrize("size", [0, 1000, True])
def test_a_prediction_batch_that_does_not_divide_among_the_partitions_is_refused(trained, size):
    config, _, checkpoints = trained
    assert config.mesh.num_partitions == 16 and 1000 % 16
    options = _predict.PredictOptions(
        checkpoint_dir=checkpoints, data="unused", batch_size=size, progress=False
    )
    with pytest.raises(sparseflow.UsageError, match=f"multiple of .* = 16 .*got {size!r}"):
        _predict.predict(config, options)


def test_the_command_takes_the_prediction_batch_size(small_run, trained, tmp_path):
    _, path, _, data = small_run
    _, _, checkpoints = trained
    out = tmp_path / "scores.csv"
    done = cli(
        "predict", "--config", str(path), "--checkpoint-dir", str(checkpoints),
        "--data", data, "--out", str(out), "--batch-size", "1000",
    )  # fmt: skip
    assert done.returncode != 0
    assert "prediction batch size must be a positive multiple" in done.stderr
    assert not out.exists()


def test_a_user_models_checkpoint_predicts_as_its_evaluation(small_run, records, tmp_path):
    tmp, path, _, data = small_run
    raw = yaml.safe_load(path.read_text())
    raw["model"] = {"module": "user_models:LinearModel", "args": {"scale": 2.0}}
    (tmp_path / "user.yaml").write_text(yaml.safe_dump(raw))
    config = load_config(tmp_path / "user.yaml")
    result = _train.train(
        config,
        _train.TrainOptions(
            data=data, steps=2, pipelined=False, checkpoint_dir=tmp_path / "ckpt", progress=False
        ),
    )
    scored = write_records(tmp_path / "data" / "part-0.array_record", records[:1024])
    predictions = _predict.predict(
        config,
        _predict.PredictOptions(checkpoint_dir=tmp_path / "ckpt", data=scored, progress=False),
    )
    reference = evaluation_scores(config, result, scored)
    np.testing.assert_allclose(predictions.scores, reference, rtol=0, atol=1e-6)


def test_the_command_writes_every_format_with_the_kept_keys(small_run, trained, records, tmp_path):
    _, path, config, _ = small_run
    _, _, checkpoints = trained
    ids = [
        tf.train.Feature(bytes_list=tf.train.BytesList(value=[f"request-{i}".encode()]))
        for i in range(len(records))
    ]
    with_ids = [with_feature(r, "request_id", f) for r, f in zip(records, ids, strict=True)]
    data = write_records(tmp_path / "data" / "part-0.array_record", with_ids)
    expected = _predict.predict(
        config, _predict.PredictOptions(checkpoint_dir=checkpoints, data=data, progress=False)
    )
    user_ids = pipelines.parse_examples(records, config.layout).ids["user_id"].values
    for suffix in (".parquet", ".csv", ".jsonl"):
        out = tmp_path / f"scores{suffix}"
        done = cli(
            "predict", "--config", str(path), "--checkpoint-dir", str(checkpoints),
            "--data", data, "--out", str(out), "--keep", "request_id,user_id",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"Scored {len(records):,} records" in done.stdout
        rows = _read(out)
        np.testing.assert_allclose(rows["score"], expected.scores, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(rows["label"], expected.labels)
        assert list(rows["request_id"]) == [f"request-{i}" for i in range(len(records))]
        np.testing.assert_array_equal(rows["user_id"], user_ids)


def _read(path) -> dict[str, list]:
    if path.suffix == ".parquet":
        return pyarrow.parquet.read_table(path).to_pydict()
    if path.suffix == ".csv":
        return pyarrow.csv.read_csv(path).to_pydict()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {key: [row[key] for row in rows] for key in rows[0]}


def test_the_command_refuses_an_output_of_no_known_format(small_run, tmp_path):
    _, path, _, data = small_run
    done = cli(
        "predict", "--config", str(path), "--checkpoint-dir", str(tmp_path),
        "--data", data, "--out", str(tmp_path / "scores.xlsx"),
    )  # fmt: skip
    assert done.returncode == 2
    assert ".parquet, .csv, .jsonl" in done.stderr


def test_a_batch_is_dispatched_only_once_the_previous_ones_scores_are_in(
    trained, records, tmp_path, monkeypatch
):
    """On several devices the forward has collectives; XLA:CPU can deadlock on two
    such programs in flight, so the scores of one come in before the next is sent."""
    config, _, checkpoints = trained
    data = write_records(tmp_path / "data" / "part-0.array_record", records)
    events = []

    class Fetched:
        def __init__(self, out):
            self.out = out

        def __array__(self, dtype=None, copy=None):
            events.append("fetched")
            return np.asarray(self.out)

    score = _predict._Scorer.__call__

    def recorded(self, batch, specs):
        events.append("dispatched")
        return Fetched(score(self, batch, specs))

    monkeypatch.setattr(_predict._Scorer, "__call__", recorded)
    predictions = _predict.predict(
        config, _predict.PredictOptions(checkpoint_dir=checkpoints, data=data, progress=False)
    )
    assert predictions.scores.shape == (RECORDS,)
    assert events == ["dispatched", "fetched"] * 3


@pytest.mark.parametrize("value_type", ["float", "int"])
def test_the_label_given_to_a_record_without_one_is_tensorflows_example(value_type):
    label = pipelines.LabelColumn(key="clicked", type=pipelines.ValueType(value_type))
    feature = (
        tf.train.Feature(float_list=tf.train.FloatList(value=[0.0]))
        if value_type == "float"
        else tf.train.Feature(int64_list=tf.train.Int64List(value=[0]))
    )
    expected = tf.train.Example(features=tf.train.Features(feature={"clicked": feature}))
    assert _predict._label_example(label) == expected.SerializeToString()
