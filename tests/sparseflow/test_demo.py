"""`sparseflow demo` end to end on a small copy of the demo config."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
import yaml
from png_checks import assert_drawn_png

from sparseflow import _cli, _demo_folder, shipped_config

REPO = Path(__file__).resolve().parents[2]


def _small_demo_config(tmp_path: Path) -> Path:
    raw = yaml.safe_load(shipped_config("demo").read_text())
    raw["dataset"] = {"dir": str(tmp_path / "data")}
    raw["synthetic"].update(examples=3072, eval_examples=1024)
    raw["training"] = dict(raw["training"], steps=4, epochs=1, checkpoint_every=2, log_every=2)
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(raw))
    return config


def test_demo_runs_the_whole_job(tmp_path, capsys, monkeypatch):
    config = _small_demo_config(tmp_path)
    # Folders of the user's beside the dataset, with the names the demo writes inside its own.
    users = [tmp_path / "fdo" / "fdo_stats-offline-1.json", tmp_path / "checkpoints" / "7"]
    for path in users:
        path.parent.mkdir()
        path.write_text("the user's")
    # A stats file left by an earlier demo run must not reach this run's limits.
    run = _demo_folder.claim(tmp_path / "demo_run")
    stale = run / "fdo" / "fdo_stats-offline-1.json"
    stale.parent.mkdir()
    stale.write_text('{"version": 1, "tables": {}}')

    assert _cli.main(["demo", "--config", str(config), "--no-progress"]) == 0
    out = capsys.readouterr().out
    written = re.search(r"FDO: 6 batches -> (.*fdo_stats-offline-\d+\.json)", out)
    assert written
    assert sorted((run / "fdo").glob("fdo_stats-*.json")) == [Path(written.group(1))]
    assert "trained 4 steps of 512 examples" in out
    assert re.search(r"eval AUC 0\.\d{4}", out)
    checkpoints = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert checkpoints[-1] == 6  # 4 steps + 2 draining calls of the pipeline
    assert any((run / "metrics").iterdir())
    assert [path.read_text() for path in users] == ["the user's"] * len(users)
    assert f"metrics: tensorboard --logdir {run / 'metrics'}" in out
    assert f"pictures: {run / 'fdo.png'}  {run / 'training.png'}" in out
    assert_drawn_png(run / "fdo.png", "tab:red")  # the FDO limit lines
    assert_drawn_png(run / "training.png", "tab:blue")  # the loss and AUC lines

    # docs/make_images.py redraws them from the run with the same functions.
    images = tmp_path / "images"
    monkeypatch.setattr("sys.argv", ["make_images", "--config", str(config), "--out", str(images)])
    runpy.run_path(str(REPO / "docs" / "make_images.py"), run_name="__main__")
    for name in ("fdo.png", "training.png"):
        assert (images / name).read_bytes() == (run / name).read_bytes()


def test_demo_refuses_a_run_folder_it_did_not_create(tmp_path, capsys):
    config = _small_demo_config(tmp_path)
    own = tmp_path / "demo_run" / "checkpoints" / "notes.txt"
    own.parent.mkdir(parents=True)
    own.write_text("the user's")

    assert _cli.main(["demo", "--config", str(config), "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert f"{tmp_path / 'demo_run'} exists but was not created by `sparseflow demo`" in error
    assert own.read_text() == "the user's"
    assert not (tmp_path / "data").exists()  # refused before doing anything


def test_claim_creates_a_marked_folder_and_empties_only_a_marked_one(tmp_path):
    folder = _demo_folder.claim(tmp_path / "run")
    assert (folder / _demo_folder.MARKER_NAME).is_file()
    (folder / "fdo").mkdir()
    (folder / "fdo" / "stats.json").write_text("{}")
    (folder / "log.txt").write_text("")
    outside = tmp_path / "outside"
    outside.mkdir()
    (folder / "link").symlink_to(outside)

    assert _demo_folder.claim(folder) == folder
    assert sorted(p.name for p in folder.iterdir()) == [_demo_folder.MARKER_NAME]
    assert outside.is_dir()  # a link is removed, not followed


@pytest.mark.parametrize("kind", ["unmarked", "symlink", "file"])
def test_claim_refuses_what_it_did_not_create(tmp_path, kind):
    target = tmp_path / "target"
    target.mkdir()
    (target / "data.txt").write_text("kept")
    folder = tmp_path / "run"
    if kind == "unmarked":
        folder = target
    elif kind == "symlink":
        (target / _demo_folder.MARKER_NAME).write_text("")
        folder.symlink_to(target)
    else:
        folder.write_text("kept")
    with pytest.raises(ValueError, match=re.escape(str(folder))):
        _demo_folder.claim(folder)
    assert (target / "data.txt").read_text() == "kept"
    if kind == "file":
        assert folder.read_text() == "kept"
