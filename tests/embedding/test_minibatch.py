"""Minibatching in the preprocessing: split masks, bucket maps and layouts."""

from __future__ import annotations

import numpy as np
import pytest

import embedding
from embedding import _minibatch

INT32_MAX = np.iinfo(np.int32).max


def _mask(*nodes: tuple[int, int]) -> int:
    """Mask with bits at (node size, node index) pairs."""
    base = {2: 0, 4: 32, 8: 48, 16: 56, 32: 60, 64: 62}
    return sum(1 << (base[size] + j) for size, j in nodes)


def _split(ids_per_bucket, max_ids, unique_per_bucket=None, max_unique=10**9) -> int:
    ids = np.asarray(ids_per_bucket, np.int64).reshape(-1, 64)
    unique = ids if unique_per_bucket is None else np.asarray(unique_per_bucket).reshape(-1, 64)
    return int(_minibatch.split_mask(ids, unique, max_ids, max_unique))


def test_split_none_needed():
    assert _split(np.ones(64), max_ids=64) == 0


def test_split_all_needed():
    assert _split(np.ones(64), max_ids=1) == (1 << 63) - 1


def test_split_root_only():
    # 64 ids, limit 32: each half holds exactly 32, so only the root is cut.
    assert _split(np.ones(64), max_ids=32) == _mask((64, 0))


def test_split_hot_bucket_cuts_its_path():
    loads = np.zeros(64, np.int64)
    loads[5] = 10
    loads[40] = 1
    # Bucket 5 alone exceeds 4: every node containing it is cut (sizes 2..64),
    # nodes elsewhere are not.
    expected = _mask((2, 2), (4, 1), (8, 0), (16, 0), (32, 0), (64, 0))
    assert _split(loads, max_ids=4) == expected


def test_split_unique_limit_and_or_over_groups():
    ids = np.zeros((2, 64), np.int64)
    unique = np.zeros((2, 64), np.int64)
    ids[0, :2] = 3  # group 0: node (2, 0) has 6 ids, 2 unique
    unique[0, :2] = 1
    ids[1, 62:] = 1  # group 1: node (2, 31) has 2 ids, 4 unique
    unique[1, 62:] = 2
    mask = int(_minibatch.split_mask(ids, unique, 5, 3))
    # Each over-limit node is cut, and so is every node above it.
    path_0 = _mask((2, 0), (4, 0), (8, 0), (16, 0), (32, 0), (64, 0))
    path_31 = _mask((2, 31), (4, 15), (8, 7), (16, 3), (32, 1), (64, 0))
    assert mask == path_0 | path_31


def test_minibatch_of_bucket():
    assert (_minibatch.minibatch_of_bucket(0) == 0).all()
    root = _minibatch.minibatch_of_bucket(_mask((64, 0)))
    assert (root == np.repeat([0, 1], 32)).all()
    everything = _minibatch.minibatch_of_bucket((1 << 63) - 1)
    assert (everything == np.arange(64)).all()
    mixed = _minibatch.minibatch_of_bucket(_mask((2, 0), (16, 1)))
    # cuts at bucket 1 (node of 2 at 0) and bucket 24 (node of 16 at 16)
    assert (mixed == np.concatenate([[0], np.ones(23), np.full(40, 2)])).all()
    with pytest.raises(ValueError, match="63 bits"):
        _minibatch.minibatch_of_bucket(1 << 63)


def test_bucket_hash_is_splitmix64():
    def splitmix64(x: int) -> int:
        m = (1 << 64) - 1
        z = (x + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    for column in [0, 1, 2, 12345, 2**40 + 7]:
        assert _minibatch.bucket_of(column) == splitmix64(column) & 63


def _specs(batch, vocab, max_ids, max_unique, combiner="sum", buffer=None):
    tables = [
        embedding.TableSpec(
            name=f"t{t}",
            vocabulary_size=vocab,
            embedding_dim=8,
            initializer=embedding.initializers.Constant(0.0),
            optimizer=embedding.SGDOptimizerSpec(),
            combiner=combiner,
            max_ids_per_partition=max_ids,
            max_unique_ids_per_partition=max_unique,
            suggested_coo_buffer_size_per_device=buffer,
        )
        for t in range(2)
    ]
    names = ["a", "b", "c"]  # a and b share t0 (feature stacking)
    return {
        name: embedding.FeatureSpec(
            name=name,
            table_spec=tables[0 if name != "c" else 1],
            input_shape=[batch, 4],
            output_shape=[batch, 8],
        )
        for name in names
    }


def _entries(out, stats_name, local, slots, n, minibatched):
    """(slot, minibatch, partition, local id, sample, gain) of every entry."""
    pointers = out.lhs_row_pointers[stats_name]
    ids = out.lhs_embedding_ids[stats_name]
    samples = out.lhs_sample_ids[stats_name]
    gains = out.lhs_gains[stats_name]
    width = max(n, 8)
    mbs = 64 if minibatched else 1
    capacity = ids.size // (local * slots)
    rows = []
    for slot in range(local * slots):
        start = 0
        for mb in range(mbs):
            for p in range(n):
                end = int(pointers[(slot * mbs + mb) * width + p])
                for k in range(start, end):
                    i = slot * capacity + k
                    rows.append((slot, mb, p, int(ids[i]), int(samples[i]), float(gains[i])))
                start = -(-end // 8) * 8
    return rows


@pytest.mark.parametrize("local,global_,slots", [(1, 1, 2), (2, 2, 2), (1, 2, 4)])
def test_minibatched_layout_equals_single_pass(local, global_, slots):
    rng = np.random.default_rng(local * 10 + slots)
    batch_global = 32 * global_ * slots
    rows = batch_global * local // global_
    vocab = 4096  # columns spread over the buckets, so no bucket alone exceeds
    features = {}
    for name in "abc":
        lengths = rng.integers(0, 9, rows)
        # Uniform ids: no single column exceeds the limits, only partitions do.
        values = rng.integers(0, vocab, lengths.sum())
        features[name] = embedding.RaggedIds(values, np.concatenate([[0], np.cumsum(lengths)]))
    n = global_ * slots
    kwargs = dict(num_sc_per_device=slots)
    big = _specs(batch_global, vocab, 4096, 4096)
    single, single_stats = embedding.preprocess_sparse_dense_matmul_input(
        features, None, big, local, global_, **kwargs
    )
    limit_ids, limit_unique = 24, 16
    small = _specs(batch_global, vocab, limit_ids, limit_unique)
    # Other hosts (if any) contribute nothing: this host decides alone.
    alone = _RecordingInterface(False, 0) if local < global_ else None
    split, split_stats = embedding.preprocess_sparse_dense_matmul_input(
        features,
        None,
        small,
        local,
        global_,
        enable_minibatching=True,
        all_reduce_interface=alone,
        **kwargs,
    )
    assert int(split.num_minibatches[0]) > 1
    assert split.lhs_row_pointers["t0"].size == local * slots * 64 * max(n, 8)
    for table in ("t0", "t1"):
        for field in (
            "max_ids_per_partition",
            "max_unique_ids_per_partition",
            "required_buffer_size_per_sc",
        ):
            np.testing.assert_array_equal(
                getattr(split_stats, field)[table], getattr(single_stats, field)[table]
            )
        assert split_stats.id_drop_counters[table] == 0
        reference = _entries(single, table, local, slots, n, minibatched=False)
        got = _entries(split, table, local, slots, n, minibatched=True)
        strip = lambda rows: sorted((s, p, i, smp, round(g, 5)) for s, _, p, i, smp, g in rows)  # noqa: E731
        assert strip(got) == strip(reference)
        owner: dict[tuple[int, int], int] = {}
        per_group: dict[tuple[int, int, int], list[int]] = {}
        for slot, mb, p, local_id, _, _ in got:
            assert mb < int(split.num_minibatches[0])
            # a column (partition, local id) lives in one minibatch only
            assert owner.setdefault((p, local_id), mb) == mb
            per_group.setdefault((slot, mb, p), []).append(local_id)
        for ids in per_group.values():
            assert len(ids) <= limit_ids and len(set(ids)) <= limit_unique


@pytest.mark.parametrize("seed", range(4))
def test_one_pass_buffer_size_holds_any_minibatched_layout(seed):
    """A buffer sized for one pass (as FDO suggests it) has room for the
    padding of every minibatch: limits far below a partition's ids force
    many minibatches, so many small padded segments."""
    rng = np.random.default_rng(seed)
    slots, batch = 2, 64
    features = {}
    for name in "abc":
        lengths = rng.integers(0, 5, batch)
        values = rng.integers(0, 1 << 20, lengths.sum())
        features[name] = embedding.RaggedIds(values, np.concatenate([[0], np.cumsum(lengths)]))
    vocab = 1 << 20
    _, stats = embedding.preprocess_sparse_dense_matmul_input(
        features, None, _specs(batch, vocab, vocab, vocab), 1, 1, num_sc_per_device=slots
    )
    # The most entries any slot needs in one pass, as a per-device buffer.
    buffer = int(max(stats.required_buffer_size_per_sc[t].max() for t in ("t0", "t1"))) * slots
    out, split_stats = embedding.preprocess_sparse_dense_matmul_input(
        features,
        None,
        _specs(batch, vocab, 8, 8, buffer=buffer),
        1,
        1,
        num_sc_per_device=slots,
        enable_minibatching=True,
    )
    assert int(out.num_minibatches[0]) > 8
    for table in ("t0", "t1"):
        assert split_stats.id_drop_counters[table] == 0
        reference = _entries(
            embedding.preprocess_sparse_dense_matmul_input(
                features, None, _specs(batch, vocab, vocab, vocab), 1, 1, num_sc_per_device=slots
            )[0],
            table,
            1,
            slots,
            slots,
            minibatched=False,
        )
        got = _entries(out, table, 1, slots, slots, minibatched=True)
        strip = lambda rows: sorted((s, p, i, smp, round(g, 5)) for s, _, p, i, smp, g in rows)  # noqa: E731
        assert strip(got) == strip(reference)


def test_minibatching_not_needed_keeps_one_pass():
    specs = _specs(16, 64, 64, 64)
    ids = np.arange(64).reshape(16, 4) % 64
    out, _ = embedding.preprocess_sparse_dense_matmul_input(
        {"a": ids, "b": ids, "c": ids},
        None,
        specs,
        1,
        1,
        num_sc_per_device=2,
        enable_minibatching=True,
    )
    assert (out.num_minibatches == 1).all()


class _RecordingInterface:
    """Stands in for other hosts: ORs in a fixed value and records the keys."""

    def __init__(self, others_flag: bool, others_mask: int):
        self.others_flag, self.others_mask, self.calls = others_flag, others_mask, []

    def all_reduce_bool(self, sync_key, value):
        self.calls.append(("bool", sync_key, value))
        return value or self.others_flag

    def all_reduce_uint64(self, sync_key, value):
        self.calls.append(("uint64", sync_key, value))
        return value | self.others_mask


def test_other_host_forces_minibatching():
    specs = _specs(16, 64, 64, 64)
    ids = np.arange(32).reshape(8, 4)  # the host-local half of the global batch
    interface = _RecordingInterface(True, _mask((64, 0)))
    out, _ = embedding.preprocess_sparse_dense_matmul_input(
        {"a": ids, "b": ids, "c": ids},
        None,
        specs,
        1,
        2,
        num_sc_per_device=2,
        enable_minibatching=True,
        all_reduce_interface=interface,
        batch_number=7,
    )
    assert interface.calls == [("bool", 14, False), ("uint64", 15, 0)]
    assert (out.num_minibatches == 2).all()


def test_multi_host_minibatching_needs_interface():
    specs = _specs(16, 64, 64, 64)
    ids = np.zeros((8, 4), np.int64)
    with pytest.raises(ValueError, match="all_reduce_interface"):
        embedding.preprocess_sparse_dense_matmul_input(
            {"a": ids, "b": ids, "c": ids},
            None,
            specs,
            1,
            2,
            num_sc_per_device=2,
            enable_minibatching=True,
        )


def test_single_hot_column_over_limit_raises_naming_minibatch():
    specs = _specs(16, 64, 4, 4)
    ids = np.zeros((16, 4), np.int64)  # id 0 in every sample: one bucket, 16 ids
    with pytest.raises(embedding.LimitBreachError, match="minibatch"):
        embedding.preprocess_sparse_dense_matmul_input(
            {"a": ids, "b": ids, "c": ids},
            None,
            specs,
            1,
            1,
            num_sc_per_device=2,
            enable_minibatching=True,
        )
