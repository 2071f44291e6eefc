"""Tests of the synthetic dataset writer (pipelines/_synthetic.py)."""

import json
import os

import numpy as np
import pytest

from embedding import RaggedIds
from pipelines import (
    SyntheticDataset,
    SyntheticFeature,
    _records,
    list_record_files,
    parse_examples,
    read_records,
    write_synthetic_dataset,
)
from pipelines._parse import serialize_examples
from pipelines._synthetic import generate_examples, id_scores, label_logits

DATASET = SyntheticDataset(
    features=(
        SyntheticFeature(
            name="user", vocabulary_size=50, min_valency=1, max_valency=4, zipf_exponent=1.3
        ),
        SyntheticFeature(
            name="item",
            vocabulary_size=1000,
            min_valency=2,
            max_valency=9,
            zipf_exponent=1.1,
            weighted=True,
        ),
        SyntheticFeature(
            name="tag", vocabulary_size=7, min_valency=3, max_valency=3, zipf_exponent=2.0
        ),
    ),
    num_dense_features=4,
)
NUM_EXAMPLES = 500
SEED = 7


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    files = write_synthetic_dataset(
        DATASET, out, num_examples=NUM_EXAMPLES, seed=SEED, num_shards=3
    )
    return out, files


def _generated(dataset, num_examples, seed):
    return [
        record
        for batch in generate_examples(dataset, num_examples=num_examples, seed=seed)
        for record in serialize_examples(batch)
    ]


def _concatenated(batches):
    """One batch holding the examples of several, in order."""
    first = batches[0]

    def ragged(field, name):
        parts = [getattr(batch, field)[name] for batch in batches]
        offsets = np.cumsum([0] + [part.row_splits[-1] for part in parts[:-1]])
        splits = [part.row_splits[1:] + offset for part, offset in zip(parts, offsets)]
        return RaggedIds(
            values=np.concatenate([part.values for part in parts]),
            row_splits=np.concatenate([[0], *splits]),
        )

    return first._replace(
        ids={name: ragged("ids", name) for name in first.ids},
        weights={name: ragged("weights", name) for name in first.weights},
        dense=np.concatenate([batch.dense for batch in batches]),
        labels=np.concatenate([batch.labels for batch in batches]),
    )


def _auc(scores, labels):
    """Area under the ROC curve by the rank-sum formula, ties at average rank."""
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    average_ranks = np.cumsum(counts) - (counts - 1) / 2.0
    ranks = average_ranks[inverse]
    positives = int(labels.sum())
    negatives = labels.size - positives
    return (ranks[labels == 1].sum() - positives * (positives + 1) / 2.0) / (positives * negatives)


def test_auc_matches_pairwise_count():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, size=60).astype(float)  # many ties
    labels = (rng.random(60) < 0.4).astype(int)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairwise = ((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean()
    assert _auc(scores, labels) == pytest.approx(pairwise, abs=1e-12)


def test_files_and_manifest(written):
    out, files = written
    assert sorted(files) == ["arrayrecord", "tfrecord"]
    assert [os.path.basename(path) for path in files["tfrecord"]] == [
        f"part-0000{shard}-of-00003.tfrecord" for shard in range(3)
    ]
    with open(os.path.join(out, "dataset.json")) as file:
        manifest = json.load(file)
    assert manifest["num_examples"] == NUM_EXAMPLES
    assert manifest["seed"] == SEED
    assert manifest["examples_per_shard"] == [166, 167, 167]
    assert manifest["num_dense_features"] == 4
    assert [feature["name"] for feature in manifest["features"]] == ["user", "item", "tag"]
    for fmt, paths in files.items():
        assert [os.path.join(out, path) for path in manifest["files"][fmt]] == paths
        assert list_record_files(os.path.join(out, fmt)) == paths


def test_formats_hold_the_generated_records_in_order(written):
    _, files = written
    expected = _generated(DATASET, NUM_EXAMPLES, SEED)
    for paths in files.values():
        assert list(read_records(paths)) == expected
        assert [len(list(read_records(path))) for path in paths] == [166, 167, 167]


def test_same_seed_writes_same_bytes(written, tmp_path):
    _, files = written
    again = write_synthetic_dataset(
        DATASET, tmp_path, num_examples=NUM_EXAMPLES, seed=SEED, num_shards=3
    )
    for fmt in files:
        for first, second in zip(files[fmt], again[fmt], strict=True):
            with open(first, "rb") as a, open(second, "rb") as b:
                assert a.read() == b.read(), (first, second)


def test_records_do_not_depend_on_sharding(written, tmp_path):
    _, files = written
    resharded = write_synthetic_dataset(
        DATASET, tmp_path, num_examples=NUM_EXAMPLES, seed=SEED, num_shards=2, formats=["tfrecord"]
    )
    assert list(resharded) == ["tfrecord"]
    assert list(read_records(resharded["tfrecord"])) == list(read_records(files["tfrecord"]))


def test_different_seed_gives_different_records():
    first = _generated(DATASET, 50, seed=1)
    second = _generated(DATASET, 50, seed=2)
    assert sum(a == b for a, b in zip(first, second)) < 5


def test_examples_respect_valency_vocabulary_and_types(written):
    _, files = written
    batch = parse_examples(list(read_records(files["arrayrecord"])), DATASET.feature_layout())
    for feature in DATASET.features:
        ids = batch.ids[feature.name]
        lengths = np.diff(ids.row_splits)
        assert lengths.min() >= feature.min_valency and lengths.max() <= feature.max_valency
        assert ids.values.min() >= 0 and ids.values.max() < feature.vocabulary_size
        if feature.min_valency < feature.max_valency:
            assert len(np.unique(lengths)) > 1
    assert sorted(batch.weights) == ["item"]
    weights = batch.weights["item"]
    np.testing.assert_array_equal(weights.row_splits, batch.ids["item"].row_splits)
    assert weights.values.dtype == np.float32
    assert 0.5 <= weights.values.min() and weights.values.max() < 1.5
    assert batch.dense.shape == (NUM_EXAMPLES, 4) and batch.dense.dtype == np.float32
    assert abs(batch.dense.mean()) < 0.2 and 0.8 < batch.dense.std() < 1.2
    assert batch.labels.dtype == np.int32 and set(np.unique(batch.labels)) == {0, 1}


def _zipf_mod_probability_of_zero(exponent, vocabulary_size, terms=200_000):
    """P((Zipf(a) - 1) mod V == 0): the mass of n = 1, 1 + V, 1 + 2V, ...

    Sums are cut at `terms` with the integral of the remainder added
    (Euler-Maclaurin to first order), in float64.
    """

    def tail_sum(start, step):
        n = start + step * np.arange(terms, dtype=np.float64)
        end = start + step * terms
        return (
            (n**-exponent).sum()
            + end ** (1 - exponent) / (step * (exponent - 1))
            + (end**-exponent) / 2
        )

    return tail_sum(1.0, float(vocabulary_size)) / tail_sum(1.0, 1.0)


def test_ids_follow_zipf_with_zero_hottest():
    (batch,) = generate_examples(DATASET, num_examples=3000, seed=3)
    for feature in DATASET.features:
        values = batch.ids[feature.name].values
        counts = np.bincount(values, minlength=feature.vocabulary_size)
        assert counts.argmax() == 0
        assert counts[0] > counts[1] > counts[2]
        expected = _zipf_mod_probability_of_zero(feature.zipf_exponent, feature.vocabulary_size)
        sigma = np.sqrt(expected * (1 - expected) / values.size)
        assert abs(counts[0] / values.size - expected) < 5 * sigma, feature.name


def _fit_logistic_regression(x, y, steps=15, ridge=1e-3):
    """Newton's method on the L2-regularized log-loss, float64."""
    x = np.hstack([x, np.ones((x.shape[0], 1))])
    w = np.zeros(x.shape[1])
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-x @ w))
        gradient = x.T @ (p - y) + ridge * w
        hessian = (x * (p * (1 - p))[:, None]).T @ x + ridge * np.eye(x.shape[1])
        w -= np.linalg.solve(hessian, gradient)
    return x @ w


def _bag_of_ids(ragged, vocabulary_size):
    rows = np.repeat(np.arange(ragged.row_splits.size - 1), np.diff(ragged.row_splits))
    bag = np.zeros((ragged.row_splits.size - 1, vocabulary_size))
    np.add.at(bag, (rows, ragged.values), 1.0)
    return bag / np.diff(ragged.row_splits)[:, None]


def test_labels_are_learnable():
    (batch, second) = generate_examples(DATASET, num_examples=5000, seed=11)
    batch = _concatenated([batch, second])
    labels = batch.labels
    assert 0.4 < labels.mean() < 0.6
    assert _auc(label_logits(DATASET, 11, batch), labels) > 0.7
    # Without the hidden scores: a linear model on the raw inputs finds the signal.
    inputs = np.hstack(
        [batch.dense]
        + [
            _bag_of_ids(batch.ids[feature.name], feature.vocabulary_size)
            for feature in DATASET.features
            if feature.vocabulary_size <= 50
        ]
    )
    assert _auc(_fit_logistic_regression(inputs, labels), labels) > 0.65


def test_labels_follow_the_logit():
    (batch,) = generate_examples(DATASET, num_examples=4000, seed=5)
    probabilities = 1.0 / (1.0 + np.exp(-label_logits(DATASET, 5, batch)))
    sigma = np.sqrt((probabilities * (1 - probabilities)).sum())
    assert abs(batch.labels.sum() - probabilities.sum()) < 5 * sigma
    high = probabilities > 0.8
    assert batch.labels[high].mean() > 0.75


def test_id_scores_are_fixed_standard_normal_values():
    ids = np.arange(200_000, dtype=np.int64) * 7919 + 2**40
    scores = id_scores(3, 1, ids)
    np.testing.assert_array_equal(scores, id_scores(3, 1, ids))
    assert abs(scores.mean()) < 0.02 and abs(scores.std() - 1) < 0.02
    assert abs(np.mean(np.abs(scores) < 1) - 0.6827) < 0.01
    for other in (id_scores(4, 1, ids), id_scores(3, 2, ids)):
        assert abs(np.corrcoef(scores, other)[0, 1]) < 0.02


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(name=""), ValueError),
        (dict(vocabulary_size=0), ValueError),
        (dict(vocabulary_size=10.0), ValueError),
        (dict(min_valency=0), ValueError),
        (dict(min_valency=5, max_valency=4), ValueError),
        (dict(zipf_exponent=1.0), ValueError),
        (dict(zipf_exponent=float("nan")), ValueError),
        (dict(zipf_exponent="1.2"), TypeError),
        (dict(weighted=1), TypeError),
    ],
)
def test_feature_validation(kwargs, error):
    arguments = dict(name="f", vocabulary_size=10, min_valency=1, max_valency=3, zipf_exponent=1.2)
    with pytest.raises(error):
        SyntheticFeature(**{**arguments, **kwargs})


def _feature(name, weighted=False):
    return SyntheticFeature(
        name=name,
        vocabulary_size=10,
        min_valency=1,
        max_valency=3,
        zipf_exponent=1.2,
        weighted=weighted,
    )


@pytest.mark.parametrize(
    "features, num_dense, match",
    [
        ((), 1, "at least one sparse feature"),
        ((_feature("a"), _feature("a")), 1, "used twice"),
        ((_feature("dense"),), 1, "used twice"),
        ((_feature("a", weighted=True), _feature("a_weights")), 1, "used twice"),
        ((_feature("a"),), -1, "num_dense_features"),
    ],
)
def test_dataset_validation(features, num_dense, match):
    with pytest.raises(ValueError, match=match):
        SyntheticDataset(features=features, num_dense_features=num_dense)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_examples=2, num_shards=3), "num_shards = 3 exceeds"),
        (dict(num_examples=0), "num_examples"),
        (dict(seed=-1), "seed"),
        (dict(formats=("parquet",)), "formats must be taken from"),
        (dict(formats=()), "at least one"),
        (dict(formats=("tfrecord", "tfrecord")), "at most once"),
    ],
)
def test_write_argument_errors(kwargs, match, tmp_path):
    arguments = dict(num_examples=10, seed=0, num_shards=2)
    with pytest.raises(ValueError, match=match):
        write_synthetic_dataset(DATASET, tmp_path, **{**arguments, **kwargs})


def _all_files(directory):
    return sorted(
        os.path.relpath(os.path.join(root, name), directory)
        for root, _, names in os.walk(directory)
        for name in names
    )


def test_interrupted_write_leaves_only_complete_files(tmp_path, monkeypatch):
    write_synthetic_dataset(DATASET, tmp_path, num_examples=40, seed=0, num_shards=2)
    written_once = _records.RecordFileWriter.write
    calls = []

    def failing_write(self, record):
        calls.append(record)
        if len(calls) == 70:  # two writes per record: record 35, in the second shard
            raise KeyboardInterrupt
        written_once(self, record)

    monkeypatch.setattr(_records.RecordFileWriter, "write", failing_write)
    with pytest.raises(KeyboardInterrupt):
        write_synthetic_dataset(DATASET, tmp_path, num_examples=60, seed=1, num_shards=2)
    # Shard 0 of the new write is complete; shard 1 is still the old one, and
    # without the manifest the directory is not taken for a complete dataset.
    assert _all_files(tmp_path) == [
        "arrayrecord/part-00000-of-00002.array_record",
        "arrayrecord/part-00001-of-00002.array_record",
        "tfrecord/part-00000-of-00002.tfrecord",
        "tfrecord/part-00001-of-00002.tfrecord",
    ]
    new_shard = list(read_records(tmp_path / "tfrecord" / "part-00000-of-00002.tfrecord"))
    assert new_shard == _generated(DATASET, 60, seed=1)[:30]


def test_complete_write_leaves_no_temporary_files(written):
    out, _ = written
    assert not [path for path in _all_files(out) if os.path.basename(path).startswith(".")]


def test_refuses_to_mix_with_shards_of_another_write(tmp_path):
    write_synthetic_dataset(DATASET, tmp_path, num_examples=30, seed=0, num_shards=3)
    with pytest.raises(ValueError, match="already holds shards of another write"):
        write_synthetic_dataset(DATASET, tmp_path, num_examples=30, seed=0, num_shards=2)


def test_held_out_split_differs_but_follows_the_same_labels():
    (train,) = generate_examples(DATASET, num_examples=3000, seed=5)
    (held_out,) = generate_examples(DATASET, num_examples=3000, seed=5, held_out=True)
    assert not np.array_equal(train.dense, held_out.dense)
    # The seed's labelling function explains the held-out labels as well ...
    assert _auc(label_logits(DATASET, 5, held_out), held_out.labels) > 0.7

    # ... and a model fitted on the training split carries over to them.
    def inputs(batch):
        return np.hstack([batch.dense, _bag_of_ids(batch.ids["user"], 50)])

    weights = np.linalg.lstsq(
        np.hstack([inputs(train), np.ones((3000, 1))]), train.labels - 0.5, rcond=None
    )[0]
    scores = np.hstack([inputs(held_out), np.ones((3000, 1))]) @ weights
    assert _auc(scores, held_out.labels) > 0.6


def test_held_out_flag_in_manifest(tmp_path):
    write_synthetic_dataset(
        DATASET,
        tmp_path,
        num_examples=20,
        seed=1,
        num_shards=1,
        formats=("tfrecord",),
        held_out=True,
    )
    assert json.loads((tmp_path / "dataset.json").read_text())["held_out"] is True
