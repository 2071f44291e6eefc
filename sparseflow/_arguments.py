"""Argument types and conventions every `sparseflow` subcommand shares."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparseflow._shipped_configs import shipped_config_names

# The config of a command run without `--config`.
DEFAULT_CONFIG = "demo"


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def common_options() -> argparse.ArgumentParser:
    """Options accepted after the subcommand as before it (`sparseflow train -v`).

    Their default is left out, so that `sparseflow -v train` keeps the value
    the top-level parser set.
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log progress (INFO)",
    )
    return parser


def subcommand(
    commands, name: str, summary: str, example: str, parents=()
) -> argparse.ArgumentParser:
    """A subcommand with a one-line description and an example in its help."""
    return commands.add_parser(
        name,
        help=summary,
        description=summary[0].upper() + summary[1:] + ".",
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common_options(), *parents],
    )


def add_devices_argument(parser: argparse.ArgumentParser) -> None:
    """`--devices N`: the mesh's device count in place of the config's `mesh.devices`."""
    parser.add_argument(
        "--devices",
        type=positive_int,
        metavar="N",
        help="devices of the mesh, in place of the config's mesh.devices (an integer, or auto: "
        "the devices JAX sees); on CPU, N simulated devices",
    )


def add_compilation_cache_argument(parser: argparse.ArgumentParser) -> None:
    """`--no-compilation-cache`, for the commands that compile."""
    parser.add_argument(
        "--no-compilation-cache",
        dest="compilation_cache",
        action="store_false",
        help="compile every program afresh, neither reading nor writing JAX's persistent "
        "compilation cache (default: on, in $SPARSEFLOW_COMPILATION_CACHE or "
        "~/.cache/sparseflow/jax-compilation-cache)",
    )


def add_config_argument(
    parser: argparse.ArgumentParser, what: str = "the run's YAML config"
) -> None:
    """`--config C`, required: a YAML file or a shipped config's name."""
    parser.add_argument(
        "--config",
        type=Path,
        required=True,
        help=f"{what}, or a shipped config's name ({', '.join(shipped_config_names())})",
    )


def add_optional_config_argument(parser: argparse.ArgumentParser) -> None:
    """`--config C`, the shipped demo config when left out."""
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help=f"a YAML file or a shipped config's name ({', '.join(shipped_config_names())}; "
        f"default: {DEFAULT_CONFIG})",
    )


def add_checkpoint_arguments(
    parser: argparse.ArgumentParser, config: str, checkpoint_dir: str
) -> None:
    """`--config C` and `--checkpoint-dir D`, required, and `--devices N`: a run's
    config and checkpoints, which the command only reads, and the mesh it reads them for."""
    add_config_argument(parser, config)
    add_devices_argument(parser)
    parser.add_argument("--checkpoint-dir", type=Path, required=True, help=checkpoint_dir)


def add_out_argument(
    parser: argparse.ArgumentParser, what: str, parse: Callable[[str], Any] = Path
) -> None:
    """`--out`, required: where the command writes, read by `parse`."""
    parser.add_argument("--out", type=parse, required=True, help=what)
