"""The config's `dataset` section: where the run's records live."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from sparseflow._config_checker import Node, get, integer, mapping


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    """Where the run's dataset lives and how big the synthetic one is.

    Attributes:
      dir: absolute directory of the dataset.
      examples: training examples.
      eval_examples: evaluation examples.
      shards: files per split and format.
    """

    dir: Path
    examples: int
    eval_examples: int
    shards: int = 1


def read_dataset(node: Node, config_dir: Path) -> DatasetConfig:
    mapping(node, ("dir", "examples", "eval_examples"), ("shards",))
    return DatasetConfig(
        # A relative dir is relative to the config file (or the folder
        # `load_config` was given), not to the working directory, so that
        # every job finds the same data.
        dir=Path(os.path.abspath(config_dir / get(node, "dir", "str"))),
        examples=integer(node, "examples"),
        eval_examples=integer(node, "eval_examples", minimum=0),
        shards=integer(node, "shards", 1),
    )
