"""Loading a run's YAML config into embedding specs, a record layout and the data's location.

One config file describes a run for every job (the FDO statistics job, the
input pipeline, the trainer): the device mesh, the global batch, the tables
and the features that read them, what the records hold, where they are, and
(for `make-data` and the demo) the synthetic data. Every key is checked: a missing, unknown
(misspelled) or mistyped key is a `ConfigError` naming the file and the YAML
path of the entry, e.g. `configs/x.yaml: features[3].table: unknown table
'foo'; known tables: a, b`. Each section is read by its own module
(`_<section>.py`) with the generic checker of `_checker.py`.

Example:
  >>> config = load_config(shipped_config("demo"))       # doctest: +SKIP
  >>> config.feature_specs["user_id"].table_spec.name    # doctest: +SKIP
  'users'
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import embedding
import pipelines
from sparseflow._model import ModelConfig, check_feature_dims
from sparseflow.config._checker import (
    Node,
    build,
    get,
    integer,
    mapping,
    naming_moved_keys,
    parse_yaml,
)
from sparseflow.config._dataset import DatasetConfig, read_dataset
from sparseflow.config._features import Feature, read_features
from sparseflow.config._mesh import (
    DeviceCount,
    MeshConfig,
    read_global_batch_size,
    read_mesh,
    written_devices,
)
from sparseflow.config._preprocessing import PreprocessingConfig, read_preprocessing
from sparseflow.config._record import read_record
from sparseflow.config._synthetic import SyntheticConfig, read_synthetic
from sparseflow.config._tables import apply_stacks, check_tables_used, read_tables
from sparseflow.config._training import TrainingConfig, read_model, read_training


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
      layout: what the records hold and how they are read (the `record`
        section, or the fixed layout without one).
      dataset: where the dataset lives.
      synthetic: the synthetic data `make-data` and the demo write; None when
        the config has no `synthetic` section.
      source_path: the config file, absolute.
      config_hash: sha256 hex digest of the parsed YAML as canonical JSON
        (FDO stats are matched to a run by `fdo_layout` instead).
      model: the dense tower's sizes and optimizer.
      training: how `sparseflow train` runs.
      devices_origin: where `mesh.devices` came from when the config's own
        integer did not set it (`auto`, or a count given in its place), for
        messages about it; None when it did.
    """

    name: str
    seed: int
    mesh: MeshConfig
    global_batch_size: int
    preprocessing: PreprocessingConfig
    tables: Mapping[str, embedding.TableSpec]
    feature_specs: Mapping[str, embedding.FeatureSpec]
    layout: pipelines.FeatureLayout
    dataset: DatasetConfig
    source_path: Path
    config_hash: str
    synthetic: SyntheticConfig | None = None
    model: ModelConfig = ModelConfig()
    training: TrainingConfig = TrainingConfig()
    devices_origin: str | None = None

    @property
    def fdo_layout(self) -> embedding.FdoLayout:
        """What this run's FDO stats depend on: stats of the same layout serve the run.

        The tables' vocabularies and dimensions, the features and stacks, the
        mesh, the global batch and the preprocessing switches: a learning rate,
        an initializer, the dense tower or a configured limit can change
        without recomputing the stats. Which record key a feature reads, and
        whether its ids are hashed, count too.
        """
        p = self.preprocessing
        extra = {
            "preprocessing.allow_id_dropping": p.allow_id_dropping,
            "preprocessing.invalid_ids": p.invalid_id_policy.value,
            "preprocessing.enable_minibatching": p.enable_minibatching,
        }
        weighted = self.layout.weighted
        extra.update({f"features.{name}.weighted": name in weighted for name in self.feature_specs})
        for column in self.layout.schema.sparse:
            if column.key != column.name or column.ids is not pipelines.IdType.INT64:
                extra[f"features.{column.name}.record"] = f"{column.key} ({column.ids.value})"
        return embedding.fdo_layout(self.feature_specs, self.fdo_geometry, extra=extra)

    @property
    def fdo_geometry(self) -> embedding.FdoGeometry:
        """The batch geometry of this run's mesh and global batch, as FDO stats record it."""
        return embedding.FdoGeometry(
            global_batch_size=self.global_batch_size,
            devices=self.mesh.devices,
            partitions_per_device=self.mesh.partitions_per_device,
            processes=self.mesh.processes,
        )


_REQUIRED_KEYS = ("name", "seed", "mesh", "global_batch_size", "tables", "features", "dataset")
_OPTIONAL_KEYS = (
    "dense_features",
    "record",
    "synthetic",
    "preprocessing",
    "stacks",
    "model",
    "training",
)

# Keys of earlier formats at their former paths, with where each is now and
# how to write it (`naming_moved_keys`): the loader names them all when it
# meets one of them as an unknown key.
_MOVED_KEYS = {
    # The synthetic data left the features and the dataset for a section of
    # its own, which a config of real records does not have.
    "features[].valency": (
        "synthetic.features.<name>.valency",
        "write synthetic: {features: {<name>: {valency: [min, max]}}} for make-data and "
        "the demo; a config with a record section drops it",
    ),
    "features[].zipf": (
        "synthetic.features.<name>.zipf",
        "beside its valency: synthetic: {features: {<name>: {valency: [min, max], zipf: 1.2}}}",
    ),
    "dataset.examples": (
        "synthetic.examples",
        "write synthetic: {examples: N, eval_examples: M, features: ...}, or drop it with a "
        "record section; dataset keeps dir, and train and eval name real records",
    ),
    "dataset.eval_examples": ("synthetic.eval_examples", "held-out examples, beside examples"),
    "dataset.shards": ("synthetic.shards", "files per split and format, beside examples"),
}


def load_config(
    path: str | os.PathLike,
    *,
    relative_to: str | os.PathLike | None = None,
    devices: int | DeviceCount | None = None,
) -> RunConfig:
    """Loads and checks a run config.

    Args:
      path: the YAML file.
      relative_to: the folder relative paths in the config (`dataset.dir`,
        `training.agreement_*`) start from; default: the config file's folder.
        The command line passes the working directory for a shipped config,
        whose own folder is inside the installed package.
      devices: the device count to use in place of `mesh.devices` (the
        command line's `--devices`). None: the config's integer, or for
        `mesh.devices: auto` the devices JAX sees now, over every process;
        asking starts JAX's backend, so XLA_FLAGS and `jax.distributed` must
        be set up before.

    Returns:
      The run's specs: tables, features (with the config's stacks applied),
      the mesh, the record layout, the dataset location and the synthetic
      data description.

    Raises:
      ConfigError: the file cannot be read, is not YAML, or an entry is
        missing, unknown, mistyped or inconsistent; the message names the
        file and the entry, or for keys of an earlier format, each of them
        and where it moved.
    """
    with _top_level(path, relative_to) as (source, base, root):
        return _run_config(source, base, root, devices)


def _run_config(
    source: str, base: Path, root: Node, devices: int | DeviceCount | None
) -> RunConfig:
    raw = root.value
    mesh, device_count = read_mesh(root.child("mesh"), devices)
    batch = read_global_batch_size(root, mesh, device_count)
    tables = read_tables(root.child("tables"))
    features = read_features(root.child("features"), tables, batch)
    check_tables_used(
        root.child("tables"), tables, {f.spec.table_spec.name for f in features.values()}
    )
    feature_specs = feature_specs_by_name(features)
    layout = _layout(root, features)
    feature_specs = apply_stacks(
        root.child("stacks") if root.has("stacks") else None, feature_specs, tables, mesh
    )
    model = read_model(root.child("model")) if root.has("model") else ModelConfig()
    try:
        check_feature_dims(
            model, {name: f.table_spec.embedding_dim for name, f in feature_specs.items()}
        )
    except ValueError as e:
        raise root.child("model").child("feature_projection").error(str(e)) from e
    return RunConfig(
        name=get(root, "name", "str"),
        seed=integer(root, "seed", minimum=0),
        mesh=mesh,
        global_batch_size=batch,
        preprocessing=(
            read_preprocessing(root.child("preprocessing"))
            if root.has("preprocessing")
            else PreprocessingConfig()
        ),
        tables=tables,
        feature_specs=feature_specs,
        layout=layout,
        dataset=read_dataset(root.child("dataset"), base),
        synthetic=_synthetic(root, feature_specs_by_name(features), layout),
        source_path=Path(os.path.abspath(source)),
        config_hash=hashlib.sha256(
            json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest(),
        model=model,
        training=_training(root, base),
        devices_origin=device_count.origin,
    )


@contextlib.contextmanager
def _top_level(
    path: str | os.PathLike, relative_to: str | os.PathLike | None
) -> Iterator[tuple[str, Path, Node]]:
    """`(file name, folder relative paths start from, the checked top-level node)`.

    An unknown key met in the block, at any depth, that has moved is
    reported with every moved key the file holds (`_MOVED_KEYS`).
    """
    source = os.fspath(path)
    base = Path(source).parent if relative_to is None else Path(relative_to)
    root = Node(parse_yaml(Path(path), source), source, "")
    with naming_moved_keys(root, _MOVED_KEYS):
        mapping(root, _REQUIRED_KEYS, _OPTIONAL_KEYS)
        yield source, base, root


def _training(root: Node, base: Path) -> TrainingConfig:
    return read_training(root.child("training"), base) if root.has("training") else TrainingConfig()


@dataclasses.dataclass(frozen=True)
class EarlySettings:
    """What a command reads of its config before JAX starts.

    Attributes:
      devices: `mesh.devices` as written: an integer, or `"auto"`.
      training: the `training` section.
    """

    devices: int | str
    training: TrainingConfig


def read_early_settings(
    path: str | os.PathLike, *, relative_to: str | os.PathLike | None = None
) -> EarlySettings:
    """`mesh.devices` as written and the `training` section, checked as `load_config` does.

    The rest of the config (whose checks need a device count) is not read:
    `auto` is resolved only once XLA_FLAGS and `jax.distributed` are set up.
    """
    with _top_level(path, relative_to) as (_, base, root):
        return EarlySettings(
            devices=written_devices(root.child("mesh")),
            training=_training(root, base),
        )


def _layout(root: Node, features: Mapping[str, Feature]) -> pipelines.FeatureLayout:
    """The `record` section's layout, or the fixed one of `features` and `dense_features`."""
    if not root.has("record"):
        if "dense_features" not in root.value:
            raise root.missing("dense_features")
        return build(
            root.child("features"),
            pipelines.FeatureLayout,
            dict(
                sparse=tuple(features),
                weighted=frozenset(name for name, f in features.items() if f.weighted),
                num_dense_features=integer(root, "dense_features", minimum=0),
            ),
        )
    if "dense_features" in root.value:
        raise root.child("dense_features").error(
            "with a record section, the dense input is the keys of record.dense"
        )
    for i, entry in enumerate(root.value["features"]):
        if "weighted" in entry:
            raise (
                root.child("features")
                .child(i)
                .child("weighted")
                .error(
                    "with a record section, name the weights key in "
                    f"record.features.{entry['name']}.weights"
                )
            )
    return read_record(root.child("record"), feature_specs_by_name(features))


def feature_specs_by_name(features: Mapping[str, Feature]) -> dict[str, embedding.FeatureSpec]:
    """The features' specs, unstacked."""
    return {name: f.spec for name, f in features.items()}


def _synthetic(
    root: Node, features: Mapping[str, embedding.FeatureSpec], layout: pipelines.FeatureLayout
) -> SyntheticConfig | None:
    if not root.has("synthetic"):
        return None
    if root.has("record"):
        raise root.child("synthetic").error(
            "synthetic data is written in the fixed record layout; a config with a "
            "record section reads real records and has no synthetic section"
        )
    return read_synthetic(root.child("synthetic"), features, layout)
