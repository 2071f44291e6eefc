"""The import job (beam_jobs/import_records.py) against hand-derived records and dead letters."""

import json
import os

import import_cases as cases
import numpy as np
import pytest
import tensorflow as tf

import beam_jobs
import pipelines
from pipelines._array_record import ArrayRecordReader


@pytest.fixture
def criteo_file(tmp_path):
    path = str(tmp_path / "day_0.tsv")
    cases.write_criteo(path)
    return path


def _criteo(**options) -> beam_jobs.ImportConfig:
    return beam_jobs.ImportConfig(spec=beam_jobs.criteo_spec(), **options)


@pytest.mark.parametrize(
    "shards, bytes_per_range, output_format",
    [(1, 2**20, "arrayrecord"), (3, 97, "arrayrecord"), (2, 1, "tfrecord")],
)
def test_criteo_lines_become_the_expected_records(
    tmp_path, criteo_file, shards, bytes_per_range, output_format
):
    config = _criteo(shards=shards, bytes_per_range=bytes_per_range, output_format=output_format)
    result = beam_jobs.run_import_job([criteo_file], config, str(tmp_path / "out"))

    expected = cases.expected_records()
    assert cases.read_back(result.files) == expected
    assert cases.letters(result.dead_letters_path) == cases.expected_dead_letters(criteo_file)
    # Shards hold contiguous lines, their line counts within one of each other.
    counts = [entry["records"] for entry in result.summary["files"]]
    assert [len(list(pipelines.read_records(path))) for path in result.files] == counts
    assert sum(counts) == len(expected)
    summary = result.summary
    assert (summary["lines"], summary["records"], summary["dead_letters"]) == (
        len(cases.CRITEO_LINES),
        len(expected),
        len(cases.CRITEO_LINES) - len(expected),
    )
    distinct = {column["key"]: column["distinct_values"] for column in summary["columns"]}
    assert distinct == cases.expected_distinct(expected)
    with open(result.summary_path) as file:
        assert json.load(file) == summary


def test_the_projects_readers_and_a_varlen_parser_read_the_records(tmp_path, criteo_file):
    result = beam_jobs.run_import_job([criteo_file], _criteo(shards=2), str(tmp_path / "out"))
    expected = cases.expected_records()
    # The Grain path's reader, by dataset index.
    reader = ArrayRecordReader(result.files)
    records = reader.read(np.arange(len(expected)))
    assert [cases.as_dict(r) for r in records] == expected
    # Empty fields are absent: a VarLenFeature sees no value.
    spec = {
        "label": tf.io.FixedLenFeature([], tf.int64),
        "int_1": tf.io.VarLenFeature(tf.int64),
        "cat_2": tf.io.VarLenFeature(tf.string),
    }
    parsed = tf.io.parse_example(records, spec)
    assert parsed["label"].numpy().tolist() == [r["label"][0] for r in expected]
    ints = tf.sparse.to_dense(parsed["int_1"], default_value=-99).numpy()[:, :1]
    assert ints.ravel().tolist() == [r.get("int_1", [-99])[0] for r in expected]
    assert parsed["cat_2"].indices.numpy()[:, 0].tolist() == [
        row for row, r in enumerate(expected) if "cat_2" in r
    ]


def test_a_csv_with_a_header_names_the_columns(tmp_path):
    path = tmp_path / "clicks.csv"
    path.write_text(
        "clicked,price,city,user\r\n"
        "1,2.5,paris,17\r\n"
        '0,,"lyon, fr",\r\n'
        "1,abc,nice,3\r\n"
        "0,1e3,,5\r\n"
    )
    names = beam_jobs.split_line(beam_jobs.first_line(str(path)), ",")
    kinds = beam_jobs.parse_columns("clicked:int,price:float,user:int")
    spec = beam_jobs.spec_from_names(names, kinds, label="clicked")
    config = beam_jobs.ImportConfig(
        spec=spec, delimiter=",", header=True, shards=2, output_format="tfrecord"
    )
    result = beam_jobs.run_import_job([str(path)], config, str(tmp_path / "out"))

    assert cases.read_back(result.files) == [
        {"label": [1], "price": [2.5], "city": [b"paris"], "user": [17]},
        {"label": [0], "city": [b"lyon, fr"]},
        {"label": [0], "price": [1000.0], "user": [5]},
    ]
    assert cases.letters(result.dead_letters_path) == [
        {"file": str(path), "line": 4, "reason": "column 'price': 'abc' is not a number"}
    ]
    distinct = {c["name"]: c["distinct_values"] for c in result.summary["columns"]}
    assert distinct == {"clicked": 2, "price": 2, "city": 2, "user": 2}


def test_headers_of_several_files_are_skipped_and_lines_numbered_per_file(tmp_path):
    paths = []
    for i in range(2):
        path = tmp_path / f"part{i}.tsv"
        path.write_text(f"y\tx\n{i}\t10\n{i}\tten\n{i}\t{i}\n")
        paths.append(str(path))
    spec = beam_jobs.spec_from_names(["y", "x"], beam_jobs.parse_columns("y:int,x:int"), "y")
    config = beam_jobs.ImportConfig(spec=spec, header=True, bytes_per_range=5, shards=3)
    result = beam_jobs.run_import_job(paths, config, str(tmp_path / "out"))
    assert cases.read_back(result.files) == [
        {"label": [0], "x": [10]},
        {"label": [0], "x": [0]},
        {"label": [1], "x": [10]},
        {"label": [1], "x": [1]},
    ]
    assert [(d["file"], d["line"]) for d in cases.letters(result.dead_letters_path)] == [
        (paths[0], 3),
        (paths[1], 3),
    ]


def test_parquet_rows_become_records(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {
            "label": pa.array([1.0, 0.0, None, 1.0]),
            "count": pa.array([3, None, 1, 2], pa.int32()),
            "site": pa.array(["a", "b", None, None]),
            "score": pa.array([0.5, float("nan"), 1.0, None], pa.float32()),
        }
    )
    path = str(tmp_path / "logs.parquet")
    pq.write_table(table, path, row_group_size=2)
    config = beam_jobs.ImportConfig(
        spec=beam_jobs.parquet_spec(path, label="label"), input_format="parquet", shards=2
    )
    result = beam_jobs.run_import_job([path], config, str(tmp_path / "out"))
    assert cases.read_back(result.files) == [
        {"label": [1.0], "count": [3], "site": [b"a"], "score": [0.5]},
        {"label": [1.0], "count": [2]},
    ]
    assert cases.letters(result.dead_letters_path) == [
        {"file": path, "line": 2, "reason": "column 'score': nan is not finite"},
        {"file": path, "line": 3, "reason": "empty label column 'label'"},
    ]


def test_parquet_files_of_other_columns_are_refused(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    first, second = str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")
    pq.write_table(pa.table({"label": [1], "x": [2]}), first)
    pq.write_table(pa.table({"label": [1], "x": ["2"]}), second)
    config = beam_jobs.ImportConfig(
        spec=beam_jobs.parquet_spec(first, label="label"), input_format="parquet"
    )
    with pytest.raises(ValueError, match=r"b.parquet: its columns .*'x', 'string'.* differ"):
        beam_jobs.run_import_job([first, second], config, str(tmp_path / "out"))


def test_an_out_dir_holding_other_records_is_refused(tmp_path, criteo_file):
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-00000-of-00009.tfrecord").write_bytes(b"")
    with pytest.raises(ValueError, match="already holds other record files"):
        beam_jobs.run_import_job([criteo_file], _criteo(), str(out))
    assert os.listdir(out) == ["part-00000-of-00009.tfrecord"]


@pytest.mark.parametrize(
    "columns, label, message",
    [
        ("a:int,a:float", None, r"Columns \['a'\] are named twice"),
        ("a:int,b:text", None, "Column 'b': unknown kind 'text'"),
        ("a:string,b:int", "a", "The label column 'a' must be int or float"),
        ("a:int,label:int", "a", "Column 'label' would clash with the label 'a'"),
        ("a:int", "b", "The label column 'b' is not among the columns"),
    ],
)
def test_bad_column_specs_are_named(columns, label, message):
    with pytest.raises(ValueError, match=message):
        beam_jobs.ColumnSpec(tuple(beam_jobs.parse_columns(columns)), label=label)
