"""The README's worked example: Criteo-format lines -> `import` -> `fdo` -> `train`,
with the shipped `criteo` config (its vocabularies shrunk to keep the test small)."""

from __future__ import annotations

import json

import numpy as np
import yaml

from sparseflow import _cli, shipped_config

LINES = 1200
MALFORMED = 600  # this line has a column too few


def _criteo_lines(rng) -> list[str]:
    """Tab-separated: a label, 13 counts, 26 hex values; about a tenth of the fields empty.

    The label is 1 when `int_1` is large, so a model that reads the counts
    can learn it.
    """
    lines = []
    for index in range(LINES):
        counts = rng.integers(0, 100, 13)
        label = int(counts[0] > 50)
        fields = [str(label)]
        fields += ["" if rng.random() < 0.1 else str(c) for c in counts]
        fields += ["" if rng.random() < 0.1 else f"{rng.integers(0, 2**32):08x}" for _ in range(26)]
        if index == MALFORMED:
            fields = fields[:-1]
        lines.append("\t".join(fields))
    return lines


def _small_criteo_config(tmp_path) -> str:
    raw = yaml.safe_load(shipped_config("criteo").read_text())
    for table in raw["tables"]:
        table["vocabulary_size"] = 1_000
    raw["global_batch_size"] = 256
    raw["training"].update(steps=6, epochs=2, log_every=3, checkpoint_every=1000)
    path = tmp_path / "criteo.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_criteo_lines_import_and_train(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "day_0.tsv"
    source.write_text("\n".join(_criteo_lines(np.random.default_rng(0))) + "\n")
    records = tmp_path / "runs" / "criteo" / "records"
    argv = ["import", "--format", "criteo", "--input", str(source), "--out", str(records)]
    assert _cli.main([*argv, "--shards", "2", "--no-progress"]) == 0
    summary = json.loads((records / "import_summary.json").read_text())
    assert summary["records"] == LINES - 1
    dead_letters = (records / "dead_letters.jsonl").read_text().splitlines()
    letters = [json.loads(line) for line in dead_letters]
    assert [letter["line"] for letter in letters] == [MALFORMED + 1]

    config = _small_criteo_config(tmp_path)
    assert _cli.main(["fdo", "--config", config]) == 0
    fdo = tmp_path / "runs" / "criteo" / "fdo"
    assert len(list(fdo.glob("fdo_stats-offline-*.json"))) == 1

    checkpoints = tmp_path / "checkpoints"
    argv = ["train", "--config", config, "--fdo", str(fdo), "--no-progress"]
    assert _cli.main([*argv, "--checkpoint-dir", str(checkpoints)]) == 0
    saved = [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()]
    assert saved and max(saved) >= 6, f"no checkpoint after 6 steps: {sorted(saved)}"
