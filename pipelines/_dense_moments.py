"""The dense moments file: mean and std of the standardized dense keys.

Written by the FDO job beside its stats (`beam_jobs`), read by training to
standardize those keys (`RecordSchema.with_moments`):
`{"version": 1, "count": n, "keys": {key: {"mean": [...], "std": [...]}}}`.
The standard deviation is the population one, 0 stored as 1 (as
tf.Transform's `scale_to_z_score` leaves a constant value only centered).
"""

from __future__ import annotations

import json
import os

import numpy as np

from pipelines._schema import DenseTransform, RecordSchema

DENSE_MOMENTS_NAME = "dense_moments.json"
_VERSION = 1


def dense_moments_content(
    count: int, mean: np.ndarray, m2: np.ndarray, schema: RecordSchema
) -> dict:
    """The file's content from the moments of the dense input's columns.

    Args:
      count: rows seen.
      mean: `float64[d]`, per column of the dense input.
      m2: `float64[d]`, per column, the sum of squared deviations from `mean`.
      schema: the schema whose standardized keys are written.
    """
    keys, start = {}, 0
    for column in schema.dense:
        stop = start + column.length
        if column.transform is DenseTransform.STANDARDIZE:
            std = np.sqrt(m2[start:stop] / count)
            keys[column.key] = {
                "mean": mean[start:stop].tolist(),
                "std": np.where(std > 0, std, 1.0).tolist(),
            }
        start = stop
    return {"version": _VERSION, "count": count, "keys": keys}


def load_dense_moments(directory: str | os.PathLike) -> dict[str, tuple[list, list]]:
    """`{key: (mean, std)}` from the `dense_moments.json` of an FDO output directory.

    Raises:
      ValueError: the file is missing or not of this format.
    """
    path = os.path.join(directory, DENSE_MOMENTS_NAME)
    try:
        with open(path) as file:
            content = json.load(file)
        if content["version"] != _VERSION:
            raise ValueError(f"version {content['version']}, expected {_VERSION}")
        return {key: (m["mean"], m["std"]) for key, m in content["keys"].items()}
    except FileNotFoundError:
        raise ValueError(
            f"{path} is missing: the standardized dense keys need the mean and std the "
            "FDO job computes (run `sparseflow fdo`)"
        ) from None
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a dense moments file ({error})") from error
