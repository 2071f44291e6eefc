"""Record files: finding them, reading them, writing them atomically.

Two formats, told apart by the file extension: ArrayRecord (`.array_record`,
random access, what Grain reads) and TFRecord (`.tfrecord`, sequential, what
tf.data and Beam read). Files whose name starts with a dot are never listed:
writers use such names for files that are not complete yet.
"""

from __future__ import annotations

import collections
import enum
import errno
import glob
import logging
import os
import re
from collections.abc import Iterator, Sequence

from array_record.python import array_record_module

from pipelines._errors import DataError, RecordFileNotFoundError
from pipelines._tensorflow import tf

_log = logging.getLogger(__name__)

# Each record its own chunk: a random read decodes one record, not a group.
# Uncompressed: a chunk of one record compresses by a few percent only, and
# decompressing it (zstd, the default) triples the cost of a random read.
_ARRAY_RECORD_WRITER_OPTIONS = "group_size:1,uncompressed"
_READ_BATCH = 1024
# TF wraps an op's message in the name of the function that ran it and the op.
_TF_NOISE = re.compile(r"^\{\{function_node [^}]*\}\}\s*|\s*\[Op:\w+\].*$", re.DOTALL)
_MAX_REASON_CHARS = 300

PathOrPaths = str | os.PathLike | Sequence[str | os.PathLike]


class RecordFormat(str, enum.Enum):
    """A record file format; the value is its name in configs and directories."""

    ARRAY_RECORD = "arrayrecord"
    TFRECORD = "tfrecord"

    @property
    def extension(self) -> str:
        return _EXTENSIONS[self]


_EXTENSIONS = {RecordFormat.ARRAY_RECORD: ".array_record", RecordFormat.TFRECORD: ".tfrecord"}
_FORMAT_NAMES = {RecordFormat.ARRAY_RECORD: "ArrayRecord", RecordFormat.TFRECORD: "TFRecord"}


def record_format(path: str | os.PathLike) -> RecordFormat:
    """The format of a record file, from its extension."""
    path = os.fspath(path)
    for fmt in RecordFormat:
        if path.endswith(fmt.extension):
            return fmt
    known = ", ".join(f"*{fmt.extension}" for fmt in RecordFormat)
    raise DataError(f"{path!r} is not a record file: its name must end in one of {known}.")


def require_record_format(paths: Sequence[str], fmt: RecordFormat, reader: str, other: str) -> None:
    """Raises DataError naming the first of `paths` that is not a `fmt` file.

    `reader` names the path reading `fmt` files, `other` the function that
    reads the rest.
    """
    for path in paths:
        if record_format(path) is not fmt:
            raise DataError(
                f"The {reader} path reads {_FORMAT_NAMES[fmt]} files "
                f"(*{fmt.extension}); {path} is not one. Read it with {other}."
            )


def list_record_files(data: PathOrPaths) -> list[str]:
    """Expands directories and glob patterns into record files.

    Args:
      data: a file, a directory (its record files, not recursive) or a glob
        pattern, or a sequence of those.

    Returns:
      The files, each entry's matches sorted, entries in the given order.

    Raises:
      DataError: an entry matches nothing, a matched file is not a record
        file, or a file is listed twice.
    """
    entries = [data] if isinstance(data, str | os.PathLike) else list(data)
    if not entries:
        raise DataError("No record files given: pass a file, a directory or a glob pattern.")
    files = [path for entry in entries for path in _expand(os.fspath(entry))]
    repeated = sorted(path for path, count in collections.Counter(files).items() if count > 1)
    if repeated:
        raise DataError(f"Record files {repeated} are listed twice in {entries}.")
    return files


def _expand(entry: str) -> list[str]:
    if os.path.isdir(entry):
        return _record_files_in(entry)
    matches = [path for path in sorted(glob.glob(entry)) if os.path.isfile(path)]
    if not matches:
        raise DataError(f"No files match {entry!r}.")
    for path in matches:
        record_format(path)
    return matches


def _record_files_in(directory: str) -> list[str]:
    names = sorted(name for name in os.listdir(directory) if not name.startswith("."))
    paths = [os.path.join(directory, name) for name in names]
    files = [path for path in paths if os.path.isfile(path) and _is_record_file(path)]
    if files:
        return files
    subdirectories = [path for path in paths if os.path.isdir(path) and _has_record_files(path)]
    hint = f" Its subdirectories {subdirectories} do: pass one of them." if subdirectories else ""
    extensions = ", ".join(f"*{fmt.extension}" for fmt in RecordFormat)
    raise DataError(f"Directory {directory!r} holds no record files ({extensions}).{hint}")


def _is_record_file(path: str) -> bool:
    return any(path.endswith(fmt.extension) for fmt in RecordFormat)


def _has_record_files(directory: str) -> bool:
    return any(_is_record_file(name) and not name.startswith(".") for name in os.listdir(directory))


def read_records(paths: PathOrPaths) -> Iterator[bytes]:
    """Yields the records of the files, file after file, in file order.

    Args:
      paths: one record file or a sequence of them (see `list_record_files`
        for directories and patterns).

    Raises:
      RecordFileNotFoundError: a file does not exist.
      DataError: a file is not a readable record file of its format (named).
    """
    paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    for path in map(os.fspath, paths):
        fmt = record_format(path)
        if not os.path.isfile(path):
            raise RecordFileNotFoundError(errno.ENOENT, "Record file not found", path)
        if fmt is RecordFormat.ARRAY_RECORD:
            yield from _read_array_record(path)
        else:
            yield from _read_tfrecord(path)


def _read_array_record(path: str) -> Iterator[bytes]:
    reader = array_record_module.ArrayRecordReader(path)
    # The reader opens a truncated or foreign file without raising; it reports
    # the failure through ok(), and its reason only when closed.
    opened = reader.ok()
    try:
        if opened:
            count = reader.num_records()
            for start in range(0, count, _READ_BATCH):
                yield from reader.read(start, min(count, start + _READ_BATCH))
    except RuntimeError as error:
        raise DataError(f"{path}: corrupt or truncated ArrayRecord file: {error}") from error
    finally:
        failure = _close(reader)
    if failure or not opened:
        reason = failure or "the reader opens it but gives no reason"
        raise DataError(f"{path}: corrupt or truncated ArrayRecord file: {reason}")


def _close(reader: array_record_module.ArrayRecordReader) -> str | None:
    """Closes the reader; returns why it failed, if it did."""
    try:
        reader.close()
    except RuntimeError as error:
        return str(error)
    return None


def _read_tfrecord(path: str) -> Iterator[bytes]:
    batches = iter(tf.data.TFRecordDataset(path).batch(_READ_BATCH))
    while True:
        try:
            batch = next(batches, None)
        except tf.errors.OpError as error:
            reason = tf_error_reason(error)
            raise DataError(f"{path}: corrupt or truncated TFRecord file: {reason}") from error
        if batch is None:
            return
        yield from batch.numpy().tolist()


def tf_error_reason(error: Exception) -> str:
    """The useful part of a TF error's message, shortened."""
    message = getattr(error, "message", None) or str(error)
    return _TF_NOISE.sub("", message)[:_MAX_REASON_CHARS]


class RecordFileWriter:
    """Writes one record file atomically.

    Records go to a hidden temporary file in the target directory, renamed to
    the target on a clean exit and deleted on an exception, so a file under
    its final name is always complete.

    Example:
      with RecordFileWriter("data/part-00000-of-00001.tfrecord") as writer:
          writer.write(record)
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._format = record_format(self.path)
        directory, name = os.path.split(self.path)
        self._temp_path = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
        self._writer = None
        self.count = 0

    def __enter__(self) -> RecordFileWriter:
        if self._format is RecordFormat.ARRAY_RECORD:
            self._writer = array_record_module.ArrayRecordWriter(
                self._temp_path, _ARRAY_RECORD_WRITER_OPTIONS
            )
        else:
            self._writer = tf.io.TFRecordWriter(self._temp_path)
        return self

    def write(self, record: bytes) -> None:
        self._writer.write(record)
        self.count += 1

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            self._writer.close()
        except BaseException:
            self._discard()
            raise
        if exc_type is None:
            os.replace(self._temp_path, self.path)
            _log.debug("Wrote %d records to %s", self.count, self.path)
        else:
            self._discard()

    def _discard(self) -> None:
        if os.path.exists(self._temp_path):
            os.remove(self._temp_path)
