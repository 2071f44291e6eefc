"""Compiled reads of Riegeli chunks from a memory-mapped file.

An ArrayRecord file is a Riegeli file: 64 KiB blocks, each starting with a
24-byte block header, over which a stream of chunks runs; a chunk is a
40-byte header and its data, and may cross block boundaries. Every block
header, chunk header and chunk's data carries a HighwayHash-64 that is checked
here as Riegeli checks it.

Only what a random read of a one-record, uncompressed simple chunk needs is
here (the layout `RecordFileWriter` writes). Anything else (compression,
several records per chunk, transposed chunks) comes back as `UNSUPPORTED`, so
the caller can hand the file to the official reader instead.

Functions return a status: `OK`, `CORRUPT` (a checksum or length does not
match, or the chunk runs past the end of the file) or `UNSUPPORTED`.
"""

from __future__ import annotations

import numba
import numpy as np

from pipelines._example_wire import read_varint
from pipelines._highway_hash import RIEGELI_KEY, highway_hash64
from pipelines._prefetch import prefetch

BLOCK_SIZE = 1 << 16
_BLOCK_HEADER_SIZE = 24
_CHUNK_HEADER_SIZE = 40
_SIMPLE_CHUNK = ord("r")
_NO_COMPRESSION = 0
# How many records ahead `read_single_records` asks for, and at most how many
# cache lines of each (beyond, the hardware prefetcher follows the record).
_PREFETCH_AHEAD = 8
_PREFETCH_LINES = 32

OK = 0
CORRUPT = 1
UNSUPPORTED = 2


@numba.njit(inline="always")
def _u64(data, at):
    value = np.uint64(0)
    for k in range(8):
        value |= np.uint64(data[at + k]) << np.uint64(8 * k)
    return value


@numba.njit(cache=True, nogil=True)
def _gather(file, position, size, out):
    """Copies `size` chunk-stream bytes from file `position` into `out`, skipping
    (and checking) the block headers on the way.

    Returns:
      `(status, position after the bytes)`.
    """
    written = 0
    while written < size:
        if position % BLOCK_SIZE == 0:
            if position + _BLOCK_HEADER_SIZE > file.size:
                return CORRUPT, position
            if highway_hash64(file, position + 8, 16, RIEGELI_KEY) != _u64(file, position):
                return CORRUPT, position
            position += _BLOCK_HEADER_SIZE
        take = min(size - written, BLOCK_SIZE - position % BLOCK_SIZE)
        if position + take > file.size:
            return CORRUPT, position
        out[written : written + take] = file[position : position + take]
        written += take
        position += take
    return OK, position


@numba.njit(cache=True, nogil=True)
def _checked_chunk(header, h, data, d):
    """Checks a chunk's header `header[h:h + 40]` and its data, which starts at
    `data[d]`, against their hashes (each array the file itself or a gathered
    copy).

    Returns:
      `(status, chunk_type, num_records, decoded_size)`.
    """
    if highway_hash64(header, h + 8, 32, RIEGELI_KEY) != _u64(header, h):
        return CORRUPT, 0, 0, 0
    data_size = np.int64(_u64(header, h + 8))
    if highway_hash64(data, d, data_size, RIEGELI_KEY) != _u64(header, h + 16):
        return CORRUPT, 0, 0, 0
    return _chunk_fields(header, h)


@numba.njit(cache=True, nogil=True)
def _chunk_fields(header, h):
    """`(OK, chunk_type, num_records, decoded_size)` of the header at `header[h]`, unchecked."""
    type_and_count = _u64(header, h + 24)
    chunk_type = np.int64(type_and_count & np.uint64(0xFF))
    num_records = np.int64(type_and_count >> np.uint64(8))
    return OK, chunk_type, num_records, np.int64(_u64(header, h + 32))


@numba.njit(cache=True, nogil=True)
def read_chunk(file, position):
    """The chunk at file `position`, checked, its data gathered from across blocks.

    Args:
      file: `uint8[file_size]`, the whole file.
      position: where the chunk begins (a block boundary counts as before
        its block header).

    Returns:
      `(status, data uint8[data_size], chunk_type, num_records, decoded_size)`.
    """
    header = np.empty(_CHUNK_HEADER_SIZE, np.uint8)
    status, position = _gather(file, position, _CHUNK_HEADER_SIZE, header)
    if status != OK or _u64(header, 8) > np.uint64(file.size):
        return CORRUPT, np.empty(0, np.uint8), 0, 0, 0
    data = np.empty(np.int64(_u64(header, 8)), np.uint8)
    status, _ = _gather(file, position, data.size, data)
    if status != OK:
        return status, data, 0, 0, 0
    status, chunk_type, num_records, decoded_size = _checked_chunk(header, 0, data, 0)
    return status, data, chunk_type, num_records, decoded_size


@numba.njit(cache=True, nogil=True)
def simple_chunk_records(data, start, stop, chunk_type, num_records, decoded_size):
    """Where the records of an uncompressed simple chunk, `data[start:stop]`, lie.

    Returns:
      `(status, ends int64[num_records + 1])`: record r is
      `data[ends[r]:ends[r + 1]]`.
    """
    ends = np.empty(max(num_records, 0) + 1, np.int64)
    if chunk_type != _SIMPLE_CHUNK or start == stop or num_records < 0:
        return UNSUPPORTED, ends
    if data[start] != _NO_COMPRESSION:
        return UNSUPPORTED, ends
    sizes_size, position = read_varint(data, start + 1, stop)
    if position < 0 or np.uint64(stop - position) < sizes_size:
        return CORRUPT, ends
    sizes_end = position + np.int64(sizes_size)
    ends[0] = sizes_end
    for r in range(num_records):
        size, position = read_varint(data, position, sizes_end)
        if position < 0 or np.uint64(stop - ends[r]) < size:
            return CORRUPT, ends
        ends[r + 1] = ends[r] + np.int64(size)
    if position != sizes_end or ends[num_records] != stop:
        return CORRUPT, ends
    if ends[num_records] - sizes_end != decoded_size:
        return CORRUPT, ends
    return OK, ends


@numba.njit(inline="always")
def _inside_one_block(file, position):
    """Whether the chunk at `position` (header and data) lies inside one block
    of the file, so that it can be checked and read in place."""
    offset = position % BLOCK_SIZE
    if offset == 0 or offset + _CHUNK_HEADER_SIZE > BLOCK_SIZE:
        return False
    if position + _CHUNK_HEADER_SIZE > file.size:
        return False
    # Not checked yet: a wrong size sends the chunk the other way, where the
    # header's hash catches it.
    data_size = _u64(file, position + 8)
    data = position + _CHUNK_HEADER_SIZE
    return data_size <= np.uint64(BLOCK_SIZE - offset - _CHUNK_HEADER_SIZE) and data_size <= (
        np.uint64(file.size - data)
    )


@numba.njit(cache=True, nogil=True)
def _copy_single_record(data, start, stop, chunk, size, out, at):
    """Copies the one record of the checked chunk `data[start:stop]` to `out[at:]`.

    `chunk` is `_checked_chunk`'s result; `size` the record's size by the file's index.
    """
    status, chunk_type, num_records, decoded_size = chunk
    if status != OK:
        return status
    if num_records != 1:
        return UNSUPPORTED
    status, ends = simple_chunk_records(data, start, stop, chunk_type, 1, decoded_size)
    if status != OK:
        return status
    if decoded_size != size:
        return CORRUPT
    out[at : at + size] = data[ends[0] : ends[1]]
    return OK


@numba.njit(cache=True, nogil=True)
def read_single_records(file, chunk_positions, sizes, out, starts, records, checked):
    """Reads one-record chunks into a buffer, each record at its place.

    A chunk inside one block (the usual case) is checked and read in place;
    one that crosses a block header is gathered first (`read_chunk`). A
    chunk inside one block is checked the first time it is read: the checks
    cost about as much as the reads (docs/benchmarks.md), and training reads
    every record once an epoch.

    Args:
      file: `uint8[file_size]`.
      chunk_positions: `int64[k]` where each chunk begins.
      sizes: `int64[k]` each record's expected size (from the file's index).
      out: `uint8[n]`, receives record i at `out[starts[i]:starts[i] + sizes[i]]`.
      starts: `int64[k]`.
      records: `int64[k]` each chunk's record index in the file.
      checked: `uint8[records in the file]`, 1 where a record's chunk was
        checked by an earlier read; set here for the chunks checked now.

    Returns:
      `(status, index of the failing chunk or -1)`.
    """
    count = chunk_positions.size
    for i in range(count):
        # Random records wait on memory: the lines of the chunk a few records
        # on are fetched while this one is copied (half the read of a batch
        # of 4096 checked records, docs/benchmarks.md).
        if i + _PREFETCH_AHEAD < count:
            ahead = chunk_positions[i + _PREFETCH_AHEAD]
            end = min(ahead + _CHUNK_HEADER_SIZE + sizes[i + _PREFETCH_AHEAD], file.size)
            for line in range(ahead, min(end, ahead + 64 * _PREFETCH_LINES), 64):
                prefetch(file, line)
        position = chunk_positions[i]
        if _inside_one_block(file, position):
            start = position + _CHUNK_HEADER_SIZE
            stop = start + np.int64(_u64(file, position + 8))
            if checked[records[i]]:
                chunk = _chunk_fields(file, position)
            else:
                chunk = _checked_chunk(file, position, file, start)
            status = _copy_single_record(file, start, stop, chunk, sizes[i], out, starts[i])
            if status == OK:
                checked[records[i]] = 1
        else:
            status, data, chunk_type, num_records, decoded_size = read_chunk(file, position)
            chunk = (status, chunk_type, num_records, decoded_size)
            status = _copy_single_record(data, 0, data.size, chunk, sizes[i], out, starts[i])
        if status != OK:
            return status, i
    return OK, -1


@numba.njit(cache=True, nogil=True)
def varint_fields(data, start, end, count):
    """The varint fields 1 to `count` of a protobuf message `data[start:end]`.

    Returns:
      `(status, values uint64[count])`; absent fields are 0. A field of
      another wire type or number makes the message `UNSUPPORTED`.
    """
    values = np.zeros(count, np.uint64)
    position = start
    while position < end:
        tag, position = read_varint(data, position, end)
        if position < 0:
            return CORRUPT, values
        field = np.int64(tag >> np.uint64(3))
        if tag & np.uint64(7) != 0 or not 1 <= field <= count:
            return UNSUPPORTED, values
        values[field - 1], position = read_varint(data, position, end)
        if position < 0:
            return CORRUPT, values
    return OK, values


@numba.njit(cache=True, nogil=True)
def footer_entries(data, ends):
    """The `ArrayRecordFooter`s (records 1 onwards of the footer chunk).

    Returns:
      `(status, int64[chunks, 3])`: each chunk's offset, decoded size and
      record count.
    """
    entries = np.zeros((ends.size - 2, 3), np.int64)
    for c in range(entries.shape[0]):
        status, values = varint_fields(data, ends[c + 1], ends[c + 2], 3)
        if status != OK:
            return status, entries
        for k in range(3):
            entries[c, k] = np.int64(values[k])
    return OK, entries
