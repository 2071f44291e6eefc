"""`sparseflow demo` end to end on a small copy of the demo config."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from sparseflow import _cli

REPO = Path(__file__).resolve().parents[2]


def test_demo_runs_the_whole_job(tmp_path, capsys):
    raw = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    raw["dataset"] = {"dir": str(tmp_path / "data"), "examples": 3072, "eval_examples": 1024}
    raw["training"] = dict(raw["training"], steps=4, epochs=1, checkpoint_every=2, log_every=2)
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(raw))
    # A stats file left by an earlier demo run must not reach this run's limits.
    stale = tmp_path / "fdo" / "fdo_stats-offline-1.json"
    stale.parent.mkdir()
    stale.write_text('{"version": 1, "tables": {}}')

    assert _cli.main(["demo", "--config", str(config), "--no-progress"]) == 0
    out = capsys.readouterr().out
    written = re.search(r"FDO: 6 batches -> (.*fdo_stats-offline-\d+\.json)", out)
    assert written
    assert sorted((tmp_path / "fdo").glob("fdo_stats-*.json")) == [Path(written.group(1))]
    assert "trained 4 steps of 512 examples" in out
    assert re.search(r"eval AUC 0\.\d{4}", out)
    checkpoints = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints[-1] == 6  # 4 steps + 2 draining calls of the pipeline
    assert any((tmp_path / "metrics").iterdir())
