"""The command line's own error type, beside the base of all user errors (`embedding`'s)."""

from __future__ import annotations

from embedding import SparseflowError


class UsageError(SparseflowError, ValueError):
    """Options that do not go together, or a run folder in the way; the message says what to do."""
