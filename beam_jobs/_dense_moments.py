"""Mean and standard deviation of the dense input over the training records.

The FDO job computes them for the dense keys a record schema standardizes
(`pipelines.DenseTransform.STANDARDIZE`), as tf.Transform's `scale_to_z_score`
does: the population mean and standard deviation of the values (after the
missing ones take their default), a standard deviation of 0 stored as 1 so
that a constant value only loses its mean. Each range of records yields
`(count, mean, M2)`, merged pairwise (Chan et al.) in float64, so the result
does not depend on how the records were split among workers beyond rounding.
They are written beside the FDO stats (format: `pipelines.dense_moments_content`).
"""

from __future__ import annotations

from typing import NamedTuple

import apache_beam as beam
import numpy as np

import pipelines
from pipelines import dense_moments_content


class Moments(NamedTuple):
    """Moments of the dense input's columns: `count` rows, `float64[d]` mean and M2."""

    count: int
    mean: np.ndarray
    m2: np.ndarray


def moments_of(dense: np.ndarray) -> Moments:
    """The moments of `dense: float32[rows, d]`."""
    values = np.asarray(dense, np.float64)
    mean = values.mean(axis=0) if len(values) else np.zeros(values.shape[1])
    return Moments(len(values), mean, ((values - mean) ** 2).sum(axis=0))


def merge(a: Moments, b: Moments) -> Moments:
    """The moments of the rows of `a` and `b` together."""
    count = a.count + b.count
    if not count:
        return a
    delta = b.mean - a.mean
    mean = a.mean + delta * (b.count / count)
    return Moments(count, mean, a.m2 + b.m2 + delta**2 * (a.count * b.count / count))


class DenseMomentsFn(beam.CombineFn):
    """`Moments` of parts -> the `Moments` of all of them."""

    def create_accumulator(self):
        return None

    def add_input(self, accumulator, moments):
        return moments if accumulator is None else merge(accumulator, moments)

    def merge_accumulators(self, accumulators):
        merged = None
        for accumulator in accumulators:
            if accumulator is not None:
                merged = self.add_input(merged, accumulator)
        return merged

    def extract_output(self, accumulator):
        return accumulator


def by_key(moments: Moments, schema: pipelines.RecordSchema) -> dict:
    """The moments file's content: per standardized dense key of `schema`, its mean and std."""
    return dense_moments_content(moments.count, moments.mean, moments.m2, schema)
