"""Argument types and conventions every `sparseflow` subcommand shares."""

from __future__ import annotations

import argparse


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
