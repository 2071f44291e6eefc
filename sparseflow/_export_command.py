"""`sparseflow export`: a run's newest checkpoint as a folder that serves without training code."""

from __future__ import annotations

import argparse
from pathlib import Path

from sparseflow import _export, _launch
from sparseflow._arguments import (
    add_checkpoint_dir_argument,
    add_config_argument,
    add_devices_argument,
)
from sparseflow._command_config import CommandConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `export` subcommand's arguments."""
    add_config_argument(parser, "the run's YAML config (the checkpoint records its layout only)")
    add_devices_argument(parser)
    add_checkpoint_dir_argument(parser, "the run's checkpoints; the newest that reads is exported")
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help="an empty or new folder: tables, manifest, jax.export program, SavedModel",
    )


def run(args: argparse.Namespace, command_config: CommandConfig) -> None:
    requested = command_config.requested_devices
    if requested is not None:
        _launch.use_cpu_devices(requested)
    exported = _export.export_model(command_config.load(), args.checkpoint_dir, args.out)
    print(f"Exported the checkpoint at step {exported.step}: {exported.path}")
