"""The import job: CSV/TSV or Parquet files -> sharded record files of `tf.train.Example`s.

    input files -> ranges (byte ranges of text, row groups of Parquet)
      -> CountRows (one pass: rows per range, so every row has a position)
      -> PlanShards (shard s gets rows [s * T // N, (s + 1) * T // N) of T)
      -> WriteShards (each shard reads its rows, parses them, writes its file)
      -> dead letters, and a summary combined from the shards' reports

Records keep the input order: shard files in name order, read one after the
other, give the good rows in file and line order. Every row is parsed once,
by the worker writing its shard; nothing but small plans and per-shard
reports moves between workers.

Outputs in `out_dir`:
  `part-SSSSS-of-NNNNN.array_record` (or `.tfrecord`)  the records
  `dead_letters.jsonl`   one `{"file", "line", "reason"}` object per bad line,
                         in no order (`line` is 1-based; a Parquet row's number)
  `import_summary.json`  lines, records, dead letters, the files and their
                         records, and per column its distinct values

The distinct values are counted exactly: each shard keeps a set per column
and the sets are merged, so memory grows with the distinct values (a Criteo
day's 26 categorical columns hold some tens of millions in all).

Runs on the runners of the FDO job (`beam_jobs.fdo_stats.make_pipeline`): in
process unless the pipeline arguments name a runner, e.g.
`--runner=beam_jobs.dask_runner.DaskRunner --dask_client_address=tcp://HOST:8786`.
The shard files are written with `pipelines.RecordFileWriter` to local paths:
on a cluster, `out_dir` and the inputs must be on a mount every worker sees.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import time
from collections.abc import Sequence

import apache_beam as beam
from apache_beam.metrics import Metrics

import pipelines
from beam_jobs._columns import ColumnSpec, ColumnSpecError
from beam_jobs._import_sources import (
    DEFAULT_BYTES_PER_RANGE,
    InputFormat,
    count_rows,
    input_ranges,
    parquet_spec,
    read_rows,
)
from beam_jobs._import_summary import SummaryFn, write_summary
from beam_jobs._lines import BadLine, LineParser
from beam_jobs._shard_plan import Piece, plan_shards
from beam_jobs._transforms import WriteDeadLetters, redistribute
from beam_jobs.fdo_stats import DEAD_LETTERS_NAME, make_pipeline, pipeline_counters

_log = logging.getLogger(__name__)

IMPORT_METRICS_NAMESPACE = "sparseflow.import"
SUMMARY_NAME = "import_summary.json"
_DEAD_LETTERS = "dead_letters"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImportConfig:
    """What an import reads and writes.

    Attributes:
      spec: the columns (for Parquet: `beam_jobs.parquet_spec` of the schema).
      input_format: text (CSV, TSV) or Parquet.
      delimiter: a text file's field separator.
      header: whether every text file starts with a header line (skipped).
      shards: output files.
      output_format: ArrayRecord or TFRecord.
      bytes_per_range: bytes of text one worker reads at a time (the unit of
        parallelism within a file).
    """

    spec: ColumnSpec
    input_format: InputFormat = InputFormat.TEXT
    delimiter: str = "\t"
    header: bool = False
    shards: int = 1
    output_format: pipelines.RecordFormat = pipelines.RecordFormat.ARRAY_RECORD
    bytes_per_range: int = DEFAULT_BYTES_PER_RANGE

    def __post_init__(self):
        object.__setattr__(self, "input_format", InputFormat(self.input_format))
        object.__setattr__(self, "output_format", pipelines.RecordFormat(self.output_format))
        for name in ("shards", "bytes_per_range"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ColumnSpecError(f"{name} must be an integer >= 1, got {value!r}.")
        LineParser(self.spec, self.delimiter)  # checks the delimiter
        if self.header and self.input_format is InputFormat.PARQUET:
            raise ColumnSpecError(
                "Parquet files have no header line; their schema names the columns."
            )

    def shard_paths(self, out_dir: str) -> list[str]:
        """The output files, in record order."""
        n = self.shards
        ext = self.output_format.extension
        return [os.path.join(out_dir, f"part-{s:05d}-of-{n:05d}{ext}") for s in range(n)]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ImportResult:
    """What a finished import produced.

    Attributes:
      files: the record files, in record order.
      dead_letters_path: the dead-letter file (empty when every line was good).
      summary_path: the summary file.
      summary: the summary, as written.
    """

    files: list[str]
    dead_letters_path: str
    summary_path: str
    summary: dict


class _WriteShardFn(beam.DoFn):
    """A shard's plan -> its record file; a report of it; bad lines as dead letters."""

    def __init__(self, config: ImportConfig, paths: list[str]):
        self._config = config
        self._paths = paths
        self._lines = Metrics.counter(IMPORT_METRICS_NAMESPACE, "lines")
        self._records = Metrics.counter(IMPORT_METRICS_NAMESPACE, "records")
        self._dead_letters = Metrics.counter(IMPORT_METRICS_NAMESPACE, "dead_letters")

    def setup(self):
        self._parser = LineParser(self._config.spec, self._config.delimiter)

    def process(self, plan: tuple[int, list[Piece]]):
        shard, pieces = plan
        config = self._config
        columns = len(config.spec.columns)
        distinct = [set() for _ in range(columns)]
        bad = 0
        with pipelines.RecordFileWriter(self._paths[shard]) as writer:
            for piece in pieces:
                rows = read_rows(piece.input_range, config.input_format, config.header)
                selected = itertools.islice(rows, piece.skip, piece.skip + piece.take)
                for line, row in enumerate(selected, start=piece.first_line):
                    try:
                        values = self._values(row)
                    except BadLine as error:
                        bad += 1
                        yield beam.pvalue.TaggedOutput(
                            _DEAD_LETTERS,
                            {"file": piece.input_range.path, "line": line, "reason": str(error)},
                        )
                        continue
                    writer.write(self._parser.example(values))
                    for seen, value in zip(distinct, values, strict=True):
                        if value is not None:
                            seen.add(value)
        self._lines.inc(writer.count + bad)
        self._records.inc(writer.count)
        self._dead_letters.inc(bad)
        yield {
            "lines": writer.count + bad,
            "records": writer.count,
            "dead_letters": bad,
            "files": [{"path": writer.path, "records": writer.count}],
            "distinct": distinct,
        }

    def _values(self, row) -> list:
        if self._config.input_format is InputFormat.PARQUET:
            self._parser.check_row(row)
            return row
        return self._parser.values(self._parser.fields(row))


class ImportRecords(beam.PTransform):
    """Input files -> shard files, dead letters and summary (written; see the module)."""

    def __init__(self, inputs: list[str], config: ImportConfig, out_dir: str):
        super().__init__()
        self._inputs = list(inputs)
        self._config = config
        self._out_dir = out_dir

    def expand(self, pbegin):
        config = self._config
        ranges = input_ranges(self._inputs, config.input_format, config.bytes_per_range)
        paths = config.shard_paths(self._out_dir)
        counts = (
            pbegin
            | "Start" >> beam.Impulse()
            | "ListRanges" >> beam.FlatMap(lambda _, ranges: ranges, ranges)
            | "DistributeRanges" >> redistribute(lambda r: r.key)
            | "CountRows"
            >> beam.Map(lambda r, c: (r.key, count_rows(r, c.input_format, c.header)), config)
            | "GatherCounts" >> beam.combiners.ToList().without_defaults()
        )
        written = (
            counts
            | "PlanShards" >> beam.FlatMap(plan_shards, ranges, config.shards, config.header)
            | "DistributeShards" >> redistribute(lambda plan: plan[0])
            | "WriteShards"
            >> beam.ParDo(_WriteShardFn(config, paths)).with_outputs(_DEAD_LETTERS, main="reports")
        )
        dead_letters_path = os.path.join(self._out_dir, DEAD_LETTERS_NAME)
        _ = written[_DEAD_LETTERS] | "WriteDeadLetters" >> WriteDeadLetters(dead_letters_path)
        return (
            written.reports
            | "Summarize" >> beam.CombineGlobally(SummaryFn()).without_defaults()
            | "WriteSummary"
            >> beam.Map(
                write_summary,
                os.path.join(self._out_dir, SUMMARY_NAME),
                config.spec,
                self._inputs,
                config.output_format.value,
            )
        )


def run_import_job(
    inputs: Sequence[str],
    config: ImportConfig,
    out_dir: str,
    pipeline_args: Sequence[str] = (),
) -> ImportResult:
    """Imports the input files into `config.shards` record files in `out_dir`.

    Args:
      inputs: the files, in order (CSV/TSV, or Parquet as `config` says).
      config: columns, formats, shards.
      out_dir: a local directory (or a mount every worker sees), created if
        missing.
      pipeline_args: Beam pipeline options (see `run_fdo_job`).

    Returns:
      The files and the summary.

    Raises:
      DataError: no inputs, a missing one, only empty ones, a Parquet file
        whose columns differ from `config.spec`, or an `out_dir` holding
        record files of another import.
    """
    inputs = [os.fspath(path) for path in inputs]
    if not inputs:
        raise pipelines.DataError("No input files given.")
    for path in inputs:
        if not os.path.isfile(path):
            raise pipelines.DataError(f"Input file not found: {path}")
    if all(os.path.getsize(path) == 0 for path in inputs):
        raise pipelines.DataError(f"The input files {inputs} are empty.")
    if config.input_format is InputFormat.PARQUET:
        for path in inputs:
            columns = parquet_spec(path, config.spec.label).columns
            if columns != config.spec.columns:
                raise pipelines.DataError(
                    f"{path}: its columns {[(c.name, c.kind.value) for c in columns]} differ "
                    f"from the import's {[(c.name, c.kind.value) for c in config.spec.columns]}."
                )
    files = config.shard_paths(out_dir)
    _check_out_dir(out_dir, files)
    pipeline = make_pipeline(pipeline_args)
    _ = pipeline | "Import" >> ImportRecords(inputs, config, out_dir)
    start = time.perf_counter()
    result = pipeline.run()
    result.wait_until_finish()
    _log.info(
        "Import of %d files took %.1f s: %s",
        len(inputs),
        time.perf_counter() - start,
        pipeline_counters(result, IMPORT_METRICS_NAMESPACE),
    )
    summary_path = os.path.join(out_dir, SUMMARY_NAME)
    with open(summary_path) as file:
        summary = json.load(file)
    return ImportResult(
        files=files,
        dead_letters_path=os.path.join(out_dir, DEAD_LETTERS_NAME),
        summary_path=summary_path,
        summary=summary,
    )


def _check_out_dir(out_dir: str, files: list[str]) -> None:
    """Creates `out_dir`; refuses one holding record files this import would not overwrite."""
    os.makedirs(out_dir, exist_ok=True)
    expected = {os.path.basename(path) for path in files}
    foreign = sorted(
        name
        for name in os.listdir(out_dir)
        if name.endswith(tuple(fmt.extension for fmt in pipelines.RecordFormat))
        and name not in expected
    )
    if foreign:
        raise pipelines.DataError(
            f"{out_dir} already holds other record files ({foreign[:3]}); remove them or "
            "choose another output directory."
        )
