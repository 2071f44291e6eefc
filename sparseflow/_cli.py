"""The `sparseflow` command line.

  sparseflow make-data --config C [--out DIR] [--examples N] [--seed S]
                       [--shards K] [--formats arrayrecord,tfrecord]
  sparseflow demo [--config C]
  sparseflow stats [--config C] [--batches N]
  sparseflow fdo --config C [--data FILES] [--out DIR] [--runner R] [--plot out.png]
                 [-- Beam options]
  sparseflow train --config C [--data GLOB] [--eval-data GLOB] [--steps N]
                   [--pipelined | --no-pipelined] [--fdo DIR] [--checkpoint-dir D]
                   [--resume] [--metrics-dir D] [--num-processes P]
                   [--agreement-tls-dir D] [--agreement-secret-file F]
  sparseflow --version

`--config` takes a YAML file or the name of a shipped config (`demo`,
`benchmark`); a shipped config's relative paths (its dataset under
`runs/<name>/data`) start from the working directory.

A user error (a bad config, a missing file, a bad record, input the
preprocessing rejects) prints one `error: ...` line and exits with status 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import pipelines
from sparseflow import _demo, _fdo_command, _launch, _stats_report, _train_command
from sparseflow._arguments import non_negative_int, positive_int, subcommand
from sparseflow._config import RunConfig, load_config
from sparseflow._shipped_configs import shipped_config
from sparseflow._version import __version__

DEFAULT_CONFIG = "demo"
_DEFAULT_CONFIG_HELP = "a YAML file or a shipped config's name (default: demo)"
_USER_ERROR_EXIT = 2


def load_cli_config(config: str | os.PathLike) -> RunConfig:
    """The config `--config` names: a YAML file, else a shipped config by name.

    A shipped config lives inside the installed package, so its relative
    paths start from the working directory instead of its own folder.

    Raises:
      ValueError: a bare name that no shipped config has (the message lists
        them); ConfigError for a file, as `load_config`.
    """
    text = os.fspath(config)
    if os.path.exists(text) or os.sep in text or text.endswith((".yaml", ".yml")):
        return load_config(text)
    return load_config(shipped_config(text), relative_to=Path.cwd())


def _formats(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


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
        help="the run's YAML config, or a shipped config's name (demo, benchmark)",
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
        default=("arrayrecord", "tfrecord"),
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
    stats.set_defaults(run=_run_stats)

    fdo = subcommand(
        commands,
        "fdo",
        "compute a dataset's FDO stats (limits, buffer sizes) with Apache Beam",
        "sparseflow fdo --config demo --runner dask --dask-workers 2 --plot fdo.png",
    )
    _fdo_command.add_arguments(fdo)
    fdo.set_defaults(run=_fdo_command.run)

    train = subcommand(
        commands,
        "train",
        "train the recommender on a dataset, streaming batches through Grain",
        "sparseflow train --config demo --fdo runs/demo/data/fdo --checkpoint-dir ckpt --resume",
    )
    _train_command.add_arguments(train)
    train.set_defaults(run=_train_command.run)
    return parser


def _make_data(args: argparse.Namespace, config: RunConfig) -> None:
    described = _stats_report.synthetic(config, "make-data")
    out = args.out or config.dataset.dir
    examples = args.examples or described.examples
    files = pipelines.write_synthetic_dataset(
        described.dataset,
        out,
        num_examples=examples,
        seed=config.seed if args.seed is None else args.seed,
        num_shards=args.shards or described.shards,
        formats=args.formats,
    )
    print(f"Wrote {examples:,} synthetic examples to {out}:")
    for fmt, paths in files.items():
        print(f"  {fmt}: {len(paths)} files ({Path(paths[0]).parent})")


def _run_demo(args: argparse.Namespace, config: RunConfig) -> None:
    _launch.use_cpu_devices(config.mesh.devices)
    print(_demo.run(config, progress=not args.no_progress))


def _run_stats(args: argparse.Namespace, config: RunConfig) -> None:
    if not _stats_report.dataset_exists(config):
        print(
            f"Writing the synthetic dataset "
            f"({_stats_report.synthetic(config, 'stats').examples:,} examples) "
            f"to {config.dataset.dir} ..."
        )
        _stats_report.make_dataset(config)
    result = _stats_report.run_stats(config, max_batches=args.batches)
    print(
        f"{config.name}: {config.mesh.devices} devices x "
        f"{config.mesh.partitions_per_device} partitions, global batch "
        f"{config.global_batch_size}"
    )
    print(_stats_report.format_report(result))


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (2 on a user error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv
    # force: Beam's import already gave the root logger a handler (a warning
    # it logs calls basicConfig), which would otherwise keep its level and format.
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        force=True,
    )
    try:
        args.run(args, load_cli_config(args.config))
    # ConfigError, BadRecordError and the preprocessing's errors are ValueErrors.
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return _USER_ERROR_EXIT
    return 0
