"""The Dask cluster a Beam job runs on: an existing one, or a local one for the job's duration.

Production: a `dask scheduler` and `dask worker tcp://HOST:8786` processes on
the machines; the job joins with `address="tcp://HOST:8786"`. The workers
open the record files by the paths the job lists, so every worker must see
them at the same path (a shared mount), or the job names them by fsspec
URLs every worker reaches (`gs://...`; see `beam_jobs._record_urls`).

Without an address, a `distributed.LocalCluster` of worker processes runs on
this machine, listening on 127.0.0.1 only, and is shut down when the job
ends. Needs `dask[distributed]` (`pip install 'sparseflow[dask]'`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import distributed

from embedding.checks import check_int

__all__ = ["DEFAULT_CONNECT_TIMEOUT_S", "dask_cluster"]

_log = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT_S = 10.0


@contextlib.contextmanager
def dask_cluster(
    *,
    address: str | None = None,
    workers: int = 2,
    connect_timeout_s: float | None = None,
) -> Iterator[str]:
    """Yields a Dask scheduler's address: `address`, or a local cluster's.

    Args:
      address: a running scheduler, e.g. `tcp://10.0.0.5:8786`; None starts
        a local cluster.
      workers: worker processes of the local cluster (one thread each);
        unused with an `address`.
      connect_timeout_s: how long to wait for the scheduler at `address`
        (default: `DEFAULT_CONNECT_TIMEOUT_S`).

    Raises:
      ValueError: `workers` below 1, or no scheduler answers at `address`
        (the message names it).
    """
    if address is not None:
        _check_reachable(address, connect_timeout_s or DEFAULT_CONNECT_TIMEOUT_S)
        yield address
        return
    check_int(workers, "workers", 1)
    # One thread per worker process: the job's steps hold the GIL (parsing,
    # preprocessing), so parallelism comes from processes.
    with distributed.LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,
    ) as cluster:
        _log.info("Local Dask cluster of %d workers at %s", workers, cluster.scheduler_address)
        yield cluster.scheduler_address


def _check_reachable(address: str, timeout_s: float) -> None:
    try:
        with distributed.Client(address, timeout=timeout_s):
            pass
    except OSError as e:
        raise ValueError(
            f"No Dask scheduler answers at {address} (waited {timeout_s:g} s): {e}"
        ) from e
