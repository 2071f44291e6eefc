"""A tiny run config for the command-line tests: `tiny.yaml` in a folder, its dataset in `data`."""

from __future__ import annotations

from pathlib import Path

import yaml


def tiny_config(tmp_path: Path) -> Path:
    """A tiny run on 4 devices x 2 partitions: `a` (two features) stacked with `b`."""
    table = {
        "embedding_dim": 8,
        "combiner": "sum",
        "optimizer": {"type": "sgd", "learning_rate": 0.1},
        "initializer": {"type": "constant", "value": 0.0},
        "max_ids_per_partition": 64,
        "max_unique_ids_per_partition": 64,
    }
    raw = {
        "name": "tiny",
        "seed": 0,
        "mesh": {"devices": 4, "partitions_per_device": 2},
        "global_batch_size": 32,
        "tables": [
            {"name": "a", "vocabulary_size": 100, **table},
            {"name": "b", "vocabulary_size": 50, **table},
        ],
        "stacks": [["a", "b"]],
        "features": [
            {"name": "fa1", "table": "a"},
            {"name": "fa2", "table": "a"},
            {"name": "fb", "table": "b", "weighted": True},
        ],
        "dense_features": 2,
        "dataset": {"dir": "data"},
        "synthetic": {
            "examples": 150,
            "eval_examples": 10,
            "shards": 2,
            "features": {
                "fa1": {"valency": [1, 3]},
                "fa2": {"valency": [1, 2]},
                "fb": {"valency": [1, 1]},
            },
        },
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path
