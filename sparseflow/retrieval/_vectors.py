"""`TrainedTwoTower`: user and item vectors of a trained two-tower model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
from flax import nnx
from numpy.typing import ArrayLike

import embedding
from sparseflow import _dense_model, _predict, _train
from sparseflow._errors import UsageError
from sparseflow.config import RunConfig
from sparseflow.retrieval._ids import row_ids


@dataclasses.dataclass(frozen=True, eq=False)
class TrainedTwoTower:
    """A trained two-tower model's towers, run on ids outside the training loop.

    Each tower is run on its features' activations as the trainer's lookup
    gives them for unweighted ids: per row, the table rows of its ids summed,
    averaged (`mean`) or divided by the square root of their count
    (`sqrtn`), as the feature's table combines them; zeros for no ids.

    Attributes:
      model: the model (a `towers.TwoTower`, or a class with its
        `user_features`, `item_features`, `user_vectors` and `item_vectors`)
        holding the trained dense parameters; its `Embed` layer is abstract.
      tables: `float32[vocabulary_size, embedding_dim]` by feature name.
      combiners: each feature's table's combiner.
    """

    model: nnx.Module
    tables: Mapping[str, np.ndarray]
    combiners: Mapping[str, embedding.Combiner]

    @classmethod
    def from_result(cls, config: RunConfig, result: _train.TrainResult) -> TrainedTwoTower:
        """The towers of `result`, trained on `config` (whose `model.module` is the model).

        Raises:
          UsageError: the config's model is not a two-tower model.
        """
        mesh = _train.make_mesh(config.mesh.devices)
        model = _dense_model.dense_model(config, mesh)
        return cls.of_arrays(config, model, result.train_state.params, result.embedding_variables)

    @classmethod
    def from_checkpoint(cls, config: RunConfig, checkpoint_dir: str | Path) -> TrainedTwoTower:
        """The towers of the newest readable checkpoint of `config`'s run in `checkpoint_dir`.

        Raises:
          UsageError: the config's model is not a two-tower model, or there is
            no checkpoint; the errors of `sparseflow predict`'s restore.
        """
        mesh = _train.make_mesh(config.mesh.devices)
        model = _dense_model.dense_model(config, mesh)
        arrays = _predict.restore(config, mesh, model, Path(checkpoint_dir)).arrays
        return cls.of_arrays(config, model, arrays["state"].params, arrays["tables"])

    @classmethod
    def of_arrays(cls, config: RunConfig, model, params, variables) -> TrainedTwoTower:
        """The towers of `model` (the run's `_dense_model`) with `params`, over the tables
        of `variables` (`EmbeddingVariables` by stack, as a checkpoint holds them)."""
        mesh = _train.make_mesh(config.mesh.devices)
        merged = model.merged(params)
        if not all(hasattr(merged, name) for name in ("user_vectors", "item_vectors")):
            raise UsageError(
                f"model.module {config.model.module!r} has no user_vectors and item_vectors; "
                "TrainedTwoTower runs a two-tower model (sparseflow.towers:TwoTower)."
            )
        stacks = {name: v.table for name, v in variables.items()}
        by_table = embedding.gather_tables(
            stacks, config.feature_specs, mesh, num_sc_per_device=config.mesh.partitions_per_device
        )
        specs = config.feature_specs
        tables = {name: by_table[spec.table_spec.name] for name, spec in specs.items()}
        combiners = {name: spec.table_spec.combiner for name, spec in specs.items()}
        return cls(merged, tables, combiners)

    def every_item(self) -> tuple[np.ndarray, np.ndarray]:
        """`(int64[n] ids, float32[n, dim] vectors)`: the item tower on every row of its one
        feature's table (row j: item id j), for an approximate nearest neighbour index.

        Raises:
          UsageError: the item tower reads several features (an item is then
            more than one table's row: `item_vectors` of the items' ids).
        """
        features = self.model.item_features
        if len(features) != 1:
            raise UsageError(
                f"The item tower reads {list(features)}; every item's vector is the tower on "
                "each row of one feature's table, so give each item's ids to item_vectors."
            )
        ids = np.arange(len(self.tables[features[0]]), dtype=np.int64)
        return ids, self.item_vectors({features[0]: ids})

    def user_vectors(self, ids: Mapping[str, ArrayLike]) -> np.ndarray:
        """`float32[n, dim]`: the user tower on `ids`, per user feature `int[n]`
        (one id a row) or n lists of ids (`recent_items`, say)."""
        return self._run(self.model.user_vectors, self.model.user_features, ids)

    def item_vectors(self, ids: Mapping[str, ArrayLike]) -> np.ndarray:
        """`float32[n, dim]`: the item tower on `ids`, per item feature as `user_vectors`
        (e.g. `{"item_id": np.arange(num_items)}` for every item, row j item j)."""
        return self._run(self.model.item_vectors, self.model.item_features, ids)

    def _run(self, tower: Callable, features: tuple[str, ...], ids: Mapping[str, ArrayLike]):
        missing = sorted(set(features) - set(ids))
        if missing:
            raise ValueError(f"ids lack the tower's features {missing} (it reads {list(features)})")
        activations = {name: self._activations(name, ids[name]) for name in features}
        rows = {name: len(value) for name, value in activations.items()}
        if len(set(rows.values())) != 1:
            raise ValueError(f"ids must hold the same number of rows per feature, got {rows}.")
        return np.asarray(tower(activations))

    def _activations(self, name: str, ids: ArrayLike) -> np.ndarray:
        """`float32[n, dim]`: each row's ids' table rows, combined as the lookup does."""
        rows = row_ids(ids, f"ids[{name!r}]")
        table = self.tables[name]
        if rows.values.size and not 0 <= rows.values.min() <= rows.values.max() < len(table):
            raise ValueError(f"ids[{name!r}] must be ids in [0, {len(table)}) (the table's rows).")
        counts = np.diff(rows.row_splits)
        sums = np.zeros((rows.rows, table.shape[1]), np.float64)
        np.add.at(sums, np.repeat(np.arange(rows.rows), counts), table[rows.values])
        scale = {
            embedding.Combiner.SUM: np.ones_like(counts),
            embedding.Combiner.MEAN: counts,
            embedding.Combiner.SQRTN: np.sqrt(counts),
        }
        divisor = np.maximum(scale[self.combiners[name]], 1)
        return (sums / divisor[:, None]).astype(np.float32)
