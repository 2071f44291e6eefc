"""Host-side preprocessing of sparse features into the per-device layout.

`preprocess_sparse_dense_matmul_input` takes the same arguments as
jax-tpu-embedding's function of that name and returns the same layout
(docs/design.md section 2), with two differences a user can rely on: ids are
checked against the vocabulary, and a limit breach with dropping off raises a
`ValueError` that names the table, device, slot and partition instead of
aborting the process.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import operator
import os
from collections.abc import Mapping
from typing import NamedTuple

import jax
import numpy as np

from embedding._feature_input import InvalidIdPolicy, flatten_feature
from embedding._layout import (
    LayoutGeometry,
    Limits,
    StackMember,
    lay_out_sorted,
    minibatching_split,
    sort_stack,
)
from embedding._minibatch import NUM_BUCKETS, AllReduceInterface, minibatch_of_bucket
from embedding._specs import FeatureSpec, round_up
from embedding._stacking import (
    Nested,
    check_partition_count,
    prepare_feature_specs_for_training,
)

_log = logging.getLogger(__name__)
# Rows per host batch (over all features) from which stacks are laid out on threads.
_THREADED_MIN_ROWS = 16_384


class SparseDenseMatmulInput(NamedTuple):
    """The layout of every stacked table, keyed by stack name.

    Attributes:
      lhs_row_pointers: `int32[L * S * max(N, 8)]` per stack (or `[L, ...]`
        with a leading dimension).
      lhs_embedding_ids: `int32[L * coo_size]` local ids within the partition.
      lhs_sample_ids: `int32[L * coo_size]` samples within the slot.
      lhs_gains: `float32[L * coo_size]`.
    """

    lhs_row_pointers: Mapping[str, np.ndarray]
    lhs_embedding_ids: Mapping[str, np.ndarray]
    lhs_sample_ids: Mapping[str, np.ndarray]
    lhs_gains: Mapping[str, np.ndarray]


class PreprocessedInput(NamedTuple):
    """Preprocessed input for the lookup (a pytree).

    Attributes:
      sparse_dense_matmul_input: the layout.
      num_minibatches: `int32[L]` (or `[L, 1]`), 1 without minibatching.
    """

    sparse_dense_matmul_input: SparseDenseMatmulInput
    num_minibatches: np.ndarray

    # The layout's arrays, read through as attributes of the input itself.
    lhs_row_pointers = property(lambda self: self.sparse_dense_matmul_input.lhs_row_pointers)
    lhs_embedding_ids = property(lambda self: self.sparse_dense_matmul_input.lhs_embedding_ids)
    lhs_sample_ids = property(lambda self: self.sparse_dense_matmul_input.lhs_sample_ids)
    lhs_gains = property(lambda self: self.sparse_dense_matmul_input.lhs_gains)


@dataclasses.dataclass
class SparseDenseMatmulInputStats:
    """Per-stack stats of one host batch, counted after merging, before dropping.

    Attributes:
      max_ids_per_partition: `int32[L * N]`, max over a device's slots.
      max_unique_ids_per_partition: `int32[L * N]`.
      required_buffer_size_per_sc: `int32[L * S]`, sum over partitions of the
        count rounded up to 8.
      id_drop_counters: input ids dropped by limits or buffer size, every
        occurrence merged into a dropped entry counted (as jax-tpu-embedding
        counts them).
      invalid_id_counters: out-of-range ids dropped (policy "drop").
    """

    max_ids_per_partition: dict[str, np.ndarray]
    max_unique_ids_per_partition: dict[str, np.ndarray]
    required_buffer_size_per_sc: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    id_drop_counters: dict[str, int] = dataclasses.field(default_factory=dict)
    invalid_id_counters: dict[str, int] = dataclasses.field(default_factory=dict)


class _FeaturePlan(NamedTuple):
    index: int  # position among the leaves of feature_specs
    name: str
    vocabulary_size: int
    combiner: str
    col_offset: int
    col_shift: int
    local_rows: int
    samples_per_slot: int
    sample_offset: int  # samples of earlier features of the stack in one slot


class _StackPlan(NamedTuple):
    name: str
    features: tuple[_FeaturePlan, ...]
    geometry: LayoutGeometry
    limits: Limits


def coo_buffer_size_per_device(
    max_ids_per_partition: int,
    suggested_coo_buffer_size_per_device: int | None,
    num_sc_per_device: int,
    num_partitions: int,
    max_minibatches: int = 1,
) -> int:
    """Buffer entries per device.

    The suggested size rounded up to a multiple of `8 * S`, or else the
    theoretical maximum `roundup8(max_ids) * S * N` (times 64 with
    minibatching: every minibatch may fill its partitions up to the limit).

    With minibatching, a suggested size (which FDO measures for one pass, so
    it bounds a slot's entries `E`) gets room for the padding the extra
    segments add. Each non-empty (minibatch, partition) segment pads by at
    most 7 entries, and there are at most `min(64 * N, E)` of them, so a slot
    needs at most `E + 7 * min(64 * N, E)` entries. A batch whose entries
    exceed the suggested size breaches the buffer as it would in one pass.
    This bound, rather than `7 * 64 * N` per slot, keeps the buffers of
    small batches small: every stage after the layout (pickling, transfer,
    lookup, update) scales with the buffer.
    """
    if suggested_coo_buffer_size_per_device is not None:
        per_slot = round_up(suggested_coo_buffer_size_per_device, 8 * num_sc_per_device)
        per_slot //= num_sc_per_device
        if max_minibatches > 1:
            per_slot += round_up(7 * min(max_minibatches * num_partitions, per_slot), 8)
        return per_slot * num_sc_per_device
    return round_up(max_ids_per_partition, 8) * num_sc_per_device * num_partitions * max_minibatches


def _local_rows(feature: FeatureSpec, local: int, global_: int, slots: int) -> int:
    batch = feature.global_batch_size
    if (batch * local) % global_ or (batch * local // global_) % (local * slots):
        raise ValueError(
            f"Feature {feature.name!r}: global batch {batch} must split evenly over "
            f"{global_} devices x {slots} partitions per device (a multiple of "
            f"{global_ * slots})."
        )
    return batch * local // global_


@functools.lru_cache(maxsize=64)
def _plan(
    leaves: tuple[FeatureSpec, ...], local: int, global_: int, slots: int, minibatching: bool
) -> tuple[_StackPlan, ...]:
    if global_ % local:
        raise ValueError(f"local_device_count {local} must divide global_device_count {global_}.")
    n = check_partition_count(global_, slots)
    by_stack: dict[str, list[tuple[int, FeatureSpec]]] = {}
    for index, feature in enumerate(leaves):
        table = feature.table_spec
        if table.setting_in_stack.padded_vocab_size % (8 * n):
            raise ValueError(
                f"Feature {feature.name!r} was prepared for another partition count; "
                f"prepare the specs for {global_} devices x {slots} partitions."
            )
        by_stack.setdefault(table.stacked_table_spec.stack_name, []).append((index, feature))
    max_minibatches = NUM_BUCKETS if minibatching else 1
    plans = []
    for name, members in by_stack.items():
        members.sort(key=lambda m: m[1].id_transformation.row_offset)
        stacked = members[0][1].table_spec.stacked_table_spec
        features, offset = [], 0
        for index, feature in members:
            rows = _local_rows(feature, local, global_, slots)
            per_slot = rows // (local * slots)
            transform = feature.id_transformation
            features.append(
                _FeaturePlan(
                    index,
                    feature.name,
                    feature.table_spec.vocabulary_size,
                    stacked.combiner.value,
                    transform.col_offset,
                    transform.col_shift,
                    rows,
                    per_slot,
                    offset,
                )
            )
            offset += per_slot
        geometry = LayoutGeometry(
            local_devices=local,
            slots_per_device=slots,
            num_partitions=n,
            rows_per_partition=stacked.stack_vocab_size // n,
            samples_per_slot=offset,
            coo_size=coo_buffer_size_per_device(
                stacked.max_ids_per_partition,
                stacked.suggested_coo_buffer_size_per_device,
                slots,
                n,
                max_minibatches,
            ),
            max_minibatches=max_minibatches,
        )
        limits = Limits(stacked.max_ids_per_partition, stacked.max_unique_ids_per_partition)
        if minibatching and stacked.suggested_coo_buffer_size_per_device is None:
            _log.warning(
                "Stack %r: with minibatching and no suggested buffer size, every device "
                "reserves %d entries (64 minibatches at the limits); apply FDO stats to "
                "size the buffer from the data.",
                name,
                geometry.coo_size,
            )
        plans.append(_StackPlan(name, tuple(features), geometry, limits))
    return tuple(plans)


def _prepared_plans(
    feature_specs: Nested, local: int, global_: int, slots: int, minibatching: bool
) -> tuple[Nested, tuple[_StackPlan, ...]]:
    """The specs prepared for the geometry, and the layout plan of every stack."""
    specs = prepare_feature_specs_for_training(feature_specs, global_, slots)
    return specs, _plan(tuple(jax.tree.leaves(specs)), local, global_, slots, minibatching)


def _stack_members(plan: _StackPlan, ids: list, weights: list | None, policy):
    members, invalid = [], 0
    for f in plan.features:
        flat = flatten_feature(
            ids[f.index],
            None if weights is None else weights[f.index],
            feature=f.name,
            expected_rows=f.local_rows,
            vocabulary_size=f.vocabulary_size,
            combiner=f.combiner,
            invalid_id_policy=policy,
        )
        members.append(
            StackMember(
                flat.ids,
                flat.row_splits,
                flat.gains,
                f.samples_per_slot,
                f.sample_offset,
                f.col_shift,
                f.col_offset,
            )
        )
        invalid += flat.invalid_ids
    return members, invalid


def _flatten_like(specs_tree, tree, what: str) -> list:
    try:
        return jax.tree.structure(specs_tree).flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(f"The structure of {what} does not match feature_specs: {e}") from e


def preprocess_sparse_dense_matmul_input(
    features: Nested,
    features_weights: Nested | None,
    feature_specs: Nested,
    local_device_count: int,
    global_device_count: int,
    *,
    num_sc_per_device: int,
    sharding_strategy: str = "MOD",
    has_leading_dimension: bool = False,
    allow_id_dropping: bool = False,
    batch_number: int = 0,
    enable_minibatching: bool = False,
    all_reduce_interface: AllReduceInterface | None = None,
    invalid_id_policy: InvalidIdPolicy | str = InvalidIdPolicy.RAISE,
) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
    """Lays out one host batch of sparse features for the sharded lookup.

    Args:
      features: pytree like `feature_specs`; each leaf the feature's host-local
        ids: `int[rows, valency]`, a 1-D object array of 1-D int arrays, or
        `RaggedIds`. `rows = global_batch * local / global devices`.
      features_weights: same structure and row lengths, or None (weight 1);
        a leaf may be None too (that feature's weights are 1).
      feature_specs: pytree of `FeatureSpec` (prepared or not).
      local_device_count: L, devices of this host (`mesh.local_mesh.size`).
      global_device_count: G, devices of all hosts (`mesh.size`).
      num_sc_per_device: S, partitions per device; `G * S` a power of two.
      sharding_strategy: only "MOD".
      has_leading_dimension: shape outputs `[L, ...]` (for `pmap`).
      allow_id_dropping: drop (and count) entries over the limits instead of
        raising.
      batch_number: the batch's index; keys the cross-host agreement, so every
        host must pass the same number for the same global batch.
      enable_minibatching: split a batch that exceeds a limit into minibatches
        (docs/design.md section 3) instead of dropping or raising. Outputs then have
        row pointers for 64 minibatches (static shapes) and `num_minibatches`
        says how many are used.
      all_reduce_interface: cross-host agreement, required for minibatching
        on several hosts (`AllReduceInterface`).
      invalid_id_policy: "raise" (default) or "drop" for out-of-range ids.

    Returns:
      `(PreprocessedInput, SparseDenseMatmulInputStats)`, keyed by stack name.
      The layout's id, sample and gain arrays are read-only: once nothing
      refers to them any more, a later call reuses their memory.

    Raises:
      ValueError: bad specs, bad input (naming the feature and row), or a limit
        breach with dropping off (naming table, device, slot, partition).
    """
    if sharding_strategy.upper() != "MOD":
        raise ValueError(f"Unsupported sharding_strategy {sharding_strategy!r}; only 'MOD'.")
    if (
        enable_minibatching
        and all_reduce_interface is None
        and (local_device_count < global_device_count)
    ):
        raise ValueError(
            "Minibatching on several hosts needs all_reduce_interface (e.g. "
            "parallel.allreduce.AllReduceNode(...).interface()) so that the hosts agree."
        )
    policy = _invalid_id_policy(invalid_id_policy)
    specs, plans = _prepared_plans(
        feature_specs,
        local_device_count,
        global_device_count,
        num_sc_per_device,
        enable_minibatching,
    )
    ids = _flatten_like(specs, features, "features")
    weights = (
        None
        if features_weights is None
        else _flatten_like(specs, features_weights, "features_weights")
    )

    def sort(plan: _StackPlan):
        members, invalid = _stack_members(plan, ids, weights, policy)
        stack = sort_stack(members, plan.geometry)
        split = (
            minibatching_split(stack, plan.geometry, plan.limits) if enable_minibatching else None
        )
        return stack, invalid, split

    map_stacks = _stack_mapper(plans)
    sorted_stacks = list(map_stacks(sort, plans))
    minibatches = None
    if enable_minibatching:
        minibatches = _agree_on_minibatches(
            [split for _, _, split in sorted_stacks], all_reduce_interface, batch_number
        )

    def lay_out(plan_and_stack):
        plan, (stack, _, _) = plan_and_stack
        return lay_out_sorted(
            table=plan.name,
            stack=stack,
            geometry=plan.geometry,
            limits=plan.limits,
            allow_id_dropping=allow_id_dropping,
            minibatches=minibatches,
        )

    layouts = dict(zip([p.name for p in plans], map_stacks(lay_out, zip(plans, sorted_stacks))))
    invalid = {plan.name: count for plan, (_, count, _) in zip(plans, sorted_stacks)}
    num_minibatches = 1 if minibatches is None else int(minibatches[-1]) + 1
    return _assemble(layouts, invalid, local_device_count, has_leading_dimension, num_minibatches)


def preprocessed_input_shapes(
    feature_specs: Nested,
    local_device_count: int,
    global_device_count: int,
    *,
    num_sc_per_device: int,
    has_leading_dimension: bool = False,
    enable_minibatching: bool = False,
) -> PreprocessedInput:
    """The shapes and dtypes `preprocess_sparse_dense_matmul_input` returns.

    They depend on the specs and the geometry only, never on a batch: the
    layout's buffers are static. Use them to size buffers, or to compile a
    step, before the first batch exists.

    Args: as `preprocess_sparse_dense_matmul_input`.

    Returns:
      A `PreprocessedInput` whose leaves are `jax.ShapeDtypeStruct`s, keyed by
      stack name like the preprocessing's output.

    Raises:
      ValueError: bad specs or geometry (as the preprocessing would).
    """
    _, plans = _prepared_plans(
        feature_specs,
        local_device_count,
        global_device_count,
        num_sc_per_device,
        enable_minibatching,
    )
    local = local_device_count

    def shaped(size: int, dtype) -> jax.ShapeDtypeStruct:
        shape = (local, size // local) if has_leading_dimension else (size,)
        return jax.ShapeDtypeStruct(shape, np.dtype(dtype))

    def per_stack(size_of, dtype) -> dict[str, jax.ShapeDtypeStruct]:
        return {plan.name: shaped(size_of(plan.geometry), dtype) for plan in plans}

    def row_pointers(g: LayoutGeometry) -> int:
        return g.num_slots * g.max_minibatches * g.row_pointer_width

    def buffer(g: LayoutGeometry) -> int:
        return g.local_devices * g.coo_size

    matmul_input = SparseDenseMatmulInput(
        per_stack(row_pointers, np.int32),
        per_stack(buffer, np.int32),
        per_stack(buffer, np.int32),
        per_stack(buffer, np.float32),
    )
    return PreprocessedInput(matmul_input, shaped(local, np.int32))


def _invalid_id_policy(value: InvalidIdPolicy | str) -> InvalidIdPolicy:
    try:
        return InvalidIdPolicy(value)
    except ValueError:
        choices = ", ".join(repr(p.value) for p in InvalidIdPolicy)
        raise ValueError(f"invalid_id_policy must be one of {choices}; got {value!r}.") from None


def _agree_on_minibatches(
    splits: list[tuple[bool, int]], interface: AllReduceInterface | None, batch_number: int
) -> np.ndarray | None:
    """The bucket -> minibatch map every host uses, or None for one pass.

    Keys: `2 * batch_number` for the required flag, `+ 1` for the split.
    """
    required = any(over for over, _ in splits)
    if interface is not None:
        required = bool(interface.all_reduce_bool(2 * batch_number, required))
    if not required:
        return None
    mask = functools.reduce(operator.or_, (m for _, m in splits), 0)
    if interface is not None:
        mask = int(interface.all_reduce_uint64(2 * batch_number + 1, mask))
    return minibatch_of_bucket(mask)


def _stack_mapper(plans: tuple[_StackPlan, ...]):
    """`map` over the stacks: on threads for large batches, in this thread for small ones.

    Stacks are independent and their heavy steps (the compiled loops, sorts,
    large numpy ops) release the GIL, so threads use every core. Below
    `_THREADED_MIN_ROWS` rows the work per stack is a few hundred
    microseconds, about what handing it to a thread and back costs.
    """
    rows = sum(feature.local_rows for plan in plans for feature in plan.features)
    return _executor().map if rows >= _THREADED_MIN_ROWS else map


@functools.cache
def _executor() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=os.cpu_count() or 1, thread_name_prefix="sparseflow-layout"
    )


def _assemble(layouts, invalid, local: int, leading: bool, num_minibatches: int):
    def shaped(field: str) -> dict[str, np.ndarray]:
        return {
            name: getattr(lay, field).reshape(local, -1) if leading else getattr(lay, field)
            for name, lay in layouts.items()
        }

    matmul_input = SparseDenseMatmulInput(
        shaped("row_pointers"),
        shaped("embedding_ids"),
        shaped("sample_ids"),
        shaped("gains"),
    )
    minibatches = np.full((local, 1) if leading else (local,), num_minibatches, np.int32)
    stats = SparseDenseMatmulInputStats(
        max_ids_per_partition={k: v.max_ids_per_partition for k, v in layouts.items()},
        max_unique_ids_per_partition={
            k: v.max_unique_ids_per_partition for k, v in layouts.items()
        },
        required_buffer_size_per_sc={k: v.required_buffer_size_per_sc for k, v in layouts.items()},
        id_drop_counters={k: v.dropped for k, v in layouts.items()},
        invalid_id_counters=invalid,
    )
    return PreprocessedInput(matmul_input, minibatches), stats
