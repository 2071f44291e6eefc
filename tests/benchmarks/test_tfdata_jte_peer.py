"""The input benchmark's tf.data + jax-tpu-embedding peer: the same specs and
limits as ours, and batches of our layout's shapes. Skipped without the peer
(the optional extra `bench`)."""

import itertools

import _tfdata_jte_peer
import numpy as np
import pytest

import embedding
import pipelines
from sparseflow import shipped_config
from sparseflow.config._run_config import load_config

jte = pytest.importorskip("jax_tpu_embedding.sparsecore.lib.nn.embedding")

DEVICES, SLOTS = 8, 2
CONFIG = load_config(shipped_config("demo"))
LAYOUT = CONFIG.synthetic.dataset.feature_layout()
BATCH = CONFIG.global_batch_size


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, list[str]]:
    return pipelines.write_synthetic_dataset(
        CONFIG.synthetic.dataset,
        tmp_path_factory.mktemp("demo"),
        num_examples=2 * BATCH,
        seed=0,
        num_shards=2,
    )


@pytest.fixture(scope="module")
def specs():
    return embedding.prepare_feature_specs_for_training(CONFIG.feature_specs, DEVICES, SLOTS)


def _rows(values, splits):
    rows = np.empty(splits.size - 1, dtype=object)
    rows[:] = np.split(values, splits[1:-1])
    return rows


def test_peer_specs_lay_out_a_batch_as_ours(files, specs):
    records = list(itertools.islice(pipelines.read_records(files["arrayrecord"]), BATCH))
    parsed = pipelines.parse_examples(records, LAYOUT)
    kwargs = dict(num_sc_per_device=SLOTS, allow_id_dropping=False)
    ours, our_stats = embedding.preprocess_sparse_dense_matmul_input(
        parsed.ids,
        {name: parsed.weights.get(name) for name in parsed.ids},
        specs,
        DEVICES,
        DEVICES,
        **kwargs,
    )
    features = {n: _rows(r.values.astype(np.int32), r.row_splits) for n, r in parsed.ids.items()}
    weights = {
        n: _rows(
            parsed.weights[n].values if n in parsed.weights else np.ones(r.values.size, np.float32),
            r.row_splits,
        )
        for n, r in parsed.ids.items()
    }
    peer_specs = _tfdata_jte_peer.peer_feature_specs(specs, DEVICES, SLOTS)
    theirs, their_stats = jte.preprocess_sparse_dense_matmul_input(
        features, weights, peer_specs, DEVICES, DEVICES, **kwargs
    )
    assert (
        set(theirs.lhs_row_pointers)
        == set(ours.lhs_row_pointers)
        == {"ads_advertisers", "categories", "context", "geo", "items", "queries", "users"}
    )
    for stack in ours.lhs_row_pointers:
        for field in ("max_ids_per_partition", "max_unique_ids_per_partition"):
            np.testing.assert_array_equal(
                getattr(their_stats, field)[stack], getattr(our_stats, field)[stack]
            )
        np.testing.assert_array_equal(
            theirs.lhs_row_pointers[stack], ours.lhs_row_pointers[stack], err_msg=stack
        )
        assert theirs.lhs_embedding_ids[stack].shape == ours.lhs_embedding_ids[stack].shape


def test_the_tfdata_pipeline_yields_batches_of_our_shapes(files, specs):
    batches = _tfdata_jte_peer.tfdata_jte_batches(
        files["tfrecord"],
        LAYOUT,
        _tfdata_jte_peer.peer_feature_specs(specs, DEVICES, SLOTS),
        host_batch=BATCH,
        local_devices=DEVICES,
        global_devices=DEVICES,
        num_sc_per_device=SLOTS,
        allow_id_dropping=False,
        enable_minibatching=True,
        parallel_calls=2,
        seed=0,
    )
    shapes = embedding.preprocessed_input_shapes(
        specs, DEVICES, DEVICES, num_sc_per_device=SLOTS, enable_minibatching=True
    )
    for _ in range(3):  # more batches than one pass over the files holds: it repeats
        out, dense, labels = next(batches)
        assert dense.shape == (BATCH, LAYOUT.num_dense_features) and labels.shape == (BATCH,)
        for field in ("lhs_embedding_ids", "lhs_gains"):
            for stack, shape in getattr(shapes, field).items():
                assert getattr(out, field)[stack].shape == shape.shape, (field, stack)
