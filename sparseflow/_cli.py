"""The `sparseflow` command line.

  sparseflow make-data --config C [--out DIR] [--examples N] [--seed S]
                       [--shards K] [--formats arrayrecord,tfrecord]
  sparseflow demo [--config C] [--devices N] [--no-compilation-cache]
  sparseflow stats [--config C] [--batches N] [--devices N]
  sparseflow fdo --config C [--data FILES] [--out DIR] [--runner R] [--plot out.png]
                 [--devices N] [-- Beam options]
  sparseflow import --input FILES --out DIR [--format criteo|csv|tsv|parquet]
                    [--header] [--columns SPEC] [--label NAME] [--shards N]
                    [--output-format arrayrecord|tfrecord] [--runner R]
  sparseflow train --config C [--data GLOB] [--eval-data GLOB] [--steps N]
                   [--pipelined | --no-pipelined] [--fdo DIR] [--checkpoint-dir D]
                   [--resume] [--metrics-dir D] [--num-processes P] [--devices N]
                   [--no-compilation-cache] [--input-timeout SECONDS]
                   [--agreement-tls-dir D] [--agreement-secret-file F]
  sparseflow convert-checkpoint --config C [--devices N] --checkpoint-dir D --out DIR
  sparseflow --version

`--config` takes a YAML file or the name of a shipped config (`demo`,
`benchmark`, `criteo`); a shipped config's relative paths (its dataset under
`runs/<name>`) start from the working directory. `--devices N` takes the
place of the config's `mesh.devices` (an integer, or `auto`: the devices JAX
sees). `train` and `demo` keep their compiled programs in JAX's persistent
compilation cache (`sparseflow._compilation_cache`).

A user error (a `SparseflowError`: a bad config, a missing or bad data file,
a corrupt FDO stats file, options that do not go together) prints one
`error: ...` line, its notes after it, and exits with status 2. Any other
exception is a bug: it prints one `internal error: ...` line and exits with
status 1, or, with `--verbose`, raises with its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import pipelines
from embedding import SparseflowError
from sparseflow import (
    _compilation_cache,
    _convert_checkpoint,
    _demo,
    _fdo_command,
    _import_command,
    _launch,
    _logging,
    _stats_report,
    _train_command,
)
from sparseflow._arguments import (
    add_compilation_cache_argument,
    add_devices_argument,
    non_negative_int,
    positive_int,
    subcommand,
)
from sparseflow._command_config import CommandConfig
from sparseflow._config import RunConfig
from sparseflow._config_mesh import devices_noun
from sparseflow._errors import UsageError
from sparseflow._version import __version__

DEFAULT_CONFIG = "demo"
_DEFAULT_CONFIG_HELP = "a YAML file or a shipped config's name (default: demo)"
_USER_ERROR_EXIT = 2
_INTERNAL_ERROR_EXIT = 1


def load_cli_config(config: str | os.PathLike, devices: int | None = None) -> RunConfig:
    """The config `--config` names: a YAML file, else a shipped config by name.

    A shipped config lives inside the installed package, so its relative
    paths start from the working directory instead of its own folder.
    `devices` (`--devices`) takes the place of `mesh.devices`.

    Raises:
      UsageError: a bare name that no shipped config has (the message lists
        them); ConfigError for a file, as `load_config`.
    """
    return CommandConfig(config, devices).load()


_RECORD_FORMATS = ("arrayrecord", "tfrecord")


def _formats(text: str) -> tuple[str, ...]:
    """An argparse type: comma-separated record formats, each known and named once."""
    formats = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(set(formats) - set(_RECORD_FORMATS))
    if unknown or not formats or len(set(formats)) != len(formats):
        raise argparse.ArgumentTypeError(
            f"must name each of {', '.join(_RECORD_FORMATS)} at most once, and at least one; "
            f"got {text!r}"
        )
    return formats


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparseflow",
        description="Input pipelines and sharded-embedding training for recommenders.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    make = subcommand(
        commands,
        "make-data",
        "write a synthetic dataset for a config's features",
        "sparseflow make-data --config demo --examples 10000 --out /tmp/data",
    )
    make.add_argument(
        "--config",
        type=Path,
        required=True,
        help="the run's YAML config, or a shipped config's name (demo, benchmark, criteo)",
    )
    make.add_argument(
        "--out", type=Path, help="output directory (default: the config's dataset.dir)"
    )
    make.add_argument(
        "--examples", type=positive_int, help="examples (default: the config's synthetic.examples)"
    )
    make.add_argument("--seed", type=non_negative_int, help="seed (default: the config's seed)")
    make.add_argument(
        "--shards", type=positive_int, help="files per format (default: synthetic.shards)"
    )
    make.add_argument(
        "--formats",
        type=_formats,
        default=_RECORD_FORMATS,
        help="comma-separated record formats (default: arrayrecord,tfrecord)",
    )
    make.set_defaults(run=_make_data)

    demo = subcommand(
        commands,
        "demo",
        "the whole job on a config's synthetic data: make it if missing, run the "
        "FDO job, train pipelined, evaluate AUC on the held-out split",
        "sparseflow demo",
    )
    demo.add_argument("--config", default=DEFAULT_CONFIG, help=_DEFAULT_CONFIG_HELP)
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_devices_argument(demo)
    add_compilation_cache_argument(demo)
    demo.set_defaults(run=_run_demo)

    stats = subcommand(
        commands,
        "stats",
        "make the config's dataset if missing, then parse and preprocess it, "
        "and summarize every table",
        "sparseflow stats --config demo --batches 20",
    )
    stats.add_argument("--config", default=DEFAULT_CONFIG, help=_DEFAULT_CONFIG_HELP)
    stats.add_argument(
        "--batches", type=positive_int, help="stop after N global batches (default: one pass)"
    )
    add_devices_argument(stats)
    stats.set_defaults(run=_run_stats)

    fdo = subcommand(
        commands,
        "fdo",
        "compute a dataset's FDO stats (limits, buffer sizes) with Apache Beam",
        "sparseflow fdo --config demo --runner dask --dask-workers 2 --plot fdo.png",
    )
    _fdo_command.add_arguments(fdo)
    fdo.set_defaults(run=_fdo_command.run)

    import_ = subcommand(
        commands,
        "import",
        "turn CSV/TSV or Parquet files into sharded records of tf.train.Examples with Apache Beam",
        "sparseflow import --format criteo --input day_0.tsv --out data/criteo --shards 64",
    )
    _import_command.add_arguments(import_)
    # The import needs no run config; the default keeps `main` unchanged.
    import_.set_defaults(run=_import_command.run, config=DEFAULT_CONFIG)

    train = subcommand(
        commands,
        "train",
        "train the recommender on a dataset, streaming batches through Grain",
        "sparseflow train --config demo --fdo runs/demo/data/fdo --checkpoint-dir ckpt --resume",
    )
    _train_command.add_arguments(train)
    train.set_defaults(run=_train_command.run)

    convert = subcommand(
        commands,
        "convert-checkpoint",
        "rewrite a run's newest checkpoint for the mesh of its config (another device count "
        "or partitions per device), without training",
        "sparseflow convert-checkpoint --config demo --devices 4 --checkpoint-dir ckpt --out ckpt4",
    )
    _convert_checkpoint.add_arguments(convert)
    convert.set_defaults(run=_convert_checkpoint.run)
    return parser


def _make_data(args: argparse.Namespace, command_config: CommandConfig) -> None:
    config = command_config.load()
    described = _stats_report.synthetic(config, "make-data")
    out = args.out or config.dataset.dir
    examples = args.examples or described.examples
    shards = args.shards or described.shards
    if shards > examples:
        raise UsageError(
            f"{shards} shards cannot each hold one of {examples} examples; lower --shards "
            "(or synthetic.shards) or raise --examples."
        )
    files = pipelines.write_synthetic_dataset(
        described.dataset,
        out,
        num_examples=examples,
        seed=config.seed if args.seed is None else args.seed,
        num_shards=shards,
        formats=args.formats,
    )
    print(f"Wrote {examples:,} synthetic examples to {out}:")
    for fmt, paths in files.items():
        print(f"  {fmt}: {len(paths)} files ({Path(paths[0]).parent})")


def _run_demo(args: argparse.Namespace, command_config: CommandConfig) -> None:
    if command_config.requested_devices is not None:
        _launch.use_cpu_devices(command_config.requested_devices)
    print(_demo.run(command_config.load(), progress=not args.no_progress))


def _run_stats(args: argparse.Namespace, command_config: CommandConfig) -> None:
    config = command_config.load()
    if not _stats_report.dataset_exists(config):
        print(
            f"Writing the synthetic dataset "
            f"({_stats_report.synthetic(config, 'stats').examples:,} examples) "
            f"to {config.dataset.dir} ..."
        )
        _stats_report.make_dataset(config)
    result = _stats_report.run_stats(config, max_batches=args.batches)
    print(
        f"{config.name}: {devices_noun(config.mesh.devices)} x "
        f"{config.mesh.partitions_per_device} partitions, global batch "
        f"{config.global_batch_size}"
    )
    print(_stats_report.format_report(result))


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (2 on a user error, 1 on a bug)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv
    _logging.configure(verbose=args.verbose)
    try:
        if hasattr(args, "compilation_cache"):
            # Before anything compiles: JAX decides whether to use the cache at its first compile.
            if args.compilation_cache:
                _compilation_cache.enable()
            else:
                _compilation_cache.disable()
        args.run(args, CommandConfig(args.config, getattr(args, "devices", None)))
    except SparseflowError as error:
        print(f"error: {' '.join([str(error), *getattr(error, '__notes__', ())])}", file=sys.stderr)
        return _USER_ERROR_EXIT
    except Exception as error:
        if args.verbose:
            raise
        print(
            f"internal error: {type(error).__name__}: {error}\n"
            "This is a bug in sparseflow; rerun with --verbose for its traceback.",
            file=sys.stderr,
        )
        return _INTERNAL_ERROR_EXIT
    return 0
