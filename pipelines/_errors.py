"""Errors of the input data: record files and the records in them."""

from __future__ import annotations

from embedding import SparseflowError


class DataError(SparseflowError, ValueError):
    """A dataset that is missing, unreadable or unfit for the run; the file is named."""


class RecordFileNotFoundError(DataError, FileNotFoundError):
    """A record file named explicitly that does not exist."""
