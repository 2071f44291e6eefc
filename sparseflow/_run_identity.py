"""What makes a checkpoint belong to a run: the config that sets its layout, and its data.

A checkpoint records the identity of the run that wrote it; `--resume`
compares it with the identity of the run resuming and names every
difference, so that a checkpoint folder is never continued by another run.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

import pipelines
from sparseflow.config._run_config import RunConfig

# Bytes read from each end of a data file for its fingerprint: enough to tell
# regenerated data from the original without reading whole files.
_SAMPLE_BYTES = 64 * 1024
_SHOWN_DIFFERENCES = 6

Identity = dict[str, Any]


def run_identity(
    config: RunConfig, data: str | Sequence[str], *, pipelined: bool, processes: int
) -> Identity:
    """The layout-relevant config and the dataset's fingerprint, JSON-able.

    Args:
      config: the run's config.
      data: the training data (files, directories or globs).
      pipelined: whether the run is SC/TC pipelined (its state is saved).
      processes: processes of the run (each saves its input position).
    """
    return dict(
        layout_identity(config, pipelined=pipelined, processes=processes),
        dataset=dataset_fingerprint(data),
    )


def layout_identity(config: RunConfig, *, pipelined: bool, processes: int) -> Identity:
    """`run_identity` without the dataset: what the config says of the run."""
    # The mesh first: a message shows the first differences, and another
    # device count also changes the stacked tables' layout after it.
    return {
        "mesh": dict(_plain(config.mesh), processes=processes),
        "tables": _plain(config.tables),
        "features": _plain(config.feature_specs),
        "dense_features": config.layout.num_dense_features,
        "global_batch_size": config.global_batch_size,
        "preprocessing": _plain(config.preprocessing),
        "model": _plain(config.model),
        "pipelined": pipelined,
        "input_order": {"seed": config.seed, "shuffle": config.training.shuffle},
    }


def dataset_fingerprint(data: str | Sequence[str]) -> dict[str, dict[str, Any]]:
    """Every record file by its path below the files' common directory: size and sampled hash.

    Relative paths keep the fingerprint of a dataset that was moved.
    """
    files = pipelines.list_record_files(data)
    common = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
    return {os.path.relpath(os.path.abspath(f), common): _file_fingerprint(f) for f in files}


def _file_fingerprint(path: str) -> dict[str, Any]:
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(_SAMPLE_BYTES))
        f.seek(max(size - _SAMPLE_BYTES, 0))
        digest.update(f.read(_SAMPLE_BYTES))
    return {"bytes": size, "sampled_sha256": digest.hexdigest()[:16]}


def array_layout(tree: Any) -> dict[str, str]:
    """Every array of `tree` by its path: `dtype[shape]`."""
    return {
        jax.tree_util.keystr(path): f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}"
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def differences(saved: Any, current: Any, where: str = "") -> list[str]:
    """Every entry where `saved` (the checkpoint's) and `current` (this run's) differ."""
    if isinstance(saved, dict) and isinstance(current, dict):
        found = []
        for key in [*saved, *(k for k in current if k not in saved)]:
            path = _join(where, str(key))
            if key not in current:
                found.append(f"{path} is only in the checkpoint")
            elif key not in saved:
                found.append(f"{path} is only in this run")
            else:
                found += differences(saved[key], current[key], path)
        return found
    if saved != current:
        return [f"{where}: {_short(saved)} in the checkpoint, {_short(current)} in this run"]
    return []


def _join(where: str, key: str) -> str:
    # Array paths (`['state'].params`) carry their own brackets.
    if not where or key.startswith("["):
        return f"{where}{key}"
    return f"{where}.{key}"


def describe(found: Sequence[str]) -> str:
    """The first differences, and how many more."""
    shown = "; ".join(found[:_SHOWN_DIFFERENCES])
    more = len(found) - _SHOWN_DIFFERENCES
    return f"{shown}; and {more} more" if more > 0 else shown


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _plain(value: Any) -> Any:
    """`value` as JSON-able data (dataclasses as dicts), unchanged by a JSON round trip."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # The class tells specs with the same fields apart (sgd from adagrad).
        fields = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"type": type(value).__name__, **fields}
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, str | int | float):
        return value
    return repr(value)
