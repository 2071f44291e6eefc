"""The FDO job as a run config sees it: its job config, and the limits FDO replaces."""

from __future__ import annotations

import beam_jobs
import embedding
import pipelines
from sparseflow.config._run_config import RunConfig


def job_config(config: RunConfig) -> beam_jobs.FdoJobConfig:
    """The FDO job's view of a run config: training's batches; the stats carry its layout."""
    return beam_jobs.FdoJobConfig(
        feature_specs=config.feature_specs,
        # The moments of standardized keys are those of the raw values.
        layout=pipelines.FeatureLayout.from_schema(config.layout.schema.without_standardization()),
        moments_schema=config.layout.schema if config.layout.schema.standardized() else None,
        geometry=config.fdo_geometry,
        config_hash=config.config_hash,
        fdo_layout=config.fdo_layout,
        training_order=beam_jobs.TrainingOrder(
            shuffle_seed=config.seed if config.training.shuffle else None,
            epochs=config.training.epochs,
        ),
    )


def configured_limits(config: RunConfig) -> dict[str, int]:
    """Per stacked table, the `max_ids_per_partition` the config sets (what FDO replaces)."""
    prepared = embedding.prepare_feature_specs_for_training(
        config.feature_specs, config.mesh.devices, config.mesh.partitions_per_device
    )
    return {
        name: stack.max_ids_per_partition
        for name, stack in embedding.get_stacked_table_specs(prepared).items()
    }
