"""Small layouts derived by hand from docs/design.md section 2.

Notation in the derivations: N partitions, S slots per device, n samples per
slot; an id becomes col -> (partition col % N, local id col // N); an entry is
(local id, sample in slot, gain). Each slot's segment for partition p starts
at the previous segment's end rounded up to 8; P is padding.
"""

import dataclasses
import functools
import math

import numpy as np
import pytest

import embedding

P = 2**31 - 1  # INT32_MAX: padding id and sample
X = math.nan  # padding gain

Table = functools.partial(
    embedding.TableSpec,
    embedding_dim=8,
    initializer=embedding.initializers.Constant(0.0),
    optimizer=embedding.SGDOptimizerSpec(),
    combiner="sum",
)


def _feature(name: str, table: embedding.TableSpec, batch: int) -> embedding.FeatureSpec:
    return embedding.FeatureSpec(
        name=name, table_spec=table, input_shape=[batch, 1], output_shape=[batch, 8]
    )


def _ragged(rows: list[list]) -> np.ndarray:
    out = np.empty(len(rows), dtype=object)
    out[:] = [np.asarray(r) for r in rows]
    return out


@dataclasses.dataclass(frozen=True)
class Expected:
    row_pointers: list[int]
    embedding_ids: list[int]
    sample_ids: list[int]
    gains: list[float]
    max_ids_per_partition: list[int]
    max_unique_ids_per_partition: list[int]
    required_buffer_size_per_sc: list[int]
    id_drop_counter: int = 0


def _assert_layout(result, stack: str, expected: Expected) -> None:
    out, stats = result
    np.testing.assert_array_equal(out.lhs_row_pointers[stack], expected.row_pointers)
    np.testing.assert_array_equal(out.lhs_embedding_ids[stack], expected.embedding_ids)
    np.testing.assert_array_equal(out.lhs_sample_ids[stack], expected.sample_ids)
    np.testing.assert_allclose(out.lhs_gains[stack], expected.gains, rtol=1e-6, atol=1e-7)
    for field in (
        "max_ids_per_partition",
        "max_unique_ids_per_partition",
        "required_buffer_size_per_sc",
    ):
        np.testing.assert_array_equal(
            getattr(stats, field)[stack], getattr(expected, field), err_msg=field
        )
    assert stats.id_drop_counters[stack] == expected.id_drop_counter


def _preprocess(features, weights, specs, *, local=1, global_=1, slots, **kwargs):
    return embedding.preprocess_sparse_dense_matmul_input(
        features, weights, specs, local, global_, num_sc_per_device=slots, **kwargs
    )


def test_one_id_per_sample():
    # N = S = 2, n = 2; coo = roundup8(4) * S * N = 32, 16 per slot.
    # slot 0: sample 0 id 3 -> p1 (1, 0); sample 1 id 4 -> p0 (2, 1).
    # slot 1: sample 0 id 7 -> p1 (3, 0); sample 1 id 2 -> p0 (1, 1).
    # Each slot: p0 at [0, 1), p1 at [8, 9), aligned end 16.
    table = Table(name="t", vocabulary_size=16, max_ids_per_partition=4)
    result = _preprocess(
        {"f": np.array([[3], [4], [7], [2]])}, None, {"f": _feature("f", table, 4)}, slots=2
    )
    _assert_layout(
        result,
        "t",
        Expected(
            row_pointers=[1, 9] + [16] * 6 + [1, 9] + [16] * 6,
            embedding_ids=[2] + [P] * 7 + [1] + [P] * 7 + [1] + [P] * 7 + [3] + [P] * 7,
            sample_ids=[1] + [P] * 7 + [0] + [P] * 7 + [1] + [P] * 7 + [0] + [P] * 7,
            gains=([1.0] + [X] * 7) * 4,
            max_ids_per_partition=[1, 1],
            max_unique_ids_per_partition=[1, 1],
            required_buffer_size_per_sc=[16, 16],
        ),
    )


def test_several_ids_with_duplicates():
    # N = S = 2, n = 2, coo 32. Duplicates in a sample merge (gains add).
    # slot 0: s0 [5,3,5,6] -> col5 x2 (p1, l2, g2), col3 (p1, l1), col6 (p0, l3)
    #         s1 [6,5,2,2] -> col6 (p0, l3), col5 (p1, l2), col2 x2 (p0, l1, g2)
    #   p0: (1,1,2) (3,0,1) (3,1,1)   p1: (1,0,1) (2,0,2) (2,1,1)
    # slot 1: s0 [4,4,4,1] -> col4 x3 (p0, l2, g3), col1 (p1, l0)
    #         s1 [1,0,7,4] -> col1 (p1, l0), col0 (p0, l0), col7 (p1, l3), col4 (p0, l2)
    #   p0: (0,1,1) (2,0,3) (2,1,1)   p1: (0,0,1) (0,1,1) (3,1,1)
    # Every partition: 3 entries, 2 distinct columns; required 8 + 8 per slot.
    table = Table(name="t", vocabulary_size=16, max_ids_per_partition=4)
    ids = np.array([[5, 3, 5, 6], [6, 5, 2, 2], [4, 4, 4, 1], [1, 0, 7, 4]])
    result = _preprocess({"f": ids}, None, {"f": _feature("f", table, 4)}, slots=2)
    pad5, nan5 = [P] * 5, [X] * 5
    _assert_layout(
        result,
        "t",
        Expected(
            row_pointers=[3, 11] + [16] * 6 + [3, 11] + [16] * 6,
            embedding_ids=[1, 3, 3] + pad5 + [1, 2, 2] + pad5 + [0, 2, 2] + pad5 + [0, 0, 3] + pad5,
            sample_ids=[1, 0, 1] + pad5 + [0, 0, 1] + pad5 + [1, 0, 1] + pad5 + [0, 1, 1] + pad5,
            gains=[2, 1, 1] + nan5 + [1, 2, 1] + nan5 + [1, 3, 1] + nan5 + [1, 1, 1] + nan5,
            max_ids_per_partition=[3, 3],
            max_unique_ids_per_partition=[2, 2],
            required_buffer_size_per_sc=[16, 16],
        ),
    )


# s0: ids [2, 5, 2] weights [1, 2, 3]; s1: ids [5, 0] weights [0.5, 1.5].
# N = 1, so local id = id; sorted: (0, s1), (2, s0, merged w 1+3), (5, s0), (5, s1).
# Denominators: sum 1 | 1; mean 6 | 2; sqrtn sqrt(14) | sqrt(2.5).
COMBINER_GAINS = {
    "sum": [1.5, 4.0, 2.0, 0.5],
    "mean": [1.5 / 2, 4 / 6, 2 / 6, 0.5 / 2],
    "sqrtn": [1.5 / math.sqrt(2.5), 4 / math.sqrt(14), 2 / math.sqrt(14), 0.5 / math.sqrt(2.5)],
}


@pytest.mark.parametrize("combiner", sorted(COMBINER_GAINS))
def test_combiners_with_weights(combiner):
    table = Table(name="t", vocabulary_size=8, combiner=combiner, max_ids_per_partition=8)
    result = _preprocess(
        {"f": _ragged([[2, 5, 2], [5, 0]])},
        {"f": _ragged([[1.0, 2.0, 3.0], [0.5, 1.5]])},
        {"f": _feature("f", table, 2)},
        slots=1,
    )
    _assert_layout(
        result,
        "t",
        Expected(
            row_pointers=[4] + [8] * 7,
            embedding_ids=[0, 2, 5, 5] + [P] * 4,
            sample_ids=[1, 0, 0, 1] + [P] * 4,
            gains=COMBINER_GAINS[combiner] + [X] * 4,
            max_ids_per_partition=[4],
            max_unique_ids_per_partition=[3],
            required_buffer_size_per_sc=[8],
        ),
    )


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_all_zero_weights_give_zero_gains(combiner):
    # s0: ids [1, 2], weights [0, 0] -> no mass, gains 0 (not NaN);
    # s1: ids [3, 3], weights [1, 3] -> merged; mean 4/4, sqrtn 4/sqrt(10).
    table = Table(name="t", vocabulary_size=8, combiner=combiner, max_ids_per_partition=8)
    result = _preprocess(
        {"f": np.array([[1, 2], [3, 3]])},
        {"f": np.array([[0.0, 0.0], [1.0, 3.0]])},
        {"f": _feature("f", table, 2)},
        slots=1,
    )
    merged = 1.0 if combiner == "mean" else 4 / math.sqrt(10)
    _assert_layout(
        result,
        "t",
        Expected(
            row_pointers=[3] + [8] * 7,
            embedding_ids=[1, 2, 3] + [P] * 5,
            sample_ids=[0, 0, 1] + [P] * 5,
            gains=[0.0, 0.0, merged] + [X] * 5,
            max_ids_per_partition=[3],
            max_unique_ids_per_partition=[3],
            required_buffer_size_per_sc=[8],
        ),
    )


# N = S = 1, n = 4; rows [0,1,2] [0,1] [3,0] [1]. Sorted entries (id, sample):
# (0,0) (0,1) (0,2) (1,0) (1,1) (1,3) (2,0) (3,2): 8 entries, 4 columns.
# Kept: the first max_ids entries among the first max_unique columns.
SORTED_ENTRIES = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 3), (2, 0), (3, 2)]


@pytest.mark.parametrize(
    ("max_ids", "max_unique", "kept"),
    [
        (5, 2, 5),  # columns {0, 1} hold 6 entries; max_ids keeps 5
        (7, 2, 6),  # max_unique binds: the 6 entries of columns {0, 1}
        (3, 1, 3),  # both bind at the same place
        (8, 3, 7),  # column 3 dropped: (3, 2)
        (2, 4, 2),  # only max_ids binds
    ],
)
def test_dropping_with_both_limits(max_ids, max_unique, kept):
    table = Table(
        name="t",
        vocabulary_size=8,
        max_ids_per_partition=max_ids,
        max_unique_ids_per_partition=max_unique,
    )
    result = _preprocess(
        {"f": _ragged([[0, 1, 2], [0, 1], [3, 0], [1]])},
        None,
        {"f": _feature("f", table, 4)},
        slots=1,
        allow_id_dropping=True,
    )
    entries = SORTED_ENTRIES[:kept]
    _assert_layout(
        result,
        "t",
        Expected(
            row_pointers=[kept] + [8] * 7,  # coo = roundup8(max_ids) = 8
            embedding_ids=[e[0] for e in entries] + [P] * (8 - kept),
            sample_ids=[e[1] for e in entries] + [P] * (8 - kept),
            gains=[1.0] * kept + [X] * (8 - kept),
            max_ids_per_partition=[8],  # stats count before dropping
            max_unique_ids_per_partition=[4],
            required_buffer_size_per_sc=[8],
            id_drop_counter=8 - kept,
        ),
    )


# N = S = 2, n = 1; every id below is even, so all go to p0 as local id // 2.
# The drop count is of input ids, every occurrence merged into a dropped entry
# counted, as jax-tpu-embedding 0.1.0 reports it (6 and 4 here).
DROPS_COUNT_OCCURRENCES = [
    # max_unique 1: slot 0 keeps local 0 (ids 0, 0: gain 2) and drops locals
    # 1, 2 (ids 2, 2, 4, 4); slot 1 keeps local 3 (6, 6) and drops local 4 (8, 8).
    pytest.param([[0, 0, 2, 2, 4, 4], [6, 6, 8, 8]], 8, 1, [2.0, 2.0], 6, id="max_unique"),
    # max_ids 1: slot 0 keeps local 0 (ids 0, 0, 0: gain 3) and drops local 1
    # (id 2) and local 2 (4, 4, 4); slot 1 keeps local 3 (6).
    pytest.param([[0, 0, 0, 2, 4, 4, 4], [6]], 1, 8, [3.0, 1.0], 4, id="max_ids"),
]


@pytest.mark.parametrize(
    ("rows", "max_ids", "max_unique", "gains", "drops"), DROPS_COUNT_OCCURRENCES
)
def test_drops_count_every_merged_occurrence(rows, max_ids, max_unique, gains, drops):
    # coo = roundup8(max_ids) * S * N = 32 in both cases, 16 per slot.
    table = Table(
        name="t",
        vocabulary_size=16,
        max_ids_per_partition=max_ids,
        max_unique_ids_per_partition=max_unique,
    )
    result = _preprocess(
        {"f": _ragged(rows)},
        None,
        {"f": _feature("f", table, 2)},
        slots=2,
        allow_id_dropping=True,
    )
    _assert_layout(
        result,
        "t",
        Expected(
            row_pointers=[1] + [8] * 7 + [1] + [8] * 7,
            embedding_ids=[0] + [P] * 15 + [3] + [P] * 15,
            sample_ids=([0] + [P] * 15) * 2,
            gains=[gains[0]] + [X] * 15 + [gains[1]] + [X] * 15,
            # Stats count merged entries before dropping: slot 0 has 3 in p0.
            max_ids_per_partition=[3, 0],
            max_unique_ids_per_partition=[3, 0],
            required_buffer_size_per_sc=[8, 8],
            id_drop_counter=drops,
        ),
    )


def test_buffer_too_small_drops_the_tail_of_a_slot():
    # N = S = 1; the suggested buffer holds 8 entries, the limits do not bind.
    # Sorted (id, sample): (0,0) (1,0) (2,1) (3,1) (4,2) (5,2) (6,3) (7,3) (8,3);
    # the ninth entry has no room: dropped and counted.
    table = Table(
        name="t",
        vocabulary_size=10,
        max_ids_per_partition=64,
        suggested_coo_buffer_size_per_device=8,
    )
    result = _preprocess(
        {"f": _ragged([[0, 1], [2, 3], [4, 5], [6, 7, 8]])},
        None,
        {"f": _feature("f", table, 4)},
        slots=1,
        allow_id_dropping=True,
    )
    _assert_layout(
        result,
        "t",
        Expected(
            row_pointers=[8] * 8,
            embedding_ids=[0, 1, 2, 3, 4, 5, 6, 7],
            sample_ids=[0, 0, 1, 1, 2, 2, 3, 3],
            gains=[1.0] * 8,
            max_ids_per_partition=[9],
            max_unique_ids_per_partition=[9],
            required_buffer_size_per_sc=[16],
            id_drop_counter=1,
        ),
    )


def test_buffer_too_small_leaves_no_room_for_a_later_partition():
    # N = 2 (G = 2, L = 1: this host has half of a batch of 4), S = 1, n = 2.
    # p0 gets ids 0, 2, 4 -> local ids 0, 1, 2; its segment [0, 3) is padded to
    # 8, the whole 8-entry buffer, so p1's entry (id 1 -> local 0) is dropped
    # and p1's segment is empty at 8.
    table = Table(
        name="t",
        vocabulary_size=16,
        max_ids_per_partition=64,
        suggested_coo_buffer_size_per_device=8,
    )
    result = _preprocess(
        {"f": np.array([[0, 2], [4, 1]])},
        None,
        {"f": _feature("f", table, 4)},
        global_=2,
        slots=1,
        allow_id_dropping=True,
    )
    _assert_layout(
        result,
        "t",
        Expected(
            row_pointers=[3] + [8] * 7,
            embedding_ids=[0, 1, 2] + [P] * 5,
            sample_ids=[0, 0, 1] + [P] * 5,
            gains=[1.0] * 3 + [X] * 5,
            max_ids_per_partition=[3, 1],
            max_unique_ids_per_partition=[3, 1],
            required_buffer_size_per_sc=[16],
            id_drop_counter=1,
        ),
    )


def test_feature_stacking_orders_features_by_name():
    # Features given as [b, a] share table t; stacking orders them by name, so
    # a (batch 4, n = 2) takes samples 0-1 of a slot and b (batch 2, n = 1)
    # sample 2. N = S = 2, coo 32.
    # slot 0: a ids 1 -> p1 (0, 0), 2 -> p0 (1, 1); b id 5 -> p1 (2, 2)
    # slot 1: a ids 3 -> p1 (1, 0), 4 -> p0 (2, 1); b id 2 -> p0 (1, 2)
    table = Table(name="t", vocabulary_size=16, max_ids_per_partition=4)
    specs = [_feature("b", table, 2), _feature("a", table, 4)]
    ids = [np.array([[5], [2]]), np.array([[1], [2], [3], [4]])]
    result = _preprocess(ids, None, specs, slots=2)
    _assert_layout(
        result,
        "t",
        Expected(
            row_pointers=[1, 10] + [16] * 6 + [2, 9] + [16] * 6,
            embedding_ids=[1] + [P] * 7 + [0, 2] + [P] * 6 + [1, 2] + [P] * 6 + [1] + [P] * 7,
            sample_ids=[1] + [P] * 7 + [0, 2] + [P] * 6 + [2, 1] + [P] * 6 + [0] + [P] * 7,
            gains=[1] + [X] * 7 + [1, 1] + [X] * 6 + [1, 1] + [X] * 6 + [1] + [X] * 7,
            max_ids_per_partition=[2, 2],
            max_unique_ids_per_partition=[2, 2],
            required_buffer_size_per_sc=[16, 16],
        ),
    )


def test_table_stacking_with_rotation():
    # t1 (vocab 32) and t2 (vocab 20 -> padded 32) stacked on G = L = 2
    # devices x S = 2: N = 4. t2 sits 32 / 4 = 8 rows into every shard
    # (col_offset 32) and is rotated by S = 2 partitions (col_shift 2):
    #   t2 col = ((id + 2) & 3) + (id & ~3) + 32
    #   id 1 -> 35 (p3, l8); 5 -> 39 (p3, l9); 2 -> 32 (p0, l8); 6 -> 36 (p0, l9)
    #   t1 col = id: 1 -> (p1, l0); 5 -> (p1, l1); 2 -> (p2, l0); 7 -> (p3, l1)
    # n = 1 per feature; f1 is sample 0, f2 sample 1 of every slot; row r is
    # device r // 2, slot r % 2. coo = suggested 16 + 16 -> 32, 16 per slot.
    t1 = Table(name="t1", vocabulary_size=32, suggested_coo_buffer_size_per_device=16)
    t2 = Table(name="t2", vocabulary_size=20, suggested_coo_buffer_size_per_device=16)
    specs = {"f1": _feature("f1", t1, 4), "f2": _feature("f2", t2, 4)}
    specs = embedding.stack_tables(specs, ["t1", "t2"], 2, 2)
    ids = {"f1": np.array([[1], [5], [2], [7]]), "f2": np.array([[1], [5], [2], [6]])}
    result = _preprocess(ids, None, specs, local=2, global_=2, slots=2)
    pad7 = [P] * 7
    _assert_layout(
        result,
        "t1_t2",
        Expected(
            row_pointers=[0, 1, 8, 9, 16, 16, 16, 16]  # d0 s0: t1 p1, t2 p3
            + [0, 1, 8, 9, 16, 16, 16, 16]  # d0 s1: t1 p1, t2 p3
            + [1, 8, 9, 16, 16, 16, 16, 16]  # d1 s0: t2 p0, t1 p2
            + [1, 8, 8, 9, 16, 16, 16, 16],  # d1 s1: t2 p0, t1 p3
            # One entry at the start of each 8-cell segment, in buffer order:
            # d0 s0 p1, p3 | d0 s1 p1, p3 | d1 s0 p0, p2 | d1 s1 p0, p3.
            embedding_ids=sum(([i] + pad7 for i in [0, 8, 1, 9, 8, 0, 9, 1]), []),
            sample_ids=sum(([i] + pad7 for i in [0, 1, 0, 1, 1, 0, 1, 0]), []),
            gains=([1.0] + [X] * 7) * 8,
            max_ids_per_partition=[0, 1, 0, 1, 1, 0, 1, 1],
            max_unique_ids_per_partition=[0, 1, 0, 1, 1, 0, 1, 1],
            required_buffer_size_per_sc=[16, 16, 16, 16],
        ),
    )


# L = G = 2, S = 1: N = 2, n = 2; rows [0,3] [1,3] on device 0, [2,2] [5,4] on 1.
# d0: s0 0 -> p0 (0,0), 3 -> p1 (1,0); s1 1 -> p1 (0,1), 3 -> p1 (1,1)
#     p0: (0,0,1)  p1: (0,1,1) (1,0,1) (1,1,1)
# d1: s0 2,2 -> p0 (1,0,2); s1 5 -> p1 (2,1), 4 -> p0 (2,1)
#     p0: (1,0,2) (2,1,1)  p1: (2,1,1)
# coo = roundup8(4) * 1 * 2 = 16 per device.
TWO_DEVICE_IDS = np.array([[0, 3], [1, 3], [2, 2], [5, 4]])
TWO_DEVICE_LAYOUT = Expected(
    row_pointers=[1, 11] + [16] * 6 + [2, 9] + [16] * 6,
    embedding_ids=[0] + [P] * 7 + [0, 1, 1] + [P] * 5 + [1, 2] + [P] * 6 + [2] + [P] * 7,
    sample_ids=[0] + [P] * 7 + [1, 0, 1] + [P] * 5 + [0, 1] + [P] * 6 + [1] + [P] * 7,
    gains=[1] + [X] * 7 + [1, 1, 1] + [X] * 5 + [2, 1] + [X] * 6 + [1] + [X] * 7,
    max_ids_per_partition=[1, 3, 2, 1],
    max_unique_ids_per_partition=[1, 2, 2, 1],
    required_buffer_size_per_sc=[16, 16],
)


def _two_device_specs():
    return {"f": _feature("f", Table(name="t", vocabulary_size=8, max_ids_per_partition=4), 4)}


def test_two_local_devices():
    result = _preprocess(
        {"f": TWO_DEVICE_IDS}, None, _two_device_specs(), local=2, global_=2, slots=1
    )
    _assert_layout(result, "t", TWO_DEVICE_LAYOUT)
    np.testing.assert_array_equal(result[0].num_minibatches, [1, 1])


def test_has_leading_dimension_shapes_per_device():
    out, stats = _preprocess(
        {"f": TWO_DEVICE_IDS},
        None,
        _two_device_specs(),
        local=2,
        global_=2,
        slots=1,
        has_leading_dimension=True,
    )
    # Row d of every array is device d's part of the flat two-device layout.
    want = TWO_DEVICE_LAYOUT
    np.testing.assert_array_equal(out.lhs_row_pointers["t"], np.reshape(want.row_pointers, (2, 8)))
    np.testing.assert_array_equal(
        out.lhs_embedding_ids["t"], np.reshape(want.embedding_ids, (2, 16))
    )
    np.testing.assert_array_equal(out.lhs_sample_ids["t"], np.reshape(want.sample_ids, (2, 16)))
    np.testing.assert_allclose(out.lhs_gains["t"], np.reshape(want.gains, (2, 16)))
    np.testing.assert_array_equal(out.num_minibatches, [[1], [1]])
    np.testing.assert_array_equal(stats.max_ids_per_partition["t"], want.max_ids_per_partition)


ROWS = [[1, 2, 3], [4, 5, 6], [7, 0, 2], [2, 2, 1]]
WEIGHTS = [[1.0, 2.0, 0.5], [1.0, 1.0, 1.0], [3.0, 0.0, 1.0], [0.25, 0.25, 2.0]]


def _input_forms(rows: list[list]) -> dict:
    values = np.array([v for r in rows for v in r])
    splits = np.cumsum([0] + [len(r) for r in rows])
    return {
        "dense": np.array(rows),
        "ragged": _ragged(rows),
        "RaggedIds": embedding.RaggedIds(values=values, row_splits=splits),
    }


@pytest.mark.parametrize("form", ["ragged", "RaggedIds"])
def test_input_forms_give_identical_layouts(form):
    table = Table(name="t", vocabulary_size=8, combiner="mean", max_ids_per_partition=8)
    specs = {"f": _feature("f", table, 4)}
    dense = _preprocess({"f": np.array(ROWS)}, {"f": np.array(WEIGHTS)}, specs, slots=2)
    other = _preprocess(
        {"f": _input_forms(ROWS)[form]}, {"f": _input_forms(WEIGHTS)[form]}, specs, slots=2
    )
    for want, got in zip(dense[0].sparse_dense_matmul_input, other[0].sparse_dense_matmul_input):
        np.testing.assert_array_equal(got["t"], want["t"])
    for field in ("max_ids_per_partition", "max_unique_ids_per_partition"):
        np.testing.assert_array_equal(getattr(other[1], field)["t"], getattr(dense[1], field)["t"])
    # The dense layout itself is not empty: 12 ids, gains of a mean.
    assert np.count_nonzero(dense[0].lhs_sample_ids["t"] != P) == 11  # (2, 2) merged in row 3
