"""Writes `sparseflow predict`'s rows to Parquet, CSV or JSON Lines, by the file's extension.

Columns: `score` (the model's output, the logit for the shipped towers;
null for a bad record that was skipped), `label` (null where the record has
none), then each kept record key.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet

from sparseflow._errors import UsageError
from sparseflow._predict import Predictions

FORMATS = (".parquet", ".csv", ".jsonl")


def check_path(path: str | Path) -> Path:
    """`path`, if its extension names a format.

    Raises:
      UsageError: it names none (the message lists them).
    """
    path = Path(path)
    if path.suffix not in FORMATS:
        raise UsageError(
            f"{path}: the extension chooses the format; use one of {', '.join(FORMATS)}."
        )
    return path


def table(predictions: Predictions) -> pa.Table:
    """The rows, one per record in input order."""
    columns = {
        "score": pa.array(predictions.scores, mask=np.isnan(predictions.scores)),
        "label": pa.array(predictions.labels, mask=predictions.labels < 0),
    }
    for key, values in predictions.kept.items():
        if key in columns:
            raise UsageError(f"--keep {key}: a column of that name is written already.")
        columns[key] = pa.array(values)
    return pa.table(columns)


def write_predictions(predictions: Predictions, path: str | Path) -> Path:
    """Writes the rows to `path` (its parent folder created), in its extension's format."""
    path = check_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = table(predictions)
    if path.suffix == ".parquet":
        pyarrow.parquet.write_table(rows, path)
    elif path.suffix == ".csv":
        pyarrow.csv.write_csv(rows, path)
    else:
        with path.open("w") as out:
            for row in rows.to_pylist():
                out.write(json.dumps(row) + "\n")
    return path
