"""A batch of serialized records back to back in one buffer."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np


class RecordBatch(Sequence[bytes]):
    """Records as one buffer and where each ends: record i is
    `data[offsets[i]:offsets[i + 1]]`.

    The reader writes a batch's records straight into one buffer and the
    parser reads that buffer: a list of records cost a copy out of the
    reader's buffer, a bytes object per record, and their join again for the
    parser (docs/benchmarks.md has the time). Indexing and iterating
    still give `bytes`, for the code that looks at records one by one (bad
    records, TF's parser).

    Args:
      data: `uint8[total]`.
      offsets: `int64[k + 1]`, ascending from 0 to `total`.
    """

    __slots__ = ("data", "offsets")

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data = data
        self.offsets = offsets

    @classmethod
    def of(cls, records: Sequence[bytes]) -> RecordBatch:
        """The batch of `records` (joined once; a `RecordBatch` as it is)."""
        if isinstance(records, RecordBatch):
            return records
        offsets = np.zeros(len(records) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, records), np.int64, count=len(records)), out=offsets[1:])
        return cls(np.frombuffer(b"".join(records), np.uint8), offsets)

    def __len__(self) -> int:
        return self.offsets.size - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"record {index} of a batch of {len(self)}")
        index %= len(self)
        return self.data[self.offsets[index] : self.offsets[index + 1]].tobytes()

    def __iter__(self) -> Iterator[bytes]:
        blob = self.data.tobytes()
        bounds = self.offsets.tolist()
        return (blob[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True))
