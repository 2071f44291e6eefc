"""`sparseflow export`: a run's newest checkpoint as a folder that serves without training code."""

from __future__ import annotations

import argparse

from sparseflow import _export, _launch
from sparseflow._arguments import add_checkpoint_arguments, add_out_argument
from sparseflow._command_config import CommandConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `export` subcommand's arguments."""
    add_checkpoint_arguments(
        parser,
        "the run's YAML config (the checkpoint records its layout only)",
        "the run's checkpoints; the newest that reads is exported",
    )
    add_out_argument(
        parser, "an empty or new folder: tables, manifest, jax.export program, SavedModel"
    )


def run(args: argparse.Namespace, command_config: CommandConfig) -> None:
    requested = command_config.requested_devices
    if requested is not None:
        _launch.use_cpu_devices(requested)
    exported = _export.export_model(command_config.load(), args.checkpoint_dir, args.out)
    print(f"Exported the checkpoint at step {exported.step}: {exported.path}")
