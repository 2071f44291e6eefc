"""The FDO job's stats against the plain-loop reference (`fdo_cases.reference`).

Pipelines run in process on `beam_jobs.make_pipeline` (the FnApiRunner); the
outputs are compared as stats-file documents, so the matchers are Beam's own
`equal_to` (multi-process workers can import it, not this module).
"""

import dataclasses
import json
import os

import apache_beam as beam
import fdo_cases
import pytest
from apache_beam.testing.util import BeamAssertException, assert_that, equal_to

import beam_jobs
import beam_jobs._transforms
import embedding
import pipelines
from beam_jobs import _batches

SYNTHETIC_EXAMPLES = 400


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """Per format, the files of one synthetic dataset (400 examples, 3 shards)."""
    directory = tmp_path_factory.mktemp("synthetic")
    return pipelines.write_synthetic_dataset(
        fdo_cases.DATASET, directory, num_examples=SYNTHETIC_EXAMPLES, seed=3, num_shards=3
    )


def _pipeline(*options: str) -> beam.Pipeline:
    return beam_jobs.make_pipeline(options)


def _stats_documents(stats):
    return stats | "ToJson" >> beam.Map(embedding.FdoStats.to_json) | beam.Map(json.loads)


@pytest.mark.parametrize(
    "fmt, processes, records_per_range",
    [("arrayrecord", 1, 1000), ("tfrecord", 2, 37), ("arrayrecord", 2, 7)],
)
def test_stats_equal_the_plain_loop_on_synthetic_data(synthetic, fmt, processes, records_per_range):
    files = synthetic[fmt]
    config = fdo_cases.job_config(processes=processes, records_per_range=records_per_range)
    expected, dead = fdo_cases.reference(files, config)
    assert not dead
    assert expected["batches"] == SYNTHETIC_EXAMPLES // fdo_cases.BATCH
    with _pipeline() as p:
        outputs = p | beam_jobs.ComputeFdoStats(files, config)
        assert_that(_stats_documents(outputs["stats"]), equal_to([expected]), label="stats")
        assert_that(outputs["dead_letters"], equal_to([]), label="no dead letters")


@pytest.mark.parametrize("mode", ["multi_threading", "multi_processing"])
def test_parallel_workers_give_the_same_stats(synthetic, mode):
    files = synthetic["arrayrecord"]
    config = fdo_cases.job_config(processes=2, records_per_range=50)
    expected, _ = fdo_cases.reference(files, config)
    with _pipeline("--direct_num_workers=2", f"--direct_running_mode={mode}") as p:
        outputs = p | beam_jobs.ComputeFdoStats(files, config)
        assert_that(_stats_documents(outputs["stats"]), equal_to([expected]), label="stats")


def _dead_letters_match(bad_positions):
    """Matches dead letters to `(file, index, kind)`, reasons naming the problem."""

    def check(letters):
        found = sorted((d["file"], d["record_index"]) for d in letters)
        wanted = sorted((path, index) for path, index, _ in bad_positions)
        if found != wanted:
            raise BeamAssertException(f"Dead letters at {found}, expected {wanted}.")
        reasons = {(d["file"], d["record_index"]): d["reason"] for d in letters}
        for path, index, kind in bad_positions:
            word = fdo_cases.BAD_RECORDS[kind][1]
            if word not in reasons[path, index]:
                reason = reasons[path, index]
                raise BeamAssertException(f"{kind}: reason {reason!r} lacks {word!r}.")

    return check


@pytest.mark.parametrize("extension", [".array_record", ".tfrecord"])
def test_hand_made_records_bad_ones_to_dead_letters(tmp_path, extension):
    files, bad = fdo_cases.hand_made_files(str(tmp_path), extension)
    config = fdo_cases.job_config(records_per_range=10)
    expected, dead = fdo_cases.reference(files, config)
    assert sorted(dead) == sorted((path, index) for path, index, _ in bad)
    assert len(bad) == len(fdo_cases.BAD_RECORDS)
    with _pipeline() as p:
        outputs = p | beam_jobs.ComputeFdoStats(files, config)
        assert_that(_stats_documents(outputs["stats"]), equal_to([expected]), label="stats")
        assert_that(outputs["dead_letters"], _dead_letters_match(bad), label="dead letters")


def test_run_fdo_job_writes_stats_and_dead_letters(tmp_path):
    files, bad = fdo_cases.hand_made_files(str(tmp_path), ".tfrecord")
    config = fdo_cases.job_config(processes=2, records_per_range=16)
    expected, _ = fdo_cases.reference(files, config)
    out = str(tmp_path / "fdo")
    result = beam_jobs.run_fdo_job(config, str(tmp_path / "*.tfrecord"), out)

    assert fdo_cases.document(result.stats) == expected
    loaded = embedding.load_fdo_stats(
        out, expected_config_hash=fdo_cases.CONFIG_HASH, expected_geometry=config.geometry
    )
    assert fdo_cases.document(loaded) == expected
    assert os.path.basename(result.stats_path).startswith("fdo_stats-offline-")
    with open(result.dead_letters_path) as file:
        letters = [json.loads(line) for line in file]
    _dead_letters_match(bad)(letters)
    assert sorted(os.listdir(out)) == sorted(
        [os.path.basename(result.stats_path), beam_jobs.DEAD_LETTERS_NAME]
    )
    good = sum(1 for path in files for _ in pipelines.read_records(path)) - len(bad)
    assert result.counters == {
        "records": good + len(bad),
        "bad_records": len(bad),
        "tail_records": good % fdo_cases.BATCH,
        "batches": good // fdo_cases.BATCH,
    }


@pytest.mark.parametrize(
    "pipeline_args",
    [[], ["--direct_num_workers=2", "--direct_running_mode=multi_processing"]],
)
def test_run_fdo_job_in_process_and_in_worker_processes(synthetic, tmp_path, pipeline_args):
    files = synthetic["arrayrecord"]
    config = fdo_cases.job_config(processes=2, records_per_range=50)
    expected, _ = fdo_cases.reference(files, config)
    out = tmp_path / "fdo"
    result = beam_jobs.run_fdo_job(config, files, str(out), pipeline_args)

    assert fdo_cases.document(result.stats) == expected
    assert result.counters == {
        "records": SYNTHETIC_EXAMPLES,
        "bad_records": 0,
        "tail_records": SYNTHETIC_EXAMPLES % fdo_cases.BATCH,
        "batches": SYNTHETIC_EXAMPLES // fdo_cases.BATCH,
    }
    with open(result.dead_letters_path) as file:
        assert file.read() == ""
    # No temporary files are left behind.
    assert sorted(os.listdir(out)) == sorted(
        [os.path.basename(result.stats_path), beam_jobs.DEAD_LETTERS_NAME]
    )


def _count_range_reads(monkeypatch) -> list:
    """The ranges the in-process job reads (`read_range` calls), as they happen."""
    reads = []

    def read_range(record_range):
        reads.append(record_range)
        return _batches.read_range(record_range)

    monkeypatch.setattr(beam_jobs._transforms, "read_range", read_range)
    return reads


def test_without_bad_records_every_range_is_read_once(synthetic, tmp_path, monkeypatch):
    files = synthetic["arrayrecord"]
    config = fdo_cases.job_config(records_per_range=50)
    expected, _ = fdo_cases.reference(files, config)
    reads = _count_range_reads(monkeypatch)
    result = beam_jobs.run_fdo_job(config, files, str(tmp_path / "fdo"))

    assert fdo_cases.document(result.stats) == expected
    ranges = [r for i, path in enumerate(files) for r in _batches.split_file(i, path, 50)]
    assert sorted(reads) == sorted(ranges)


def _files_bad_at_the_end(directory, records_b: int, bad_b: range) -> list[str]:
    """File a: 100 good records; file b: `records_b`, those at `bad_b` bad."""
    bad = [record for record, _ in fdo_cases.BAD_RECORDS.values()]
    records = [
        bad[i % len(bad)] if i in bad_b else fdo_cases.example(100 + i) for i in range(records_b)
    ]
    a = [fdo_cases.example(row) for row in range(100)]
    return [
        fdo_cases.write_records(str(directory / "a.array_record"), a),
        fdo_cases.write_records(str(directory / "b.array_record"), records),
    ]


@pytest.mark.parametrize(
    "records_b, bad_b, batches, read_once",
    [
        # 136 good records: the last range, [132, 140), holds only tail records
        # either way, so the first pass's stats stand.
        (40, range(36, 40), 4, True),
        # 127 good records: 3 batches, not 4; as if all were good, a's last
        # range (good records [96, 100)) and b's would be in batch 3.
        (30, range(27, 30), 3, False),
        # The ranges after file b's first bad one start earlier than assumed.
        (40, range(20, 33), 3, False),
    ],
)
@pytest.mark.parametrize(
    "pipeline_args", [[], ["--direct_num_workers=2", "--direct_running_mode=multi_threading"]]
)
def test_bad_records_at_the_end(
    tmp_path, monkeypatch, records_b, bad_b, batches, read_once, pipeline_args
):
    files = _files_bad_at_the_end(tmp_path, records_b, bad_b)
    config = fdo_cases.job_config(processes=2, records_per_range=16)
    expected, dead = fdo_cases.reference(files, config)
    assert len(dead) == len(bad_b)
    reads = _count_range_reads(monkeypatch)
    result = beam_jobs.run_fdo_job(config, files, str(tmp_path / "fdo"), pipeline_args)

    assert fdo_cases.document(result.stats) == expected
    good = 100 + records_b - len(bad_b)
    assert result.counters == {
        "records": 100 + records_b,
        "bad_records": len(bad_b),
        "tail_records": good - batches * fdo_cases.BATCH,
        "batches": batches,
    }
    ranges = [r for i, path in enumerate(files) for r in _batches.split_file(i, path, 16)]
    assert set(reads) == set(ranges)
    assert (len(reads) == len(ranges)) == read_once


@pytest.mark.parametrize("order", [None, beam_jobs.TrainingOrder(shuffle_seed=3, epochs=2)])
def test_run_fdo_job_without_a_whole_batch_is_an_error(tmp_path, order):
    path = fdo_cases.write_records(
        str(tmp_path / "small.array_record"), [fdo_cases.example(row) for row in range(20)]
    )
    config = dataclasses.replace(fdo_cases.job_config(), training_order=order)
    with pytest.raises(ValueError, match="20 good records .* no whole global batch of 32"):
        beam_jobs.run_fdo_job(config, path, str(tmp_path / "fdo"))


def test_run_fdo_job_names_a_corrupt_file(tmp_path):
    path = tmp_path / "broken.tfrecord"
    fdo_cases.write_records(str(path), [fdo_cases.example(row) for row in range(40)])
    path.write_bytes(path.read_bytes()[:-25])
    with pytest.raises(Exception, match="broken.tfrecord"):
        beam_jobs.run_fdo_job(fdo_cases.job_config(), str(path), str(tmp_path / "fdo"))
