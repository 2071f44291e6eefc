"""Aligned plain-text tables for the command line's reports."""

from __future__ import annotations

from collections.abc import Sequence


def aligned_table(rows: Sequence[Sequence[str]], aligns: Sequence[str]) -> list[str]:
    """The lines of `rows` (the first the header) in columns, a rule under the header.

    `aligns` holds one format alignment per column: "<" or ">".
    """
    widths = [max(len(row[i]) for row in rows) for i in range(len(aligns))]
    lines = [
        "  ".join(
            f"{cell:{align}{width}}" for cell, align, width in zip(row, aligns, widths, strict=True)
        ).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return lines
