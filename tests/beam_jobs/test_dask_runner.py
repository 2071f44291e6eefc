"""The FDO job on a 2-worker local Dask cluster gives what the in-process runner gives."""

import json
import os
import socket

import apache_beam as beam
import fdo_cases
import import_cases
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that, equal_to

import beam_jobs
import pipelines

dask_cluster = pytest.importorskip("beam_jobs.dask_cluster")

RUNNER = "beam_jobs.dask_runner.DaskRunner"


@pytest.fixture(scope="module")
def scheduler():
    """A local cluster of two worker processes on 127.0.0.1, shut down after the module."""
    with dask_cluster.dask_cluster(workers=2) as address:
        yield address


def _dask_args(address: str) -> list[str]:
    return [f"--runner={RUNNER}", f"--dask_client_address={address}"]


def _letters(path: str) -> list[dict]:
    with open(path) as file:
        return sorted(
            (json.loads(line) for line in file), key=lambda d: (d["file"], d["record_index"])
        )


@pytest.mark.parametrize("extension", [".array_record", ".tfrecord"])
def test_dask_gives_the_in_process_stats_and_dead_letters(scheduler, tmp_path, extension):
    files, bad = fdo_cases.hand_made_files(str(tmp_path), extension)
    config = fdo_cases.job_config(processes=2, records_per_range=16)
    in_process = beam_jobs.run_fdo_job(config, files, str(tmp_path / "in_process"))
    on_dask = beam_jobs.run_fdo_job(config, files, str(tmp_path / "dask"), _dask_args(scheduler))

    expected, _ = fdo_cases.reference(files, config)
    assert fdo_cases.document(on_dask.stats) == fdo_cases.document(in_process.stats) == expected
    letters = _letters(on_dask.dead_letters_path)
    assert letters == _letters(in_process.dead_letters_path)
    assert sorted((d["file"], d["record_index"]) for d in letters) == sorted(
        (path, index) for path, index, _ in bad
    )
    assert on_dask.counters == in_process.counters
    # Every step ran once: no shard of the dead letters is left behind.
    assert sorted(os.listdir(tmp_path / "dask")) == sorted(
        [os.path.basename(on_dask.stats_path), beam_jobs.DEAD_LETTERS_NAME]
    )


def test_dask_workers_fetch_files_named_by_urls(scheduler, tmp_path):
    files, bad = fdo_cases.hand_made_files(str(tmp_path), ".array_record")
    config = fdo_cases.job_config(processes=2, records_per_range=16)
    in_process = beam_jobs.run_fdo_job(config, files, str(tmp_path / "in_process"))
    url = f"file://{tmp_path}/*.array_record"
    on_dask = beam_jobs.run_fdo_job(config, url, str(tmp_path / "dask"), _dask_args(scheduler))

    assert fdo_cases.document(on_dask.stats) == fdo_cases.document(in_process.stats)
    assert on_dask.counters == in_process.counters
    named = sorted((d["file"], d["record_index"]) for d in _letters(on_dask.dead_letters_path))
    assert named == sorted((f"file://{path}", index) for path, index, _ in bad)


def test_dask_imports_what_the_in_process_runner_imports(scheduler, tmp_path):
    path = str(tmp_path / "day_0.tsv")
    import_cases.write_criteo(path)
    config = beam_jobs.ImportConfig(spec=beam_jobs.criteo_spec(), shards=3, bytes_per_range=120)
    in_process = beam_jobs.run_import_job([path], config, str(tmp_path / "in_process"))
    on_dask = beam_jobs.run_import_job(
        [path], config, str(tmp_path / "dask"), _dask_args(scheduler)
    )

    records = import_cases.read_back(on_dask.files)
    assert records == import_cases.read_back(in_process.files) == import_cases.expected_records()
    # Byte for byte: the Examples' feature maps are serialized in key order
    # whatever the worker process.
    assert list(pipelines.read_records(on_dask.files)) == list(
        pipelines.read_records(in_process.files)
    )
    letters = import_cases.letters(on_dask.dead_letters_path)
    assert letters == import_cases.letters(in_process.dead_letters_path)
    assert letters == import_cases.expected_dead_letters(path)
    # The summaries differ only in the output directory.
    dask_summary, in_process_summary = (
        {**summary, "files": [f["records"] for f in summary["files"]]}
        for summary in (on_dask.summary, in_process.summary)
    )
    assert dask_summary == in_process_summary


class _EveryTagFn(beam.DoFn):
    """Odd numbers to "odd", even ones to the main output; their count at the bundle's end."""

    def start_bundle(self):
        self._seen = 0

    def process(self, number):
        self._seen += 1
        if number % 2:
            yield beam.pvalue.TaggedOutput("odd", number)
        else:
            yield number

    def finish_bundle(self):
        yield beam.pvalue.TaggedOutput(
            "seen", beam.transforms.window.GlobalWindows.windowed_value(self._seen)
        )


def test_tagged_outputs_bundle_ends_and_side_inputs(scheduler):
    options = PipelineOptions(_dask_args(scheduler))
    with beam.Pipeline(RUNNER, options=options) as p:
        numbers = p | beam.Create(range(10))
        split = numbers | beam.ParDo(_EveryTagFn()).with_outputs("odd", "seen", main="even")
        total = split.seen | "Total" >> beam.CombineGlobally(sum)
        shifted = split.odd | beam.Map(lambda n, offset: n + offset, beam.pvalue.AsSingleton(total))
        assert_that(split.even, equal_to([0, 2, 4, 6, 8]), label="even")
        assert_that(shifted, equal_to([11, 13, 15, 17, 19]), label="odd plus the count")


def test_an_unreachable_scheduler_is_named(tmp_path):
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{unused.getsockname()[1]}"
    with pytest.raises(ValueError, match=f"No Dask scheduler answers at {address}"):
        with dask_cluster.dask_cluster(address=address, connect_timeout_s=1):
            pass
