"""Records in one buffer (`RecordBatch`): the records rebuilt from it, and parsed from it."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import embedding
import pipelines
from pipelines import _parse
from pipelines._array_record import ArrayRecordReader
from pipelines._record_batch import RecordBatch

LAYOUT = pipelines.FeatureLayout.from_schema(
    pipelines.RecordSchema.fixed(("a", "bb"), frozenset({"bb"}), 3)
)


@given(st.lists(st.binary(max_size=40), max_size=20))
def test_the_records_come_back_by_index_slice_and_iteration(records):
    batch = RecordBatch.of(records)
    assert len(batch) == len(records)
    assert list(batch) == records
    assert [batch[i] for i in range(-len(records), len(records))] == records + records
    assert batch[1:-1:2] == records[1:-1:2]
    assert all(type(record) is bytes for record in batch)
    assert RecordBatch.of(batch) is batch


def test_an_index_past_the_end_is_an_index_error():
    batch = RecordBatch.of([b"x", b"yz"])
    with pytest.raises(IndexError, match="record 2 of a batch of 2"):
        batch[2]
    with pytest.raises(IndexError):
        batch[-3]


def _batch(rows: int) -> pipelines.ParsedBatch:
    rng = np.random.default_rng(rows)
    ragged = [rng.integers(0, 50, size=rng.integers(0, 4)).tolist() for _ in range(rows)]
    splits = np.cumsum([0] + [len(r) for r in ragged])
    ids = embedding.RaggedIds(np.array(sum(ragged, []), np.int64), splits)
    weights = embedding.RaggedIds(rng.random(splits[-1]).astype(np.float32), splits)
    return pipelines.ParsedBatch(
        ids={"a": ids, "bb": ids},
        weights={"bb": weights},
        dense=rng.normal(size=(rows, 3)).astype(np.float32),
        labels=rng.integers(0, 2, rows).astype(np.int32),
    )


def _assert_same(got: pipelines.ParsedBatch, want: pipelines.ParsedBatch) -> None:
    for name in want.ids:
        np.testing.assert_array_equal(got.ids[name].values, want.ids[name].values)
        np.testing.assert_array_equal(got.ids[name].row_splits, want.ids[name].row_splits)
    np.testing.assert_array_equal(got.weights["bb"].values, want.weights["bb"].values)
    np.testing.assert_array_equal(got.dense, want.dense)
    np.testing.assert_array_equal(got.labels, want.labels)


def test_a_batch_parses_as_its_list_of_records():
    batch = _batch(37)
    records = _parse.serialize_examples(batch)
    _assert_same(pipelines.parse_examples(RecordBatch.of(records), LAYOUT), batch)


def test_bad_records_are_found_in_a_batch_as_in_a_list():
    records = _parse.serialize_examples(_batch(9))
    records[4] = b"\x0a\x02\x0a"  # truncated
    from_list = pipelines.parse_examples_lenient(records, LAYOUT)
    from_batch = pipelines.parse_examples_lenient(RecordBatch.of(records), LAYOUT)
    assert [row for row, _ in from_batch[1]] == [row for row, _ in from_list[1]] == [4]
    _assert_same(from_batch[0], from_list[0])


def test_the_reader_writes_rows_of_several_files_in_the_order_asked(tmp_path):
    records = _parse.serialize_examples(_batch(30))
    paths = []
    for f, part in enumerate((records[:11], records[11:12], records[12:])):
        paths.append(str(tmp_path / f"part-{f}.array_record"))
        with pipelines.RecordFileWriter(paths[-1]) as writer:
            for record in part:
                writer.write(record)
    order = [29, 0, 11, 12, 3, 11, 28]
    batch = ArrayRecordReader(paths).read(order)
    assert isinstance(batch, RecordBatch)
    lengths = [len(records[i]) for i in order]
    np.testing.assert_array_equal(batch.offsets, np.cumsum([0] + lengths))
    assert batch.data.tobytes() == b"".join(records[i] for i in order)
