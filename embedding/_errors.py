"""The base of the errors that bad input causes, in every sparseflow package."""

from __future__ import annotations


class SparseflowError(Exception):
    """A config, data file, stats file or command-line request that cannot be used.

    Its message names what was wrong and how to fix it; the `sparseflow`
    command prints it as one `error: ...` line. The concrete types are also
    `ValueError`s (`ConfigError`, `DataError`, `FdoStatsError`, ...); any
    other exception is a bug in sparseflow.
    """
