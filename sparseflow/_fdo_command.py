"""`sparseflow fdo`: the offline FDO statistics job for a config's dataset.

  sparseflow fdo --config C [--data FILE|DIR|GLOB ...] [--out DIR] [--runner R] [--devices N]
                 [--dask-address tcp://HOST:8786 | --dask-workers N]
                 [--direct_num_workers N] [--direct_running_mode MODE]
                 [--plot out.png] [--headroom H] [-- other Beam options]

`--runner dask` runs the job on Dask (see `sparseflow._runner_options`). The workers open
the record files by path: on a cluster, `--data` must name files on a mount
every worker sees under the same path, or fsspec URLs (`gs://...`) every
worker reaches. Without `--runner` the job runs in process.

Beam pipeline options other than the ones above go after `--`, e.g.
`-- --flink_master=localhost:8081 --environment_type=LOOPBACK`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import beam_jobs
import embedding
from sparseflow._arguments import add_config_argument, add_devices_argument
from sparseflow._command_config import CommandConfig
from sparseflow._fdo_run import configured_limits, job_config
from sparseflow._runner_options import add_runner_arguments, dask_address, pipeline_args


def _headroom(text: str) -> float:
    value = float(text)
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be a number >= 1, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `fdo` subcommand's arguments."""
    add_config_argument(parser)
    parser.add_argument(
        "--data",
        nargs="+",
        help="record files (ArrayRecord or TFRecord): files, directories or glob patterns, "
        "local or fsspec URLs as --out takes (gs://bucket/data, file:///data), read in the "
        "given order (default: the config's dataset.train, or the synthetic data under "
        "dataset.dir)",
    )
    parser.add_argument(
        "--out", help="output directory of the stats (default: the config's dataset.dir/fdo)"
    )
    parser.add_argument("--plot", type=Path, help="also save a figure of the ids per partition")
    parser.add_argument(
        "--headroom",
        type=_headroom,
        default=1.1,
        help="factor over the observed maxima for the limits shown (default: 1.1)",
    )
    add_devices_argument(parser)
    add_runner_arguments(parser)


def run(args: argparse.Namespace, command_config: CommandConfig) -> None:
    """Runs the job, prints where the stats went and the limits they call for."""
    config = command_config.load()
    data = args.data or list(config.dataset.train_data)
    out = args.out or str(config.dataset.dir / "fdo")
    with dask_address(args) as address:
        result = beam_jobs.run_fdo_job(job_config(config), data, out, pipeline_args(args, address))
    counters = result.counters
    print(
        f"{result.stats.batches} global batches of {config.global_batch_size} from "
        f"{counters.get('records', 0):,} records ({counters.get('bad_records', 0):,} bad, "
        f"{counters.get('tail_records', 0):,} after the last whole batch)."
    )
    print(f"FDO stats: {result.stats_path}")
    print(f"Dead letters: {result.dead_letters_path}")
    configured = configured_limits(config)
    limits = embedding.fdo_limits(result.stats, headroom=args.headroom)
    print(f"Limits at headroom {args.headroom:g} (configured max ids in brackets):")
    for name, limit in limits.items():
        print(
            f"  {name}: max_ids_per_partition {limit.max_ids_per_partition} "
            f"[{configured[name]}], max_unique_ids_per_partition "
            f"{limit.max_unique_ids_per_partition}, suggested_coo_buffer_size_per_device "
            f"{limit.suggested_coo_buffer_size_per_device}"
        )
    if args.plot:
        beam_jobs.plot_fdo_stats(
            result.stats, args.plot, headroom=args.headroom, configured_limits=configured
        )
        print(f"Figure: {args.plot}")
