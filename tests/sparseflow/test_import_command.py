"""`sparseflow import`: the import job from the command line."""

import json
import re
import sys
from pathlib import Path

import pytest

import pipelines
from sparseflow import _cli

sys.path.insert(0, str(Path(__file__).parents[1] / "beam_jobs"))
import import_cases as cases  # noqa: E402


def test_import_writes_records_dead_letters_and_a_summary(tmp_path, capsys):
    path = str(tmp_path / "day_0.tsv")
    cases.write_criteo(path)
    out = tmp_path / "out"
    status = _cli.main(
        [
            "import",
            "--format",
            "criteo",
            "--input",
            str(tmp_path),
            "--out",
            str(out),
            "--shards",
            "2",
            "--output-format",
            "tfrecord",
            "--no-progress",
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    expected = cases.expected_records()
    bad = len(cases.CRITEO_LINES) - len(expected)
    assert (
        f"Imported {len(expected)} records of {len(cases.CRITEO_LINES)} lines from 1 file "
        f"({bad} dead letters) into 2 tfrecord files in {out}." in printed
    )
    files = sorted(str(p) for p in out.glob("part-*.tfrecord"))
    assert cases.read_back(files) == expected
    assert cases.letters(out / "dead_letters.jsonl") == cases.expected_dead_letters(path)
    summary = json.loads((out / "import_summary.json").read_text())
    distinct = cases.expected_distinct(expected)
    assert {c["key"]: c["distinct_values"] for c in summary["columns"]} == distinct
    assert f"  cat_9   hex     {distinct['cat_9']}" in printed
    assert pipelines.list_record_files(str(out)) == files


@pytest.mark.parametrize(
    "files, options, message",
    [
        (
            {"a.tsv": "1\t2\n"},
            ["--format", "criteo", "--header"],
            "--format criteo fixes the columns",
        ),
        ({"a.csv": "1,2\n"}, [], "Name the columns: --header"),
        ({"a.dat": "1,2\n"}, [], "Cannot tell the format of"),
        (
            {"a.csv": "x,y\n1,2\n", "b.csv": "x,z\n1,2\n"},
            ["--header"],
            "The header of .*b.csv differs",
        ),
        (
            {"a.csv": "x,y\n1,2\n"},
            ["--header", "--columns", "w:int"],
            r"Columns \['w'\] are given kinds",
        ),
        ({"a.parquet": "not parquet"}, [], "not a readable Parquet file"),
        ({"a.csv": "1;2\n"}, ["--columns", "a,b", "--delimiter", ";;"], "one character"),
        ({"a.csv": "1\n"}, ["--columns", "a", "--label", "a"], "must be int or float"),
    ],
)
def test_bad_options_are_user_errors(tmp_path, capsys, files, options, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    inputs = [str(tmp_path / name) for name in files]
    status = _cli.main(["import", "--input", *inputs, "--out", str(tmp_path / "out"), *options])
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert re.search(message, err)


def test_an_unknown_column_kind_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        _cli.main(["import", "--input", "x.csv", "--out", "o", "--columns", "a:text"])
    assert exit_.value.code == 2
    assert "Column 'a': unknown kind 'text'" in capsys.readouterr().err
