"""Random access to a dataset of ArrayRecord files, a batch of records per call.

One reader per file, opened once per process (after unpickling, in a Grain
worker, on first use). A batch of dataset record indices is mapped to (file,
position) with one numpy search, then each record is read on its own. Grain's
`ArrayRecordDataSource` maps every index in Python and starts a thread pool
per call, which at a few hundred records per batch costs more than the reads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
from array_record.python import array_record_module

from pipelines._batching import RecordFiles
from pipelines._records import RecordFormat, require_record_format

# Random reads: a read-ahead buffer would only fetch records nobody asked for.
_READER_OPTIONS = "readahead_buffer_size:0"


class ArrayRecordReader:
    """The records of ArrayRecord files by dataset index (files in order).

    Picklable: a copy reopens the files when it first reads.

    Args:
      paths: the files, in dataset order.

    Raises:
      ValueError: a file is not an ArrayRecord file, or cannot be opened.
    """

    def __init__(self, paths: Sequence[str]):
        require_record_format(paths, RecordFormat.ARRAY_RECORD, "Grain", "make_tfdata_iterator")
        self._paths = tuple(paths)
        self._lock = threading.Lock()
        self._readers = [_open(path) for path in self._paths]
        counts = tuple(reader.num_records() for reader in self._readers)
        self._files = RecordFiles(self._paths, counts)
        self._ends = np.cumsum(counts, dtype=np.int64)
        self._starts = self._ends - counts

    @property
    def files(self) -> RecordFiles:
        return self._files

    def read(self, record_indices: Sequence[int] | np.ndarray) -> list[bytes]:
        """The records at `record_indices` (`int[k]`), in that order.

        Raises:
          IndexError: an index is outside the dataset.
          ValueError: a file cannot be read (named).
        """
        indices = np.asarray(record_indices, np.int64).reshape(-1)
        if indices.size and not (0 <= indices.min() and indices.max() < self._ends[-1]):
            bad = indices[(indices < 0) | (indices >= self._ends[-1])][0]
            raise IndexError(
                f"Record {bad} is outside the dataset of {self._ends[-1]} records "
                f"({len(self._paths)} files)."
            )
        file_of = np.searchsorted(self._ends, indices, side="right").tolist()
        positions = (indices - self._starts[file_of]).tolist()
        readers = self._open_readers()
        try:
            # A one-record range read costs a fifth of a record in a
            # `read(indices)` call, which sets up a parallel read each time.
            return [readers[f].read(p, p + 1)[0] for f, p in zip(file_of, positions, strict=True)]
        except RuntimeError:
            self._raise_read_error(file_of, positions)
            raise

    def _raise_read_error(self, file_of: list[int], positions: list[int]) -> None:
        """Finds the record that cannot be read and raises naming it and its file."""
        for f, p in zip(file_of, positions, strict=True):
            try:
                self._readers[f].read(p, p + 1)
            except RuntimeError as error:
                raise ValueError(
                    f"Record {p} of {self._paths[f]} cannot be read (corrupt or truncated "
                    f"ArrayRecord file): {error}"
                ) from error

    def _open_readers(self) -> list[array_record_module.ArrayRecordReader]:
        if None in self._readers:
            with self._lock:
                self._readers = [
                    _open(path) if reader is None else reader
                    for path, reader in zip(self._paths, self._readers, strict=True)
                ]
        return self._readers

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_readers"] = [None] * len(self._paths)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _open(path: str) -> array_record_module.ArrayRecordReader:
    try:
        reader = array_record_module.ArrayRecordReader(path, _READER_OPTIONS)
    except (RuntimeError, ValueError, OSError) as error:
        raise ValueError(f"{path}: cannot open as an ArrayRecord file: {error}") from error
    if not reader.ok():
        raise ValueError(f"{path}: corrupt or truncated ArrayRecord file (the reader is not ok).")
    return reader
