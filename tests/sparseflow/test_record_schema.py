"""A config's `record` section (sparseflow/config/_record.py): loading, errors, training."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import tensorflow as tf
import yaml

import beam_jobs
import pipelines
from pipelines._records import RecordFileWriter
from sparseflow import ConfigError, _cli, _fdo_run, _stats_report, _train, load_config


def _table(name: str, vocabulary: int) -> dict:
    return {
        "name": name,
        "vocabulary_size": vocabulary,
        "embedding_dim": 8,
        "combiner": "mean",
        "optimizer": {"type": "adagrad", "learning_rate": 0.1, "initial_accumulator_value": 0.1},
        "initializer": {"type": "normal", "stddev": 0.05},
        "max_ids_per_partition": 64,
        "max_unique_ids_per_partition": 64,
    }


def _raw(data_dir: str = "data") -> dict:
    """Records of clicks on ads: hex-string user ids, int64 ad ids, two dense keys."""
    return {
        "name": "clicks",
        "seed": 1,
        "mesh": {"devices": 8, "partitions_per_device": 2},
        "global_batch_size": 64,
        "preprocessing": {"enable_minibatching": False},
        "tables": [_table("users", 1000), _table("ads", 100)],
        "features": [
            {"name": "user", "table": "users"},
            {"name": "ad", "table": "ads"},
        ],
        "record": {
            "features": {
                "user": {"key": "C1", "ids": "bytes", "required": True},
                "ad": {"key": "ad_id", "weights": "ad_weight"},
            },
            "dense": [
                {"key": "I1", "type": "int", "default": 0, "transform": "log1p"},
                {"key": "score", "default": 0.0},
            ],
            "label": {"key": "ctr", "type": "float", "threshold": 0.5},
        },
        "dataset": {"dir": data_dir, "train": "train/*.array_record", "eval": "eval"},
        "model": {"bottom_mlp": [8], "top_mlp": [8], "learning_rate": 0.05},
        "training": {"log_every": 5, "shuffle": False, "pipelined": False},
    }


def _write(path, raw: dict) -> str:
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _records(rng, count: int) -> list[bytes]:
    """Examples whose label is `score > 0`, with some keys left out."""
    records = []
    for _ in range(count):
        score = float(rng.normal())
        feature = {
            "C1": tf.train.Feature(
                bytes_list=tf.train.BytesList(value=[b"%08x" % rng.integers(0, 2**32)])
            ),
            "ctr": tf.train.Feature(
                float_list=tf.train.FloatList(value=[0.9 if score > 0 else 0.1])
            ),
            "score": tf.train.Feature(float_list=tf.train.FloatList(value=[score])),
        }
        if rng.random() < 0.7:
            ad = int(rng.integers(0, 100))
            feature["ad_id"] = tf.train.Feature(int64_list=tf.train.Int64List(value=[ad]))
            feature["ad_weight"] = tf.train.Feature(float_list=tf.train.FloatList(value=[1.0]))
        if rng.random() < 0.5:
            count_value = int(rng.integers(0, 1000))
            feature["I1"] = tf.train.Feature(int64_list=tf.train.Int64List(value=[count_value]))
        example = tf.train.Example(features=tf.train.Features(feature=feature))
        records.append(example.SerializeToString())
    return records


def _write_records(directory, records: list[bytes]) -> str:
    directory.mkdir(parents=True)
    with RecordFileWriter(str(directory / "part-00000.array_record")) as writer:
        for record in records:
            writer.write(record)
    return str(directory)


def test_loads_the_record_schema(tmp_path):
    config = load_config(_write(tmp_path / "c.yaml", _raw()))
    schema = config.layout.schema
    user, ad = schema.sparse
    assert (user.key, user.ids, user.hash_buckets, user.required) == (
        "C1",
        pipelines.IdType.BYTES,
        1000,
        True,
    )
    assert (ad.key, ad.ids, ad.weights_key, ad.required) == (
        "ad_id",
        pipelines.IdType.INT64,
        "ad_weight",
        False,
    )
    assert [(c.key, c.type, c.default, c.transform) for c in schema.dense] == [
        ("I1", pipelines.ValueType.INT, 0.0, pipelines.DenseTransform.LOG1P),
        ("score", pipelines.ValueType.FLOAT, 0.0, pipelines.DenseTransform.NONE),
    ]
    assert schema.label == pipelines.LabelColumn(key="ctr", type="float", threshold=0.5)
    assert config.layout.num_dense_features == 2 and config.layout.weighted == {"ad"}
    assert config.fdo_layout.entries["features.user.record"] == "C1 (bytes)"
    # The widths were read as absent (None) when a width was not also an index.
    assert (config.model.bottom_mlp, config.model.top_mlp) == ((8,), (8,))


def test_trains_end_to_end_on_records_of_its_schema(tmp_path):
    config = load_config(_write(tmp_path / "c.yaml", _raw()))
    rng = np.random.default_rng(0)
    _write_records(tmp_path / "train", _records(rng, 1280))
    _write_records(tmp_path / "eval", _records(rng, 256))
    options = _train.TrainOptions(
        data=list(config.dataset.train_data), eval_data=config.dataset.eval, progress=False
    )
    result = _train.train(config, options)
    assert result.steps == 20
    assert np.isfinite(result.losses).all()
    # The label is `score > 0`, a dense input: a model that reads it learns it.
    assert result.eval_auc > 0.8


def _mutated(**changes):
    def mutate(raw):
        for path, value in changes.items():
            *parents, last = path.split("/")
            node = raw
            for key in parents:
                node = node[int(key)] if isinstance(node, list) else node[key]
            if value is None:
                del node[last]
            elif isinstance(node, list):
                node[int(last)] = value
            else:
                node[last] = value

    return mutate


ERRORS = {
    "misspelled key": (
        _mutated(**{"record/features/user/kee": "C1"}),
        "record.features.user.kee: unknown key; did you mean 'key'?",
    ),
    "unknown feature": (
        _mutated(**{"record/features/usr": {"key": "u"}}),
        "record.features.usr: unknown feature; did you mean 'user'? known features: user, ad",
    ),
    "unknown id type": (
        _mutated(**{"record/features/user/ids": "string"}),
        "record.features.user.ids: unknown id type 'string'; choose one of: int64, bytes",
    ),
    "threshold of an int label": (
        _mutated(**{"record/label/type": "int"}),
        "record.label.threshold: a threshold applies to a float label only",
    ),
    "unknown transform": (
        _mutated(**{"record/dense/0/transform": "log"}),
        "record.dense[0].transform: unknown dense transform 'log'; "
        "choose one of: none, log1p, standardize",
    ),
    "default not a number": (
        _mutated(**{"record/dense/1/default": "zero"}),
        "record.dense[1].default: expected a number, got a string 'zero'",
    ),
    "key read twice": (
        _mutated(**{"record/dense/1/key": "C1"}),
        "record: record keys ['C1'] are read twice",
    ),
    "weighted beside a record section": (
        _mutated(**{"features/1/weighted": True}),
        "features[1].weighted: with a record section, name the weights key in "
        "record.features.ad.weights",
    ),
    "dense_features beside a record section": (
        _mutated(dense_features=3),
        "dense_features: with a record section, the dense input is the keys of record.dense",
    ),
}


@pytest.mark.parametrize("case", ERRORS)
def test_record_errors_name_the_entry(tmp_path, case):
    mutate, message = ERRORS[case]
    raw = copy.deepcopy(_raw())
    mutate(raw)
    path = _write(tmp_path / "c.yaml", raw)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == f"{path}: {message}" or str(error.value).startswith(
        f"{path}: {message}"
    )


def test_a_record_of_the_wrong_type_is_named(tmp_path):
    config = load_config(_write(tmp_path / "c.yaml", _raw()))
    records = _records(np.random.default_rng(0), 4)
    example = tf.train.Example.FromString(records[1])
    example.features.feature["C1"].CopyFrom(
        tf.train.Feature(int64_list=tf.train.Int64List(value=[7]))
    )
    records[1] = example.SerializeToString()
    with pytest.raises(pipelines.BadRecordError) as error:
        pipelines.parse_examples(records, config.layout)
    assert str(error.value) == (
        "Bad record at index 1 of the batch: feature 'C1' holds a int64_list, expected bytes_list"
    )


def test_dataset_paths_are_relative_to_the_config(tmp_path):
    raw = _raw()
    raw["dataset"]["eval"] = ["eval-a", "/abs/eval-b/*.tfrecord"]
    config = load_config(_write(tmp_path / "c.yaml", raw))
    assert config.dataset.train == (str(tmp_path / "train" / "*.array_record"),)
    assert config.dataset.train_data == config.dataset.train
    assert config.dataset.eval == (str(tmp_path / "eval-a"), "/abs/eval-b/*.tfrecord")
    assert config.synthetic is None


DATA_ERRORS = {
    "synthetic beside a record section": (
        _mutated(synthetic={"examples": 10, "eval_examples": 0, "features": {}}),
        "synthetic: synthetic data is written in the fixed record layout",
    ),
    "example count in the dataset section": (
        _mutated(**{"dataset/examples": 100}),
        "keys of an earlier config format: dataset.examples moved to synthetic.examples",
    ),
    "empty train list": (
        _mutated(**{"dataset/train": []}),
        "dataset.train: expected a path or a non-empty list of paths",
    ),
}


@pytest.mark.parametrize("case", DATA_ERRORS)
def test_dataset_errors_name_the_entry(tmp_path, case):
    mutate, message = DATA_ERRORS[case]
    raw = _raw()
    mutate(raw)
    path = _write(tmp_path / "c.yaml", raw)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {message}")):
        load_config(path)


def test_synthetic_section_names_every_feature(tmp_path):
    raw = _raw()
    del raw["record"]
    raw["dense_features"] = 2
    raw["synthetic"] = {
        "examples": 64,
        "eval_examples": 0,
        "features": {"user": {"valency": [1, 2]}},
    }
    path = _write(tmp_path / "c.yaml", raw)
    with pytest.raises(
        ConfigError, match=re.escape(f"{path}: synthetic.features.ad: missing required key")
    ):
        load_config(path)


def test_make_data_needs_a_synthetic_section(tmp_path, capsys):
    path = _write(tmp_path / "c.yaml", _raw())
    assert _cli.main(["make-data", "--config", path]) != 0
    assert "make-data writes synthetic data, described by a config's `synthetic` section" in (
        capsys.readouterr().err
    )


def test_fdo_job_computes_the_moments_training_standardizes_with(tmp_path):
    raw = _raw()
    raw["record"]["dense"][1]["transform"] = "standardize"
    config = load_config(_write(tmp_path / "c.yaml", raw))
    records = _records(np.random.default_rng(3), 640)
    data = _write_records(tmp_path / "train", records)
    out = tmp_path / "fdo"
    beam_jobs.run_fdo_job(_fdo_run.job_config(config), [data], str(out))
    # Reference: numpy float64 over the records' `score` (default 0.0 when absent).
    scores = np.array(
        [
            tf.train.Example.FromString(r).features.feature["score"].float_list.value[0]
            for r in records
        ],
        np.float64,
    )
    moments = pipelines.load_dense_moments(out)
    assert list(moments) == ["score"]
    np.testing.assert_allclose(moments["score"][0], [scores.mean()], rtol=1e-9)
    np.testing.assert_allclose(moments["score"][1], [scores.std()], rtol=1e-9)

    with pytest.raises(ValueError, match=r"standardized .* give the FDO output directory"):
        _train.record_layout(config, _train.TrainOptions(data=data))
    layout = _train.record_layout(config, _train.TrainOptions(data=data, fdo_dir=out))
    dense = pipelines.parse_examples(records[:8], layout).dense[:, 1]
    expected = (scores[:8] - scores.mean()) / scores.std()
    np.testing.assert_allclose(dense, expected, rtol=1e-5, atol=1e-6)


def test_stats_reports_distinct_ids_out_of_vocabulary_and_collisions(tmp_path):
    raw = _raw()
    raw["tables"][1]["vocabulary_size"] = 50  # ad ids are drawn from [0, 100)
    raw["preprocessing"]["invalid_ids"] = "drop"
    config = load_config(_write(tmp_path / "c.yaml", raw))
    records = _records(np.random.default_rng(4), 640)
    _write_records(tmp_path / "train", records)
    report = _stats_report.run_stats(config)
    # Reference: the records' values, read with protobuf; buckets by TensorFlow.
    examples = [tf.train.Example.FromString(r).features.feature for r in records]
    strings = {f["C1"].bytes_list.value[0] for f in examples}
    buckets = set(tf.strings.to_hash_bucket_fast(sorted(strings), 1000).numpy().tolist())
    ads = {f["ad_id"].int64_list.value[0] for f in examples if "ad_id" in f}
    user, ad = report.features
    assert (user.name, user.hashed, user.distinct) == ("user", True, len(strings))
    assert user.collisions == pytest.approx(1 - len(buckets) / len(strings))
    assert user.collisions > 0 and user.out_of_vocabulary == 0
    assert (ad.name, ad.hashed, ad.distinct) == ("ad", False, len(ads))
    assert ad.out_of_vocabulary == pytest.approx(sum(a >= 50 for a in ads) / len(ads))
    text = _stats_report.format_report(report)
    assert re.search(
        rf"\nuser +hashed +{len(strings)} +0\.00% +{100 * user.collisions:.2f}%\n", text
    )
