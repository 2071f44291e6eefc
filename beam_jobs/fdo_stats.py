"""The offline FDO statistics job (docs/design.md section 8).

Reads a dataset of `tf.train.Example` records (ArrayRecord or TFRecord),
forms the global batches training draws (its shuffle over its epochs, bad
records' rows filled as training fills them; see `beam_jobs._training_batches`)
or, without a training order, the good records' batches in file order (see
`beam_jobs._batches`), lays every host's share of
every batch out with the online preprocessing, and writes per stacked table
the maxima per partition, percentiles of the per-batch maxima, a histogram
of the per-partition max ids and per logical table the id frequencies, as
an FDO stats file (`embedding.FdoStats`; format in `embedding.fdo._file`).

Outputs in `out_dir`:
  `fdo_stats-offline-<time_ns>.json`  the stats (load with
                                      `embedding.load_fdo_stats(out_dir, ...)`)
  `dead_letters.jsonl`                one `{"file", "record_index", "reason"}`
                                      object per bad record, in no order
  `dense_moments.json`                mean and std of the standardized dense
                                      keys (`config.moments_schema`; see
                                      `beam_jobs._dense_moments`)

Runs in process on Beam's FnApiRunner (the engine of Beam's DirectRunner for
batch pipelines) unless the pipeline arguments name another runner: on a Dask
cluster with `--runner=beam_jobs.dask_runner.DaskRunner
--dask_client_address=tcp://HOST:8786` (see `beam_jobs.dask_cluster`), or on
`FlinkRunner`, `SparkRunner`, `DataflowRunner` with their usual options;
`--direct_num_workers N --direct_running_mode multi_processing` (or
`multi_threading`) spreads the in-process run over local processes (or threads).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.portability.api import beam_provision_api_pb2
from apache_beam.runners.portability.fn_api_runner import fn_runner
from apache_beam.runners.portability.portable_runner import JobServiceHandle

import embedding
import pipelines
from beam_jobs._job_config import FdoJobConfig
from beam_jobs._record_urls import list_files
from beam_jobs._state_sampling import short_state_sampling
from beam_jobs._transforms import (
    METRICS_NAMESPACE,
    ComputeFdoStats,
    WriteDeadLetters,
    WriteFdoStatsFile,
    write_json,
)
from pipelines import DENSE_MOMENTS_NAME

_log = logging.getLogger(__name__)

DEAD_LETTERS_NAME = "dead_letters.jsonl"
STATS_SOURCE = "offline"


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class FdoJobResult:
    """What a finished FDO job produced.

    Attributes:
      stats_path: the stats file.
      dead_letters_path: the dead-letter file (empty when no record was bad).
      stats: the stats, as written.
      counters: the job's Beam counters: `records`, `bad_records`,
        `tail_records` (good records after the last whole batch), `batches`.
    """

    stats_path: str
    dead_letters_path: str
    stats: embedding.FdoStats
    counters: Mapping[str, int]


def make_pipeline(pipeline_args: Sequence[str] = ()) -> beam.Pipeline:
    """A pipeline for the arguments; in process (Beam's FnApiRunner) unless a runner is named.

    Beam's default runner, and its DirectRunner too, first try Prism, a
    separate binary they download from the network; the DirectRunner runs a
    batch pipeline on the FnApiRunner when that fails. The FnApiRunner is
    taken directly: no network, no Prism job server, no extra translation of
    the pipeline. It reads the `--direct_*` options as the DirectRunner does.
    """
    options = PipelineOptions(list(pipeline_args))
    runner = None if options.view_as(StandardOptions).runner else _in_process_runner(options)
    return beam.Pipeline(runner=runner, options=options)


def _in_process_runner(options: PipelineOptions) -> fn_runner.FnApiRunner:
    """The FnApiRunner as the DirectRunner sets it up (its workers get the options)."""
    encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
    provision_info = fn_runner.ExtendedProvisionInfo(
        beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded)
    )
    return fn_runner.FnApiRunner(provision_info=provision_info)


def run_fdo_job(
    config: FdoJobConfig,
    data: str | Sequence[str],
    out_dir: str,
    pipeline_args: Sequence[str] = (),
) -> FdoJobResult:
    """Computes the FDO stats of a dataset and writes them to `out_dir`.

    Args:
      config: the run (specs, record layout, geometry, config hash).
      data: record files: a file, directory or glob pattern, or a list of them
        (see `pipelines.list_record_files`), read in the listed order; each
        may be an fsspec URL (`gs://bucket/logs/*.tfrecord`), whose files the
        workers fetch whole.
      out_dir: output directory (local or any Beam filesystem, e.g. gs://...).
      pipeline_args: Beam pipeline options, e.g. `["--direct_num_workers=2",
        "--direct_running_mode=multi_processing"]`,
        `["--runner=beam_jobs.dask_runner.DaskRunner",
        "--dask_client_address=tcp://host:8786"]` or `["--runner=FlinkRunner",
        "--flink_master=host:8081"]`.

    Returns:
      The paths, the stats and the counters.

    Raises:
      DataError: no record files, a corrupt file, or fewer good records than
        one global batch.
    """
    files = list_files(data)
    if not FileSystems.exists(out_dir):
        FileSystems.mkdirs(out_dir)
    stats_path = FileSystems.join(out_dir, embedding.fdo_stats_file_name(STATS_SOURCE))
    dead_letters_path = FileSystems.join(out_dir, DEAD_LETTERS_NAME)
    pipeline = make_pipeline(pipeline_args)
    outputs = pipeline | "FdoStats" >> ComputeFdoStats(files, config)
    _ = outputs["stats"] | "WriteStats" >> WriteFdoStatsFile(stats_path)
    _ = outputs["dead_letters"] | "WriteDeadLetters" >> WriteDeadLetters(dead_letters_path)
    if "dense_moments" in outputs:
        moments_path = FileSystems.join(out_dir, DENSE_MOMENTS_NAME)
        _ = outputs["dense_moments"] | "WriteDenseMoments" >> beam.Map(write_json, moments_path)
    start = time.perf_counter()
    in_process = isinstance(pipeline.runner, fn_runner.FnApiRunner)
    with short_state_sampling() if in_process else contextlib.nullcontext():
        result = pipeline.run()
        result.wait_until_finish()
    counters = pipeline_counters(result, METRICS_NAMESPACE)
    _log.info(
        "FDO job over %d files took %.1f s: %s", len(files), time.perf_counter() - start, counters
    )
    if not FileSystems.exists(stats_path):
        good = counters.get("records", 0) - counters.get("bad_records", 0)
        raise pipelines.DataError(
            f"{data}: {good} good records (of {counters.get('records', 0)}) make no whole "
            f"global batch of {config.geometry.global_batch_size}; no stats were written."
        )
    with FileSystems.open(stats_path) as file:
        stats = embedding.FdoStats.from_json(file.read().decode(), source=stats_path)
    return FdoJobResult(
        stats_path=stats_path, dead_letters_path=dead_letters_path, stats=stats, counters=counters
    )


def pipeline_counters(result: beam.runners.runner.PipelineResult, namespace: str) -> dict[str, int]:
    """A finished job's counters in `namespace`, summed over steps (committed where known)."""
    query = result.metrics().query(MetricsFilter().with_namespace(namespace))
    counters: dict[str, int] = {}
    for counter in query["counters"]:
        value = counter.committed if counter.committed is not None else counter.attempted
        counters[counter.key.metric.name] = counters.get(counter.key.metric.name, 0) + value
    return counters
