"""`sparseflow make-data`: a synthetic dataset for a config's features."""

from __future__ import annotations

import argparse
from pathlib import Path

import pipelines
from sparseflow import _datasets
from sparseflow._arguments import add_config_argument, non_negative_int, positive_int
from sparseflow._command_config import CommandConfig
from sparseflow._errors import UsageError

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `make-data` subcommand's arguments."""
    add_config_argument(parser)
    parser.add_argument(
        "--out", type=Path, help="output directory (default: the config's dataset.dir)"
    )
    parser.add_argument(
        "--examples", type=positive_int, help="examples (default: the config's synthetic.examples)"
    )
    parser.add_argument("--seed", type=non_negative_int, help="seed (default: the config's seed)")
    parser.add_argument(
        "--shards", type=positive_int, help="files per format (default: synthetic.shards)"
    )
    parser.add_argument(
        "--formats",
        type=_formats,
        default=_RECORD_FORMATS,
        help="comma-separated record formats (default: arrayrecord,tfrecord)",
    )


def run(args: argparse.Namespace, command_config: CommandConfig) -> None:
    config = command_config.load()
    described = _datasets.synthetic(config, "make-data")
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
