"""The Beam runner options of the `fdo` and `import` subcommands.

`--runner dask` runs a job on Dask (`beam_jobs.dask_runner`, needs
`pip install 'sparseflow[dask]'`): on the cluster whose scheduler is at
`--dask-address`, or on a local cluster of `--dask-workers` processes
(127.0.0.1 only) started for the job and shut down after it. Without
`--runner` a job runs in process (Beam's FnApiRunner, never Beam's default,
which first tries to download Prism). Beam pipeline options other than these
go after `--`.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from sparseflow._arguments import positive_int
from sparseflow._errors import UsageError

_RUNNING_MODES = ("in_memory", "multi_threading", "multi_processing")
DASK = "dask"
DASK_RUNNER = "beam_jobs.dask_runner.DaskRunner"
_DEFAULT_DASK_WORKERS = 2


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    """`--runner`, the Dask and in-process runners' options, and Beam options after `--`."""
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
    parser.add_argument("beam_options", nargs="*", help="further Beam pipeline options, after `--`")


def pipeline_args(args: argparse.Namespace, dask_address: str | None) -> list[str]:
    """The Beam pipeline options the arguments ask for."""
    if dask_address is not None:
        named = [f"--runner={DASK_RUNNER}", f"--dask_client_address={dask_address}"]
    else:
        named = [
            f"--{name}={getattr(args, name)}"
            for name in ("runner", "direct_num_workers", "direct_running_mode")
            if getattr(args, name) is not None
        ]
    return named + list(args.beam_options)


@contextlib.contextmanager
def dask_address(args: argparse.Namespace) -> Iterator[str | None]:
    """The scheduler to run on with `--runner dask` (a local one lives as long as the job)."""
    if args.runner != DASK:
        if args.dask_address is not None or args.dask_workers is not None:
            raise UsageError("--dask-address and --dask-workers need --runner dask.")
        yield None
        return
    if args.dask_address is not None and args.dask_workers is not None:
        raise UsageError(
            "--dask-workers sizes a local cluster; a cluster at --dask-address has its own workers."
        )
    try:
        from beam_jobs import dask_cluster  # the `dask` extra: only this runner needs it
    except ModuleNotFoundError as e:
        raise UsageError(f"--runner dask needs {e.name}: pip install 'sparseflow[dask]'.") from e
    with contextlib.ExitStack() as stack:
        cluster = dask_cluster.dask_cluster(
            address=args.dask_address, workers=args.dask_workers or _DEFAULT_DASK_WORKERS
        )
        try:
            address = stack.enter_context(cluster)
        except ValueError as e:  # no scheduler at --dask-address: the user's to fix
            raise UsageError(str(e)) from e
        yield address
