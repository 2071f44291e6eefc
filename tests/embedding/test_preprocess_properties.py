"""Properties of the layout on random specs and batches.

(a) the layout equals the slow reference (`reference_layout`) exactly;
(b) reading the output back (undoing the slot/sample mapping and the stacked
    column transform) gives the input's (sample, id, summed gain) multiset;
(c) the stats equal a direct count over the input;
(d) every input id merged into an entry missing from the output is counted
    as dropped (jax-tpu-embedding's drop count).
"""

import collections
import dataclasses
import math

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_layout import column, read_layout, reference_layout, row_gains

import embedding

EXAMPLES = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclasses.dataclass(frozen=True)
class Scenario:
    specs: dict  # feature name -> FeatureSpec, stacked when drawn so
    ids: dict  # feature name -> host-local rows (lists of ids)
    weights: dict | None
    local: int
    global_: int
    slots: int
    allow_id_dropping: bool
    drop_invalid_ids: bool
    form: str  # "ragged" or "RaggedIds"

    @property
    def partitions(self) -> int:
        return self.global_ * self.slots

    def prepared(self) -> dict:
        return embedding.prepare_feature_specs_for_training(self.specs, self.global_, self.slots)


COMBINERS = st.sampled_from(["sum", "mean", "sqrtn"])
WEIGHTS = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0])


def _table(draw, index: int, combiner: str | None) -> embedding.TableSpec:
    generous = draw(st.booleans())
    return embedding.TableSpec(
        name=f"t{index}",
        vocabulary_size=draw(st.integers(1, 70)),
        embedding_dim=draw(st.sampled_from([4, 8])),  # both pad to 8: stackable
        initializer=embedding.initializers.Constant(0.0),
        optimizer=embedding.SGDOptimizerSpec(),
        combiner=combiner or draw(COMBINERS),
        max_ids_per_partition=256 if generous else draw(st.sampled_from([1, 2, 3, 8])),
        max_unique_ids_per_partition=256 if generous else draw(st.sampled_from([1, 2, 5])),
        suggested_coo_buffer_size_per_device=draw(st.sampled_from([None, None, 16, 64, 256])),
    )


def _rows(draw, count: int, vocabulary_size: int, invalid: bool) -> list[list[int]]:
    low, high = (-3, vocabulary_size + 2) if invalid else (0, vocabulary_size - 1)
    row = st.lists(st.integers(low, high), min_size=0, max_size=4)
    return draw(st.lists(row, min_size=count, max_size=count))


def _stacked(draw, specs: dict, global_: int, slots: int) -> dict:
    """Stacks two or more of the tables, in a random order, when there are two."""
    names = sorted({f.table_spec.name for f in specs.values()})
    if len(names) < 2:
        return specs
    group = draw(st.permutations(names))[: draw(st.integers(2, len(names)))]
    rotation = draw(st.sampled_from([None, 0, 1, 3]))
    return embedding.stack_tables(specs, group, global_, slots, rotation=rotation)


@st.composite
def scenarios(draw, *, allow_id_dropping: bool | None = None) -> Scenario:
    local = draw(st.sampled_from([1, 2]))
    global_ = local * draw(st.sampled_from([1, 2]))
    slots = draw(st.sampled_from([1, 2, 4]))
    # Table stacking needs a shared combiner.
    stack = draw(st.booleans())
    combiner = draw(COMBINERS) if stack else None
    tables = [_table(draw, i, combiner) for i in range(draw(st.integers(1, 3)))]
    invalid = draw(st.integers(0, 4)) == 0
    specs, ids, weights = {}, {}, {}
    for i in range(draw(st.integers(len(tables), 4))):
        # Every table is used at least once.
        table = tables[i] if i < len(tables) else draw(st.sampled_from(tables))
        batch = global_ * slots * draw(st.integers(1, 3))
        name = f"f{i}"
        specs[name] = embedding.FeatureSpec(
            name=name,
            table_spec=table,
            input_shape=[batch, 4],
            output_shape=[batch, table.embedding_dim],
        )
        ids[name] = _rows(draw, batch * local // global_, table.vocabulary_size, invalid)
        weights[name] = [
            draw(st.lists(WEIGHTS, min_size=len(r), max_size=len(r))) for r in ids[name]
        ]
    return Scenario(
        specs=_stacked(draw, specs, global_, slots) if stack else specs,
        ids=ids,
        weights=weights if draw(st.booleans()) else None,
        local=local,
        global_=global_,
        slots=slots,
        allow_id_dropping=draw(st.booleans()) if allow_id_dropping is None else allow_id_dropping,
        drop_invalid_ids=invalid,
        form=draw(st.sampled_from(["ragged", "RaggedIds"])),
    )


def _as_input(rows: list[list], form: str, dtype):
    if form == "RaggedIds":
        values = np.array([v for r in rows for v in r], dtype=dtype)
        return embedding.RaggedIds(values, np.cumsum([0] + [len(r) for r in rows]))
    out = np.empty(len(rows), dtype=object)
    out[:] = [np.array(r, dtype=dtype) for r in rows]
    return out


def _run(s: Scenario):
    return embedding.preprocess_sparse_dense_matmul_input(
        {k: _as_input(v, s.form, np.int64) for k, v in s.ids.items()},
        None
        if s.weights is None
        else {k: _as_input(v, s.form, np.float32) for k, v in s.weights.items()},
        s.specs,
        s.local,
        s.global_,
        num_sc_per_device=s.slots,
        allow_id_dropping=s.allow_id_dropping,
        invalid_id_policy="drop" if s.drop_invalid_ids else "raise",
    )


def _reference(s: Scenario) -> dict:
    return reference_layout(
        s.ids,
        s.weights,
        s.prepared(),
        local_device_count=s.local,
        global_device_count=s.global_,
        num_sc_per_device=s.slots,
        drop_invalid_ids=s.drop_invalid_ids,
    )


def _stacks(s: Scenario) -> dict[str, list[embedding.FeatureSpec]]:
    """Prepared features of every stack, in sample order within a slot."""
    stacks = collections.defaultdict(list)
    for feature in s.prepared().values():
        stacks[feature.table_spec.stacked_table_spec.stack_name].append(feature)
    return {k: sorted(v, key=lambda f: f.id_transformation.row_offset) for k, v in stacks.items()}


def _per_slot(s: Scenario, feature: embedding.FeatureSpec) -> int:
    return feature.global_batch_size // (s.global_ * s.slots)


def _segments(s: Scenario, out, stack: str) -> dict:
    return read_layout(
        out.lhs_row_pointers[stack],
        out.lhs_embedding_ids[stack],
        out.lhs_sample_ids[stack],
        out.lhs_gains[stack],
        local=s.local,
        slots=s.slots,
        partitions=s.partitions,
        coo_size=out.lhs_embedding_ids[stack].size // s.local,
    )


@given(scenarios())
@EXAMPLES
def test_layout_equals_reference(s):
    expected = _reference(s)
    must_raise = not s.allow_id_dropping and any(
        r.limit_breaches or r.buffer_overflows for r in expected.values()
    )
    if must_raise:
        with pytest.raises(ValueError, match="slot"):
            _run(s)
        return
    out, stats = _run(s)
    assert sorted(out.lhs_row_pointers) == sorted(expected)
    for name, want in expected.items():
        np.testing.assert_array_equal(out.lhs_row_pointers[name], want.row_pointers)
        np.testing.assert_array_equal(out.lhs_embedding_ids[name], want.embedding_ids)
        np.testing.assert_array_equal(out.lhs_sample_ids[name], want.sample_ids)
        np.testing.assert_allclose(out.lhs_gains[name], want.gains, rtol=1e-5, atol=1e-6)
        for field, got in (
            ("max_ids_per_partition", stats.max_ids_per_partition[name]),
            ("max_unique_ids_per_partition", stats.max_unique_ids_per_partition[name]),
            ("required_buffer_size_per_sc", stats.required_buffer_size_per_sc[name]),
        ):
            np.testing.assert_array_equal(got, getattr(want, field), err_msg=field)
        assert stats.id_drop_counters[name] == want.id_drop_counter
        assert stats.invalid_id_counters[name] == want.invalid_id_counter


def _input_multiset(s: Scenario, features: list) -> dict[tuple[str, int, int], float]:
    """`{(feature, host row, id): summed gain}` straight from the input."""
    combined = collections.defaultdict(float)
    for f in features:
        vocab = f.table_spec.vocabulary_size
        for row, ids in enumerate(s.ids[f.name]):
            weights = [1.0] * len(ids) if s.weights is None else s.weights[f.name][row]
            kept = [(i, w) for i, w in zip(ids, weights) if 0 <= i < vocab]
            gains = row_gains([w for _, w in kept], f.table_spec.combiner.value)
            for (i, _), gain in zip(kept, gains):
                combined[f.name, row, i] += gain
    return combined


def _input_occurrences(s: Scenario, features: list) -> collections.Counter:
    """`{(feature, host row, id): occurrences}` of the in-range input ids."""
    return collections.Counter(
        (f.name, row, i)
        for f in features
        for row, ids in enumerate(s.ids[f.name])
        for i in ids
        if 0 <= i < f.table_spec.vocabulary_size
    )


def _output_multiset(s: Scenario, segments: dict, features: list) -> dict:
    """Undoes slot/sample numbering and the column transform of every entry."""
    n = s.partitions
    read = {}
    for (device, slot, p), entries in segments.items():
        for local_id, sample, gain in entries:
            col = int(local_id) * n + p
            offset = 0
            for f in features:
                if sample < offset + _per_slot(s, f):
                    break
                offset += _per_slot(s, f)
            else:
                raise AssertionError(f"sample {sample} past the slot's features")
            t = f.id_transformation
            x = col - t.col_offset
            assert 0 <= x < f.table_spec.setting_in_stack.padded_vocab_size, (f.name, col)
            feature_id = (x & ~(n - 1)) + (((x & (n - 1)) - t.col_shift) % n)
            row = (device * s.slots + slot) * _per_slot(s, f) + int(sample) - offset
            key = (f.name, row, feature_id)
            assert key not in read, f"{key} appears twice: entries were not merged"
            read[key] = float(gain)
    return read


@given(scenarios(allow_id_dropping=True))
@EXAMPLES
def test_output_reads_back_to_the_input(s):
    out, stats = _run(s)
    for name, features in _stacks(s).items():
        want = _input_multiset(s, features)
        got = _output_multiset(s, _segments(s, out, name), features)
        # Merged entries are dropped whole: what is left is a subset.
        assert got.keys() <= want.keys()
        occurrences = _input_occurrences(s, features)
        dropped = sum(occurrences[key] for key in want.keys() - got.keys())
        assert stats.id_drop_counters[name] == dropped
        for key, gain in got.items():
            assert math.isclose(gain, want[key], rel_tol=1e-5, abs_tol=1e-6), key


def _direct_counts(s: Scenario, features: list):
    """Merged entries and distinct columns per (device, slot, partition)."""
    n = s.partitions
    entries, columns = set(), set()
    for f in features:
        per_slot = _per_slot(s, f)
        t = f.id_transformation
        for row, ids in enumerate(s.ids[f.name]):
            device, slot = divmod(row // per_slot, s.slots)
            for i in ids:
                if 0 <= i < f.table_spec.vocabulary_size:
                    col = column(i, t.col_shift, t.col_offset, n)
                    entries.add((device, slot, col % n, f.name, row, col))
                    columns.add((device, slot, col % n, col))
    count = collections.Counter(e[:3] for e in entries)
    unique = collections.Counter(c[:3] for c in columns)
    return count, unique


@given(scenarios(allow_id_dropping=True))
@EXAMPLES
def test_stats_equal_a_direct_count(s):
    _, stats = _run(s)
    n = s.partitions
    for name, features in _stacks(s).items():
        count, unique = _direct_counts(s, features)
        max_ids = np.zeros(s.local * n, int)
        max_unique = np.zeros(s.local * n, int)
        required = np.zeros(s.local * s.slots, int)
        for (device, slot, p), c in count.items():
            max_ids[device * n + p] = max(max_ids[device * n + p], c)
            max_unique[device * n + p] = max(max_unique[device * n + p], unique[device, slot, p])
            required[device * s.slots + slot] += -(-c // 8) * 8
        np.testing.assert_array_equal(stats.max_ids_per_partition[name], max_ids)
        np.testing.assert_array_equal(stats.max_unique_ids_per_partition[name], max_unique)
        np.testing.assert_array_equal(stats.required_buffer_size_per_sc[name], required)
        invalid = sum(
            not 0 <= i < f.table_spec.vocabulary_size
            for f in features
            for r in s.ids[f.name]
            for i in r
        )
        assert stats.invalid_id_counters[name] == invalid


@given(scenarios(allow_id_dropping=True))
@EXAMPLES
def test_every_drop_is_counted(s):
    out, stats = _run(s)
    for name, features in _stacks(s).items():
        occurrences = _input_occurrences(s, features)
        written = _output_multiset(s, _segments(s, out, name), features)
        in_output = sum(occurrences[key] for key in written)
        assert sum(occurrences.values()) - in_output == stats.id_drop_counters[name]


@given(scenarios(allow_id_dropping=True), st.booleans(), st.booleans())
@EXAMPLES
def test_static_shapes_are_the_outputs(s, leading, minibatching):
    # Minibatching on several hosts needs an agreement group; one host suffices here.
    minibatching = minibatching and s.local == s.global_
    geometry = dict(num_sc_per_device=s.slots, has_leading_dimension=leading)
    out, _ = embedding.preprocess_sparse_dense_matmul_input(
        {k: _as_input(v, s.form, np.int64) for k, v in s.ids.items()},
        None,
        s.specs,
        s.local,
        s.global_,
        allow_id_dropping=True,
        invalid_id_policy="drop",
        enable_minibatching=minibatching,
        **geometry,
    )
    static = embedding.preprocessed_input_shapes(
        s.specs, s.local, s.global_, enable_minibatching=minibatching, **geometry
    )
    got = jax.tree.map(lambda x: (x.shape, x.dtype), out)
    assert got == jax.tree.map(lambda x: (x.shape, x.dtype), static)
