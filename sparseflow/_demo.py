"""`sparseflow demo`: the whole job on a config's synthetic data.

1. the synthetic training set and its held-out split (made if missing);
2. the offline FDO job (Apache Beam, in-process runner) over the training set;
3. pipelined training with the FDO limits, streaming batches through Grain,
   with a progress bar, TensorBoard metrics and orbax checkpoints;
4. AUC on the held-out split, and a summary.

Artifacts go next to the dataset: `<dataset.dir>/../{fdo,checkpoints,metrics}`.
A demo run starts from fresh checkpoints (it does not resume).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import beam_jobs
import embedding
from sparseflow import _fdo_command, _stats_report, _train
from sparseflow._config import RunConfig
from sparseflow._train_command import summary


def run_dir(config: RunConfig) -> Path:
    return config.dataset.dir.parent


def ensure_data(config: RunConfig) -> None:
    if not _stats_report.dataset_exists(config):
        print(f"Writing {config.dataset.examples:,} training examples to {config.dataset.dir} ...")
        _stats_report.make_dataset(config)
    _stats_report.checked_manifest(config)
    held_out = _stats_report.held_out_dir(config)
    if not (held_out / _stats_report.MANIFEST_NAME).is_file():
        print(f"Writing {config.dataset.eval_examples:,} held-out examples to {held_out} ...")
        _stats_report.make_held_out(config)


def run_fdo(config: RunConfig, data: str) -> tuple[Path, str]:
    out = run_dir(config) / "fdo"
    # Training merges every stats file of the directory (element-wise max):
    # the files of earlier demo runs, perhaps of another config or dataset,
    # would set this run's limits. The demo starts afresh, as its checkpoints do.
    shutil.rmtree(out, ignore_errors=True)
    result = beam_jobs.run_fdo_job(_fdo_command.job_config(config), [data], str(out))
    limits = embedding.fdo_limits(result.stats, headroom=config.training.fdo_headroom)
    lines = [f"FDO: {result.stats.batches} batches -> {result.stats_path}"]
    for name, limit in limits.items():
        lines.append(
            f"  {name:<16} max ids/partition {limit.max_ids_per_partition:>5}   "
            f"max unique {limit.max_unique_ids_per_partition:>5}   "
            f"buffer/device {limit.suggested_coo_buffer_size_per_device:>6}"
        )
    return out, "\n".join(lines)


def run(config: RunConfig, *, progress: bool = True) -> str:
    """Runs the demo; returns its summary."""
    began = time.perf_counter()
    ensure_data(config)
    data = str(config.dataset.dir / "arrayrecord")
    fdo_dir, fdo_summary = run_fdo(config, data)
    print(fdo_summary)
    checkpoints = run_dir(config) / "checkpoints"
    shutil.rmtree(checkpoints, ignore_errors=True)
    result = _train.train(
        config,
        _train.TrainOptions(
            data=data,
            eval_data=str(_stats_report.held_out_dir(config) / "arrayrecord"),
            fdo_dir=fdo_dir,
            checkpoint_dir=checkpoints,
            metrics_dir=run_dir(config) / "metrics",
            progress=progress,
        ),
    )
    return "\n".join(
        [
            f"{config.name}: {config.mesh.devices} devices x "
            f"{config.mesh.partitions_per_device} partitions, global batch "
            f"{config.global_batch_size}, "
            f"{'pipelined' if config.training.pipelined else 'sequential'}",
            summary(config, result),
            f"checkpoints: {checkpoints}   metrics: {run_dir(config) / 'metrics'}",
            f"demo finished in {time.perf_counter() - began:.0f} s",
        ]
    )
