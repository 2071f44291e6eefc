"""`sparseflow fdo`: the offline FDO statistics job for a config's dataset.

  sparseflow fdo --config C [--data FILE|DIR|GLOB ...] [--out DIR] [--runner R]
                 [--dask-address tcp://HOST:8786 | --dask-workers N]
                 [--direct_num_workers N] [--direct_running_mode MODE]
                 [--plot out.png] [--headroom H] [-- other Beam options]

`--runner dask` runs the job on Dask (`beam_jobs.dask_runner`, needs
`pip install 'sparseflow[dask]'`): on the cluster whose scheduler is at
`--dask-address`, or on a local cluster of `--dask-workers` processes
(127.0.0.1 only) started for the job and shut down after it. The workers open
the record files by path: on a cluster, `--data` must name files on a mount
every worker sees under the same path, or fsspec URLs (`gs://...`) every
worker reaches. Without `--runner` the job runs in process.

Beam pipeline options other than the ones above go after `--`, e.g.
`-- --flink_master=localhost:8081 --environment_type=LOOPBACK`.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path

import beam_jobs
import embedding
import pipelines
from sparseflow._arguments import positive_int
from sparseflow._config import RunConfig

_RUNNING_MODES = ("in_memory", "multi_threading", "multi_processing")
DASK = "dask"
_DASK_RUNNER = "beam_jobs.dask_runner.DaskRunner"
_DEFAULT_DASK_WORKERS = 2


def _headroom(text: str) -> float:
    value = float(text)
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be a number >= 1, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `fdo` subcommand's arguments."""
    parser.add_argument(
        "--config",
        type=Path,
        required=True,
        help="the run's YAML config, or a shipped config's name (demo, benchmark)",
    )
    parser.add_argument(
        "--data",
        nargs="+",
        help="record files (ArrayRecord or TFRecord): files, directories or glob patterns, "
        "read in the given order (default: the config's dataset.train, or the synthetic "
        "data under dataset.dir)",
    )
    parser.add_argument(
        "--out", help="output directory of the stats (default: the config's dataset.dir/fdo)"
    )
    parser.add_argument(
        "--runner",
        help=f"Beam runner: {DASK!r} (Dask), or a Beam runner's name, e.g. FlinkRunner "
        "(default: Beam's FnApiRunner, in process)",
    )
    parser.add_argument(
        "--dask-address",
        help="--runner dask: the scheduler of a running cluster, e.g. tcp://HOST:8786 "
        "(default: a local cluster for the job)",
    )
    parser.add_argument(
        "--dask-workers",
        type=positive_int,
        help=f"--runner dask: worker processes of the local cluster "
        f"(default: {_DEFAULT_DASK_WORKERS})",
    )
    parser.add_argument(
        "--direct_num_workers", type=positive_int, help="in-process runner: parallel workers"
    )
    parser.add_argument(
        "--direct_running_mode", choices=_RUNNING_MODES, help="in-process runner: how workers run"
    )
    parser.add_argument("--plot", type=Path, help="also save a figure of the ids per partition")
    parser.add_argument(
        "--headroom",
        type=_headroom,
        default=1.1,
        help="factor over the observed maxima for the limits shown (default: 1.1)",
    )
    parser.add_argument("beam_options", nargs="*", help="further Beam pipeline options, after `--`")


def job_config(config: RunConfig) -> beam_jobs.FdoJobConfig:
    """The FDO job's view of a run config; the stats carry its layout."""
    mesh = config.mesh
    return beam_jobs.FdoJobConfig(
        feature_specs=config.feature_specs,
        # The moments of standardized keys are those of the raw values.
        layout=pipelines.FeatureLayout.from_schema(config.layout.schema.without_standardization()),
        moments_schema=config.layout.schema if config.layout.schema.standardized() else None,
        geometry=embedding.FdoGeometry(
            global_batch_size=config.global_batch_size,
            devices=mesh.devices,
            partitions_per_device=mesh.partitions_per_device,
            processes=mesh.processes,
        ),
        config_hash=config.config_hash,
        fdo_layout=config.fdo_layout,
    )


def _pipeline_args(args: argparse.Namespace, dask_address: str | None) -> list[str]:
    if dask_address is not None:
        named = [f"--runner={_DASK_RUNNER}", f"--dask_client_address={dask_address}"]
    else:
        named = [
            f"--{name}={getattr(args, name)}"
            for name in ("runner", "direct_num_workers", "direct_running_mode")
            if getattr(args, name) is not None
        ]
    return named + list(args.beam_options)


@contextlib.contextmanager
def _dask_address(args: argparse.Namespace) -> Iterator[str | None]:
    """The scheduler to run on with `--runner dask` (a local one lives as long as the job)."""
    if args.runner != DASK:
        if args.dask_address is not None or args.dask_workers is not None:
            raise ValueError("--dask-address and --dask-workers need --runner dask.")
        yield None
        return
    if args.dask_address is not None and args.dask_workers is not None:
        raise ValueError(
            "--dask-workers sizes a local cluster; a cluster at --dask-address has its own workers."
        )
    try:
        from beam_jobs import dask_cluster  # the `dask` extra: only this runner needs it
    except ModuleNotFoundError as e:
        raise ValueError(f"--runner dask needs {e.name}: pip install 'sparseflow[dask]'.") from e
    with dask_cluster.dask_cluster(
        address=args.dask_address, workers=args.dask_workers or _DEFAULT_DASK_WORKERS
    ) as address:
        yield address


def configured_limits(config: RunConfig) -> dict[str, int]:
    """Per stacked table, the `max_ids_per_partition` the config sets (what FDO replaces)."""
    prepared = embedding.prepare_feature_specs_for_training(
        config.feature_specs, config.mesh.devices, config.mesh.partitions_per_device
    )
    return {
        name: stack.max_ids_per_partition
        for name, stack in embedding.get_stacked_table_specs(prepared).items()
    }


def run(args: argparse.Namespace, config: RunConfig) -> None:
    """Runs the job, prints where the stats went and the limits they call for."""
    data = args.data or list(config.dataset.train_data)
    out = args.out or str(config.dataset.dir / "fdo")
    with _dask_address(args) as dask_address:
        pipeline_args = _pipeline_args(args, dask_address)
        result = beam_jobs.run_fdo_job(job_config(config), data, out, pipeline_args)
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
