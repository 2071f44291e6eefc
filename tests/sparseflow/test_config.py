"""Loading run configs: specs equal to hand-built ones, and every error named."""

import copy
import re
from pathlib import Path

import pytest
import yaml

import embedding
import pipelines
from embedding import initializers
from sparseflow import ConfigError, load_config, shipped_config


def _base() -> dict:
    """A small valid config: feature stacking on `a`, table stacking of `a` and `b`."""
    adagrad = {"type": "adagrad", "learning_rate": 0.1, "initial_accumulator_value": 0.5}
    table = {
        "embedding_dim": 8,
        "combiner": "mean",
        "optimizer": adagrad,
        "initializer": {"type": "normal", "stddev": 0.02},
        "max_ids_per_partition": 64,
        "max_unique_ids_per_partition": 32,
    }
    return {
        "name": "small",
        "seed": 3,
        "mesh": {"devices": 8, "partitions_per_device": 2},
        "global_batch_size": 64,
        "preprocessing": {"allow_id_dropping": True, "invalid_ids": "drop"},
        "tables": [
            {"name": "a", "vocabulary_size": 1000, **table},
            {
                "name": "b",
                "vocabulary_size": 500,
                **table,
                "suggested_coo_buffer_size_per_device": 1024,
            },
            {
                "name": "c",
                "vocabulary_size": 100,
                "embedding_dim": 16,
                "combiner": "sum",
                "optimizer": {
                    "type": "ftrl",
                    "learning_rate": 0.05,
                    "beta": 0.5,
                    "multiply_linear_by_learning_rate": True,
                },
                "initializer": {"type": "constant", "value": 0.25},
                "max_ids_per_partition": 16,
                "max_unique_ids_per_partition": 16,
            },
        ],
        "stacks": [["a", "b"]],
        "features": [
            {"name": "fa1", "table": "a"},
            {"name": "fa2", "table": "a"},
            {"name": "fb", "table": "b", "weighted": True},
            {"name": "fc", "table": "c"},
        ],
        "dense_features": 5,
        "dataset": {"dir": "data"},
        "synthetic": {
            "examples": 1000,
            "eval_examples": 100,
            "shards": 2,
            "features": {
                "fa1": {"valency": [1, 4]},
                "fa2": {"valency": [2, 3], "zipf": 1.3},
                "fb": {"valency": [1, 1]},
                "fc": {"valency": [1, 2], "zipf": 2.5},
            },
        },
    }


def _write(tmp_path: Path, config, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
    return path


def _expected_tables() -> dict[str, embedding.TableSpec]:
    ab = dict(
        embedding_dim=8,
        combiner="mean",
        optimizer=embedding.AdagradOptimizerSpec(learning_rate=0.1, initial_accumulator_value=0.5),
        initializer=initializers.Normal(stddev=0.02),
        max_ids_per_partition=64,
        max_unique_ids_per_partition=32,
    )
    c = embedding.TableSpec(
        name="c",
        vocabulary_size=100,
        embedding_dim=16,
        combiner="sum",
        optimizer=embedding.FTRLOptimizerSpec(
            learning_rate=0.05, beta=0.5, multiply_linear_by_learning_rate=True
        ),
        initializer=initializers.Constant(0.25),
        max_ids_per_partition=16,
        max_unique_ids_per_partition=16,
    )
    return {
        "a": embedding.TableSpec(name="a", vocabulary_size=1000, **ab),
        "b": embedding.TableSpec(
            name="b", vocabulary_size=500, suggested_coo_buffer_size_per_device=1024, **ab
        ),
        "c": c,
    }


def _expected_feature_specs(tables) -> dict:
    def feature(name, table):
        return embedding.FeatureSpec(
            name=name,
            table_spec=tables[table],
            input_shape=[64],
            output_shape=[64, tables[table].embedding_dim],
        )

    specs = {
        "fa1": feature("fa1", "a"),
        "fa2": feature("fa2", "a"),
        "fb": feature("fb", "b"),
        "fc": feature("fc", "c"),
    }
    return embedding.stack_tables(specs, ["a", "b"], 8, 2)


def test_valid_config_builds_the_hand_built_specs(tmp_path):
    config = load_config(_write(tmp_path, _base()))
    tables = _expected_tables()
    assert list(config.tables.items()) == list(tables.items())
    assert list(config.feature_specs) == ["fa1", "fa2", "fb", "fc"]
    assert dict(config.feature_specs) == dict(_expected_feature_specs(tables))
    assert config.feature_specs["fb"].table_spec.stacked_table_spec.stack_name == "a_b"
    assert not config.feature_specs["fc"].table_spec.is_stacked()
    assert (config.name, config.seed, config.global_batch_size) == ("small", 3, 64)
    assert (config.mesh.devices, config.mesh.partitions_per_device) == (8, 2)
    assert (config.mesh.processes, config.mesh.num_partitions) == (1, 16)
    assert config.preprocessing.allow_id_dropping is True
    assert config.preprocessing.invalid_id_policy is embedding.InvalidIdPolicy.DROP
    assert config.dataset.dir == tmp_path / "data"
    assert (config.dataset.train, config.dataset.eval) == (None, None)
    assert config.dataset.train_data == (str(tmp_path / "data" / "arrayrecord"),)
    assert (config.synthetic.examples, config.synthetic.eval_examples) == (1000, 100)
    assert config.synthetic.shards == 2
    assert config.source_path == tmp_path / "run.yaml"


def test_valid_config_builds_the_synthetic_dataset(tmp_path):
    config = load_config(_write(tmp_path, _base()))
    feature = pipelines.SyntheticFeature
    assert config.synthetic.dataset == pipelines.SyntheticDataset(
        features=(
            feature(
                name="fa1", vocabulary_size=1000, min_valency=1, max_valency=4, zipf_exponent=1.1
            ),
            feature(
                name="fa2", vocabulary_size=1000, min_valency=2, max_valency=3, zipf_exponent=1.3
            ),
            feature(
                name="fb",
                vocabulary_size=500,
                min_valency=1,
                max_valency=1,
                zipf_exponent=1.1,
                weighted=True,
            ),
            feature(
                name="fc", vocabulary_size=100, min_valency=1, max_valency=2, zipf_exponent=2.5
            ),
        ),
        num_dense_features=5,
    )


@pytest.mark.parametrize(
    ("optimizer", "expected"),
    [
        (
            {"type": "laprop", "learning_rate": 0.01, "b1": 0.8, "b2": 0.9, "eps": 1e-8},
            embedding.LaPropOptimizerSpec(learning_rate=0.01, b1=0.8, b2=0.9, eps=1e-8),
        ),
        (
            {"type": "adagrad_momentum", "momentum": 0.8, "exponent": 4, "use_nesterov": True},
            embedding.AdagradMomentumOptimizerSpec(momentum=0.8, exponent=4, use_nesterov=True),
        ),
        (
            {"type": "f2a", "rho": 0.25, "max_lr_multiplier": 10, "l1_regularization_strength": 1},
            embedding.F2AOptimizerSpec(
                rho=0.25, max_lr_multiplier=10, l1_regularization_strength=1
            ),
        ),
        (
            {"type": "rowwise_adam", "beta_2": 0.99, "weight_decay": 0.001},
            embedding.RowWiseAdamOptimizerSpec(beta_2=0.99, weight_decay=0.001),
        ),
    ],
)
def test_the_later_optimizers_load_by_their_type(tmp_path, optimizer, expected):
    config = _base()
    config["tables"][2]["optimizer"] = optimizer
    assert load_config(_write(tmp_path, config)).tables["c"].optimizer == expected


def test_optional_sections_take_their_defaults(tmp_path):
    raw = _base()
    del raw["preprocessing"], raw["stacks"], raw["synthetic"]["shards"]
    config = load_config(_write(tmp_path, raw))
    assert config.preprocessing.allow_id_dropping is False
    assert config.preprocessing.invalid_id_policy is embedding.InvalidIdPolicy.RAISE
    assert config.synthetic.shards == 1
    # a and b share dim, optimizer and combiner: stacked by default; c has its own.
    stacks = {name: f.table_spec.stacked_table_spec for name, f in config.feature_specs.items()}
    assert {name: s.stack_name if s else None for name, s in stacks.items()} == {
        "fa1": "a_b",
        "fa2": "a_b",
        "fb": "a_b",
        "fc": None,
    }
    assert config.training.worker_priority is pipelines.WorkerPriority.IDLE


@pytest.mark.parametrize("stacks", ["auto", "none"])
def test_stacks_auto_and_none(tmp_path, stacks):
    explicit = load_config(_write(tmp_path, _base()))
    raw = _base()
    raw["stacks"] = stacks
    config = load_config(_write(tmp_path, raw))
    if stacks == "auto":
        assert config.feature_specs == explicit.feature_specs
    else:
        assert not any(f.table_spec.is_stacked() for f in config.feature_specs.values())


def test_stacks_of_another_word_is_an_error(tmp_path):
    raw = _base()
    raw["stacks"] = "all"
    with pytest.raises(ConfigError, match=r"stacks: expected 'auto', 'none' or a list"):
        load_config(_write(tmp_path, raw))


def test_absolute_dataset_dir_is_kept(tmp_path):
    raw = _base()
    raw["dataset"]["dir"] = str(tmp_path / "elsewhere")
    config = load_config(_write(tmp_path, raw))
    assert config.dataset.dir == tmp_path / "elsewhere"


def test_agreement_security_paths_are_relative_to_the_config(tmp_path):
    raw = _base()
    raw["training"] = {"agreement_tls_dir": "tls", "agreement_secret_file": "/run/secret"}
    config = load_config(_write(tmp_path, raw))
    security = config.training.agreement_security(run_id="run-a")
    assert (security.tls_dir, security.secret_file) == (tmp_path / "tls", Path("/run/secret"))
    assert security.run_id == "run-a"


def test_the_agreement_is_insecure_without_tls_or_secret(tmp_path):
    config = load_config(_write(tmp_path, _base()))
    assert config.training.agreement_security(run_id="run-a") is None


def test_config_hash_is_canonical_and_tracks_values(tmp_path):
    raw = _base()
    first = load_config(_write(tmp_path, raw, "one.yaml")).config_hash
    assert re.fullmatch(r"[0-9a-f]{64}", first)
    assert load_config(_write(tmp_path, raw, "one.yaml")).config_hash == first
    # Key order, flow style and comments do not change the hash.
    reordered = yaml.safe_dump(
        dict(reversed(list(raw.items()))), sort_keys=False, default_flow_style=True
    )
    assert load_config(_write(tmp_path, "# note\n" + reordered, "two.yaml")).config_hash == first
    raw["tables"][0]["max_ids_per_partition"] = 65
    assert load_config(_write(tmp_path, raw, "three.yaml")).config_hash != first


@pytest.mark.parametrize(
    "path, value",
    [
        ("tables.0.optimizer.learning_rate", 0.5),
        ("tables.2.initializer.value", 0.5),
        ("tables.0.max_ids_per_partition", 128),
        ("tables.2.combiner", "mean"),
        ("synthetic.features.fa2.zipf", 1.1),
        ("synthetic.features.fa1.valency", [1, 9]),
        ("synthetic.examples", 64),
        ("dense_features", 7),
        ("seed", 4),
    ],
)
def test_fdo_layout_ignores_what_the_stats_do_not_depend_on(tmp_path, path, value):
    raw = _base()
    before = load_config(_write(tmp_path, raw, "one.yaml"))
    _set(path, value)(raw)
    after = load_config(_write(tmp_path, raw, "two.yaml"))
    assert after.config_hash != before.config_hash
    assert after.fdo_layout == before.fdo_layout


@pytest.mark.parametrize(
    "path, value, named",
    [
        ("tables.0.vocabulary_size", 2000, "tables.a.vocabulary_size: 1000 in the stats, 2000 now"),
        ("tables.2.embedding_dim", 8, "tables.c.embedding_dim: 16 in the stats, 8 now"),
        ("features.1.table", "c", 'features.fa2.table: "a" in the stats, "c" now'),
        ("features.2.weighted", False, "features.fb.weighted: true in the stats, false now"),
        ("global_batch_size", 128, "geometry.global_batch_size: 64 in the stats, 128 now"),
        ("mesh.partitions_per_device", 4, "geometry.partitions_per_device: 2 in the stats, 4"),
        ("preprocessing.invalid_ids", "raise", 'invalid_ids: "drop" in the stats, "raise" now'),
        ("stacks", "none", 'tables.b.stack: "a_b" in the stats, "b" now'),
    ],
)
def test_fdo_layout_names_what_changed(tmp_path, path, value, named):
    raw = _base()
    before = load_config(_write(tmp_path, raw, "one.yaml")).fdo_layout
    _set(path, value)(raw)
    after = load_config(_write(tmp_path, raw, "two.yaml")).fdo_layout
    assert after.key != before.key
    assert any(named in line for line in after.differences(before.entries))


def _set(path: str, value):
    """A mutation of the base config: sets the entry at a dotted path."""

    def mutate(raw):
        *parents, last = path.split(".")
        node = raw
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _delete(path: str):
    def mutate(raw):
        *parents, last = path.split(".")
        node = raw
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        del node[last]

    return mutate


def _append(path: str, item):
    def mutate(raw):
        node = raw
        for key in path.split("."):
            node = node[int(key)] if isinstance(node, list) else node[key]
        node.append(copy.deepcopy(item))

    return mutate


ERROR_CASES = {
    "missing top-level key": (_delete("seed"), "seed: missing required key"),
    "missing table key": (_delete("tables.0.combiner"), "tables[0].combiner: missing required key"),
    "missing optimizer type": (
        _delete("tables.2.optimizer.type"),
        "tables[2].optimizer.type: missing required key",
    ),
    "int as string": (
        _set("global_batch_size", "64"),
        "global_batch_size: expected an integer, got a string",
    ),
    "bool as int": (
        _set("preprocessing.allow_id_dropping", 1),
        "preprocessing.allow_id_dropping: expected true or false, got int 1",
    ),
    "float as string": (
        _set("tables.0.optimizer.learning_rate", "1e-3"),
        "tables[0].optimizer.learning_rate: expected a number, got a string '1e-3' "
        "(YAML reads it as a string; write it with a dot, e.g. 1.0e-03)",
    ),
    "list expected": (_set("features", {"name": "x"}), "features: expected a list, got a mapping"),
    "mapping expected": (_set("mesh", [8, 2]), "mesh: expected a mapping, got a list"),
    "negative count": (
        _set("tables.0.vocabulary_size", 0),
        "tables[0].vocabulary_size: must be an integer >= 1",
    ),
    "unknown top-level key": (
        _set("sed", 1),
        "sed: unknown key; did you mean 'seed'? known keys: name, seed",
    ),
    "unknown mesh key": (
        _set("mesh.device", 8),
        "mesh.device: unknown key; did you mean 'devices'?",
    ),
    "unknown optimizer key": (
        _set("tables.2.optimizer.momentum", 0.9),
        "tables[2].optimizer.momentum: unknown key; known keys: type, learning_rate, "
        "learning_rate_power",
    ),
    "unknown initializer key": (
        _set("tables.2.initializer.stddev", 0.1),
        "tables[2].initializer.stddev: unknown key",
    ),
    "unknown feature key": (_set("features.1.valence", [1, 2]), "features[1].valence: unknown key"),
    "unknown table": (
        _set("features.3.table", "foo"),
        "features[3].table: unknown table 'foo'; known tables: a, b, c",
    ),
    "duplicate table": (
        _set("tables.1.name", "a"),
        "tables[1].name: duplicate table name 'a' (also at tables[0])",
    ),
    "duplicate feature": (
        _set("features.2.name", "fa1"),
        "features[2].name: duplicate feature name 'fa1' (also at features[0])",
    ),
    "partitions not a power of two": (
        _set("mesh.devices", 3),
        "mesh: devices (3) x partitions_per_device (2) = 6 partitions; this must be a power of two",
    ),
    "processes do not divide devices": (
        _set("mesh.processes", 3),
        "mesh: 3 processes cannot share 8 devices evenly",
    ),
    "batch not divisible": (
        _set("global_batch_size", 72),
        "global_batch_size: 72 is not divisible by devices x partitions_per_device = 16",
    ),
    "valency min > max": (
        _set("synthetic.features.fa1.valency", [5, 2]),
        "synthetic.features.fa1.valency: min valency 5 is greater than max valency 2",
    ),
    "valency min < 1": (
        _set("synthetic.features.fa1.valency", [0, 2]),
        "synthetic.features.fa1.valency: min valency must be >= 1",
    ),
    "valency not a pair": (
        _set("synthetic.features.fa1.valency", [1, 2, 3]),
        "synthetic.features.fa1.valency: expected [min, max]",
    ),
    "valency not ints": (
        _set("synthetic.features.fa1.valency", [1, 2.5]),
        "synthetic.features.fa1.valency[1]: expected an integer",
    ),
    "zipf equal to 1": (
        _set("synthetic.features.fa2.zipf", 1.0),
        "synthetic.features.fa2.zipf: the Zipf exponent must be > 1, got 1.0",
    ),
    "zipf below 1": (
        _set("synthetic.features.fa2.zipf", 0.5),
        "synthetic.features.fa2.zipf: the Zipf exponent must be > 1",
    ),
    "unknown optimizer": (
        _set("tables.0.optimizer.type", "rmsprop"),
        "tables[0].optimizer.type: unknown optimizer type 'rmsprop'; choose one of: sgd, "
        "adagrad, rowwise_adagrad, adam, ftrl, laprop, adagrad_momentum, f2a, rowwise_adam",
    ),
    "unknown initializer": (
        _set("tables.0.initializer.type", "xavier"),
        "tables[0].initializer.type: unknown initializer type 'xavier'; choose one of: normal, "
        "truncated_normal, uniform, constant",
    ),
    "unknown combiner": (
        _set("tables.0.combiner", "max"),
        "tables[0].combiner: unknown combiner 'max'; choose one of: sum, mean, sqrtn",
    ),
    "unknown invalid-id policy": (
        _set("preprocessing.invalid_ids", "ignore"),
        "preprocessing.invalid_ids: unknown invalid-id policy 'ignore'; choose one of: raise, drop",
    ),
    "unknown worker priority": (
        _set("training", {"workers": 1, "worker_priority": "high"}),
        "training.worker_priority: unknown worker priority 'high'; choose one of: idle, normal",
    ),
    "optimizer rejects a value": (
        _set("tables.0.optimizer.initial_accumulator_value", 0.0),
        "tables[0].optimizer: AdagradOptimizerSpec: initial_accumulator_value must be > 0",
    ),
    "stack names an unknown table": (
        _set("stacks", [["a", "z"]]),
        "stacks[0][1]: unknown table 'z'; known tables: a, b, c",
    ),
    "stack mixes incompatible tables": (
        _set("stacks", [["a", "c"]]),
        "stacks[0]: Cannot stack tables ['a', 'c'] into 'a_c': their padded embedding dim differs",
    ),
    "table in two stacks": (
        _set("stacks", [["a", "b"], ["b", "c"]]),
        "stacks[1][0]: table 'b' is already in stacks[0]",
    ),
    "stack of one table": (_set("stacks", [["a"]]), "stacks[0]: a stack needs at least two tables"),
    "table read by no feature": (
        _append("tables", {**_base()["tables"][2], "name": "d"}),
        "tables[3]: table 'd' is read by no feature",
    ),
    "feature name taken by the record format": (
        _set("features.3.name", "label"),
        "features: Record keys ['label'] are used twice",
    ),
    "no features": (_set("features", []), "features: at least one feature is required"),
    "negative dense count": (_set("dense_features", -1), "dense_features: must be an integer >= 0"),
    "missing dataset key": (_delete("dataset.dir"), "dataset.dir: missing required key"),
    # Keys that never were at these paths: the table of moved keys is not consulted.
    "misspelled key beside moved ones": (
        _set("synthetic.example", 10),
        "synthetic.example: unknown key; did you mean 'examples'? known keys: examples, "
        "eval_examples, features, shards",
    ),
    "moved key's name elsewhere": (
        _set("tables.2.zipf", 1.2),
        "tables[2].zipf: unknown key; known keys: name, vocabulary_size",
    ),
}


@pytest.mark.parametrize("mutate, message", ERROR_CASES.values(), ids=ERROR_CASES.keys())
def test_config_errors_name_the_file_and_the_entry(tmp_path, mutate, message):
    raw = _base()
    mutate(raw)
    path = _write(tmp_path, raw)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value).startswith(f"{path}: {message}")
    assert error.value.source == str(path)
    assert isinstance(error.value, ValueError)


RAW_TEXT_CASES = {
    "duplicate YAML key": (
        "name: a\nseed: 1\nseed: 2\n",
        "invalid YAML: line 3, column 1: duplicate key 'seed'",
    ),
    "invalid YAML": ("name: [a\n", "invalid YAML: line 2, column 1:"),
    "not a mapping": ("- 1\n- 2\n", "expected a mapping, got a list"),
    "empty file": ("", "expected a mapping, got empty"),
}


@pytest.mark.parametrize("text, message", RAW_TEXT_CASES.values(), ids=RAW_TEXT_CASES.keys())
def test_unusable_files_are_config_errors(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {message}")):
        load_config(path)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'no.yaml'}: cannot read")):
        load_config(tmp_path / "no.yaml")


@pytest.mark.parametrize("name", ["demo", "benchmark", "two_tower"])
def test_shipped_configs_load(name, tmp_path):
    config = load_config(shipped_config(name), relative_to=tmp_path)
    assert config.name == name
    assert config.dataset.dir == tmp_path / "runs" / name / "data"


def test_relative_paths_start_from_the_config_file_by_default():
    config = load_config(shipped_config("demo"))
    assert config.dataset.dir == shipped_config("demo").parent / "runs" / "demo" / "data"


def test_unknown_shipped_config_names_the_shipped_ones():
    with pytest.raises(
        ValueError,
        match="no shipped config named 'dem'; shipped configs: benchmark, criteo, demo, two_tower",
    ):
        shipped_config("dem")


def test_demo_config_has_the_documented_shape():
    config = load_config(shipped_config("demo"))
    assert (len(config.tables), len(config.feature_specs)) == (8, 10)
    assert (config.mesh.devices, config.mesh.partitions_per_device) == (8, 2)
    assert config.global_batch_size in (256, 512)
    readers = [f.table_spec.name for f in config.feature_specs.values()]
    assert any(readers.count(name) > 1 for name in config.tables)
    assert any(f.table_spec.is_stacked() for f in config.feature_specs.values())
    assert {t.optimizer.short_name() for t in config.tables.values()} == {
        "sgd",
        "adagrad",
        "rowwise_adagrad",
        "adam",
        "ftrl",
    }
    assert all(1000 <= t.vocabulary_size <= 100_000 for t in config.tables.values())
    assert all(8 <= t.embedding_dim <= 16 for t in config.tables.values())
    assert (config.synthetic.examples, config.synthetic.eval_examples) == (50_000, 5_000)
    # One idle-priority worker: input work must not take the step's cores.
    assert config.training.workers == 1
    assert config.training.worker_priority is pipelines.WorkerPriority.IDLE


@pytest.mark.parametrize("name", ["demo"])
def test_shipped_limits_cannot_be_exceeded(name):
    """Every stack's limits cover the most ids one partition slot can receive."""
    config = load_config(shipped_config(name))
    mesh = config.mesh
    prepared = embedding.prepare_feature_specs_for_training(
        config.feature_specs, mesh.devices, mesh.partitions_per_device
    )
    valency = {f.name: f.max_valency for f in config.synthetic.dataset.features}
    bound: dict[str, int] = {}
    for feature in prepared.values():
        stack = feature.table_spec.stacked_table_spec.stack_name
        per_slot = config.global_batch_size // mesh.num_partitions
        bound[stack] = bound.get(stack, 0) + per_slot * valency[feature.name]
    for stack, spec in embedding.get_stacked_table_specs(prepared).items():
        assert spec.max_ids_per_partition >= bound[stack], stack
        assert spec.max_unique_ids_per_partition >= bound[stack], stack


def test_benchmark_config_has_the_benchmark_geometry():
    config = load_config(shipped_config("benchmark"))
    assert (config.mesh.devices, config.mesh.partitions_per_device) == (8, 4)
    assert config.global_batch_size == 32768
    assert [(t.vocabulary_size, t.embedding_dim) for t in config.tables.values()] == [
        (1_000_000, 16)
    ] * 8
    assert {
        (f.min_valency, f.max_valency, f.zipf_exponent) for f in config.synthetic.dataset.features
    } == {(1, 20, 1.1)}


def test_feature_projection_off_needs_every_dim_to_be_the_interaction_dim(tmp_path):
    raw = _base()  # dims: a 8, b 8, c 16
    raw["model"] = {"bottom_mlp": [32, 8], "feature_projection": False}
    with pytest.raises(ConfigError, match=r"model\.feature_projection: .*\{'fc': 16\}"):
        load_config(_write(tmp_path, raw))
    raw["tables"][2]["embedding_dim"] = 8
    assert load_config(_write(tmp_path, raw)).model.feature_projection is False


_TABLES = """
name: run
seed: 3
mesh: {devices: 8, partitions_per_device: 2}
global_batch_size: 64
tables:
  - {name: a, vocabulary_size: 1000, embedding_dim: 8, combiner: mean,
     optimizer: {type: sgd, learning_rate: 0.1}, initializer: {type: normal, stddev: 0.02},
     max_ids_per_partition: 64, max_unique_ids_per_partition: 32}
dense_features: 5
"""
_OLD_FORMAT = (
    _TABLES
    + """
features:
  - {name: fa, table: a, valency: [1, 4]}
  - {name: fb, table: a, valency: [2, 3], zipf: 1.3}
dataset:
  dir: data
  examples: 1000
  eval_examples: 100
  shards: 2
"""
)
_CURRENT_FORMAT = (
    _TABLES
    + """
features:
  - {name: fa, table: a}
  - {name: fb, table: a}
dataset:
  dir: data
synthetic:
  examples: 1000
  eval_examples: 100
  shards: 2
  features:
    fa: {valency: [1, 4]}
    fb: {valency: [2, 3], zipf: 1.3}
"""
)


def test_a_config_of_the_earlier_format_names_every_moved_key_in_one_error(tmp_path):
    path = _write(tmp_path, _OLD_FORMAT)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert message.startswith(f"{path}: keys of an earlier config format: ")
    for old, now in {
        "features[0].valency": "synthetic.features.fa.valency",
        "features[1].valency": "synthetic.features.fb.valency",
        "features[1].zipf": "synthetic.features.fb.zipf",
        "dataset.examples": "synthetic.examples",
        "dataset.eval_examples": "synthetic.eval_examples",
        "dataset.shards": "synthetic.shards",
    }.items():
        assert f"{old} moved to {now}" in message


def test_the_same_config_in_the_current_format_loads(tmp_path):
    config = load_config(_write(tmp_path, _CURRENT_FORMAT))
    assert (config.synthetic.examples, config.synthetic.eval_examples) == (1000, 100)
    assert config.synthetic.shards == 2
    assert [
        (f.min_valency, f.max_valency, f.zipf_exponent) for f in config.synthetic.dataset.features
    ] == [(1, 4, 1.1), (2, 3, 1.3)]


def test_a_moved_key_left_behind_is_named_where_the_loader_meets_it(tmp_path):
    path = _write(tmp_path, _CURRENT_FORMAT.replace("  dir: data\n", "  dir: data\n  shards: 2\n"))
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"{path}: keys of an earlier config format: dataset.shards moved to synthetic.shards ("
        ),
    ):
        load_config(path)


def test_an_unknown_key_met_before_the_moved_ones_keeps_its_error(tmp_path):
    path = _write(tmp_path, _OLD_FORMAT + "sed: 1\n")
    with pytest.raises(
        ConfigError, match=re.escape(f"{path}: sed: unknown key; did you mean 'seed'?")
    ):
        load_config(path)
