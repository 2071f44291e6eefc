"""A config's synthetic dataset: made, found and checked (`make-data`, `stats`, `demo`)."""

from __future__ import annotations

import dataclasses
import json

import pipelines
from sparseflow.config._run_config import RunConfig
from sparseflow.config._synthetic import SyntheticConfig

MANIFEST_NAME = "dataset.json"


def dataset_exists(config: RunConfig) -> bool:
    """Whether the config's dataset exists: records named by `dataset.train`, or a
    complete synthetic dataset in its directory."""
    return config.dataset.train is not None or (config.dataset.dir / MANIFEST_NAME).is_file()


def synthetic(config: RunConfig, command: str) -> SyntheticConfig:
    """The config's `synthetic` section, which `command` needs.

    Raises:
      ValueError: the config has none.
    """
    if config.synthetic is None:
        raise ValueError(
            f"{command} writes synthetic data, described by a config's `synthetic` "
            f"section; {config.source_path} has none."
        )
    return config.synthetic


def make_dataset(config: RunConfig) -> dict[str, list[str]]:
    """Writes the config's synthetic training set; returns the files per format."""
    described = synthetic(config, "make-data")
    return pipelines.write_synthetic_dataset(
        described.dataset,
        config.dataset.dir,
        num_examples=described.examples,
        seed=config.seed,
        num_shards=described.shards,
    )


def held_out_dir(config: RunConfig):
    """Where the held-out split of the config's dataset lives."""
    return config.dataset.dir / "eval"


def make_held_out(config: RunConfig) -> dict[str, list[str]]:
    """Writes the held-out split (same labelling function, other examples)."""
    described = synthetic(config, "make-data")
    return pipelines.write_synthetic_dataset(
        described.dataset,
        held_out_dir(config),
        num_examples=described.eval_examples,
        seed=config.seed,
        num_shards=1,
        formats=("arrayrecord",),
        held_out=True,
    )


def checked_manifest(config: RunConfig) -> dict:
    """The dataset's manifest, checked to describe the config's features."""
    path = config.dataset.dir / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    described = synthetic(config, "the synthetic dataset").dataset
    expected = [dataclasses.asdict(f) for f in described.features]
    if (
        manifest.get("features") != expected
        or manifest.get("num_dense_features") != described.num_dense_features
    ):
        raise pipelines.DataError(
            f"The dataset in {config.dataset.dir} was made for other features than "
            f"those of {config.source_path}; remove the directory to have it "
            "regenerated, or point dataset.dir elsewhere."
        )
    return manifest
