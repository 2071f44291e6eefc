"""`sparseflow demo`: the whole job on a config's synthetic data.

1. the synthetic training set and its held-out split (made if missing);
2. the offline FDO job (Apache Beam, in-process runner) over the training set;
3. pipelined training with the FDO limits, streaming batches through Grain,
   with a progress bar, TensorBoard metrics and orbax checkpoints;
4. AUC on the held-out split, and a summary;
5. two pictures: the FDO spread per partition (`fdo.png`) and the loss and
   AUC against the step (`training.png`, from the TensorBoard scalars).

Artifacts go to the demo's own run folder next to the dataset,
`<dataset.dir>/../demo_run/{fdo,checkpoints,metrics,fdo.png,training.png}`
(`runs/demo/demo_run` for the shipped demo), which every demo run
empties first (it does not resume); a folder of that name the demo did not
create is refused (`_demo_folder`).
"""

from __future__ import annotations

import time
from pathlib import Path

import beam_jobs
import embedding
from sparseflow import _datasets, _demo_folder, _fdo_run, _run_images, _train
from sparseflow._errors import UsageError
from sparseflow._train_summary import summary
from sparseflow.config._mesh import devices_noun
from sparseflow.config._run_config import RunConfig

RUN_DIR_NAME = "demo_run"
FDO_IMAGE = "fdo.png"
TRAINING_IMAGE = "training.png"


def run_dir(config: RunConfig) -> Path:
    """The demo's run folder: `demo_run` beside the dataset."""
    folder = config.dataset.dir.parent / RUN_DIR_NAME
    if folder == config.dataset.dir:
        raise UsageError(
            f"dataset.dir {config.dataset.dir} is the demo's run folder, which every demo "
            "run empties; give the dataset another directory name."
        )
    return folder


def claim_run_dir(config: RunConfig) -> Path:
    """The demo's run folder, emptied of an earlier demo run's outputs (or created).

    Raises:
      UsageError: a folder of that name exists that the demo did not create.
    """
    return _demo_folder.claim(run_dir(config))


def ensure_data(config: RunConfig) -> None:
    if not _datasets.dataset_exists(config):
        examples = _datasets.synthetic(config, "the demo").examples
        print(f"Writing {examples:,} training examples to {config.dataset.dir} ...")
        _datasets.make_dataset(config)
    _datasets.checked_manifest(config)
    held_out = _datasets.held_out_dir(config)
    if not (held_out / _datasets.MANIFEST_NAME).is_file():
        examples = config.synthetic.eval_examples
        print(f"Writing {examples:,} held-out examples to {held_out} ...")
        _datasets.make_held_out(config)


def run_fdo(config: RunConfig, data: str, folder: Path) -> tuple[Path, str]:
    """Runs the FDO job into `folder/fdo`, draws `folder/fdo.png`; returns the directory, a summary.

    `folder` comes from `claim_run_dir`: training merges every stats file of
    the directory (element-wise max), so stats of an earlier run, perhaps of
    another config or dataset, must not be there.
    """
    out = folder / "fdo"
    result = beam_jobs.run_fdo_job(_fdo_run.job_config(config), [data], str(out))
    _run_images.draw_fdo(config, result.stats, folder / FDO_IMAGE)
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
    folder = claim_run_dir(config)
    ensure_data(config)
    data = str(config.dataset.dir / "arrayrecord")
    fdo_dir, fdo_summary = run_fdo(config, data, folder)
    print(fdo_summary)
    checkpoints, metrics = folder / "checkpoints", folder / "metrics"
    result = _train.train(
        config,
        _train.TrainOptions(
            data=data,
            eval_data=str(_datasets.held_out_dir(config) / "arrayrecord"),
            fdo_dir=fdo_dir,
            checkpoint_dir=checkpoints,
            metrics_dir=metrics,
            progress=progress,
        ),
    )
    training_image = _run_images.draw_training(
        _run_images.read_scalars(metrics), folder / TRAINING_IMAGE
    )
    return "\n".join(
        [
            f"{config.name}: {devices_noun(config.mesh.devices)} x "
            f"{config.mesh.partitions_per_device} partitions, global batch "
            f"{config.global_batch_size}, "
            f"{'pipelined' if config.training.pipelined else 'sequential'}",
            summary(config, result),
            f"checkpoints: {checkpoints}",
            f"metrics: tensorboard --logdir {metrics}",
            f"pictures: {folder / FDO_IMAGE}  {training_image}",
            f"demo finished in {time.perf_counter() - began:.0f} s",
        ]
    )
