"""`sparseflow demo`: the whole job on a config's synthetic data (`sparseflow._demo`)."""

from __future__ import annotations

import argparse

from sparseflow import _demo, _launch
from sparseflow._arguments import (
    add_compilation_cache_argument,
    add_devices_argument,
    add_optional_config_argument,
)
from sparseflow._command_config import CommandConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `demo` subcommand's arguments."""
    add_optional_config_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_devices_argument(parser)
    add_compilation_cache_argument(parser)


def run(args: argparse.Namespace, command_config: CommandConfig) -> None:
    if command_config.requested_devices is not None:
        _launch.use_cpu_devices(command_config.requested_devices)
    print(_demo.run(command_config.load(), progress=not args.no_progress))
