"""Loading a run's YAML config into embedding specs and a synthetic-data description.

One config file describes a run for every job (the FDO statistics job, the
input pipeline, the trainer): the device mesh, the global batch, the tables
and the features that read them. Every key is checked: a missing, unknown
(misspelled) or mistyped key is a `ConfigError` naming the file and the YAML
path of the entry, e.g. `configs/x.yaml: features[3].table: unknown table
'foo'; known tables: a, b`.

Example:
  >>> config = load_config(shipped_config("demo"))       # doctest: +SKIP
  >>> config.feature_specs["user_id"].table_spec.name    # doctest: +SKIP
  'users'
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

import embedding
import pipelines
from embedding import initializers
from parallel import allreduce
from sparseflow._model import ModelConfig
from sparseflow._tower_config import read_pipeshard, read_tower

_OPTIMIZERS: dict[str, type[embedding.OptimizerSpec]] = {
    "sgd": embedding.SGDOptimizerSpec,
    "adagrad": embedding.AdagradOptimizerSpec,
    "rowwise_adagrad": embedding.RowWiseAdagradOptimizerSpec,
    "adam": embedding.AdamOptimizerSpec,
    "ftrl": embedding.FTRLOptimizerSpec,
}
_INITIALIZERS: dict[str, type] = {
    "normal": initializers.Normal,
    "truncated_normal": initializers.TruncatedNormal,
    "uniform": initializers.Uniform,
    "constant": initializers.Constant,
}
_DEFAULT_ZIPF_EXPONENT = 1.1


class ConfigError(embedding.SparseflowError, ValueError):
    """A config file that cannot be used; the message names the file and entry.

    Attributes:
      source: the config file, as given to `load_config`.
      yaml_path: the bad entry, e.g. `features[3].table` (empty: the whole file).
    """

    def __init__(self, source: str, yaml_path: str, message: str):
        where = f"{source}: {yaml_path}" if yaml_path else source
        super().__init__(f"{where}: {message}")
        self.source = source
        self.yaml_path = yaml_path


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The device mesh.

    Attributes:
      devices: G, devices over all hosts.
      partitions_per_device: S, embedding partitions ("sparse cores") per device.
      processes: hosts (one process each); each holds `devices / processes`.
    """

    devices: int
    partitions_per_device: int
    processes: int = 1

    def __post_init__(self) -> None:
        for name in ("devices", "partitions_per_device", "processes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        n = self.num_partitions
        if n & (n - 1):
            raise ValueError(
                f"devices ({self.devices}) x partitions_per_device "
                f"({self.partitions_per_device}) = {n} partitions; this must be a power of two"
            )
        if self.devices % self.processes:
            raise ValueError(
                f"{self.processes} processes cannot share {self.devices} devices evenly"
            )

    @property
    def num_partitions(self) -> int:
        """N = G * S, a power of two."""
        return self.devices * self.partitions_per_device

    @property
    def local_devices(self) -> int:
        """Devices of one host."""
        return self.devices // self.processes


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreprocessingConfig:
    """How the host preprocessing treats ids over the limits or out of range.

    Attributes:
      allow_id_dropping: drop (and count) ids over a table's partition limits
        instead of raising.
      invalid_id_policy: raise on ids outside the vocabulary, or drop them.
    """

    allow_id_dropping: bool = False
    invalid_id_policy: embedding.InvalidIdPolicy = embedding.InvalidIdPolicy.RAISE
    enable_minibatching: bool = False
    on_bad_record: pipelines.BadRecordPolicy = pipelines.BadRecordPolicy.RAISE


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """How `sparseflow train` runs.

    Attributes:
      steps: training steps (global batches); None: one pass over the data.
      pipelined: overlap the sparse stages of one batch with the dense stage
        of the previous one (`parallel.step`).
      checkpoint_every: steps between checkpoints (one is also written at the end).
      log_every: steps between logged metrics.
      eval_batches: held-out batches evaluated at the end (None: all).
      workers: Grain worker processes per host (0: in-process).
      worker_priority: the workers' CPU scheduling (`pipelines.WorkerPriority`):
        "idle" runs them only on CPU time the training step leaves free.
      shuffle: shuffle the training records (seeded by `seed`) every epoch.
      epochs: passes over the training data when `steps` is None.
      fdo_headroom: factor applied to FDO limits.
      agreement_port: first port of the hosts' all-reduce groups (worker w
        uses `agreement_port + w`); 0 picks free ports (one process only).
      agreement_tls_dir: mutual TLS between the hosts' all-reduce nodes: a
        directory with `ca.crt`, `rank-<r>.crt` and `rank-<r>.key`
        (`parallel.allreduce.AllReduceSecurity`); relative to the config file.
      agreement_secret_file: a file holding the run's shared secret (at least
        16 bytes); every agreement message then carries an HMAC keyed by it.
        Relative to the config file. Without either, the agreement is
        insecure, for hosts on one machine.
    """

    steps: int | None = None
    pipelined: bool = True
    checkpoint_every: int = 100
    log_every: int = 10
    eval_batches: int | None = None
    workers: int = 0
    worker_priority: pipelines.WorkerPriority = pipelines.WorkerPriority.IDLE
    shuffle: bool = True
    epochs: int = 1
    fdo_headroom: float = 1.1
    agreement_port: int = 0
    agreement_tls_dir: Path | None = None
    agreement_secret_file: Path | None = None

    def agreement_security(self, run_id: str) -> allreduce.AllReduceSecurity | None:
        """The agreement's authentication for run `run_id`; None when insecure."""
        if self.agreement_tls_dir is None and self.agreement_secret_file is None:
            return None
        return allreduce.AllReduceSecurity(
            tls_dir=self.agreement_tls_dir,
            secret_file=self.agreement_secret_file,
            run_id=run_id,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    """Where the run's dataset lives and how big the synthetic one is.

    Attributes:
      dir: absolute directory of the dataset.
      examples: training examples.
      eval_examples: evaluation examples.
      shards: files per split and format.
    """

    dir: Path
    examples: int
    eval_examples: int
    shards: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A loaded, checked config.

    Attributes:
      name: the run's name.
      seed: seed of initializers and synthetic data.
      mesh: devices and partitions.
      global_batch_size: examples per global batch.
      preprocessing: id dropping and invalid-id policy.
      tables: the logical tables by name (not stacked), in config order.
      feature_specs: the features by name, in config order, with the config's
        table stacks applied; tables outside any stack are left unprepared
        (the preprocessing prepares them).
      synthetic: the synthetic data description of the same features.
      dataset: where the dataset lives.
      source_path: the config file, absolute.
      config_hash: sha256 hex digest of the parsed YAML as canonical JSON
        (FDO stats are matched to a run by `fdo_layout` instead).
      model: the dense tower's sizes and optimizer.
      training: how `sparseflow train` runs.
    """

    name: str
    seed: int
    mesh: MeshConfig
    global_batch_size: int
    preprocessing: PreprocessingConfig
    tables: Mapping[str, embedding.TableSpec]
    feature_specs: Mapping[str, embedding.FeatureSpec]
    synthetic: pipelines.SyntheticDataset
    dataset: DatasetConfig
    source_path: Path
    config_hash: str
    model: ModelConfig = ModelConfig()
    training: TrainingConfig = TrainingConfig()

    @property
    def fdo_layout(self) -> embedding.FdoLayout:
        """What this run's FDO stats depend on: stats of the same layout serve the run.

        The tables' vocabularies and dimensions, the features and stacks, the
        mesh, the global batch and the preprocessing switches: a learning rate,
        an initializer, the dense tower or a configured limit can change
        without recomputing the stats.
        """
        geometry = embedding.FdoGeometry(
            global_batch_size=self.global_batch_size,
            devices=self.mesh.devices,
            partitions_per_device=self.mesh.partitions_per_device,
            processes=self.mesh.processes,
        )
        p = self.preprocessing
        extra = {
            "preprocessing.allow_id_dropping": p.allow_id_dropping,
            "preprocessing.invalid_ids": p.invalid_id_policy.value,
            "preprocessing.enable_minibatching": p.enable_minibatching,
        }
        weighted = self.synthetic.feature_layout().weighted
        extra.update({f"features.{name}.weighted": name in weighted for name in self.feature_specs})
        return embedding.fdo_layout(self.feature_specs, geometry, extra=extra)


@dataclasses.dataclass(frozen=True)
class _Node:
    """A value of the parsed YAML and where it sits, for error messages."""

    value: Any
    source: str
    path: str

    def error(self, message: str) -> ConfigError:
        return ConfigError(self.source, self.path, message)

    def child(self, key: str | int) -> _Node:
        if isinstance(key, int):
            path = f"{self.path}[{key}]"
        else:
            path = f"{self.path}.{key}" if self.path else key
        return _Node(self.value[key], self.source, path)

    def missing(self, key: str) -> ConfigError:
        return _Node(None, self.source, self.child_path(key)).error("missing required key")

    def child_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key


def _type_name(value: Any) -> str:
    return {
        dict: "a mapping",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        type(None): "empty",
    }.get(type(value), type(value).__name__)


def _mapping(node: _Node, required: tuple[str, ...], optional: tuple[str, ...] = ()):
    """Checks `node` is a mapping with all `required` keys and no others."""
    if not isinstance(node.value, dict):
        raise node.error(f"expected a mapping, got {_type_name(node.value)}")
    known = required + optional
    for key in node.value:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise _Node(None, node.source, node.child_path(str(key))).error(
                f"unknown key; {hint}known keys: {', '.join(known)}"
            )
    for key in required:
        if key not in node.value:
            raise node.missing(key)


def _get(node: _Node, key: str, kind: str, default: Any = None) -> Any:
    """The value at `key` (or `default` when absent), checked to be of `kind`.

    `kind` is one of "int", "number", "bool", "str", "list".
    """
    if key not in node.value:
        return default
    return _check_kind(node.child(key), kind)


def _check_kind(node: _Node, kind: str) -> Any:
    value = node.value
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str) and bool(value),
        "list": isinstance(value, list),
    }[kind]
    if not ok:
        expected = {
            "int": "an integer",
            "number": "a number",
            "bool": "true or false",
            "str": "a non-empty string",
            "list": "a list",
        }[kind]
        raise node.error(
            f"expected {expected}, got {_type_name(value)} {value!r}"
            f"{_float_hint(value) if kind == 'number' else ''}"
        )
    return float(value) if kind == "number" else value


def _float_hint(value: Any) -> str:
    # YAML 1.1 reads an exponent without a dot (1e-3) as a string.
    try:
        float(value)
    except (TypeError, ValueError):
        return ""
    return f" (YAML reads it as a string; write it with a dot, e.g. {float(value):.1e})"


def _int(node: _Node, key: str, default: Any = None, minimum: int = 1) -> Any:
    """The integer at `key` (or `default` when absent), checked to be >= `minimum`."""
    value = _get(node, key, "int", default)
    if value is not None and value < minimum:
        raise node.child(key).error(f"must be an integer >= {minimum}, got {value}")
    return value


def _choice(node: _Node, key: str, choices: Mapping[str, Any] | tuple[str, ...], what: str) -> str:
    value = _get(node, key, "str")
    if value not in choices:
        raise node.child(key).error(
            f"unknown {what} {value!r}; choose one of: {', '.join(choices)}"
        )
    return value


def _enum_choice(node: _Node, key: str, default: enum.Enum, what: str) -> enum.Enum:
    """The member of `default`'s enum named by the value at `key`, or `default` when absent."""
    if key not in node.value:
        return default
    cls = type(default)
    return cls(_choice(node, key, tuple(member.value for member in cls), what))


def _spec_params(node: _Node, cls: type) -> dict[str, Any]:
    """The keyword arguments of a spec dataclass (numbers and flags) from `node`.

    The accepted keys are the dataclass's fields, typed by their defaults, so a
    new optimizer parameter needs no change here.
    """
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    _mapping(node, ("type",), tuple(fields))
    return {
        name: _get(node, name, "bool" if isinstance(default, bool) else "number")
        for name, default in fields.items()
        if name in node.value
    }


def _build(node: _Node, cls: type, kwargs: dict[str, Any]) -> Any:
    """`cls(**kwargs)`, its own checks reported at `node`."""
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise node.error(str(e)) from e


def _typed_spec(node: _Node, registry: Mapping[str, type], what: str) -> Any:
    """An optimizer or initializer: `{type: <registry key>, <its parameters>}`."""
    if not isinstance(node.value, dict):
        raise node.error(f"expected a mapping with a 'type', got {_type_name(node.value)}")
    if "type" not in node.value:
        raise node.missing("type")
    cls = registry[_choice(node, "type", registry, f"{what} type")]
    return _build(node, cls, _spec_params(node, cls))


def _mesh(node: _Node) -> MeshConfig:
    _mapping(node, ("devices", "partitions_per_device"), ("processes",))
    return _build(
        node,
        MeshConfig,
        dict(
            devices=_int(node, "devices"),
            partitions_per_device=_int(node, "partitions_per_device"),
            processes=_int(node, "processes", 1),
        ),
    )


def _global_batch_size(node: _Node, mesh: MeshConfig) -> int:
    batch = _int(node, "global_batch_size")
    if batch % mesh.num_partitions:
        raise node.child("global_batch_size").error(
            f"{batch} is not divisible by devices x partitions_per_device = "
            f"{mesh.num_partitions}; every partition slot takes an equal share"
        )
    return batch


def _preprocessing(node: _Node) -> PreprocessingConfig:
    _mapping(node, (), ("allow_id_dropping", "invalid_ids", "enable_minibatching", "on_bad_record"))
    return PreprocessingConfig(
        allow_id_dropping=_get(node, "allow_id_dropping", "bool", False),
        invalid_id_policy=_enum_choice(
            node, "invalid_ids", embedding.InvalidIdPolicy.RAISE, "invalid-id policy"
        ),
        enable_minibatching=_get(node, "enable_minibatching", "bool", False),
        on_bad_record=_enum_choice(
            node, "on_bad_record", pipelines.BadRecordPolicy.RAISE, "bad-record policy"
        ),
    )


def _widths(node: _Node, key: str, default: tuple[int, ...]) -> tuple[int, ...]:
    if key not in node.value:
        return default
    values = _get(node, key, "list")
    child = node.child(key)
    return tuple(_int(child, i) for i in range(len(values)))


def _model(node: _Node) -> ModelConfig:
    _mapping(node, (), ("bottom_mlp", "top_mlp", "learning_rate", "tower", "pipeshard"))
    defaults = ModelConfig()
    return _build(
        node,
        ModelConfig,
        dict(
            bottom_mlp=_widths(node, "bottom_mlp", defaults.bottom_mlp),
            top_mlp=_widths(node, "top_mlp", defaults.top_mlp),
            learning_rate=_get(node, "learning_rate", "number", defaults.learning_rate),
            tower=read_tower(node.child("tower")) if "tower" in node.value else defaults.tower,
            pipeshard=read_pipeshard(node.child("pipeshard"))
            if "pipeshard" in node.value
            else None,
        ),
    )


def _training(node: _Node, config_dir: Path) -> TrainingConfig:
    fields = {f.name: f.default for f in dataclasses.fields(TrainingConfig)}
    _mapping(node, (), tuple(fields))
    values = dict(
        steps=_int(node, "steps"),
        pipelined=_get(node, "pipelined", "bool", fields["pipelined"]),
        checkpoint_every=_int(node, "checkpoint_every", fields["checkpoint_every"]),
        log_every=_int(node, "log_every", fields["log_every"]),
        eval_batches=_int(node, "eval_batches"),
        workers=_int(node, "workers", fields["workers"], minimum=0),
        worker_priority=_enum_choice(
            node, "worker_priority", fields["worker_priority"], "worker priority"
        ),
        shuffle=_get(node, "shuffle", "bool", fields["shuffle"]),
        epochs=_int(node, "epochs", fields["epochs"]),
        fdo_headroom=_get(node, "fdo_headroom", "number", fields["fdo_headroom"]),
        agreement_port=_int(node, "agreement_port", fields["agreement_port"], minimum=0),
        agreement_tls_dir=_path(node, "agreement_tls_dir", config_dir),
        agreement_secret_file=_path(node, "agreement_secret_file", config_dir),
    )
    if values["fdo_headroom"] < 1:
        raise node.child("fdo_headroom").error(f"must be >= 1, got {values['fdo_headroom']}")
    return TrainingConfig(**values)


def _table(node: _Node) -> embedding.TableSpec:
    _mapping(
        node,
        (
            "name",
            "vocabulary_size",
            "embedding_dim",
            "combiner",
            "optimizer",
            "initializer",
            "max_ids_per_partition",
            "max_unique_ids_per_partition",
        ),
        ("suggested_coo_buffer_size_per_device",),
    )
    combiners = tuple(c.value for c in embedding.Combiner)
    return _build(
        node,
        embedding.TableSpec,
        dict(
            name=_get(node, "name", "str"),
            vocabulary_size=_int(node, "vocabulary_size"),
            embedding_dim=_int(node, "embedding_dim"),
            combiner=_choice(node, "combiner", combiners, "combiner"),
            optimizer=_typed_spec(node.child("optimizer"), _OPTIMIZERS, "optimizer"),
            initializer=_typed_spec(node.child("initializer"), _INITIALIZERS, "initializer"),
            max_ids_per_partition=_int(node, "max_ids_per_partition"),
            max_unique_ids_per_partition=_int(node, "max_unique_ids_per_partition"),
            suggested_coo_buffer_size_per_device=_int(node, "suggested_coo_buffer_size_per_device"),
        ),
    )


def _named_list(node: _Node, what: str, parse) -> dict[str, Any]:
    """Parses a non-empty list of named entries into a dict, rejecting duplicates."""
    items = _check_kind(node, "list")
    if not items:
        raise node.error(f"at least one {what} is required")
    parsed: dict[str, Any] = {}
    first_index: dict[str, int] = {}
    for i in range(len(items)):
        entry = parse(node.child(i))
        if entry.name in parsed:
            where = node.child(i).child("name")
            raise where.error(
                f"duplicate {what} name {entry.name!r} (also at "
                f"{node.path}[{first_index[entry.name]}])"
            )
        parsed[entry.name] = entry
        first_index[entry.name] = i
    return parsed


def _valency(node: _Node) -> tuple[int, int]:
    values = _check_kind(node, "list")
    if len(values) != 2:
        raise node.error(f"expected [min, max], got {values!r}")
    low, high = (_check_kind(node.child(i), "int") for i in range(2))
    if low < 1:
        raise node.error(f"min valency must be >= 1 (every sample has an id), got {low}")
    if low > high:
        raise node.error(f"min valency {low} is greater than max valency {high}")
    return low, high


@dataclasses.dataclass(frozen=True)
class _Feature:
    name: str
    spec: embedding.FeatureSpec
    synthetic: pipelines.SyntheticFeature


def _feature(
    node: _Node, tables: Mapping[str, embedding.TableSpec], global_batch_size: int
) -> _Feature:
    _mapping(node, ("name", "table", "valency"), ("zipf", "weighted"))
    name = _get(node, "name", "str")
    table_name = _get(node, "table", "str")
    if table_name not in tables:
        raise node.child("table").error(
            f"unknown table {table_name!r}; known tables: {', '.join(tables)}"
        )
    table = tables[table_name]
    min_valency, max_valency = _valency(node.child("valency"))
    zipf = _get(node, "zipf", "number", _DEFAULT_ZIPF_EXPONENT)
    if not zipf > 1:
        raise node.child("zipf").error(f"the Zipf exponent must be > 1, got {zipf}")
    spec = _build(
        node,
        embedding.FeatureSpec,
        dict(
            name=name,
            table_spec=table,
            input_shape=[global_batch_size, max_valency],
            output_shape=[global_batch_size, table.embedding_dim],
        ),
    )
    synthetic = _build(
        node,
        pipelines.SyntheticFeature,
        dict(
            name=name,
            vocabulary_size=table.vocabulary_size,
            min_valency=min_valency,
            max_valency=max_valency,
            zipf_exponent=zipf,
            weighted=_get(node, "weighted", "bool", False),
        ),
    )
    return _Feature(name, spec, synthetic)


def _check_tables_used(
    node: _Node, tables: Mapping[str, embedding.TableSpec], features: Mapping[str, _Feature]
) -> None:
    used = {f.spec.table_spec.name for f in features.values()}
    for i, name in enumerate(tables):
        if name not in used:
            raise node.child(i).error(
                f"table {name!r} is read by no feature; remove it or add a feature"
            )


def _stacks(
    node: _Node,
    feature_specs: dict[str, embedding.FeatureSpec],
    tables: Mapping[str, embedding.TableSpec],
    mesh: MeshConfig,
) -> dict[str, embedding.FeatureSpec]:
    """Applies every table stack (a list of table names) to `feature_specs`."""
    order = list(feature_specs)
    stacked_in: dict[str, int] = {}
    for i, names in enumerate(_check_kind(node, "list")):
        stack = node.child(i)
        if len(_check_kind(stack, "list")) < 2:
            raise stack.error(f"a stack needs at least two tables, got {names!r}")
        for j in range(len(names)):
            name = _check_kind(stack.child(j), "str")
            if name not in tables:
                raise stack.child(j).error(
                    f"unknown table {name!r}; known tables: {', '.join(tables)}"
                )
            if name in stacked_in:
                raise stack.child(j).error(
                    f"table {name!r} is already in {node.path}[{stacked_in[name]}]"
                )
            stacked_in[name] = i
        try:
            feature_specs = embedding.stack_tables(
                feature_specs, names, mesh.devices, mesh.partitions_per_device
            )
        except ValueError as e:
            raise stack.error(str(e)) from e
    # The stacking returns the dict in sorted-key order; keep the config's.
    return {name: feature_specs[name] for name in order}


def _path(node: _Node, key: str, config_dir: Path) -> Path | None:
    """The path at `key`, relative to `config_dir`; None when absent."""
    value = _get(node, key, "str")
    return None if value is None else Path(os.path.abspath(config_dir / value))


def _dataset(node: _Node, config_dir: Path) -> DatasetConfig:
    _mapping(node, ("dir", "examples", "eval_examples"), ("shards",))
    return DatasetConfig(
        # A relative dir is relative to the config file (or the folder
        # `load_config` was given), not to the working directory, so that
        # every job finds the same data.
        dir=Path(os.path.abspath(config_dir / _get(node, "dir", "str"))),
        examples=_int(node, "examples"),
        eval_examples=_int(node, "eval_examples", minimum=0),
        shards=_int(node, "shards", 1),
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that rejects a key repeated in one mapping.

    Plain PyYAML keeps the last of repeated keys, which would hide a
    copy-and-paste mistake in a table or feature entry.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(path: Path, source: str) -> Any:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(source, "", f"cannot read the config: {e.strerror or e}") from e
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(source, "", f"invalid YAML: {where}{e.problem}") from e
    except yaml.YAMLError as e:
        raise ConfigError(source, "", f"invalid YAML: {e}") from e


def load_config(
    path: str | os.PathLike, *, relative_to: str | os.PathLike | None = None
) -> RunConfig:
    """Loads and checks a run config.

    Args:
      path: the YAML file.
      relative_to: the folder relative paths in the config (`dataset.dir`,
        `training.agreement_*`) start from; default: the config file's folder.
        The command line passes the working directory for a shipped config,
        whose own folder is inside the installed package.

    Returns:
      The run's specs: tables, features (with the config's stacks applied),
      the mesh, the synthetic-data description and the dataset location.

    Raises:
      ConfigError: the file cannot be read, is not YAML, or an entry is
        missing, unknown, mistyped or inconsistent; the message names the
        file and the entry.
    """
    source = os.fspath(path)
    base = Path(source).parent if relative_to is None else Path(relative_to)
    raw = _parse_yaml(Path(path), source)
    root = _Node(raw, source, "")
    _mapping(
        root,
        (
            "name",
            "seed",
            "mesh",
            "global_batch_size",
            "tables",
            "features",
            "dense_features",
            "dataset",
        ),
        ("preprocessing", "stacks", "model", "training"),
    )
    mesh = _mesh(root.child("mesh"))
    batch = _global_batch_size(root, mesh)
    tables = _named_list(root.child("tables"), "table", _table)
    features = _named_list(
        root.child("features"), "feature", lambda node: _feature(node, tables, batch)
    )
    _check_tables_used(root.child("tables"), tables, features)
    feature_specs = {name: f.spec for name, f in features.items()}
    if raw.get("stacks") is not None:
        feature_specs = _stacks(root.child("stacks"), feature_specs, tables, mesh)
    return RunConfig(
        name=_get(root, "name", "str"),
        seed=_int(root, "seed", minimum=0),
        mesh=mesh,
        global_batch_size=batch,
        preprocessing=(
            _preprocessing(root.child("preprocessing"))
            if raw.get("preprocessing") is not None
            else PreprocessingConfig()
        ),
        tables=tables,
        feature_specs=feature_specs,
        synthetic=_build(
            root.child("features"),
            pipelines.SyntheticDataset,
            dict(
                features=tuple(f.synthetic for f in features.values()),
                num_dense_features=_int(root, "dense_features", minimum=0),
            ),
        ),
        dataset=_dataset(root.child("dataset"), base),
        source_path=Path(os.path.abspath(source)),
        config_hash=hashlib.sha256(
            json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest(),
        model=_model(root.child("model")) if raw.get("model") is not None else ModelConfig(),
        training=(
            _training(root.child("training"), base)
            if raw.get("training") is not None
            else TrainingConfig()
        ),
    )
