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
  sparseflow predict --config C --checkpoint-dir D --data GLOB --out FILE [--keep KEY,...]
                     [--fdo DIR] [--devices N]
  sparseflow export --config C --checkpoint-dir D --out DIR [--devices N]
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
import gc
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NamedTuple

from embedding import SparseflowError
from sparseflow import _compilation_cache, _logging, _process
from sparseflow._arguments import subcommand
from sparseflow._command_config import CommandConfig
from sparseflow._version import __version__
from sparseflow.config._run_config import RunConfig

_USER_ERROR_EXIT = 2
_INTERNAL_ERROR_EXIT = 1


class _Command(NamedTuple):
    """A subcommand: its help, and the module with its `add_arguments` and `run`."""

    summary: str
    example: str
    module: str


# Only the chosen command's module is imported: `train` does not load Apache
# Beam, which the FDO and import jobs need.
_COMMANDS = {
    "make-data": _Command(
        "write a synthetic dataset for a config's features",
        "sparseflow make-data --config demo --examples 10000 --out /tmp/data",
        "sparseflow._make_data_command",
    ),
    "demo": _Command(
        "the whole job on a config's synthetic data: make it if missing, run the "
        "FDO job, train pipelined, evaluate AUC on the held-out split",
        "sparseflow demo",
        "sparseflow._demo_command",
    ),
    "stats": _Command(
        "make the config's dataset if missing, then parse and preprocess it, "
        "and summarize every table",
        "sparseflow stats --config demo --batches 20",
        "sparseflow._stats_command",
    ),
    "fdo": _Command(
        "compute a dataset's FDO stats (limits, buffer sizes) with Apache Beam",
        "sparseflow fdo --config demo --runner dask --dask-workers 2 --plot fdo.png",
        "sparseflow._fdo_command",
    ),
    "import": _Command(
        "turn CSV/TSV or Parquet files into sharded records of tf.train.Examples with Apache Beam",
        "sparseflow import --format criteo --input day_0.tsv --out data/criteo --shards 64",
        "sparseflow._import_command",
    ),
    "train": _Command(
        "train the recommender on a dataset, streaming batches through Grain",
        "sparseflow train --config demo --fdo runs/demo/data/fdo --checkpoint-dir ckpt --resume",
        "sparseflow._train_command",
    ),
    "convert-checkpoint": _Command(
        "rewrite a run's newest checkpoint for the mesh of its config (another device count "
        "or partitions per device), without training",
        "sparseflow convert-checkpoint --config demo --devices 4 --checkpoint-dir ckpt --out ckpt4",
        "sparseflow._convert_checkpoint",
    ),
    "predict": _Command(
        "score every record of a dataset, in order, with a run's newest checkpoint, into "
        "Parquet, CSV or JSON Lines",
        "sparseflow predict --config demo --checkpoint-dir runs/demo/demo_run/checkpoints "
        "--data runs/demo/data/eval/arrayrecord --out scores.parquet --keep user_id",
        "sparseflow._predict_command",
    ),
    "export": _Command(
        "write a run's newest checkpoint as a folder that serves without the training code: "
        "one array per table, a jax.export program, a TensorFlow SavedModel",
        "sparseflow export --config demo --checkpoint-dir runs/demo/demo_run/checkpoints "
        "--out export",
        "sparseflow._export_command",
    ),
}


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


def _parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser of `argv`: every command listed, the one `argv` names with its arguments.

    The command is the first argument that is not an option (the top-level
    options take no values).
    """
    parser = argparse.ArgumentParser(
        prog="sparseflow",
        description="Input pipelines and sharded-embedding training for recommenders.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, command in _COMMANDS.items():
        sub = subcommand(commands, name, command.summary, command.example)
        if name == chosen:
            module = importlib.import_module(command.module)
            module.add_arguments(sub)
            sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None, *, owns_process: bool = False) -> int:
    """Runs the command line; returns the exit status (2 on a user error, 1 on a bug).

    `owns_process`: called by the `sparseflow` script (`sparseflow._script`),
    which paused the garbage collector before importing anything: once the
    command's modules are imported, the objects alive are taken out of the
    collector's scans and the collector runs again.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser(argv).parse_args(argv)
    if owns_process:
        _process.freeze_live_objects()
        gc.enable()
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
