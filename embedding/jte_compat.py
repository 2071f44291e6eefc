"""jax-tpu-embedding's names and signatures, as aliases of `embedding`.

A script written for jax-tpu-embedding 0.1.0 switches by changing its
imports only:

    from embedding import jte_compat as embedding          # was ...lib.nn.embedding
    from embedding import jte_compat as embedding_spec     # was ...lib.nn.embedding_spec
    from embedding import jte_compat as table_stacking     # was ...lib.nn.table_stacking

Every name here takes the reference's arguments and returns what the
reference returns, computed by `embedding`'s own functions. Where the two
differ (docs/switching.md lists it all):

* `embedding`'s specs are frozen dataclasses; this module's `TableSpec`
  takes the reference's in-place edits (`table.stacked_table_spec = ...`),
  checked, and every function reads a table as it is when called.
  `prepare_feature_specs_for_training` and
  `update_preprocessing_parameters` put prepared specs into the dict and
  list containers they are given (the reference edits the spec objects
  themselves) and also return the prepared tree; every function here
  prepares unprepared specs alike, so a spec held elsewhere (in a tuple, or
  a `TableSpec` variable) gives the same results. A table placed in a stack
  of its own by hand, whose feature has no id transformation, lays out as
  in the reference (its stack's limits and buffer, see `read_placements`).
* `sc_simd_width` (later versions' preprocessing argument) is accepted as 8
  only, the partition alignment of this layout; a local batch over
  `2**26 - 1` samples per device is refused as the reference refuses it.
* The lookup and the update run on global arrays over a 1-D mesh, not
  inside `shard_map` (they partition themselves): call them directly or
  under `jax.jit`. The mesh is that of the variables' sharding, or `mesh=`.
* `num_sc_per_device=None` (the reference counts the host's SparseCores)
  needs a device that has them: pass it explicitly.
* `FDOClient` is `embedding.FdoClient`, a file client whose `load()` gives
  `FdoStats`, which `update_preprocessing_parameters` takes.
  `NPZFileFDOClient` is the reference's file client, its files and
  semantics.
* `TableSpec` takes the reference's `_setting_in_stack=`,
  `_stacked_table_spec=` and `quantization_config=`; a quantized table is
  refused when it is placed in a stack.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from embedding._jte_specs import QuantizationConfig, TableSpec, read_placements
from embedding._layout import ALIGNMENT
from embedding._lookup import sparse_dense_matmul
from embedding._optimizers import (
    AdagradMomentumOptimizerSpec,
    AdagradMomentumSlots,
    AdagradOptimizerSpec,
    AdagradSlots,
    AdamOptimizerSpec,
    AdamSlots,
    F2AOptimizerSpec,
    F2ASlots,
    FTRLOptimizerSpec,
    FTRLSlots,
    LaPropOptimizerSpec,
    LaPropSlots,
    OptimizerSpec,
    SGDOptimizerSpec,
    SGDSlots,
)
from embedding._preprocess import (
    PreprocessedInput,
    SparseDenseMatmulInput,
    SparseDenseMatmulInputStats,
    coo_buffer_size_per_device,
)
from embedding._preprocess import (
    preprocess_sparse_dense_matmul_input as _preprocess,
)
from embedding._specs import (
    FeatureIdTransformation,
    FeatureSpec,
    StackedTableSpec,
    TableSettingInStack,
)
from embedding._specs import TableSpec as _AnyTableSpec  # ours, or this module's subclass
from embedding._stacking import (
    Nested,
    check_partition_count,
    get_stacked_table_specs,
    own_stack,
)
from embedding._stacking import (
    prepare_feature_specs_for_training as _prepare,
)
from embedding._update import apply_gradients
from embedding._variables import EmbeddingVariables as _Variables
from embedding._variables import to_logical_order, to_sharded_order
from embedding.fdo._client import FdoClient
from embedding.fdo._file import FdoStats
from embedding.fdo._limits import StackLimits, apply_fdo, set_stack_limits
from embedding.fdo._npz_client import NPZFileFDOClient

FDOClient = FdoClient
# The reference's names of the optimizers' slot tuples.
SGDSlotVariables = SGDSlots
AdagradSlotVariables = AdagradSlots
AdamSlotVariables = AdamSlots
FTRLSlotVariables = FTRLSlots
LaPropSlotVariables = LaPropSlots
AdagradMomentumSlotVariables = AdagradMomentumSlots
F2ASlotVariables = F2ASlots

# Minibatching gives a batch up to 64 passes over the limits.
_MAX_MINIBATCHES = 64
# The reference's CooFormat keeps a sample's row within a device's batch in
# 26 bits (`CooFormat::kDataMask`) and refuses larger local batches; so does
# this module, so that a batch that runs here runs there too.
_COO_MAX_SAMPLES_PER_DEVICE = (1 << 26) - 1


class EmbeddingVariables(NamedTuple):
    """A stacked table and its optimizer slots, with the reference's field names.

    Attributes:
      table: `float32[stack_vocab_size, stack_embedding_dim]`, sharded by rows.
      slot: the optimizer's slot variables in its order (`()` for SGD,
        `(accumulator,)` for Adagrad, ...).
    """

    table: Any
    slot: Any


def _num_sc(num_sc_per_device: int | None) -> int:
    if num_sc_per_device is None:
        raise ValueError(
            "num_sc_per_device=None counts the SparseCores of this host's devices, which "
            "only jax-tpu-embedding on TPU can; pass num_sc_per_device (e.g. 4)."
        )
    return num_sc_per_device


def _check_mod(sharding_strategy: str) -> None:
    if str(sharding_strategy).upper() != "MOD":
        raise ValueError(f"Unsupported sharding strategy {sharding_strategy!r}; only MOD is.")


def _update_in_place(container: Any, prepared: Any) -> None:
    """Puts the leaves of `prepared` into the dicts and lists of `container`."""
    if isinstance(container, dict):
        keys = container.keys()
    elif isinstance(container, list):
        keys = range(len(container))
    elif isinstance(container, tuple):
        for old, new in zip(container, prepared, strict=True):
            _update_in_place(old, new)
        return
    else:
        return
    for key in keys:
        if isinstance(container[key], FeatureSpec):
            container[key] = prepared[key]
        else:
            _update_in_place(container[key], prepared[key])


def prepare_feature_specs_for_training(
    feature_specs: Nested[FeatureSpec],
    global_device_count: int,
    num_sc_per_device: int | None = None,
) -> Nested[FeatureSpec]:
    """`embedding.prepare_feature_specs_for_training`, also stored into `feature_specs`.

    The prepared specs replace the unprepared ones in `feature_specs`' dicts
    and lists (tuples keep theirs); the prepared tree is returned too.
    """
    prepared = _prepare(
        read_placements(feature_specs), global_device_count, _num_sc(num_sc_per_device)
    )
    _update_in_place(feature_specs, prepared)
    return prepared


def _batch_stats_limits(
    feature_specs: Nested[FeatureSpec], stats: SparseDenseMatmulInputStats, num_sc: int
) -> dict[str, StackLimits]:
    """The reference's reading of `NPZFileFDOClient.load()`'s stats: per
    stack, the max of its arrays (at least 1), the buffer `max * num_sc`;
    a stack the stats do not name keeps its limits.

    Raises:
      ValueError: a feature is not prepared (the reference requires it too).
    """

    def largest(arrays: Mapping[str, Any], name: str, current: int) -> int:
        return max(1, int(np.max(arrays.get(name, current))))

    limits = {}
    for name, stack in get_stacked_table_specs(feature_specs).items():
        buffer = stats.required_buffer_size_per_sc.get(name)
        limits[name] = StackLimits(
            max_ids_per_partition=largest(
                stats.max_ids_per_partition, name, stack.max_ids_per_partition
            ),
            max_unique_ids_per_partition=largest(
                stats.max_unique_ids_per_partition, name, stack.max_unique_ids_per_partition
            ),
            suggested_coo_buffer_size_per_device=(
                stack.suggested_coo_buffer_size_per_device
                if buffer is None
                else max(1, int(np.max(buffer)) * num_sc)
            ),
        )
    return limits


def update_preprocessing_parameters(
    feature_specs: Nested[FeatureSpec],
    stats: FdoStats | SparseDenseMatmulInputStats,
    num_sc_per_device: int | None = None,
) -> Nested[FeatureSpec]:
    """New stack limits from FDO stats, also stored into `feature_specs`.

    `FdoStats` (`FDOClient.load()`) go through `embedding.apply_fdo`;
    `SparseDenseMatmulInputStats` (`NPZFileFDOClient.load()`) are read as the
    reference reads them: per stack the max of each array, the buffer per
    device `max(required_buffer_size_per_sc) * num_sc_per_device`.

    Raises:
      ValueError: `num_sc_per_device` is not the `FdoStats`' partitions per
        device, or, with `SparseDenseMatmulInputStats`, a feature is not
        prepared.
    """
    num_sc = _num_sc(num_sc_per_device)
    if isinstance(stats, SparseDenseMatmulInputStats):
        prepared = set_stack_limits(
            feature_specs,
            _batch_stats_limits(feature_specs, stats, num_sc),
            # The specs are prepared (checked above): the device count is not read.
            global_device_count=1,
            num_sc_per_device=num_sc,
        )
    elif num_sc != stats.geometry.partitions_per_device:
        raise ValueError(
            f"num_sc_per_device is {num_sc} but the stats were measured with "
            f"{stats.geometry.partitions_per_device} partitions per device."
        )
    else:
        prepared = apply_fdo(read_placements(feature_specs), stats)
    _update_in_place(feature_specs, prepared)
    return prepared


def _check_simd_width(sc_simd_width: int | None) -> None:
    if sc_simd_width is None or (type(sc_simd_width) is int and sc_simd_width == ALIGNMENT):
        return
    raise ValueError(
        f"sc_simd_width={sc_simd_width!r} is not supported: sparseflow pads every "
        f"partition's entries and the row pointers to multiples of {ALIGNMENT}, the "
        "SparseCore SIMD width of TPU v4, v5 and v6e. Pass sc_simd_width=8 or leave it out."
    )


def _check_coo_rows(prepared: Nested[FeatureSpec], global_device_count: int) -> None:
    """Refuses the local batches the reference's CooFormat cannot index."""
    rows: dict[str, int] = {}
    for feature in jax.tree.leaves(prepared):
        stack = feature.table_spec.stacked_table_spec.stack_name
        rows[stack] = rows.get(stack, 0) + feature.global_batch_size // global_device_count
    for stack, count in rows.items():
        if count > _COO_MAX_SAMPLES_PER_DEVICE:
            raise ValueError(
                f"Stack {stack!r}: the local batch of {count} samples per device (over "
                f"{global_device_count} devices) exceeds the maximum limit supported by the "
                f"SparseCore CooFormat ({_COO_MAX_SAMPLES_PER_DEVICE} samples, a 26-bit row "
                "field). Spread the global batch over more devices or use smaller batches."
            )


def preprocess_sparse_dense_matmul_input(
    features: Nested,
    features_weights: Nested | None,
    feature_specs: Nested[FeatureSpec],
    local_device_count: int,
    global_device_count: int,
    *,
    num_sc_per_device: int | None = None,
    sc_simd_width: int | None = None,
    sharding_strategy: str = "MOD",
    has_leading_dimension: bool = False,
    allow_id_dropping: bool = False,
    batch_number: int = 0,
    enable_minibatching: bool = False,
    all_reduce_interface: Any = None,
) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
    """`embedding.preprocess_sparse_dense_matmul_input` (ids checked against the vocabulary).

    Raises:
      ValueError: `sc_simd_width` other than 8 (None is 8), a stack's local
        batch over `2**26 - 1` samples per device (the reference's limit),
        or what `embedding.preprocess_sparse_dense_matmul_input` raises.
    """
    _check_mod(sharding_strategy)
    _check_simd_width(sc_simd_width)
    num_sc = _num_sc(num_sc_per_device)
    prepared = _prepare(read_placements(feature_specs), global_device_count, num_sc)
    _check_coo_rows(prepared, global_device_count)
    return _preprocess(
        features,
        features_weights,
        prepared,
        local_device_count,
        global_device_count,
        num_sc_per_device=num_sc,
        has_leading_dimension=has_leading_dimension,
        allow_id_dropping=allow_id_dropping,
        batch_number=batch_number,
        enable_minibatching=enable_minibatching,
        all_reduce_interface=all_reduce_interface,
    )


def compute_coo_buffer_size_per_device(
    feature_specs: Nested[FeatureSpec],
    global_device_count: int,
    num_sc_per_device: int | None = None,
    enable_minibatching: bool = False,
) -> dict[str, int]:
    """Buffer entries per device of every stacked table, by stack name
    (`embedding.coo_buffer_size_per_device` of its limits)."""
    num_sc = _num_sc(num_sc_per_device)
    num_partitions = check_partition_count(global_device_count, num_sc)
    stacks = get_stacked_table_specs(
        _prepare(read_placements(feature_specs), global_device_count, num_sc)
    )
    return {
        name: coo_buffer_size_per_device(
            stack.max_ids_per_partition,
            stack.suggested_coo_buffer_size_per_device,
            num_sc,
            num_partitions,
            _MAX_MINIBATCHES if enable_minibatching else 1,
        )
        for name, stack in stacks.items()
    }


def _stacks(table_specs: Nested[_AnyTableSpec], num_shards: int) -> dict[str, list[_AnyTableSpec]]:
    """Prepared members of every stack of `table_specs`, in row-offset order;
    an unprepared table stands alone in a stack of its name (as preparing does)."""
    check_partition_count(num_shards, 1)
    stacks: dict[str, list[_AnyTableSpec]] = {}
    for table in jax.tree.leaves(table_specs):
        if not isinstance(table, _AnyTableSpec):
            raise TypeError(f"Expected TableSpec leaves, got {type(table).__name__}.")
        if not table.is_stacked():
            table = own_stack(table, num_shards, total_sample_count=1)
        stacks.setdefault(table.stacked_table_spec.stack_name, []).append(table)
    for members in stacks.values():
        members.sort(key=lambda t: t.setting_in_stack.row_offset_in_shard)
    return stacks


def stack_and_shard_tables(
    table_specs: Nested[_AnyTableSpec],
    tables: Nested[Any],
    num_shards: int,
    pad_value: float = np.nan,
) -> dict[str, np.ndarray]:
    """Logical tables -> stacked tables in sharded row order, on the host.

    Args:
      table_specs: pytree of `TableSpec`.
      tables: the same pytree of `[vocabulary_size, embedding_dim]` values.
      num_shards: `global_device_count * num_sc_per_device`.
      pad_value: the padding rows' and columns' value.

    Returns:
      `float32[num_shards, stack_vocab_size / num_shards, stack_embedding_dim]`
      by stack name: shard `k` is partition `k`, so
      `.reshape(-1, stack_embedding_dim)` placed with rows sharded over the
      devices is `EmbeddingVariables.table`.
    """
    values = {
        table.name: np.asarray(value, np.float32)
        for table, value in zip(jax.tree.leaves(table_specs), jax.tree.leaves(tables), strict=True)
    }
    out = {}
    for name, members in _stacks(table_specs, num_shards).items():
        logical = [values[table.name] for table in members]
        stacked = to_sharded_order(logical, members, num_shards)
        present = to_sharded_order([np.ones_like(v) for v in logical], members, num_shards)
        stacked = np.where(present > 0, stacked, np.float32(pad_value))
        out[name] = stacked.reshape(num_shards, -1, stacked.shape[1])
    return out


def unshard_and_unstack_tables(
    table_specs: Nested[_AnyTableSpec], stacked_tables: Mapping[str, Any], num_shards: int
) -> Nested[np.ndarray]:
    """Inverse of `stack_and_shard_tables`: the pytree of `table_specs` with
    each table's `[vocabulary_size, embedding_dim]` values (numpy)."""
    logical = {}
    for name, members in _stacks(table_specs, num_shards).items():
        stacked = np.asarray(stacked_tables[name])
        stacked = stacked.reshape(-1, stacked.shape[-1])
        for table, values in zip(
            members, to_logical_order(stacked, members, num_shards), strict=True
        ):
            logical[table.name] = values
    return jax.tree.map(lambda table: logical[table.name], table_specs)


def _mesh(mesh: Mesh | None, variables: Mapping[str, Any], global_device_count: int | None) -> Mesh:
    """`mesh`, else the mesh the variables are sharded over, else all devices."""
    if mesh is not None:
        return mesh
    for entry in variables.values():
        if isinstance(entry.table, jax.Array) and not isinstance(entry.table, jax.core.Tracer):
            sharding = entry.table.sharding
            if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
                return sharding.mesh
    if global_device_count not in (None, jax.device_count()):
        raise ValueError(
            f"global_device_count is {global_device_count} but {jax.device_count()} devices "
            "exist; pass mesh= (the 1-D mesh the tables are sharded over)."
        )
    return Mesh(np.array(jax.devices()), ("x",))


def _our_variables(
    variables: Mapping[str, Any], feature_specs: Nested[FeatureSpec]
) -> dict[str, _Variables]:
    """`embedding.EmbeddingVariables` of the reference's `(table, slot)` pairs."""
    # The stacks' optimizers do not depend on the partition count.
    stacks = get_stacked_table_specs(_prepare(feature_specs, 1, 1))
    out = {}
    for name, entry in variables.items():
        if isinstance(entry, _Variables) or name not in stacks:
            out[name] = entry  # an unknown stack is the lookup's error to report
        else:
            out[name] = _Variables(entry.table, stacks[name].optimizer.slots_type(*entry.slot))
    return out


def _like_input(updated: Mapping[str, _Variables], given: Mapping[str, Any]) -> dict[str, Any]:
    """The updated variables in the type they were given in."""
    return {
        name: value if isinstance(given[name], _Variables) else EmbeddingVariables(*value)
        for name, value in updated.items()
    }


@contextlib.contextmanager
def _global_arrays_hint():
    """Adds to a disagreement of shapes the likeliest cause after switching."""
    try:
        yield
    except ValueError as error:
        error.add_note(
            "Called inside shard_map? sparseflow's lookup and update take the global arrays "
            "(call them directly or under jax.jit): they partition themselves."
        )
        raise


def _unsupported(**flags: bool) -> None:
    for name, unsupported in flags.items():
        if unsupported:
            raise ValueError(f"{name} is not supported by sparseflow's lookup.")


def tpu_sparse_dense_matmul(
    preprocessed_inputs: PreprocessedInput | SparseDenseMatmulInput,
    embedding_variables: Mapping[str, Any],
    feature_specs: Nested[FeatureSpec],
    *,
    global_device_count: int,
    sharding_strategy: str = "MOD",
    num_sc_per_device: int | None = None,
    enable_minibatching: bool = False,
    perform_unstacking: bool = True,
    use_activation_unstack_primitive: bool = False,
    mesh: Mesh | None = None,
) -> Nested[jax.Array]:
    """`embedding.sparse_dense_matmul`: per feature `float32[global_batch, dim]`.

    `num_sc_per_device` and `use_activation_unstack_primitive` are accepted
    and unused (the input's shapes carry the former); `mesh` defaults to
    the variables' mesh.

    Raises:
      ValueError: `perform_unstacking=False`, a strategy other than MOD, or
        input, variables and specs that disagree (e.g. per-device arrays,
        inside `shard_map`).
    """
    del num_sc_per_device, use_activation_unstack_primitive
    _check_mod(sharding_strategy)
    _unsupported(**{"perform_unstacking=False": not perform_unstacking})
    if isinstance(preprocessed_inputs, SparseDenseMatmulInput):
        preprocessed_inputs = PreprocessedInput(preprocessed_inputs)
    feature_specs = read_placements(feature_specs)
    with _global_arrays_hint():
        return sparse_dense_matmul(
            preprocessed_inputs,
            _our_variables(embedding_variables, feature_specs),
            feature_specs,
            _mesh(mesh, embedding_variables, global_device_count),
            enable_minibatching=enable_minibatching,
        )


def tpu_sparse_dense_matmul_grad(
    activation_gradients: Nested[jax.Array],
    preprocessed_inputs: PreprocessedInput | SparseDenseMatmulInput,
    embedding_variables: Mapping[str, Any],
    feature_specs: Nested[FeatureSpec],
    *,
    global_device_count: int | None = None,
    sharding_strategy: str = "MOD",
    label: str = "",
    step: Any = None,
    num_sc_per_device: int | None = None,
    enable_minibatching: bool = False,
    perform_stacking: bool = True,
    use_gradient_stacking_primitive: bool = False,
    embedding_var_limits: Mapping[str, tuple[float | None, float | None]] | None = None,
    mesh: Mesh | None = None,
) -> dict[str, Any]:
    """`embedding.apply_gradients`: the variables after one optimizer step.

    `step=None` is step 0; `label`, `num_sc_per_device` and
    `use_gradient_stacking_primitive` are accepted and unused. The variables
    come back in the type they were given (`EmbeddingVariables` of this
    module or of `embedding`); `embedding_variables` is donated.

    Raises:
      ValueError: `perform_stacking=False`, `embedding_var_limits`, a
        strategy other than MOD, or input, variables and specs that
        disagree (e.g. per-device arrays, inside `shard_map`).
    """
    del label, num_sc_per_device, use_gradient_stacking_primitive
    _check_mod(sharding_strategy)
    _unsupported(
        **{
            "perform_stacking=False": not perform_stacking,
            "embedding_var_limits": embedding_var_limits is not None,
        }
    )
    if isinstance(preprocessed_inputs, SparseDenseMatmulInput):
        preprocessed_inputs = PreprocessedInput(preprocessed_inputs)
    feature_specs = read_placements(feature_specs)
    with _global_arrays_hint():
        updated = apply_gradients(
            activation_gradients,
            preprocessed_inputs,
            _our_variables(embedding_variables, feature_specs),
            feature_specs,
            _mesh(mesh, embedding_variables, global_device_count),
            0 if step is None else step,
            enable_minibatching=enable_minibatching,
        )
    return _like_input(updated, embedding_variables)


__all__ = [
    "AdagradMomentumOptimizerSpec",
    "AdagradMomentumSlotVariables",
    "AdagradOptimizerSpec",
    "AdagradSlotVariables",
    "AdamOptimizerSpec",
    "AdamSlotVariables",
    "EmbeddingVariables",
    "F2AOptimizerSpec",
    "F2ASlotVariables",
    "FDOClient",
    "FTRLOptimizerSpec",
    "FTRLSlotVariables",
    "FeatureIdTransformation",
    "FeatureSpec",
    "LaPropOptimizerSpec",
    "LaPropSlotVariables",
    "NPZFileFDOClient",
    "OptimizerSpec",
    "PreprocessedInput",
    "QuantizationConfig",
    "SGDOptimizerSpec",
    "SGDSlotVariables",
    "SparseDenseMatmulInput",
    "SparseDenseMatmulInputStats",
    "StackedTableSpec",
    "TableSettingInStack",
    "TableSpec",
    "compute_coo_buffer_size_per_device",
    "prepare_feature_specs_for_training",
    "preprocess_sparse_dense_matmul_input",
    "stack_and_shard_tables",
    "tpu_sparse_dense_matmul",
    "tpu_sparse_dense_matmul_grad",
    "unshard_and_unstack_tables",
    "update_preprocessing_parameters",
]
