"""Record files named by fsspec URLs (`gs://...`, `s3://...`, `file:///...`): listed, and fetched.

The record readers (ArrayRecord's, and TFRecord's through tf.data) open local
paths, so a worker fetches a file named by a URL whole into a temporary
local file before reading it. Such a file is read as one range
(`split_file`): each of the job's passes fetches it once, and the files are
spread over the workers.
"""

from __future__ import annotations

import collections
import contextlib
import os
import posixpath
import shutil
import tempfile
from collections.abc import Iterator, Sequence

import fsspec

import pipelines
from pipelines import DataError

_RECORD_SUFFIXES = (".array_record", ".tfrecord")


def is_url(path: str) -> bool:
    """Whether `path` names a file through a filesystem protocol (`gs://bucket/x`)."""
    return "://" in path


def list_files(data: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """`pipelines.list_record_files`, where entries may also be fsspec URLs.

    A URL names a file, a directory (its record files) or a glob pattern; the
    files it matches are returned as URLs.

    Raises:
      DataError: an entry matches no record file, or a file is listed twice.
    """
    entries = [data] if isinstance(data, str | os.PathLike) else list(data)
    if not any(is_url(os.fspath(entry)) for entry in entries):
        return pipelines.list_record_files(data)
    files = [
        path
        for entry in map(os.fspath, entries)
        for path in (_expand_url(entry) if is_url(entry) else pipelines.list_record_files(entry))
    ]
    repeated = sorted(path for path, count in collections.Counter(files).items() if count > 1)
    if repeated:
        raise DataError(f"Record files {repeated} are listed twice in {entries}.")
    return files


def _expand_url(entry: str) -> list[str]:
    try:
        fs, path = fsspec.core.url_to_fs(entry)
        if fs.isdir(path):
            found = [p for p in fs.ls(path, detail=False) if fs.isfile(p)]
        else:
            found = [p for p in fs.glob(path) if fs.isfile(p)]
    except (OSError, ValueError) as e:
        raise DataError(f"Cannot list {entry!r}: {e}") from e
    matches = sorted(
        p
        for p in found
        if p.endswith(_RECORD_SUFFIXES) and not posixpath.basename(p).startswith(".")
    )
    if not matches:
        raise DataError(f"No record files ({', '.join(_RECORD_SUFFIXES)}) match {entry!r}.")
    return [fs.unstrip_protocol(p) for p in matches]


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """Yields a local path of the file: `path` itself, or a fetched copy of a URL's file.

    Raises:
      DataError: the URL's file cannot be fetched (named).
    """
    if not is_url(path):
        yield path
        return
    suffix = next((s for s in _RECORD_SUFFIXES if path.endswith(s)), "")
    with tempfile.TemporaryDirectory(prefix="sparseflow-records-") as directory:
        local = os.path.join(directory, f"records{suffix}")
        try:
            with fsspec.open(path, "rb") as source, open(local, "wb") as target:
                shutil.copyfileobj(source, target)
        except OSError as e:
            raise DataError(f"{path}: cannot fetch the record file: {e}") from e
        yield local
