"""A slow, direct reading of docs/design.md section 2: the oracle of the layout tests.

Plain loops over Python lists and dicts, one step of the design text per
helper, so that a reader can check it against the text line by line. It takes
prepared specs (the stacking functions are tested on their own) and the
host-local rows of every feature as lists of ids.

`read_layout` is the inverse direction: it cuts a preprocessed buffer back
into per-(device, slot, partition) entries and checks every padding cell.

The oracle is itself checked against the recorded outputs of jax-tpu-embedding
(test_preprocess_reference_fixtures.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

INT32_MAX = 2**31 - 1
ALIGNMENT = 8

Rows = Sequence[Sequence[float]]
"""A feature's host-local rows: `rows[r]` lists the ids (or weights) of row r."""


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass
class ReferenceStack:
    """The expected layout and stats of one stacked table (flat lists)."""

    row_pointers: list[int]
    embedding_ids: list[int]
    sample_ids: list[int]
    gains: list[float]
    coo_size: int
    max_ids_per_partition: list[int]
    max_unique_ids_per_partition: list[int]
    required_buffer_size_per_sc: list[int]
    # Input ids dropped: every occurrence merged into a dropped entry.
    id_drop_counter: int = 0
    invalid_id_counter: int = 0
    # (device, slot, partition) whose entries exceed a limit.
    limit_breaches: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    # (device, slot) whose kept entries do not fit the slot's buffer.
    buffer_overflows: list[tuple[int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _Member:
    """One feature of a stack, as the layout sees it."""

    name: str
    vocabulary_size: int
    row_offset: int
    col_offset: int
    col_shift: int
    samples_per_slot: int


def coo_size_per_device(max_ids: int, suggested: int | None, slots: int, partitions: int) -> int:
    """Section 2, item 7."""
    if suggested is not None:
        return round_up(suggested, ALIGNMENT * slots)
    return round_up(max_ids, ALIGNMENT) * slots * partitions


def column(feature_id: int, col_shift: int, col_offset: int, partitions: int) -> int:
    """Section 2, item 2 (with shift 0 and offset 0 it is the id itself)."""
    low = (feature_id + col_shift) & (partitions - 1)
    high = feature_id & ~(partitions - 1)
    return low + high + col_offset


def row_gains(weights: Sequence[float], combiner: str) -> list[float]:
    """Section 2, item 3; a row whose weights are all zero gets gains 0."""
    if combiner == "sum":
        denominator = 1.0
    elif combiner == "mean":
        denominator = sum(weights)
    else:
        denominator = math.sqrt(sum(w * w for w in weights))
    return [0.0 if denominator == 0 else w / denominator for w in weights]


def within_limits(entries: list[tuple], max_ids: int, max_unique: int) -> list[tuple]:
    """Section 2, item 5: the first `max_ids` entries of the first
    `max_unique` distinct columns, walking the sorted entries."""
    kept, columns = [], []
    for entry in entries:
        local_id = entry[0]
        if local_id not in columns:
            if len(columns) == max_unique:
                break  # later entries only have larger columns
            columns.append(local_id)
        if len(kept) == max_ids:
            break
        kept.append(entry)
    return kept


def _members(stack_features) -> list[_Member]:
    members = []
    for feature, samples_per_slot in stack_features:
        t = feature.id_transformation
        members.append(
            _Member(
                name=feature.name,
                vocabulary_size=feature.table_spec.vocabulary_size,
                row_offset=t.row_offset,
                col_offset=t.col_offset,
                col_shift=t.col_shift,
                samples_per_slot=samples_per_slot,
            )
        )
    return sorted(members, key=lambda m: m.row_offset)


def _slot_entries(
    members, ids, weights, *, device, slot, slots, partitions, combiner, drop_invalid
) -> tuple[dict[tuple[int, int, int], float], dict[tuple[int, int, int], int], int]:
    """Section 2, items 1-4 for one slot: `{(partition, local_id, sample): gain}`,
    the input ids merged into each entry, and the invalid ids."""
    merged: dict[tuple[int, int, int], float] = {}
    occurrences: dict[tuple[int, int, int], int] = {}
    invalid = 0
    sample_offset = 0
    for m in members:
        for j in range(m.samples_per_slot):
            row = (device * slots + slot) * m.samples_per_slot + j
            row_ids = [int(i) for i in ids[m.name][row]]
            row_weights = (
                [1.0] * len(row_ids)
                if weights is None
                else [float(w) for w in weights[m.name][row]]
            )
            valid = [0 <= i < m.vocabulary_size for i in row_ids]
            if not all(valid) and not drop_invalid:
                raise ValueError(f"reference: feature {m.name}, row {row}: id out of range")
            invalid += valid.count(False)
            row_ids = [i for i, ok in zip(row_ids, valid) if ok]
            row_weights = [w for w, ok in zip(row_weights, valid) if ok]
            for feature_id, gain in zip(row_ids, row_gains(row_weights, combiner)):
                col = column(feature_id, m.col_shift, m.col_offset, partitions)
                key = (col % partitions, col // partitions, sample_offset + j)
                merged[key] = merged.get(key, 0.0) + gain
                occurrences[key] = occurrences.get(key, 0) + 1
        sample_offset += m.samples_per_slot
    return merged, occurrences, invalid


def _by_partition(merged: dict, partitions: int) -> list[list[tuple[int, int, float]]]:
    """Section 2, item 4: per partition, entries sorted by local id, then sample."""
    by_partition = [[] for _ in range(partitions)]
    for p, local_id, sample in sorted(merged):
        by_partition[p].append((local_id, sample, merged[p, local_id, sample]))
    return by_partition


def _count(out: ReferenceStack, by_partition, *, device: int, slot: int, slots: int) -> None:
    """Section 2, item 8: stats after merging, before dropping."""
    partitions = len(by_partition)
    for p, entries in enumerate(by_partition):
        stat = device * partitions + p
        out.max_ids_per_partition[stat] = max(out.max_ids_per_partition[stat], len(entries))
        unique = len({e[0] for e in entries})
        out.max_unique_ids_per_partition[stat] = max(out.max_unique_ids_per_partition[stat], unique)
        out.required_buffer_size_per_sc[device * slots + slot] += round_up(len(entries), ALIGNMENT)


def _write_slot(
    out: ReferenceStack,
    by_partition,
    occurrences,
    stacked,
    *,
    device: int,
    slot: int,
    slots: int,
) -> None:
    """Section 2, items 5 and 6: limits, then the slot's segments and pointers.

    Entries that find the slot's buffer full are dropped and counted: the
    design text leaves the order open, and the reference package fills a
    slot in buffer order until it is full. A dropped entry counts every input
    id merged into it, as the reference package counts drops.
    """
    partitions = len(by_partition)
    width = max(partitions, ALIGNMENT)
    capacity = out.coo_size // slots
    base = device * out.coo_size + slot * capacity
    pointers = (device * slots + slot) * width
    position = 0
    for p, entries in enumerate(by_partition):
        kept = within_limits(
            entries, stacked.max_ids_per_partition, stacked.max_unique_ids_per_partition
        )
        if len(kept) < len(entries):
            out.limit_breaches.append((device, slot, p))
            out.id_drop_counter += sum(occurrences[p, e[0], e[1]] for e in entries[len(kept) :])
        for local_id, sample, gain in kept:
            if position == capacity:
                out.id_drop_counter += occurrences[p, local_id, sample]
                if (device, slot) not in out.buffer_overflows:
                    out.buffer_overflows.append((device, slot))
                continue
            out.embedding_ids[base + position] = local_id
            out.sample_ids[base + position] = sample
            out.gains[base + position] = gain
            position += 1
        out.row_pointers[pointers + p] = position
        position = round_up(position, ALIGNMENT)
    for p in range(partitions, width):
        out.row_pointers[pointers + p] = position


def _layout_stack(
    stacked, members, ids, weights, *, local, global_, slots, drop_invalid
) -> ReferenceStack:
    partitions = global_ * slots
    coo_size = coo_size_per_device(
        stacked.max_ids_per_partition,
        stacked.suggested_coo_buffer_size_per_device,
        slots,
        partitions,
    )
    out = ReferenceStack(
        row_pointers=[0] * (local * slots * max(partitions, ALIGNMENT)),
        embedding_ids=[INT32_MAX] * (local * coo_size),
        sample_ids=[INT32_MAX] * (local * coo_size),
        gains=[math.nan] * (local * coo_size),
        coo_size=coo_size,
        max_ids_per_partition=[0] * (local * partitions),
        max_unique_ids_per_partition=[0] * (local * partitions),
        required_buffer_size_per_sc=[0] * (local * slots),
    )
    for device in range(local):
        for slot in range(slots):
            merged, occurrences, invalid = _slot_entries(
                members,
                ids,
                weights,
                device=device,
                slot=slot,
                slots=slots,
                partitions=partitions,
                combiner=stacked.combiner.value,
                drop_invalid=drop_invalid,
            )
            out.invalid_id_counter += invalid
            by_partition = _by_partition(merged, partitions)
            _count(out, by_partition, device=device, slot=slot, slots=slots)
            _write_slot(
                out, by_partition, occurrences, stacked, device=device, slot=slot, slots=slots
            )
    return out


def reference_layout(
    ids: Mapping[str, Rows],
    weights: Mapping[str, Rows] | None,
    prepared_specs: Mapping[str, object],
    *,
    local_device_count: int,
    global_device_count: int,
    num_sc_per_device: int,
    drop_invalid_ids: bool = False,
) -> dict[str, ReferenceStack]:
    """The expected layout of every stack, keyed by stack name.

    Entries over the limits or over the buffer are dropped and counted, and
    where that happened is listed (`limit_breaches`, `buffer_overflows`): with
    dropping off the library must raise exactly when these lists are not empty.

    Args:
      ids: host-local rows of every feature, by feature name.
      weights: same shape as `ids`, or None for weight 1.
      prepared_specs: `FeatureSpec`s by feature name, with the stacking
        fields filled in (`embedding.prepare_feature_specs_for_training`).
      local_device_count: L.
      global_device_count: G.
      num_sc_per_device: S.
      drop_invalid_ids: drop out-of-range ids (and count them) instead of
        raising.
    """
    stacks: dict[str, list] = {}
    for feature in prepared_specs.values():
        local_rows = feature.input_shape[0] * local_device_count // global_device_count
        per_slot = local_rows // (local_device_count * num_sc_per_device)
        stack_name = feature.table_spec.stacked_table_spec.stack_name
        stacks.setdefault(stack_name, []).append((feature, per_slot))
    result = {}
    for name, stack_features in stacks.items():
        result[name] = _layout_stack(
            stack_features[0][0].table_spec.stacked_table_spec,
            _members(stack_features),
            ids,
            weights,
            local=local_device_count,
            global_=global_device_count,
            slots=num_sc_per_device,
            drop_invalid=drop_invalid_ids,
        )
    return result


def read_layout(
    row_pointers,
    embedding_ids,
    sample_ids,
    gains,
    *,
    local: int,
    slots: int,
    partitions: int,
    coo_size: int,
) -> dict[tuple[int, int, int], list[tuple[int, int, float]]]:
    """Cuts flat layout arrays into `{(device, slot, partition): entries}`.

    Every partition segment starts at the previous segment's end rounded up
    to 8; every cell that no segment covers must be padding, and the row
    pointers past partition N must hold the slot's aligned end.

    Raises:
      AssertionError: the arrays are not a well-formed layout.
    """
    row_pointers, embedding_ids, sample_ids, gains = (
        list(a) for a in (row_pointers, embedding_ids, sample_ids, gains)
    )
    width = max(partitions, ALIGNMENT)
    capacity = coo_size // slots
    assert len(row_pointers) == local * slots * width
    assert len(embedding_ids) == len(sample_ids) == len(gains) == local * coo_size
    segments = {}
    covered = set()
    for device in range(local):
        for slot in range(slots):
            pointers = row_pointers[(device * slots + slot) * width :][:width]
            base = device * coo_size + slot * capacity
            start = 0
            for p in range(partitions):
                end = pointers[p]
                assert start <= end <= capacity, (device, slot, p, start, end)
                segments[device, slot, p] = [
                    (embedding_ids[i], sample_ids[i], gains[i])
                    for i in range(base + start, base + end)
                ]
                covered.update(range(base + start, base + end))
                start = round_up(end, ALIGNMENT)
            assert pointers[partitions:] == [start] * (width - partitions), (device, slot)
    for i in set(range(local * coo_size)) - covered:
        assert (embedding_ids[i], sample_ids[i]) == (INT32_MAX, INT32_MAX), i
        assert math.isnan(gains[i]), i
    return segments
