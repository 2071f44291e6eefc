"""jax-tpu-embedding's file FDO client (`NPZFileFDOClient`), its files and semantics.

Each process records the stats of its batches, `SparseDenseMatmulInputStats`
of one batch each, and publishes them to one file
`<base_dir>/fdo_stats_<process index>_<time in ns>.npz`, an array per stack
and statistic named `<stack><suffix>` (`_max_ids`, `_max_unique_ids`,
`_required_buffer_size`, `_id_drop_counters`): the batches' arrays stacked
row by row. `load` reads the newest file of every process and takes, key by
key, the element-wise max over the processes' arrays.

This is the reference's format, for scripts that switch by changing imports
(`embedding.jte_compat`); sparseflow's own stats files (`FdoClient`,
`FdoStats`) also carry the geometry and layout they were measured with.
"""

from __future__ import annotations

import glob
import os
import re
import time
from typing import Any

import jax
import numpy as np

from embedding._preprocess import SparseDenseMatmulInputStats

_PREFIX = "fdo_stats"
_NAME = re.compile(rf"{_PREFIX}_(\d+)_(\d+)\.npz")
# The statistics a file holds, by field of `SparseDenseMatmulInputStats`,
# with the suffix of their arrays' names (the reference's).
_SUFFIXES = {
    "max_ids_per_partition": "_max_ids",
    "max_unique_ids_per_partition": "_max_unique_ids",
    "required_buffer_size_per_sc": "_required_buffer_size",
    "id_drop_counters": "_id_drop_counters",
}


def latest_files_by_process(files: list[str]) -> list[str]:
    """The newest of `files` named `fdo_stats_<process>_<ns>.npz` for every
    process, processes in descending order; other names are left out."""
    newest: dict[int, tuple[int, str]] = {}
    for path in files:
        match = _NAME.fullmatch(os.path.basename(path))
        if match:
            process, stamp = int(match.group(1)), int(match.group(2))
            newest[process] = max(newest.get(process, (stamp, path)), (stamp, path))
    return [newest[process][1] for process in sorted(newest, reverse=True)]


def _statistic(key: str) -> tuple[str, str]:
    """`(field, stack name)` of an array named `<stack><suffix>`.

    Raises:
      ValueError: the name ends with none of the suffixes.
    """
    for field, suffix in _SUFFIXES.items():
        if key.endswith(suffix):
            return field, key[: -len(suffix)]
    raise ValueError(
        f"Unexpected array {key!r} in an FDO stats file: names end with one of "
        f"{list(_SUFFIXES.values())}."
    )


class NPZFileFDOClient:
    """jax-tpu-embedding's `NPZFileFDOClient`: stats in `.npz` files in `base_dir`.

    Example:
      client = NPZFileFDOClient("/tmp/fdo")
      _, stats = jte_compat.preprocess_sparse_dense_matmul_input(...)
      client.record(stats)   # every batch
      client.publish()       # every process
      stats = client.load()  # the max over the processes' newest files
    """

    def __init__(self, base_dir: str | os.PathLike):
        self._base_dir = os.fspath(base_dir)
        # field -> stack -> the recorded batches' arrays, stacked row by row.
        self._recorded: dict[str, dict[str, np.ndarray]] = {field: {} for field in _SUFFIXES}

    def record(self, data: Any) -> None:
        """Adds one batch's stats (`SparseDenseMatmulInputStats`, ours or the
        reference's) under the earlier ones: a stack's arrays are stacked row
        by row."""
        for field, recorded in self._recorded.items():
            for stack, value in getattr(data, field, {}).items():
                value = np.asarray(value)
                if stack in recorded:
                    value = np.vstack((recorded[stack], value))
                recorded[stack] = value

    def publish(self) -> None:
        """Writes the recorded stats to a new file of this process in `base_dir`."""
        arrays = {
            f"{stack}{_SUFFIXES[field]}": value
            for field, recorded in self._recorded.items()
            for stack, value in recorded.items()
        }
        os.makedirs(self._base_dir, exist_ok=True)
        name = f"{_PREFIX}_{jax.process_index()}_{time.time_ns()}.npz"
        np.savez(os.path.join(self._base_dir, name), **arrays)

    def _get_latest_files_by_process(self, files: list[str]) -> list[str]:
        """`latest_files_by_process`, under the reference's name."""
        return latest_files_by_process(files)

    def load(self) -> SparseDenseMatmulInputStats:
        """The element-wise max, per array, over every process's newest file.

        Raises:
          FileNotFoundError: `base_dir` holds no stats file.
          ValueError: a file holds an array of another name.
        """
        files = latest_files_by_process(glob.glob(os.path.join(self._base_dir, f"{_PREFIX}*.npz")))
        if not files:
            raise FileNotFoundError(
                f"No FDO stats files ({_PREFIX}_<process>_<ns>.npz) in {self._base_dir}; "
                "publish() writes them."
            )
        merged: dict[str, np.ndarray] = {}
        for path in files:
            with np.load(path) as arrays:
                for key in arrays.files:
                    value = arrays[key]
                    if key in merged:
                        value = np.max(np.vstack((merged[key], value)), axis=0)
                    merged[key] = value
        loaded: dict[str, dict[str, np.ndarray]] = {field: {} for field in _SUFFIXES}
        for key, value in merged.items():
            field, stack = _statistic(key)
            loaded[field][stack] = value
        self._recorded = loaded
        return SparseDenseMatmulInputStats(**loaded)
