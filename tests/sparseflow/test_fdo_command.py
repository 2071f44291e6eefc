"""`sparseflow fdo`: the offline FDO job from the command line."""

from pathlib import Path

import yaml

import embedding
import pipelines
from sparseflow import _cli, load_config


def _config(tmp_path: Path) -> Path:
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
            {"name": "fa1", "table": "a", "valency": [1, 3]},
            {"name": "fa2", "table": "a", "valency": [1, 2]},
            {"name": "fb", "table": "b", "valency": [1, 1], "weighted": True},
        ],
        "dense_features": 2,
        "dataset": {"dir": "data", "examples": 150, "eval_examples": 10, "shards": 2},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_fdo_writes_stats_for_the_config_and_a_figure(tmp_path, capsys):
    config_path = _config(tmp_path)
    config = load_config(config_path)
    pipelines.write_synthetic_dataset(
        config.synthetic, config.dataset.dir, num_examples=150, seed=0, num_shards=2
    )
    out, figure = tmp_path / "fdo", tmp_path / "fdo.png"
    status = _cli.main(
        [
            "fdo",
            "--config",
            str(config_path),
            "--out",
            str(out),
            "--plot",
            str(figure),
            "--headroom",
            "1.25",
            "--",
            "--direct_num_workers=1",
        ]
    )
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert (
        "4 global batches of 32 from 150 records (0 bad, 22 after the last whole batch)" in printed
    )

    geometry = embedding.FdoGeometry(global_batch_size=32, devices=4, partitions_per_device=2)
    stats = embedding.load_fdo_stats(
        out, expected_config_hash=config.config_hash, expected_geometry=geometry
    )
    assert stats.batches == 4 and sorted(stats.stacks) == ["a_b"]
    limits = embedding.fdo_limits(stats, headroom=1.25)["a_b"]
    assert f"a_b: max_ids_per_partition {limits.max_ids_per_partition} [128]" in printed
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "dead_letters.jsonl").read_text() == ""


def test_fdo_without_record_files_is_a_user_error(tmp_path, capsys):
    status = _cli.main(
        ["fdo", "--config", str(_config(tmp_path)), "--data", str(tmp_path / "none*.tfrecord")]
    )
    assert status == 2
    assert capsys.readouterr().err.startswith("error: No files match")
