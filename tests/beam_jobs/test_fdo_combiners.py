"""The FDO CombineFns, called directly and in a pipeline, against numpy and Counter."""

import collections
import json

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.util import assert_that, equal_to
from hypothesis import given, settings
from hypothesis import strategies as st

import beam_jobs
import beam_jobs._transforms
import embedding

SEEDS = range(5)


def _combine(fn, inputs, rng):
    """Folds random groups of the inputs, merges the accumulators in random order."""
    size = min(3, len(inputs) - 1)
    cuts = sorted(rng.choice(np.arange(1, len(inputs)), size=size, replace=False))
    groups = np.split(np.arange(len(inputs)), cuts)
    accumulators = []
    for group in groups:
        accumulator = fn.create_accumulator()
        for index in group:
            accumulator = fn.add_input(accumulator, inputs[index])
        accumulators.append(fn.compact(accumulator) if rng.random() < 0.5 else accumulator)
    accumulators.append(fn.create_accumulator())
    rng.shuffle(accumulators)
    return fn.extract_output(fn.merge_accumulators(accumulators))


def _max_inputs(rng, count=12):
    return [
        {"a": rng.integers(0, 100, 8), ("b", "x"): rng.integers(0, 5, (2, 3))} for _ in range(count)
    ]


@pytest.mark.parametrize("seed", SEEDS)
def test_elementwise_max_any_split_and_order(seed):
    rng = np.random.default_rng(seed)
    inputs = _max_inputs(rng)
    result = _combine(beam_jobs.ElementwiseMaxFn(), inputs, rng)
    assert set(result) == {"a", ("b", "x")}
    for key in result:
        np.testing.assert_array_equal(result[key], np.max([i[key] for i in inputs], axis=0))


def test_elementwise_max_rejects_a_shape_change():
    fn = beam_jobs.ElementwiseMaxFn()
    accumulator = fn.add_input(fn.create_accumulator(), {"a": np.zeros(4, np.int32)})
    with pytest.raises(ValueError, match="'a' has shape \\(5,\\), earlier \\(4,\\)"):
        fn.add_input(accumulator, {"a": np.zeros(5, np.int32)})


def test_elementwise_max_does_not_modify_its_inputs():
    fn = beam_jobs.ElementwiseMaxFn()
    first, second = np.array([1, 5]), np.array([3, 2])
    accumulator = fn.add_input(fn.create_accumulator(), {"a": first})
    fn.add_input(accumulator, {"a": second})
    np.testing.assert_array_equal(first, [1, 5])


@pytest.mark.parametrize("seed", SEEDS)
def test_int_histogram_any_split_and_order(seed):
    rng = np.random.default_rng(seed)
    inputs = [{"p": rng.integers(0, 2 + 10 * i, 4), "s": rng.integers(0, 30, 1)} for i in range(15)]
    result = _combine(beam_jobs.IntHistogramFn(), inputs, rng)
    for key, width in (("p", 4), ("s", 1)):
        counts = result[key]
        assert counts.shape[0] == width
        for k in range(width):
            expected = collections.Counter(int(i[key][k]) for i in inputs)
            actual = {v: int(c) for v, c in enumerate(counts[k]) if c}
            assert actual == expected


def test_int_histogram_rejects_negative_values():
    fn = beam_jobs.IntHistogramFn()
    with pytest.raises(ValueError, match="negative value -2"):
        fn.add_input(fn.create_accumulator(), {"p": np.array([3, -2])})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=300))
def test_histogram_percentiles_are_numpy_inverted_cdf(values):
    counts = np.bincount(values)
    percentiles = beam_jobs.histogram_percentiles(counts)
    assert list(percentiles) == [name for name, _ in beam_jobs.PERCENTILES]
    for name, q in beam_jobs.PERCENTILES:
        assert percentiles[name] == int(np.percentile(values, q, method="inverted_cdf")), name


def test_histogram_percentiles_hand_case():
    # Values 1..1000: p99.9 is the 999th value, the max the 1000th.
    counts = np.ones(1001, np.int64)
    counts[0] = 0
    percentiles = beam_jobs.histogram_percentiles(counts)
    assert percentiles == {"p50": 500, "p90": 900, "p99": 990, "p99.9": 999, "max": 1000}


def _id_inputs(rng, count):
    inputs = []
    for _ in range(count):
        ids = rng.zipf(1.3, 40) % 50
        unique, counts = np.unique(ids, return_counts=True)
        inputs.append({"t": (unique, counts), "u": (np.array([7]), np.array([2]))})
    return inputs


@pytest.mark.parametrize("seed", SEEDS)
def test_id_frequency_any_split_and_order(seed):
    rng = np.random.default_rng(seed)
    # More inputs than one accumulator keeps unfolded, so folding is exercised.
    inputs = _id_inputs(rng, 150)
    result = _combine(beam_jobs.IdFrequencyFn(top_k=4), inputs, rng)
    counter = collections.Counter()
    for element in inputs:
        counter.update(dict(zip(*(a.tolist() for a in element["t"]))))
    ranked = sorted(counter.items(), key=lambda item: (-item[1], item[0]))
    assert result["t"] == embedding.TableIdFrequency(
        ids=sum(counter.values()), distinct_ids=len(counter), top_ids=tuple(ranked[:4])
    )
    assert result["u"] == embedding.TableIdFrequency(ids=300, distinct_ids=1, top_ids=((7, 300),))


def test_id_frequency_ties_rank_the_smaller_id_first():
    fn = beam_jobs.IdFrequencyFn(top_k=3)
    accumulator = fn.add_input(
        fn.create_accumulator(), {"t": (np.array([9, 4, 6, 2]), np.array([5, 5, 1, 5]))}
    )
    assert fn.extract_output(accumulator)["t"].top_ids == ((2, 5), (4, 5), (9, 5))


def _batch_stats(rng, batch: int) -> beam_jobs.BatchStats:
    stacks = {
        name: {
            "max_ids_per_partition": rng.integers(0, 40, 16).astype(np.int32),
            "max_unique_ids_per_partition": rng.integers(0, 20, 16).astype(np.int32),
            "required_buffer_size_per_sc": 8 * rng.integers(2, 30, 4).astype(np.int32),
        }
        for name in ("s1", "s2")
    }
    ids, counts = np.unique(rng.integers(0, 30, 50), return_counts=True)
    return beam_jobs.BatchStats(batch, stacks, {"t": (ids, counts)})


GEOMETRY = embedding.FdoGeometry(
    global_batch_size=64, devices=4, partitions_per_device=2, processes=2
)


@pytest.mark.parametrize("seed", SEEDS)
def test_fdo_stats_fn_does_not_depend_on_split_or_order(seed):
    rng = np.random.default_rng(seed)
    inputs = [_batch_stats(rng, b) for b in range(20)]
    fn = beam_jobs.FdoStatsFn(geometry=GEOMETRY, config_hash="h", top_k=3)
    once = fn.extract_output(
        fn.merge_accumulators([fn.add_input(fn.create_accumulator(), i) for i in inputs])
    )
    assert once.batches == 20
    np.testing.assert_array_equal(
        once.stacks["s1"].max_ids_per_partition,
        np.max([i.stacks["s1"]["max_ids_per_partition"] for i in inputs], axis=0),
    )
    # L = 2 local devices x N = 8 partitions: a partition's max is over both devices.
    partition_maxima = [
        i.stacks["s2"]["max_ids_per_partition"].reshape(2, 8).max(axis=0) for i in inputs
    ]
    histogram = once.stacks["s2"].partition_histogram
    for p in range(8):
        assert collections.Counter(int(m[p]) for m in partition_maxima) == {
            v: c for v, c in enumerate(histogram[p].tolist()) if c
        }
    again = _combine(fn, inputs, rng)
    assert json.loads(again.to_json()) == json.loads(once.to_json())


def test_fdo_stats_fn_without_batches_has_no_stacks():
    fn = beam_jobs.FdoStatsFn(geometry=GEOMETRY, config_hash="h", top_k=3)
    stats = fn.extract_output(fn.create_accumulator())
    assert (stats.batches, dict(stats.stacks), dict(stats.tables)) == (0, {}, {})


def test_combine_fns_in_a_pipeline():
    rng = np.random.default_rng(7)
    maxima = _max_inputs(rng, 9)
    histograms = [{"p": rng.integers(0, 6, 3)} for _ in range(9)]
    ids = _id_inputs(rng, 9)
    with beam_jobs.make_pipeline() as p:
        max_result = (
            p
            | "Maxima" >> beam.Create(maxima)
            | "Max" >> beam.CombineGlobally(beam_jobs.ElementwiseMaxFn())
            | "MaxList" >> beam.Map(lambda r: r["a"].tolist())
        )
        assert_that(
            max_result, equal_to([np.max([m["a"] for m in maxima], 0).tolist()]), label="max"
        )
        histogram_result = (
            p
            | "Histograms" >> beam.Create(histograms)
            | "Histogram" >> beam.CombineGlobally(beam_jobs.IntHistogramFn())
            | "HistogramTotals" >> beam.Map(lambda r: r["p"].sum(axis=1).tolist())
        )
        assert_that(histogram_result, equal_to([[9, 9, 9]]), label="histogram")
        frequency = (
            p
            | "Ids" >> beam.Create(ids)
            | "Frequency" >> beam.CombineGlobally(beam_jobs.IdFrequencyFn(top_k=2))
            | "IdTotal" >> beam.Map(lambda r: r["u"].ids)
        )
        assert_that(frequency, equal_to([18]), label="frequency")


def test_partial_then_merged_accumulators_equal_one_combine():
    rng = np.random.default_rng(3)
    inputs = [_batch_stats(rng, b) for b in range(12)]
    fn = beam_jobs.FdoStatsFn(geometry=GEOMETRY, config_hash="h", top_k=3)
    partial, merge = beam_jobs.PartialCombineFn(fn), beam_jobs.MergeAccumulatorsFn(fn)
    parts = [_combine(partial, inputs[:5], rng), _combine(partial, inputs[5:], rng)]
    merged = _combine(merge, [*parts, partial.extract_output(partial.create_accumulator())], rng)
    whole = _combine(fn, inputs, rng)
    assert merged.batches == 12
    assert json.loads(merged.to_json()) == json.loads(whole.to_json())


def test_merging_side_input_accumulators_leaves_them_as_they_were():
    rng = np.random.default_rng(4)
    inputs = [_batch_stats(rng, b) for b in range(9)]
    fn = beam_jobs.FdoStatsFn(geometry=GEOMETRY, config_hash="h", top_k=3)
    partial = beam_jobs.PartialCombineFn(fn)
    parts = [[_combine(partial, inputs[:4], rng)], [_combine(partial, inputs[4:], rng)]]
    before = [json.loads(fn.extract_output(p[0]).to_json()) for p in parts]

    (merged,) = beam_jobs._transforms._merged(None, fn, *parts)

    assert json.loads(merged.to_json()) == json.loads(_combine(fn, inputs, rng).to_json())
    assert [json.loads(fn.extract_output(p[0]).to_json()) for p in parts] == before
    assert beam_jobs._transforms._merged(None, fn, [], []) == []
