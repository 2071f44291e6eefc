"""`load_exported`: an export folder's tables and forward, scoring raw ids."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jax import export

from sparseflow_serving._manifest import FORMAT_VERSION, MANIFEST_NAME


class ExportedModel:
    """A model `sparseflow export` wrote: its tables, manifest and forward program.

    Attributes:
      manifest: the folder's `manifest.json`.
      tables: `float32[vocabulary_size, dim]` by table name, rows in vocabulary order.
    """

    def __init__(
        self,
        directory: Path,
        manifest: dict,
        tables: dict[str, np.ndarray],
        forward: export.Exported | None,
    ):
        self._directory = directory
        self.manifest, self.tables, self._forward = manifest, tables, forward
        self._features = {feature["name"]: feature for feature in manifest["features"]}

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """A two-tower model's `(int64[n] ids, float32[n, dim] vectors)` of every item.

        Raises:
          ValueError: the export is of a model of logits, which has no items.
        """
        items = self.manifest.get("items")
        if items is None:
            raise ValueError("This export is of a model of logits: it holds no item vectors.")
        return np.load(self._directory / items["ids"]), np.load(self._directory / items["vectors"])

    def score(
        self,
        ids: Mapping[str, Sequence[Sequence[int]]],
        dense: Any,
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
    ) -> np.ndarray:
        """The model's outputs (logits) of a batch.

        Args:
          ids: per feature (every one of the manifest's), each example's ids:
            ints in `[0, vocabulary_size)`; bytes ids hashed already, as the
            manifest's `hashing` says.
          dense: `float[batch, num_dense_features]`, the dense inputs after the
            record schema's transforms (the manifest's `dense`).
          weights: per weighted feature, one weight >= 0 per id; the others
            (and a feature left out) weigh each id 1.

        Returns:
          `float32[batch]`.

        Raises:
          ValueError: a feature missing or unknown, an id out of its table, a
            batch size that differs between the inputs, or an export of item
            vectors only.
        """
        if self._forward is None:
            raise ValueError(
                "This export is of a two-tower model: it holds its item vectors (items()), "
                "no forward to score with."
            )
        dense = np.asarray(dense, np.float32)
        weights = dict(weights or {})
        unknown = sorted(set(ids) - set(self._features))
        missing = sorted(set(self._features) - set(ids))
        if unknown or missing:
            raise ValueError(
                f"ids must hold every feature of the export: unknown {unknown}, missing {missing}."
            )
        padded = {name: self._padded(name, ids[name], weights.get(name), dense.shape[0])
                  for name in self._features}  # fmt: skip
        id_arrays = {name: value[0] for name, value in padded.items()}
        weight_arrays = {name: value[1] for name, value in padded.items()}
        return np.asarray(self._forward.call(self.tables, id_arrays, weight_arrays, dense))

    def _padded(self, name: str, rows, weights, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """`(int32[batch, length], float32[batch, length])`: the rows padded with id 0 of
        weight 0 to a power-of-two length (few lengths, few compilations)."""
        if len(rows) != batch:
            raise ValueError(f"Feature {name!r} has {len(rows)} examples, dense has {batch}.")
        longest = max((len(row) for row in rows), default=0)
        length = 1 << max(longest - 1, 0).bit_length()
        ids = np.zeros((batch, length), np.int32)
        gains = np.zeros((batch, length), np.float32)
        vocabulary = self.tables[self._features[name]["table"]].shape[0]
        for r, row in enumerate(rows):
            row = np.asarray(row, np.int64)
            if row.size and (row.min() < 0 or row.max() >= vocabulary):
                raise ValueError(
                    f"Feature {name!r}, example {r}: ids {row.tolist()} are not all in "
                    f"[0, {vocabulary})."
                )
            ids[r, : row.size] = row
            gains[r, : row.size] = 1.0 if weights is None else np.asarray(weights[r], np.float32)
        return ids, gains


def load_exported(directory: str | os.PathLike) -> ExportedModel:
    """Loads the folder `sparseflow export` wrote.

    Raises:
      ValueError: it holds no manifest of a known format version.
    """
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise ValueError(
            f"{directory} holds no {MANIFEST_NAME}: give the folder of sparseflow export."
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} is of format version {manifest.get('format_version')!r}; this loader reads "
            f"version {FORMAT_VERSION}. Export the model again with this sparseflow."
        )
    tables = {
        name: np.load(directory / table["file"]) for name, table in manifest["tables"].items()
    }
    forward = manifest.get("forward")
    if forward is not None:
        forward = export.deserialize(bytearray((directory / forward).read_bytes()))
    return ExportedModel(directory, manifest, tables, forward)
