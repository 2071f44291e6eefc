"""Synthetic Criteo-format click logs, written with vectorized numpy.

A line is tab-separated: a label (0 or 1), 13 integer counts and 26
categorical values of 8 hexadecimal digits; an empty field is a missing
value. A `LogProfile` says how the columns are drawn; `KAGGLE` follows the
Criteo Display Advertising Challenge (Kaggle) training set. The same profile,
seed and line count give the same file, byte for byte. Standard library and
numpy only.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

INT_COLUMNS = 13
CAT_COLUMNS = 26
_CHUNK = 100_000
_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
_TAB, _NEWLINE = ord("\t"), ord("\n")
# A uniform effect in [-0.5, 0.5] has this standard deviation.
_UNIFORM_STD = np.sqrt(1 / 12)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogProfile:
    """How the columns of a synthetic log are drawn.

    Attributes:
      cardinalities: distinct values of each categorical column (26). A value
        is drawn by its rank r in 1..cardinality with probability about
        proportional to r^-zipf, then written as a 32-bit value, distinct per
        rank and column.
      zipf: the exponent of that rank law (> 0, not 1).
      int_empty: the share of empty fields of each integer column (13).
      cat_empty: the share of empty fields of each categorical column (26).
      positives: the share of lines labelled 1.
      label_signal: the standard deviation of the part of a label's logit
        that its categorical values explain (each value of each column has a
        fixed effect); 0: labels independent of the features.
      bad_every: every n-th line has a non-integer count in `int_3`, which an
        importer must reject (0: none).

    The counts are `Zipf(1.5) - 1`: most are small, a few are huge.
    """

    cardinalities: tuple[int, ...]
    zipf: float
    int_empty: tuple[float, ...]
    cat_empty: tuple[float, ...]
    positives: float
    label_signal: float = 0.0
    bad_every: int = 0

    def __post_init__(self) -> None:
        sizes = {"cardinalities": CAT_COLUMNS, "int_empty": INT_COLUMNS, "cat_empty": CAT_COLUMNS}
        for name, size in sizes.items():
            if len(getattr(self, name)) != size:
                raise ValueError(f"LogProfile.{name} needs {size} entries")
        if self.zipf <= 0 or self.zipf == 1:
            raise ValueError(f"LogProfile.zipf must be > 0 and not 1, got {self.zipf}")


KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
"""Distinct values of the 26 categorical columns of the Kaggle training set."""

KAGGLE = LogProfile(
    cardinalities=KAGGLE_CARDINALITIES,
    zipf=1.1,
    # Shares of empty fields per column, rounded, as reported for the Kaggle
    # training set: about 20% of the counts and 11% of the categories.
    int_empty=(0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22),
    cat_empty=(0, 0, 0.03, 0.03, 0, 0.12, 0, 0, 0, 0, 0, 0.03, 0)
    + (0, 0, 0.03, 0, 0, 0.44, 0.44, 0.03, 0.76, 0, 0.03, 0.44, 0.44),
    positives=0.25,
    label_signal=1.0,
)


def cached_log(path: Path, lines: int, profile: LogProfile, *, seed: int = 0) -> Path:
    """`path`, a log of `lines` lines written by `write_log` if it is missing."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"writing {lines:,} lines to {path} ...", flush=True)
    temp = path.with_suffix(".tmp")
    write_log(temp, lines, profile, seed=seed)
    os.replace(temp, path)
    return path


def write_log(path: Path, lines: int, profile: LogProfile, *, seed: int = 0) -> None:
    """Writes `lines` lines drawn as `profile` says, in blocks of 100,000."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as file:
        for start in range(0, lines, _CHUNK):
            file.write(_block(rng, start, min(_CHUNK, lines - start), profile))


def _block(rng: np.random.Generator, start: int, n: int, profile: LogProfile) -> bytes:
    values = np.stack(
        [
            _categorical(rng, n, size, profile.zipf, c)
            for c, size in enumerate(profile.cardinalities)
        ],
        axis=1,
    )
    cat_empty = rng.random((n, CAT_COLUMNS)) < np.asarray(profile.cat_empty)
    counts = rng.zipf(1.5, (n, INT_COLUMNS)) - 1
    int_empty = rng.random((n, INT_COLUMNS)) < np.asarray(profile.int_empty)
    labels = _labels(rng, values, cat_empty, profile)
    fields = [_decimal(labels, np.zeros(n, bool))]
    fields += [_decimal(counts[:, j], int_empty[:, j]) for j in range(INT_COLUMNS)]
    if profile.bad_every:
        bad = np.flatnonzero((start + np.arange(n)) % profile.bad_every == profile.bad_every - 1)
        text, lengths = fields[3]  # int_3
        text[bad, 0], lengths[bad] = ord("x"), 1
    fields += [_hexadecimal(values[:, j], cat_empty[:, j]) for j in range(CAT_COLUMNS)]
    return _lines(fields).tobytes()


def _categorical(
    rng: np.random.Generator, n: int, cardinality: int, zipf: float, column: int
) -> np.ndarray:
    """`uint64[n]` 32-bit values of ranks drawn from a Zipf law bounded by `cardinality`.

    The rank inverts the law's continuous CDF on [1, cardinality + 1); an odd
    multiplier modulo 2^32 keeps distinct ranks distinct.
    """
    power = 1.0 - zipf
    top = (cardinality + 1.0) ** power - 1.0
    ranks = np.floor((1.0 + rng.random(n) * top) ** (1.0 / power)).astype(np.uint64)
    ranks = np.minimum(ranks, np.uint64(cardinality))
    offset = np.uint64((column + 1) * 0x7F4A7C15)
    return (ranks * np.uint64(0x9E3779B1) + offset) & np.uint64(0xFFFFFFFF)


def _labels(
    rng: np.random.Generator, values: np.ndarray, empty: np.ndarray, profile: LogProfile
) -> np.ndarray:
    """`int64[n]` labels with `profile.positives` ones on average, their logits
    partly a fixed effect per (column, value)."""
    effects = ((values * np.uint64(0x2545F491)) >> np.uint64(8)) & np.uint64(0xFFFF)
    effects = np.where(empty, 0.0, effects / 65535.0 - 0.5).sum(axis=1)
    logits = profile.label_signal * effects / (_UNIFORM_STD * np.sqrt(CAT_COLUMNS))
    low, high = -20.0, 20.0  # the bias that gives the asked share of positives
    for _ in range(40):
        bias = (low + high) / 2
        if np.mean(1 / (1 + np.exp(-(logits + bias)))) < profile.positives:
            low = bias
        else:
            high = bias
    chance = 1 / (1 + np.exp(-(logits + (low + high) / 2)))
    return (rng.random(len(logits)) < chance).astype(np.int64)


def _decimal(values: np.ndarray, empty: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(uint8[n, width] digits, int64[n] lengths)` of non-negative integers; empty ones 0 long."""
    text = values.astype("S20")
    lengths = np.where(empty, 0, np.char.str_len(text))
    width = max(int(lengths.max(initial=0)), 1)
    return text.view(np.uint8).reshape(len(values), 20)[:, :width].copy(), lengths


def _hexadecimal(values: np.ndarray, empty: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(uint8[n, 8] digits, int64[n] lengths)` of 32-bit values; empty ones 0 long."""
    shifts = np.arange(28, -4, -4, dtype=np.uint64)
    digits = _HEX[((values[:, None] >> shifts) & np.uint64(0xF)).astype(np.intp)]
    return digits, np.where(empty, 0, 8)


def _lines(fields: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The bytes of the lines: each row's fields, `lengths` long, tab-separated."""
    lengths = np.stack([length for _, length in fields], axis=1)
    with_separator = lengths + 1  # a tab after each field, a newline after the last
    ends = np.cumsum(with_separator.ravel()).reshape(lengths.shape)
    starts = ends - with_separator
    out = np.full(int(ends[-1, -1]), _TAB, np.uint8)
    out[ends[:, -1] - 1] = _NEWLINE
    for j, (text, length) in enumerate(fields):
        for c in range(text.shape[1]):
            rows = np.flatnonzero(length > c)
            out[starts[rows, j] + c] = text[rows, c]
    return out
