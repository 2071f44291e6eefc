"""`sparseflow stats`: parse and preprocess a config's dataset, and summarize every table."""

from __future__ import annotations

import argparse

from sparseflow import _datasets, _stats_report
from sparseflow._arguments import (
    add_devices_argument,
    add_optional_config_argument,
    positive_int,
)
from sparseflow._command_config import CommandConfig
from sparseflow.config._mesh import devices_noun


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `stats` subcommand's arguments."""
    add_optional_config_argument(parser)
    parser.add_argument(
        "--batches", type=positive_int, help="stop after N global batches (default: one pass)"
    )
    add_devices_argument(parser)


def run(args: argparse.Namespace, command_config: CommandConfig) -> None:
    config = command_config.load()
    if not _datasets.dataset_exists(config):
        print(
            f"Writing the synthetic dataset "
            f"({_datasets.synthetic(config, 'stats').examples:,} examples) "
            f"to {config.dataset.dir} ..."
        )
        _datasets.make_dataset(config)
    result = _stats_report.run_stats(config, max_batches=args.batches)
    print(
        f"{config.name}: {devices_noun(config.mesh.devices)} x "
        f"{config.mesh.partitions_per_device} partitions, global batch "
        f"{config.global_batch_size}"
    )
    print(_stats_report.format_report(result))
