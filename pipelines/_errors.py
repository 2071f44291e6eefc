"""Errors of the input: record files, the records in them, the processes reading them."""

from __future__ import annotations

from embedding import SparseflowError


class DataError(SparseflowError, ValueError):
    """A dataset that is missing, unreadable or unfit for the run; the file is named."""


class RecordFileNotFoundError(DataError, FileNotFoundError):
    """A record file named explicitly that does not exist."""


class InputWorkerError(SparseflowError, RuntimeError):
    """A worker process of the input ended while the run needed it; the worker is named."""


class InputTimeoutError(SparseflowError, TimeoutError):
    """No batch came within the input timeout; the batch and who prepares it are named."""
