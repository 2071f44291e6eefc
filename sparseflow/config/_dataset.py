"""The config's `dataset` section: where the run's records live.

  dataset:
    dir: runs/demo/data          # the run's data folder (synthetic data, FDO stats)
    train: [/data/train-*.tfrecord]   # optional: files, directories or globs
    eval: /data/eval                  # optional

Without `train`, training reads the synthetic data `make-data` writes under
`dir`. Relative paths start from the config file's folder (or the folder
`load_config` was given), not from the working directory, so that every job
finds the same data.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from sparseflow.config._checker import Node, check_kind, get, mapping

SYNTHETIC_TRAIN_DIR = "arrayrecord"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    """Where the run's dataset lives.

    Attributes:
      dir: absolute directory of the run's data (synthetic data, FDO stats).
      train: training record files, directories or globs (absolute); None:
        the synthetic data under `dir`.
      eval: held-out record files, directories or globs; None: none.
    """

    dir: Path
    train: tuple[str, ...] | None = None
    eval: tuple[str, ...] | None = None

    @property
    def train_data(self) -> tuple[str, ...]:
        """What training reads: `train`, or the synthetic training split under `dir`."""
        return self.train or (os.fspath(self.dir / SYNTHETIC_TRAIN_DIR),)


def _paths(node: Node, key: str, config_dir: Path) -> tuple[str, ...] | None:
    """A path or a non-empty list of paths at `key`, absolute; None when absent."""
    if not node.has(key):
        return None
    child = node.child(key)
    if isinstance(child.value, str):
        entries = [check_kind(child, "str")]
    else:
        if not check_kind(child, "list"):
            raise child.error("expected a path or a non-empty list of paths")
        entries = [check_kind(child.child(i), "str") for i in range(len(child.value))]
    return tuple(os.path.abspath(config_dir / entry) for entry in entries)


def read_dataset(node: Node, config_dir: Path) -> DatasetConfig:
    mapping(node, ("dir",), ("train", "eval"))
    return DatasetConfig(
        dir=Path(os.path.abspath(config_dir / get(node, "dir", "str"))),
        train=_paths(node, "train", config_dir),
        eval=_paths(node, "eval", config_dir),
    )
