"""What the FDO job needs to know about a run."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import embedding
import pipelines
from embedding.checks import check_int

DEFAULT_RECORDS_PER_RANGE = 8192
DEFAULT_TOP_K = 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingOrder:
    """How training orders the records (its Grain input path), for the job to follow.

    Attributes:
      shuffle_seed: training's shuffle seed, or None for file order.
      epochs: passes over the data training makes (the job computes stats
        over the batches of all of them).
    """

    shuffle_seed: int | None
    epochs: int = 1

    def __post_init__(self) -> None:
        # The same checks as the training input's.
        pipelines.BatchingConfig(
            global_batch_size=1, num_epochs=self.epochs, shuffle_seed=self.shuffle_seed
        )


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class FdoJobConfig:
    """The run the FDO job computes stats for.

    Attributes:
      feature_specs: per sparse feature (its record key), its spec, with the
        run's table stacking applied (unstacked tables may be unprepared).
      layout: what a record holds; its sparse features are those of
        `feature_specs`.
      geometry: global batch size, devices, partitions per device, processes.
      config_hash: the run config's hash, written into the stats file.
      top_k: heavy hitters kept per table.
      records_per_range: records one worker reads at a time (the unit of
        parallelism; a file of R records is read as ceil(R / this) ranges).
      fdo_layout: what the stats depend on (`embedding.fdo_layout`), written
        into the stats file: a run of the same layout may use them.
      training_order: training's record order: the job then forms exactly
        the batches training draws (`beam_jobs._training_batches`) and
        the stats say so (`FdoStats.batch_order`). None: the batches of the
        good records in file order (`beam_jobs._batches`), for input
        paths whose order the job does not know.
      moments_schema: a record schema whose standardized dense keys get
        their mean and std computed (`layout` must read them raw); None: none.
    """

    feature_specs: Mapping[str, embedding.FeatureSpec]
    layout: pipelines.FeatureLayout
    geometry: embedding.FdoGeometry
    config_hash: str
    top_k: int = DEFAULT_TOP_K
    records_per_range: int = DEFAULT_RECORDS_PER_RANGE
    fdo_layout: embedding.FdoLayout | None = None
    training_order: TrainingOrder | None = None
    moments_schema: pipelines.RecordSchema | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_specs", dict(self.feature_specs))
        if set(self.feature_specs) != set(self.layout.sparse):
            raise ValueError(
                f"The layout's sparse features {sorted(self.layout.sparse)} differ from the "
                f"features of feature_specs {sorted(self.feature_specs)}."
            )
        batch = self.geometry.global_batch_size
        for name, spec in self.feature_specs.items():
            if spec.global_batch_size != batch:
                raise ValueError(
                    f"Feature {name!r} has global batch {spec.global_batch_size}, the geometry "
                    f"{batch}; they must agree."
                )
        for name in ("top_k", "records_per_range"):
            value = getattr(self, name)
            minimum = 0 if name == "top_k" else 1
            check_int(value, name, minimum)

    @property
    def vocabulary_sizes(self) -> dict[str, int]:
        """Per feature, its table's vocabulary size."""
        return {name: spec.table_spec.vocabulary_size for name, spec in self.feature_specs.items()}
