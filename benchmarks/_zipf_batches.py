"""Batches of Zipf-distributed ragged ids, shared by the benchmarks."""

from __future__ import annotations

import numpy as np

import embedding

SCATTER = 2_654_435_761  # a prime near 2^32 / golden ratio


def make_batches(
    num_batches: int,
    seed: int,
    *,
    tables: int,
    rows: int,
    vocabulary: int,
    zipf: float,
    max_valency: int,
    scattered: bool = False,
) -> list[dict[str, embedding.RaggedIds]]:
    """`num_batches` dicts of `RaggedIds` by feature `f<t>`: `int32` ids
    `(Zipf(zipf) - 1) mod vocabulary`, 1..max_valency ids per row.

    With `scattered`, the id of rank `r` is `r * SCATTER mod vocabulary` (a
    permutation of the rows when `vocabulary` is not a multiple of the prime
    `SCATTER`): the popular rows lie all over the table, as hashed ids do,
    instead of in its first cache lines."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(num_batches):
        batch = {}
        for t in range(tables):
            lengths = rng.integers(1, max_valency + 1, rows)
            ranks = (rng.zipf(zipf, lengths.sum()) - 1) % vocabulary
            if scattered:
                ranks = ranks * SCATTER % vocabulary
            ids = ranks.astype(np.int32)
            batch[f"f{t}"] = embedding.RaggedIds(ids, np.concatenate([[0], np.cumsum(lengths)]))
        batches.append(batch)
    return batches
