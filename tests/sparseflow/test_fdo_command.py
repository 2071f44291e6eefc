"""`sparseflow fdo`: the offline FDO job from the command line."""

import dataclasses
import json
import socket
from pathlib import Path

import fsspec
import jax
import numpy as np
import pytest
import yaml
from jax.sharding import Mesh
from tiny_config import tiny_config

import embedding
import pipelines
from sparseflow import RunConfig, _cli, _train, load_config


def test_fdo_writes_stats_for_the_config_and_a_figure(tmp_path, capsys):
    config_path = tiny_config(tmp_path)
    config = load_config(config_path)
    pipelines.write_synthetic_dataset(
        config.synthetic.dataset, config.dataset.dir, num_examples=150, seed=0, num_shards=2
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
        out, expected_config_hash=config.fdo_layout, expected_geometry=geometry
    )
    assert stats.batches == 4 and sorted(stats.stacks) == ["a_b"]
    limits = embedding.fdo_limits(stats, headroom=1.25)["a_b"]
    assert f"a_b: max_ids_per_partition {limits.max_ids_per_partition} [128]" in printed
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "dead_letters.jsonl").read_text() == ""


def _fdo_stats(config_path: Path, data: str, out: Path) -> embedding.FdoStats:
    argv = ["fdo", "--config", str(config_path), "--data", data, "--out", str(out)]
    assert _cli.main([*argv, "--", "--direct_num_workers=1"]) == 0
    return embedding.load_fdo_stats(out, expected_config_hash=None, expected_geometry=None)


@pytest.mark.parametrize("protocol", ["file", "memory"])
def test_fdo_reads_the_data_from_an_fsspec_url(tmp_path, protocol):
    config_path = tiny_config(tmp_path)
    config = load_config(config_path)
    files = pipelines.write_synthetic_dataset(
        config.synthetic.dataset, config.dataset.dir, num_examples=150, seed=0, num_shards=2
    )["arrayrecord"]
    if protocol == "file":
        url = Path(files[0]).parent.as_uri()
    else:
        memory = fsspec.filesystem("memory")
        url = f"memory://{tmp_path.name}/arrayrecord"
        for path in files:
            memory.put_file(path, f"{url}/{Path(path).name}")
    local = _fdo_stats(config_path, str(Path(files[0]).parent), tmp_path / "fdo-local")
    remote = _fdo_stats(config_path, url, tmp_path / "fdo-url")
    assert remote.batches == local.batches == 4
    np.testing.assert_array_equal(
        remote.stacks["a_b"].partition_histogram, local.stacks["a_b"].partition_histogram
    )
    assert embedding.fdo_limits(remote) == embedding.fdo_limits(local)


def test_fdo_without_record_files_is_a_user_error(tmp_path, capsys):
    status = _cli.main(
        ["fdo", "--config", str(tiny_config(tmp_path)), "--data", str(tmp_path / "none*.tfrecord")]
    )
    assert status == 2
    assert capsys.readouterr().err.startswith("error: No files match")


def _changed(config_path: Path, name: str, change) -> RunConfig:
    raw = yaml.safe_load(config_path.read_text())
    change(raw)
    path = config_path.with_name(name)
    path.write_text(yaml.safe_dump(raw))
    return load_config(path)


def test_stats_serve_a_new_learning_rate_and_refuse_a_new_vocabulary(tmp_path, capsys):
    config_path = tiny_config(tmp_path)
    config = load_config(config_path)
    pipelines.write_synthetic_dataset(
        config.synthetic.dataset, config.dataset.dir, num_examples=150, seed=0, num_shards=2
    )
    out = tmp_path / "fdo"
    status = _cli.main(["fdo", "--config", str(config_path), "--out", str(out)])
    assert status == 0, capsys.readouterr()

    def learning_rate(raw):
        raw["tables"][0]["optimizer"]["learning_rate"] = 0.01

    def vocabulary(raw):
        raw["tables"][1]["vocabulary_size"] = 60

    tuned = _changed(config_path, "tuned.yaml", learning_rate)
    geometry = embedding.FdoGeometry(global_batch_size=32, devices=4, partitions_per_device=2)
    stats = embedding.load_fdo_stats(
        out, expected_config_hash=tuned.fdo_layout, expected_geometry=geometry
    )
    assert stats.batches == 4
    # Training reads them the same way: the tuned run takes the stats' limits. The
    # stats cover exactly the batches it draws (same records, seed and epochs), so the
    # limits add no spread margin; another shuffle seed draws other batches.
    assert stats.batch_order == embedding.FdoBatchOrder(records=150, shuffle_seed=0, epochs=1)
    mesh = Mesh(np.array(jax.devices()[:4]), ("devices",))
    options = _train.TrainOptions(data=str(config.dataset.dir / "arrayrecord"), fdo_dir=out)
    prepared = embedding.prepare_feature_specs_for_training(tuned.feature_specs, 4, 2)
    assert _train._feature_specs(tuned, options, mesh) == embedding.apply_fdo(
        prepared, stats, headroom=tuned.training.fdo_headroom, spread_margin=0.0
    )
    reseeded = dataclasses.replace(tuned, seed=1)
    assert _train._feature_specs(reseeded, options, mesh) == embedding.apply_fdo(
        prepared, stats, headroom=tuned.training.fdo_headroom
    )
    grown = _changed(config_path, "grown.yaml", vocabulary)
    with pytest.raises(embedding.FdoStatsError, match="tables.b.vocabulary_size"):
        _train._feature_specs(grown, options, mesh)
    with pytest.raises(
        embedding.FdoStatsError, match="tables.b.vocabulary_size: 50 in the stats, 60 now"
    ):
        embedding.load_fdo_stats(
            out, expected_config_hash=grown.fdo_layout, expected_geometry=geometry
        )


def _stats_document(out: Path) -> dict:
    (path,) = out.glob("fdo_stats-offline-*.json")
    return json.loads(path.read_text())


def test_fdo_on_a_local_dask_cluster_writes_the_in_process_stats(tmp_path, capsys):
    pytest.importorskip("distributed")
    config_path = tiny_config(tmp_path)
    config = load_config(config_path)
    pipelines.write_synthetic_dataset(
        config.synthetic.dataset, config.dataset.dir, num_examples=150, seed=0, num_shards=2
    )
    runs = {
        "in_process": [],
        "dask": ["--runner", "dask", "--dask-workers", "2"],
    }
    for name, runner_args in runs.items():
        out = tmp_path / name
        status = _cli.main(["fdo", "--config", str(config_path), "--out", str(out), *runner_args])
        assert status == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    assert printed.count("4 global batches of 32 from 150 records (0 bad, 22 after") == 2
    in_process, on_dask = (_stats_document(tmp_path / name) for name in runs)
    assert in_process == on_dask and on_dask["batches"] == 4


def test_fdo_names_an_unreachable_dask_scheduler_in_one_line(tmp_path, capsys, monkeypatch):
    dask_cluster = pytest.importorskip("beam_jobs.dask_cluster")
    monkeypatch.setattr(dask_cluster, "DEFAULT_CONNECT_TIMEOUT_S", 1.0)
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{unused.getsockname()[1]}"
    argv = ["fdo", "--config", str(tiny_config(tmp_path)), "--runner", "dask"]
    status = _cli.main([*argv, "--dask-address", address])
    error = capsys.readouterr().err
    assert status == 2
    assert error.startswith(f"error: No Dask scheduler answers at {address}")
    assert error.count("\n") == 1, error


def test_dask_options_without_the_dask_runner_are_a_user_error(tmp_path, capsys):
    argv = ["fdo", "--config", str(tiny_config(tmp_path)), "--dask-workers", "2"]
    assert _cli.main(argv) == 2
    assert "need --runner dask" in capsys.readouterr().err
