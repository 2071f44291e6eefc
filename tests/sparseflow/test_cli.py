"""The `sparseflow` command line: make-data, stats, and one-line user errors."""

import ast
import gc
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from array_record.python import array_record_module

import pipelines
import sparseflow
from sparseflow import _cli, _datasets, load_config, shipped_config

BATCH = 32


def _config(tmp_path: Path, *, limit: int = 64, allow_id_dropping: bool = False, **top) -> Path:
    """A tiny run: `a` read by fa1 and fa2, stacked with `b`; `c` alone."""
    table = {
        "embedding_dim": 8,
        "combiner": "sum",
        "optimizer": {"type": "adagrad"},
        "initializer": {"type": "constant", "value": 0.0},
        "max_ids_per_partition": limit,
        "max_unique_ids_per_partition": limit,
    }
    raw = {
        "name": "tiny",
        "seed": 0,
        "mesh": {"devices": 8, "partitions_per_device": 2},
        "global_batch_size": BATCH,
        "preprocessing": {"allow_id_dropping": allow_id_dropping},
        "tables": [
            {"name": "a", "vocabulary_size": 100, **table},
            {"name": "b", "vocabulary_size": 50, **table},
            {
                "name": "c",
                "vocabulary_size": 20,
                **table,
                "combiner": "mean",
                "optimizer": {"type": "sgd", "learning_rate": 0.1},
            },
        ],
        "stacks": [["a", "b"]],
        "features": [
            {"name": "fa1", "table": "a"},
            {"name": "fa2", "table": "a"},
            {"name": "fb", "table": "b", "weighted": True},
            {"name": "fc", "table": "c"},
        ],
        "dense_features": 3,
        "dataset": {"dir": "data"},
        "synthetic": {
            "examples": 200,
            "eval_examples": 20,
            "shards": 2,
            "features": {
                "fa1": {"valency": [1, 3]},
                "fa2": {"valency": [1, 2]},
                "fb": {"valency": [1, 1]},
                "fc": {"valency": [1, 2], "zipf": 2.0},
            },
        },
        **top,
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _records(directory: Path) -> list[bytes]:
    return list(pipelines.read_records(pipelines.list_record_files(str(directory))))


def _summary_rows(out: str) -> dict[str, list[str]]:
    """The demo's table rows by stack name, cells split on runs of 2+ spaces."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("stack "))
    rows = {}
    for line in lines[header + 2 :]:
        if not line.strip():
            break
        cells = [cell.strip() for cell in line.split("  ") if cell.strip()]
        rows[cells[0]] = cells
    return rows


def test_make_data_writes_the_requested_dataset(tmp_path, capsys):
    out = tmp_path / "out"
    status = _cli.main(
        [
            "make-data",
            "--config",
            str(_config(tmp_path)),
            "--out",
            str(out),
            "--examples",
            "200",
            "--seed",
            "1",
            "--shards",
            "2",
            "--formats",
            "arrayrecord",
        ]
    )
    assert status == 0
    assert "Wrote 200 synthetic examples" in capsys.readouterr().out
    assert (out / "dataset.json").is_file()
    assert not (out / "tfrecord").exists()
    assert len(pipelines.list_record_files(str(out / "arrayrecord"))) == 2
    records = _records(out / "arrayrecord")
    assert len(records) == 200
    layout = load_config(tmp_path / "tiny.yaml").layout
    assert pipelines.parse_examples(records, layout).labels.shape == (200,)


def test_stats_makes_the_dataset_and_summarizes_every_stack(tmp_path, capsys):
    config = _config(tmp_path)
    assert _cli.main(["stats", "--config", str(config), "--batches", "2"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "data" / "dataset.json").is_file()
    rows = _summary_rows(out)
    assert list(rows) == ["a_b", "c"]
    assert rows["a_b"][1] == "fa1, fa2, fb"
    # ids/batch, counted independently from the first two batches' records.
    parsed = pipelines.parse_examples(
        _records(tmp_path / "data" / "arrayrecord")[: 2 * BATCH],
        load_config(config).layout,
    )
    ids = {name: parsed.ids[name].values.size for name in parsed.ids}
    assert rows["a_b"][2] == f"{(ids['fa1'] + ids['fa2'] + ids['fb']) / 2:,.0f}"
    assert rows["c"][2] == f"{ids['fc'] / 2:,.0f}"
    assert [row[-2:] for row in rows.values()] == [["0", "0"], ["0", "0"]]
    assert f"2 batches, {2 * BATCH} examples" in out


def test_stats_reads_an_existing_dataset_in_full(tmp_path, capsys):
    config = _config(tmp_path)
    make = ["make-data", "--config", str(config), "--examples", "100", "--shards", "1"]
    assert _cli.main(make) == 0
    assert _cli.main(["stats", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "Writing the synthetic dataset" not in out
    assert f"{100 // BATCH} batches, {100 // BATCH * BATCH} examples" in out


def test_stats_counts_drops_when_dropping_is_allowed(tmp_path, capsys):
    config = _config(tmp_path, limit=1, allow_id_dropping=True)
    assert _cli.main(["stats", "--config", str(config), "--batches", "1"]) == 0
    rows = _summary_rows(capsys.readouterr().out)
    assert int(rows["a_b"][-2].replace(",", "")) > 0
    # The stack's limit is the sum of its two tables' limits.
    assert rows["a_b"][3].endswith("/ 2")


def _assert_user_error(capsys, argv, message: str) -> None:
    assert _cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err
    assert err.count("\n") == 1


def test_more_shards_than_examples_is_a_user_error(tmp_path, capsys):
    argv = ["make-data", "--config", str(_config(tmp_path)), "--examples", "3", "--shards", "4"]
    _assert_user_error(capsys, argv, "error: 4 shards cannot each hold one of 3 examples")
    assert not (tmp_path / "data").exists()


def test_limit_breach_is_a_user_error(tmp_path, capsys):
    config = _config(tmp_path, limit=1)
    _assert_user_error(capsys, ["stats", "--config", str(config), "--batches", "1"], "'a_b'")


def test_bad_config_is_a_user_error(tmp_path, capsys):
    config = _config(tmp_path, global_batch_size=40)
    _assert_user_error(
        capsys,
        ["stats", "--config", str(config)],
        f"error: {config}: global_batch_size: 40 is not divisible",
    )


def test_missing_config_is_a_user_error(tmp_path, capsys):
    missing = tmp_path / "missing.yaml"
    _assert_user_error(capsys, ["make-data", "--config", str(missing)], f"{missing}: cannot read")


def test_bad_record_is_a_user_error(tmp_path, capsys):
    config = _config(tmp_path)
    assert _cli.main(["make-data", "--config", str(config), "--examples", "64"]) == 0
    shard = pipelines.list_record_files(str(tmp_path / "data" / "arrayrecord"))[0]
    writer = array_record_module.ArrayRecordWriter(shard, "group_size:1")
    for _ in range(BATCH):
        writer.write(b"not an example")
    writer.close()
    _assert_user_error(capsys, ["stats", "--config", str(config)], "Bad record at index 0")


def test_dataset_of_other_features_is_a_user_error(tmp_path, capsys):
    config = _config(tmp_path)
    assert _cli.main(["make-data", "--config", str(config), "--examples", "64"]) == 0
    config = _config(tmp_path, dense_features=4)
    _assert_user_error(capsys, ["stats", "--config", str(config)], "made for other features")


@pytest.mark.parametrize("bug", [RuntimeError, ValueError, FileNotFoundError])
def test_a_bug_is_an_internal_error_not_a_user_error(tmp_path, monkeypatch, capsys, bug):
    def broken(*args, **kwargs):
        raise bug("bug")

    monkeypatch.setattr(_datasets, "dataset_exists", broken)
    assert _cli.main(["stats", "--config", str(_config(tmp_path))]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"internal error: {bug.__name__}: bug\n")
    assert "rerun with --verbose" in err and "Traceback" not in err


@pytest.mark.parametrize("bug", [RuntimeError, ValueError])
def test_a_bug_raises_with_its_traceback_when_verbose(tmp_path, monkeypatch, bug):
    def broken(*args, **kwargs):
        raise bug("bug")

    monkeypatch.setattr(_datasets, "dataset_exists", broken)
    with pytest.raises(bug, match="bug"):
        _cli.main(["stats", "--verbose", "--config", str(_config(tmp_path))])


@pytest.mark.parametrize("command", ["demo", "stats"])
def test_the_default_config_is_the_shipped_demo_with_data_in_the_working_directory(
    command, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    config = _cli.load_cli_config(_cli._parser([command]).parse_args([command]).config)
    assert config.source_path == shipped_config("demo")
    assert config.dataset.dir == tmp_path / "runs" / "demo" / "data"


def test_a_file_named_like_a_shipped_config_is_read_as_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("demo").write_text(_config(tmp_path).read_text())
    assert _cli.load_cli_config("demo").name == "tiny"


def test_an_unknown_config_name_is_a_user_error_listing_the_shipped_ones(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert _cli.main(["stats", "--config", "dem"]) == 2
    assert "no shipped config named 'dem'; shipped configs: benchmark, criteo, demo, two_tower" in (
        capsys.readouterr().err
    )


def test_a_missing_yaml_file_is_a_config_error_naming_it(tmp_path, capsys):
    missing = tmp_path / "demo.yaml"
    assert _cli.main(["stats", "--config", str(missing)]) == 2
    assert f"{missing}: cannot read" in capsys.readouterr().err


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"sparseflow {sparseflow.__version__}\n"


_NEGATIVE_IDS = {
    "format": "sparseflow.fdo_stats",
    "version": 1,
    "config_hash": "ab" * 32,
    "geometry": {"global_batch_size": 2, "devices": 1, "partitions_per_device": 1, "processes": 1},
    "batches": 1,
    "stacks": {
        "a_b": {
            "max_ids_per_partition": [-1],
            "max_unique_ids_per_partition": [0],
            "required_buffer_size_per_sc": [0],
        }
    },
}


@pytest.mark.parametrize(
    "text, message",
    [
        (
            json.dumps(_NEGATIVE_IDS),
            "corrupt FDO stats file: stacks['a_b'].max_ids_per_partition[0]: must be an integer",
        ),
        ("[" * 100_000, "corrupt FDO stats file: nested too deeply"),
    ],
    ids=["negative value", "deeply nested"],
)
def test_a_corrupt_fdo_stats_file_is_a_user_error(tmp_path, capsys, text, message):
    stats = tmp_path / "fdo_stats-offline-00000000000000000001.json"
    stats.write_text(text)
    argv = ["train", "--config", str(_config(tmp_path)), "--fdo", str(stats)]
    _assert_user_error(capsys, argv, f"error: {stats}: {message}")


@pytest.mark.parametrize(
    "argv", [["-v", "stats"], ["stats", "-v"], ["stats", "--verbose", "--batches", "2"]]
)
def test_verbose_is_accepted_before_and_after_the_subcommand(argv):
    assert _cli._parser(argv).parse_args(argv).verbose is True


def test_quiet_by_default_before_and_after_the_subcommand():
    assert _cli._parser(["stats"]).parse_args(["stats"]).verbose is False


@pytest.mark.parametrize(
    "command", ["make-data", "demo", "stats", "fdo", "import", "train", "convert-checkpoint"]
)
def test_every_subcommand_helps_with_a_description_and_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        _cli._parser([command, "--help"]).parse_args([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert f"example:\n  sparseflow {command}" in text
    description = text.split("\n\n")[1]
    assert description.endswith(".") and "\n" not in description.strip()[:20]


def test_the_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_:
        _cli._parser(["--help"]).parse_args(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for command in ["make-data", "demo", "stats", "fdo", "import", "train", "convert-checkpoint"]:
        assert f"    {command}" in text


@pytest.mark.parametrize(("command", "loads_beam"), [("train", False), ("fdo", True)])
def test_only_the_chosen_subcommand_is_imported(command, loads_beam):
    # A fresh interpreter: this one has imported Beam for other tests.
    probe = (
        "import sys\n"
        "from sparseflow import _cli\n"
        f"_cli._parser({[command]!r})\n"
        "print('apache_beam' in sys.modules, 'flax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == [str(loads_beam), "False"]  # flax: a user's model only


def test_the_crash_hook_is_hidden_from_help(capsys):
    with pytest.raises(SystemExit):
        _cli._parser(["train", "--help"]).parse_args(["train", "--help"])
    assert "--stop-after" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--config", "demo", "--steps", "0"], "must be a positive integer, got 0"),
        (["train", "--config", "demo", "--steps", "ten"], "must be an integer, got 'ten'"),
        (["train", "--config", "demo", "--num-processes", "-1"], "must be a positive integer"),
        (["train", "--config", "demo", "--agreement-port", "-5"], "must be an integer >= 0"),
        (["fdo", "--config", "demo", "--dask-workers", "0"], "must be a positive integer"),
        (["make-data", "--config", "demo", "--formats", "parquet"], "got 'parquet'"),
        (["make-data", "--config", "demo", "--formats", "tfrecord,tfrecord"], "at most once"),
        (["make-data", "--config", "demo", "--formats", ","], "at least one"),
    ],
)
def test_flags_are_validated(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        _cli._parser(argv).parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_progress_bar_is_off_where_stderr_is_no_terminal():
    from sparseflow._metrics import Progress

    # Under pytest stderr is captured, not a terminal.
    bar = Progress(total=3, initial=0, enabled=True)
    try:
        assert bar._bar.disable
    finally:
        bar.close()


def test_no_command_module_imports_another():
    """Commands sit on library modules (`_datasets`, `_fdo_run`, `_train`, ...):
    a command's module, and the demo's, import none of the command modules."""
    commands = {command.module for command in _cli._COMMANDS.values()}
    importers = commands | {"sparseflow._demo"}
    for module in sorted(importers):
        path = Path(importlib.import_module(module).__file__)
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
        assert not imported & (commands - {module}), f"{module} imports a command module"


_RECORD_FREEZES = """
import gc, json, sys

collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))

from sparseflow import _process, _script

freezes = []
freeze = _process.freeze_live_objects


def recorded():
    freeze()
    freezes.append({
        "frozen": gc.get_freeze_count(),
        "command imported": COMMAND in sys.modules,
        "collections before": list(collections),
    })


_process.freeze_live_objects = recorded
sys.argv = ["sparseflow", *ARGV]
status = _script.script()
print(json.dumps({"status": status, "freezes": freezes, "collector on": gc.isenabled()}))
"""


def test_the_script_freezes_the_imported_objects_and_again_before_its_exit(tmp_path):
    argv = ["make-data", "--config", str(_config(tmp_path)), "--out", str(tmp_path / "out")]
    argv += ["--examples", "20", "--shards", "1", "--formats", "arrayrecord"]
    code = _RECORD_FREEZES.replace("COMMAND", repr("sparseflow._make_data_command"))
    code = code.replace("ARGV", repr(argv))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == 0
    assert (tmp_path / "out" / "dataset.json").is_file()
    first, last = result["freezes"]
    # The command's module and its imports (numpy, jax, grain: far more than 10^4
    # objects) are frozen before it runs; what the run made, before the exit.
    assert first["command imported"] and first["frozen"] > 10_000
    # Before the script runs, importing the package's face and the script may set off
    # a young collection or two; the command's imports (with the collector on, some
    # 400 collections, three of them full) none.
    assert 2 not in first["collections before"] and len(first["collections before"]) < 5
    assert last["frozen"] > first["frozen"]
    assert result["collector on"]


def test_importing_the_package_imports_none_of_its_modules_until_a_name_is_used():
    """The script's entry point is in the package: what `import sparseflow` imports
    runs before the script can pause the collector."""
    code = (
        "import sys, sparseflow\n"
        "heavy = ('jax', 'numpy', 'grain', 'sparseflow._train', 'sparseflow.config')\n"
        "print([m for m in heavy if m in sys.modules])\n"
        "sparseflow.Trainer\n"
        "print('sparseflow._train' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.split() == ["[]", "True"]


def test_main_inside_a_users_process_freezes_nothing(tmp_path):
    before = gc.get_freeze_count()
    argv = ["make-data", "--config", str(_config(tmp_path)), "--out", str(tmp_path / "out")]
    assert _cli.main([*argv, "--examples", "20", "--shards", "1", "--formats", "arrayrecord"]) == 0
    assert gc.get_freeze_count() == before
