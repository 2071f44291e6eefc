"""`sparseflow import`: CSV/TSV or Parquet files -> sharded record files of `tf.train.Example`s.

  sparseflow import --input FILE|DIR|GLOB ... --out DIR
                    [--format criteo|csv|tsv|parquet] [--header] [--columns SPEC]
                    [--label NAME] [--delimiter C] [--shards N]
                    [--output-format arrayrecord|tfrecord] [--no-progress]
                    [--runner R ...] [-- other Beam options]

The columns: `--format criteo` fixes them (label, int_1..int_13,
cat_1..cat_26; tab-separated, no header). A CSV/TSV file names them in a
header line (`--header`; `--columns` then gives kinds of some of them) or
`--columns name:kind,...` names them all; kinds are int, float, string, hex.
A Parquet file's schema gives them. The job is `beam_jobs.run_import_job`;
the runner options are the `fdo` command's (`sparseflow._runner_options`).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import threading
from collections.abc import Iterator

import tqdm

import beam_jobs
import pipelines
from sparseflow._arguments import DEFAULT_CONFIG, positive_int
from sparseflow._errors import UsageError
from sparseflow._runner_options import add_runner_arguments, dask_address, pipeline_args

CRITEO = "criteo"
_FORMATS = (CRITEO, "csv", "tsv", "parquet")
_EXTENSION_FORMATS = {".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}
_DELIMITERS = {"csv": ",", "tsv": "\t", CRITEO: "\t"}
_POLL_S = 0.5


def _columns(text: str) -> list[beam_jobs.Column]:
    try:
        return beam_jobs.parse_columns(text)
    except beam_jobs.ColumnSpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `import` subcommand's arguments."""
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="input files: files, directories (their files) or glob patterns, in record order",
    )
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument(
        "--format",
        choices=_FORMATS,
        help="input format (default: from the first file's extension: .csv, .tsv, .parquet)",
    )
    parser.add_argument(
        "--header", action="store_true", help="CSV/TSV: every file starts with a header line"
    )
    parser.add_argument(
        "--columns",
        type=_columns,
        help="CSV/TSV: the columns as name:kind,... (kinds: int, float, string, hex); "
        "with --header, kinds of some header columns (the others are strings)",
    )
    parser.add_argument(
        "--label", help="CSV/TSV/Parquet: the label column (int or float), written as `label`"
    )
    parser.add_argument(
        "--delimiter", help="CSV/TSV: the field separator (default: ',' for csv, tab for tsv)"
    )
    parser.add_argument("--shards", type=positive_int, default=1, help="output files (default: 1)")
    parser.add_argument(
        "--output-format",
        choices=[fmt.value for fmt in pipelines.RecordFormat],
        default=pipelines.RecordFormat.ARRAY_RECORD.value,
        help="record format (default: arrayrecord)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_runner_arguments(parser)
    # The import needs no run config; the default keeps the dispatch in `_cli.main` unchanged.
    parser.set_defaults(config=DEFAULT_CONFIG)


def input_files(entries: list[str]) -> list[str]:
    """Files, directories (their visible files, sorted) and glob patterns (sorted) -> files.

    Raises:
      DataError: an entry that matches no file.
    """
    files = []
    for entry in entries:
        if os.path.isdir(entry):
            names = sorted(name for name in os.listdir(entry) if not name.startswith("."))
            found = [os.path.join(entry, name) for name in names]
        else:
            found = sorted(glob.glob(entry)) if glob.has_magic(entry) else [entry]
        found = [path for path in found if os.path.isfile(path)]
        if not found:
            raise pipelines.DataError(f"No input files match {entry!r}.")
        files.extend(found)
    return files


def import_config(args: argparse.Namespace, files: list[str]) -> beam_jobs.ImportConfig:
    """The job's config from the arguments (the column spec from a header or schema if so asked).

    Raises:
      UsageError: options that do not fit the format.
      DataError: files whose headers differ, or an unreadable one.
    """
    fmt = args.format or _EXTENSION_FORMATS.get(os.path.splitext(files[0])[1].lower())
    if fmt is None:
        raise UsageError(
            f"Cannot tell the format of {files[0]} from its extension: pass --format "
            f"({', '.join(_FORMATS)})."
        )
    common = {"shards": args.shards, "output_format": args.output_format}
    if fmt == CRITEO:
        given = [
            name for name in ("header", "columns", "label", "delimiter") if getattr(args, name)
        ]
        if given:
            raise UsageError(f"--format criteo fixes the columns; drop --{', --'.join(given)}.")
        return beam_jobs.ImportConfig(
            spec=beam_jobs.criteo_spec(), delimiter=_DELIMITERS[CRITEO], **common
        )
    if fmt == "parquet":
        if args.header or args.columns or args.delimiter:
            raise UsageError(
                "A Parquet file's schema gives its columns: drop --header, "
                "--columns and --delimiter."
            )
        spec = beam_jobs.parquet_spec(files[0], args.label)
        return beam_jobs.ImportConfig(
            spec=spec, input_format=beam_jobs.InputFormat.PARQUET, **common
        )
    delimiter = args.delimiter or _DELIMITERS[fmt]
    return beam_jobs.ImportConfig(
        spec=_text_spec(args, files, delimiter), delimiter=delimiter, header=args.header, **common
    )


def _text_spec(args: argparse.Namespace, files: list[str], delimiter: str) -> beam_jobs.ColumnSpec:
    if not args.header:
        if not args.columns:
            raise UsageError(
                "Name the columns: --header (a header line) or --columns name:kind,..."
            )
        return beam_jobs.ColumnSpec(tuple(args.columns), label=args.label)
    headers = {path: beam_jobs.first_line(path) for path in files}
    first = headers[files[0]]
    differing = [path for path, header in headers.items() if header != first]
    if differing:
        raise pipelines.DataError(f"The header of {differing[0]} differs from that of {files[0]}.")
    try:
        names = beam_jobs.split_line(first, delimiter)
    except beam_jobs.BadLine as e:
        raise pipelines.DataError(f"{files[0]}: unreadable header line: {e}") from e
    return beam_jobs.spec_from_names(names, args.columns or (), args.label)


@contextlib.contextmanager
def _shard_progress(paths: list[str], enabled: bool) -> Iterator[None]:
    """A bar of finished shard files (they appear under their names when complete)."""
    bar = tqdm.tqdm(
        total=len(paths), unit="shard", desc="import", disable=None if enabled else True
    )
    stop = threading.Event()

    def poll():
        while not stop.wait(_POLL_S):
            bar.update(sum(map(os.path.exists, paths)) - bar.n)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        bar.update(sum(map(os.path.exists, paths)) - bar.n)
        bar.close()


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def run(args: argparse.Namespace, config=None) -> None:
    """Runs the import; prints what it wrote and the distinct values per column."""
    del config  # the import needs no run config
    files = input_files(args.input)
    job = import_config(args, files)
    with (
        dask_address(args) as address,
        _shard_progress(job.shard_paths(args.out), not args.no_progress),
    ):
        result = beam_jobs.run_import_job(files, job, args.out, pipeline_args(args, address))
    summary = result.summary
    print(
        f"Imported {_count(summary['records'], 'record')} of {_count(summary['lines'], 'line')} "
        f"from {_count(len(files), 'file')} ({_count(summary['dead_letters'], 'dead letter')}) "
        f"into {_count(len(result.files), job.output_format.value + ' file')} in {args.out}."
    )
    print(f"Dead letters: {result.dead_letters_path}")
    print(f"Summary: {result.summary_path}")
    print("Distinct values per column:")
    width = max(len(column["name"]) for column in summary["columns"])
    for column in summary["columns"]:
        print(f"  {column['name']:<{width}}  {column['kind']:<6}  {column['distinct_values']:,}")
