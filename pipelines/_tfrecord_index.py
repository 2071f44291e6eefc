"""Random access to TFRecord files: an index of record offsets, and reads by index.

A TFRecord file is a sequence of `uint64 length, uint32 masked crc32c of the
length, data[length], uint32 masked crc32c of the data` (little-endian).
The index walks the length fields (a compiled loop over the memory-mapped
file, reading 8 bytes per record); TensorFlow's random reader then reads a
record at its offset and checks both checksums, so a corrupt length or
record is reported when read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numba
import numpy as np

from pipelines._errors import DataError
from pipelines._records import tf_error_reason
from pipelines._tensorflow import tf

_HEADER_BYTES = 12  # length, its checksum
_FOOTER_BYTES = 4  # the data's checksum


@numba.njit(cache=True, nogil=True)
def _walk(data, offsets):
    """Walks the records of `data` (`uint8[size]`); fills `offsets` while it has room.

    Returns (records walked, where the walk ended): the end is `data.size` for
    a whole file, anything else for a truncated one.
    """
    position, count, size = 0, 0, data.size
    while position + _HEADER_BYTES <= size:
        length = 0
        for b in range(8):
            length |= np.int64(data[position + b]) << np.int64(8 * b)
        if length < 0 or length > size:
            return count, position
        if count < offsets.size:
            offsets[count] = position
        count += 1
        position += _HEADER_BYTES + length + _FOOTER_BYTES
    return count, position


def record_offsets(path: str) -> np.ndarray:
    """`int64[records]` the offset of each record of a TFRecord file.

    Raises:
      DataError: the file ends inside a record (named, with the offset).
    """
    if os.path.getsize(path) == 0:
        return np.zeros(0, np.int64)
    data = np.memmap(path, np.uint8, mode="r")
    count, end = _walk(data, np.zeros(0, np.int64))
    if end != data.size:
        raise DataError(
            f"{path}: corrupt or truncated TFRecord file: its record lengths add up to "
            f"{end} bytes, the file has {data.size}."
        )
    offsets = np.zeros(count, np.int64)
    _walk(data, offsets)
    return offsets


class IndexedTFRecordFiles:
    """The records of TFRecord files by dataset index (files in order).

    Args:
      paths: the files, in dataset order.
    """

    def __init__(self, paths: Sequence[str]):
        self._paths = tuple(paths)
        self._offsets = [record_offsets(path) for path in self._paths]
        counts = [offsets.size for offsets in self._offsets]
        self.counts = tuple(counts)
        self._ends = np.cumsum(counts, dtype=np.int64)
        self._readers: dict[int, object] = {}

    def read(self, record_indices: Sequence[int] | np.ndarray) -> list[bytes]:
        """The records at `record_indices` (`int[k]`, each in the dataset), in that order.

        Raises:
          DataError: a record fails its checksums (its file and offset named).
        """
        indices = np.asarray(record_indices, np.int64).reshape(-1)
        file_of = np.searchsorted(self._ends, indices, side="right")
        records = []
        for f, index in zip(file_of.tolist(), indices.tolist(), strict=True):
            start = int(self._ends[f] - self.counts[f])
            offset = int(self._offsets[f][index - start])
            records.append(self._read(f, offset))
        return records

    def _read(self, f: int, offset: int) -> bytes:
        if f not in self._readers:
            from tensorflow.python.lib.io import tf_record  # TensorFlow, when first read

            self._readers[f] = tf_record.tf_record_random_reader(self._paths[f])
        try:
            record, _ = self._readers[f].read(offset)
        except (tf.errors.OpError, OSError, IndexError) as error:
            raise DataError(
                f"{self._paths[f]}: corrupt or truncated TFRecord file at byte {offset}: "
                f"{tf_error_reason(error)}"
            ) from error
        return record
