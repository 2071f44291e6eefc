"""`sparseflow predict`: score every record of a dataset with a run's newest checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from sparseflow import _launch, _predict, _predictions_file
from sparseflow._arguments import add_checkpoint_arguments, add_out_argument
from sparseflow._command_config import CommandConfig
from sparseflow._errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `predict` subcommand's arguments."""
    add_checkpoint_arguments(
        parser,
        "the run's YAML config",
        "the run's checkpoints; the newest that reads scores (only read)",
    )
    parser.add_argument(
        "--data", required=True, help="ArrayRecord files, directories or globs to score"
    )
    add_out_argument(
        parser, "the rows: score, label, kept keys; .parquet, .csv or .jsonl", _output_file
    )
    parser.add_argument(
        "--keep",
        type=lambda text: [key for key in text.split(",") if key],
        default=[],
        metavar="KEY,...",
        help="record keys whose values go with each row (e.g. a request id)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        help="records per forward (default: the config's global_batch_size); a multiple of "
        "devices x partitions_per_device",
    )
    parser.add_argument(
        "--fdo",
        type=Path,
        help="the FDO output whose dense moments standardize dense keys (only for a config "
        "that standardizes some)",
    )


def _output_file(text: str) -> Path:
    """An argparse type: a path whose extension names an output format."""
    try:
        return _predictions_file.check_path(text)
    except UsageError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def run(args: argparse.Namespace, command_config: CommandConfig) -> None:
    requested = command_config.requested_devices
    if requested is not None:
        _launch.use_cpu_devices(requested)
    options = _predict.PredictOptions(
        checkpoint_dir=args.checkpoint_dir,
        data=args.data,
        keep=args.keep,
        fdo_dir=args.fdo,
        batch_size=args.batch_size,
    )
    predictions = _predict.predict(command_config.load(), options)
    path = _predictions_file.write_predictions(predictions, args.out)
    skipped = (
        f", {len(predictions.bad_records)} bad records skipped" if predictions.bad_records else ""
    )
    print(
        f"Scored {predictions.scores.size - len(predictions.bad_records):,} records with the "
        f"checkpoint at step {predictions.step}{skipped}: {path}"
    )
