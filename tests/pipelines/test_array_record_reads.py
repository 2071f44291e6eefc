"""Tests of the compiled ArrayRecord reads (pipelines/_riegeli.py, _highway_hash.py):
against HighwayHash's published vectors and the official ArrayRecord reader."""

import os
import shutil

import numba
import numpy as np
import pytest
from array_record.python import array_record_module
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelines._array_record import ArrayRecordReader
from pipelines._highway_hash import highway_hash64
from pipelines._records import RecordFileWriter

# HighwayHash-64 of bytes 0, 1, ..., n - 1 under the key of bytes 0 to 31,
# for n = 0 to 35: the reference implementation's test vectors.
_PUBLISHED = [
    0x907A56DE22C26E53, 0x7EAB43AAC7CDDD78, 0xB8D0569AB0B53D62, 0x5C6BEFAB8A463D80,
    0xF205A46893007EDA, 0x2B8A1668E4A94541, 0xBD4CCC325BEFCA6F, 0x4D02AE1738F59482,
    0xE1205108E55F3171, 0x32D2644EC77A1584, 0xF6E10ACDB103A90B, 0xC3BBF4615B415C15,
    0x243CC2040063FA9C, 0xA89A58CE65E641FF, 0x24B031A348455A23, 0x40793F86A449F33B,
    0xCFAB3489F97EB832, 0x19FE67D2C8C5C0E2, 0x04DD90A69C565CC2, 0x75D9518E2371C504,
    0x38AD9B1141D3DD16, 0x0264432CCD8A70E0, 0xA9DB5A6288683390, 0xD7B05492003F028C,
    0x205F615AEA59E51E, 0xEEE0C89621052884, 0x1BFC1A93A7284F4F, 0x512175B5B70DA91D,
    0xF71F8976A0A2C639, 0xAE093FEF1F84E3E7, 0x22CA92B01161860F, 0x9FC7007CCF035A68,
    0xA0C964D9ECD580FC, 0x2C90F73CA03181FC, 0x185CF84E5691EB9E, 0x4FC1F5EF2752AA9B,
]  # fmt: skip
_KEY = np.array(
    [0x0706050403020100, 0x0F0E0D0C0B0A0908, 0x1716151413121110, 0x1F1E1D1C1B1A1918],
    np.uint64,
)


@pytest.mark.parametrize("size", range(len(_PUBLISHED)))
def test_highway_hash_matches_the_published_vectors(size):
    data = np.arange(64, dtype=np.uint8)
    assert int(highway_hash64(data, 0, size, _KEY)) == _PUBLISHED[size]
    shifted = np.concatenate([np.zeros(3, np.uint8), data])
    assert int(highway_hash64(shifted, 3, size, _KEY)) == _PUBLISHED[size]


def test_highway_hash_matches_the_published_vectors_of_key_1234():
    key = np.array([1, 2, 3, 4], np.uint64)
    assert highway_hash64((128 + np.arange(33)).astype(np.uint8), 0, 33, key) == 0x53C516CCE478CAD7
    assert highway_hash64(np.array([255], np.uint8), 0, 1, key) == 0x7858F24D2D79B2B2


def test_highway_hash_refuses_a_strided_array():
    # Its packets are loaded from the array's memory: a view with gaps would
    # hash the bytes between its elements.
    with pytest.raises(numba.TypingError):
        highway_hash64(np.arange(128, dtype=np.uint8)[::2], 0, 40, _KEY)


def _write(path, records, options=None):
    if options is None:
        with RecordFileWriter(str(path)) as writer:
            for record in records:
                writer.write(record)
    else:
        writer = array_record_module.ArrayRecordWriter(str(path), options)
        for record in records:
            writer.write(record)
        writer.close()
    return str(path)


def _official(path):
    reader = array_record_module.ArrayRecordReader(path)
    return [reader.read(i, i + 1)[0] for i in range(reader.num_records())]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(
        st.one_of(st.integers(0, 600), st.integers(20_000, 140_000)), min_size=0, max_size=12
    ),
    seed=st.integers(0, 2**31),
)
def test_compiled_reads_equal_the_written_records(tmp_path_factory, sizes, seed):
    rng = np.random.default_rng(seed)
    records = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in sizes]
    path = _write(tmp_path_factory.mktemp("records") / "part-0.array_record", records)
    reader = ArrayRecordReader([path])
    assert reader.mapped_files == (True,)
    order = rng.permutation(len(records))
    assert list(reader.read(order)) == [records[i] for i in order]
    official = _official(path)
    assert list(reader.read(order)) == [official[i] for i in order]


def test_records_across_block_boundaries_are_read_whole(tmp_path):
    # 30 kB records: most chunks straddle a 64 KiB block header.
    records = [bytes([r]) * 30_000 + b"end %d" % r for r in range(9)]
    path = _write(tmp_path / "part-0.array_record", records)
    reader = ArrayRecordReader([path])
    assert reader.mapped_files == (True,)
    assert list(reader.read(list(reversed(range(9))))) == records[::-1]


@pytest.mark.parametrize(
    "options", ["group_size:1", "group_size:4,uncompressed", "group_size:65536"]
)
def test_other_layouts_fall_back_to_the_official_reader(tmp_path, options):
    records = [b"record %d" % r * (r + 1) for r in range(10)]
    path = _write(tmp_path / "part-0.array_record", records, options)
    reader = ArrayRecordReader([path])
    assert reader.mapped_files == (False,)
    assert list(reader.read([9, 0, 4])) == [records[9], records[0], records[4]]


def _corrupt(source, tmp_path, find: bytes, offset: int):
    """A copy of `source` with one byte flipped, `offset` bytes after `find`."""
    path = str(tmp_path / "copy" / os.path.basename(source))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    shutil.copy(source, path)
    data = bytearray(open(path, "rb").read())
    at = data.index(find) + offset
    data[at] ^= 0x01
    open(path, "wb").write(bytes(data))
    return path


@pytest.fixture
def plain_file(tmp_path):
    records = [b"plain record %03d " % r * 3 for r in range(40)]
    return _write(tmp_path / "part-0.array_record", records), records


@pytest.mark.parametrize("offset", [0, 5, 40])
def test_a_flipped_byte_in_a_record_is_named(plain_file, tmp_path, offset):
    source, records = plain_file
    path = _corrupt(source, tmp_path, records[17], offset)
    reader = ArrayRecordReader([path])
    assert list(reader.read([16, 18])) == [records[16], records[18]]
    with pytest.raises(ValueError, match=f"Record 17 of {path} cannot be read"):
        reader.read([3, 17])


def test_a_record_is_checked_the_first_time_a_process_reads_it(plain_file, tmp_path):
    # The file changes in place after records 16 and 17 were read (which a
    # reader does not allow): the first read of record 18 checks it and names
    # it, a second read of 17 reads what is there without checking it again,
    # and a new reader (another process) checks 17 again.
    source, records = plain_file
    path = tmp_path / "changing.array_record"
    shutil.copy(source, path)
    reader = ArrayRecordReader([str(path)])
    assert list(reader.read([16, 17])) == records[16:18]
    data = bytearray(path.read_bytes())
    for r in (17, 18):
        at = data.index(records[r])
        data[at] ^= 0x01
    with open(path, "r+b") as file:
        file.write(data)
    with pytest.raises(ValueError, match=f"Record 18 of {path} cannot be read"):
        reader.read([18])
    changed = bytes([records[17][0] ^ 0x01]) + records[17][1:]
    assert list(reader.read([17])) == [changed]
    with pytest.raises(ValueError, match=f"Record 17 of {path} cannot be read"):
        ArrayRecordReader([str(path)]).read([17])


def test_a_flipped_byte_in_a_chunk_header_is_named(plain_file, tmp_path):
    source, records = plain_file
    # A chunk's data is 1 compression byte, 2 varints, then the record; its
    # 40-byte header ends right before. The byte flipped is its record count.
    path = _corrupt(source, tmp_path, records[5], -3 - 40 + 25)
    with pytest.raises(ValueError, match=f"Record 5 of {path} cannot be read"):
        ArrayRecordReader([path]).read([5])


def test_a_flipped_byte_in_a_block_header_is_named(tmp_path):
    records = [bytes([65 + r]) * 30_000 for r in range(5)]
    source = _write(tmp_path / "part-0.array_record", records)
    # The block header at 64 KiB sits inside record 2 (30 kB records and
    # small headers): a record whose bytes run over it fails, others read.
    path = str(tmp_path / "copy.array_record")
    data = bytearray(open(source, "rb").read())
    data[65536 + 12] ^= 0x01
    open(path, "wb").write(bytes(data))
    reader = ArrayRecordReader([path])
    assert list(reader.read([0, 4])) == [records[0], records[4]]
    with pytest.raises(ValueError, match=f"Record 2 of {path} cannot be read"):
        reader.read([2])


def test_a_file_that_changes_size_is_refused_not_read(plain_file):
    path, records = plain_file
    reader = ArrayRecordReader([path])
    assert list(reader.read([1])) == [records[1]]
    with open(path, "ab") as handle:
        handle.write(b"more")
    with pytest.raises(ValueError, match=f"{path} changed size since it was opened"):
        reader.read([1])


def test_an_empty_file_is_mapped_and_holds_no_records(tmp_path):
    path = _write(tmp_path / "part-0.array_record", [])
    reader = ArrayRecordReader([path])
    assert reader.mapped_files == (True,)
    assert reader.files.counts == (0,)
    assert list(reader.read([])) == []
