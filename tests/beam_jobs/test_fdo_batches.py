"""Forming global batches from record ranges (beam_jobs/_batches.py), without Beam."""

import fdo_cases
import numpy as np
import pytest

import pipelines
from beam_jobs import _batches
from beam_jobs._batches import RecordRange, SparseRows
from embedding import RaggedIds


def _random_rows(rng, count: int) -> tuple[SparseRows, list[list[int]]]:
    """Rows of one feature `f` (weighted), and the same rows as Python lists."""
    lists = [rng.integers(0, 100, rng.integers(0, 4)).tolist() for _ in range(count)]
    splits = np.cumsum([0] + [len(row) for row in lists])
    values = np.array([v for row in lists for v in row], np.int64)
    rows = SparseRows(
        ids={"f": RaggedIds(values, splits)},
        weights={"f": RaggedIds(values.astype(np.float32) / 2, splits)},
    )
    return rows, lists


def _as_lists(rows: SparseRows) -> list[list[int]]:
    ragged = rows.ids["f"]
    weights = rows.weights["f"]
    np.testing.assert_array_equal(weights.row_splits, ragged.row_splits)
    np.testing.assert_array_equal(weights.values, ragged.values.astype(np.float32) / 2)
    splits = ragged.row_splits.tolist()
    return [ragged.values[a:b].tolist() for a, b in zip(splits, splits[1:])]


@pytest.mark.parametrize("seed", range(4))
def test_slice_keep_and_concat_rows(seed):
    rng = np.random.default_rng(seed)
    rows, lists = _random_rows(rng, 20)
    assert rows.num_rows == 20
    assert _as_lists(_batches.slice_rows(rows, 3, 11)) == lists[3:11]
    keep = rng.random(20) < 0.5
    assert _as_lists(_batches.keep_rows(rows, keep)) == [r for r, k in zip(lists, keep) if k]
    order = rng.integers(0, 20, 30)
    assert _as_lists(_batches.take_rows(rows, order)) == [lists[i] for i in order]
    parts = [_batches.slice_rows(rows, a, b) for a, b in ((0, 4), (4, 4), (4, 20))]
    assert _as_lists(_batches.concat_rows(parts)) == lists


@pytest.mark.parametrize("seed", range(6))
def test_fragments_of_any_ranges_join_into_the_batches(seed):
    rng = np.random.default_rng(seed)
    total, batch_size = 97, 8
    rows, lists = _random_rows(rng, total)
    cuts = sorted(rng.choice(np.arange(1, total), size=rng.integers(1, 12), replace=False))
    bounds = [0, *cuts, total]
    num_batches = total // batch_size
    whole, fragments = {}, {}
    for start, stop in zip(bounds, bounds[1:]):
        part = _batches.slice_rows(rows, start, stop)
        for batch, offset, piece in _batches.batch_fragments(part, start, batch_size, num_batches):
            if piece.num_rows == batch_size:
                whole[batch] = piece
            else:
                fragments.setdefault(batch, []).append((offset, piece))
    for batch, pieces in fragments.items():
        rng.shuffle(pieces)
        whole[batch] = _batches.join_fragments(batch, pieces, batch_size)
    assert sorted(whole) == list(range(num_batches))
    for batch, batch_rows in whole.items():
        assert _as_lists(batch_rows) == lists[batch * batch_size : (batch + 1) * batch_size]


def test_join_fragments_names_a_gap():
    rows, _ = _random_rows(np.random.default_rng(0), 8)
    pieces = [(0, _batches.slice_rows(rows, 0, 3)), (4, _batches.slice_rows(rows, 4, 8))]
    with pytest.raises(ValueError, match=r"Batch 5: fragments leave rows \[3, 4\) out"):
        _batches.join_fragments(5, pieces, 8)


def test_range_offsets_number_good_records_in_file_order():
    counts = [((1, 0), 4), ((0, 10), 7), ((0, 0), 9), ((2, 0), 0), ((1, 5), 1)]
    # Each range has two bad records more than its good ones.
    checks = [(key, _batches.RangeCheck(n + 2, np.arange(2))) for key, n in counts]
    offsets = _batches.range_offsets(checks)
    assert offsets.first == {(0, 0): 0, (0, 10): 9, (1, 0): 16, (1, 5): 20, (2, 0): 21}
    assert offsets.total == 21


def test_range_span_is_what_whole_batches_take_of_a_range():
    ranges = [RecordRange(0, "a", 0, 10), RecordRange(0, "a", 10, 14), RecordRange(1, "b", 0, 9)]
    assumed = _batches.assumed_offsets(ranges)
    assert assumed == _batches.RangeOffsets({(0, 0): 0, (0, 10): 10, (1, 0): 14}, 23)
    # Batches of 8: good records [0, 16) make the whole batches, 16 on are the tail.
    assert _batches.range_span(assumed, (0, 0), 10, 8) == (0, 10)
    assert _batches.range_span(assumed, (0, 10), 4, 8) == (10, 14)
    assert _batches.range_span(assumed, (0, 10), 3, 8) == (10, 13)
    assert _batches.range_span(assumed, (1, 0), 9, 8) == (14, 16)
    # A whole batch fewer: the second range gives none of its records.
    assert _batches.range_span(assumed._replace(total=15), (0, 10), 4, 8) == (10, 10)


def test_host_rows_are_consecutive_shares():
    rows, lists = _random_rows(np.random.default_rng(1), 12)
    assert [_as_lists(_batches.host_rows(rows, h, 3)) for h in range(3)] == [
        lists[0:4],
        lists[4:8],
        lists[8:12],
    ]


def test_check_records_maps_bad_rows_back_to_record_indices():
    bad = fdo_cases.BAD_RECORDS
    records = [
        bad["not an example"][0],
        fdo_cases.example(1),
        bad["id too large"][0],
        fdo_cases.example(2),
        bad["nan weight"][0],
        bad["missing feature"][0],
        fdo_cases.example(3),
    ]
    vocabulary = fdo_cases.job_config().vocabulary_sizes
    rows, problems = _batches.check_records(records, fdo_cases.LAYOUT, vocabulary)
    assert [index for index, _ in problems] == [0, 2, 4, 5]
    assert "feature 'item': id 300 is outside the vocabulary [0, 300)" in problems[1][1]
    assert "feature 'history': weight nan" in problems[2][1]
    expected = pipelines.parse_examples([records[i] for i in (1, 3, 6)], fdo_cases.LAYOUT)
    for name, ragged in expected.ids.items():
        np.testing.assert_array_equal(rows.ids[name].values, ragged.values)
        np.testing.assert_array_equal(rows.ids[name].row_splits, ragged.row_splits)
    weights = expected.weights["history"]
    np.testing.assert_array_equal(rows.weights["history"].values, weights.values)


@pytest.mark.parametrize("extension", [".array_record", ".tfrecord"])
def test_read_range_equals_the_sequential_read(tmp_path, extension):
    records = [fdo_cases.example(row) for row in range(23)]
    path = fdo_cases.write_records(str(tmp_path / f"f{extension}"), records)
    ranges = _batches.split_file(3, path, 10)
    assert [tuple(r[:1] + r[2:]) for r in ranges] == [(3, 0, 10), (3, 10, 20), (3, 20, 23)]
    assert [record for r in ranges for record in _batches.read_range(r)] == list(
        pipelines.read_records(path)
    )


def test_read_range_past_the_end_is_an_error(tmp_path):
    path = fdo_cases.write_records(str(tmp_path / "f.tfrecord"), [fdo_cases.example(0)] * 3)
    with pytest.raises(ValueError, match=r"f.tfrecord: expected records \[2, 5\), read 1"):
        _batches.read_range(RecordRange(0, path, 2, 5))
