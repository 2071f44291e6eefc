"""Preprocessing throughput: sparseflow against jax-tpu-embedding, side by side.

The geometry of `sparseflow/configs/benchmark.yaml`: 8 tables of 1M rows, Zipf(1.1) ids,
1..20 ids per sample, 8 devices x 4 partitions, host batch 32768. Both
libraries get identical batches and limits and are timed alternately, pass by
pass, in one run. Limits measured (`ratio_vs_jax_tpu_embedding_<limits>`):
  * 256, 1024, 8192: max ids = max unique ids per partition, buffer size
    unset (dropping on; 256 drops, 8192 is what a user without FDO stats
    gets);
  * fdo: taken from a stats pass over the same batches, as FDO sets them.

Two input forms are measured:
  * object: a 1-D object array of int32 rows per feature, the ragged form
    both libraries accept (every limit setting);
  * flat: each library's own flat form of the same batch (`RaggedIds` for
    sparseflow, the COO sparse-tensor entry point for jax-tpu-embedding), at
    the FDO limits.

The peer is the optional extra `bench` (`make bench-env`). Without it only
sparseflow's figures are printed. The last line printed is one JSON object.

    python benchmarks/preprocess.py [--batches 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import _zipf_batches
import numpy as np

import embedding

TABLES = 8
VOCABULARY = 1_000_000
DIM = 16
HOST_BATCH = 32768
DEVICES = 8
PARTITIONS_PER_DEVICE = 4
ZIPF = 1.1
MAX_VALENCY = 20
FIXED_LIMITS = (256, 1024, 8192)


def make_batches(num_batches: int, seed: int) -> list[dict[str, embedding.RaggedIds]]:
    return _zipf_batches.make_batches(
        num_batches,
        seed,
        tables=TABLES,
        rows=HOST_BATCH,
        vocabulary=VOCABULARY,
        zipf=ZIPF,
        max_valency=MAX_VALENCY,
    )


def as_object_rows(batch: dict[str, embedding.RaggedIds]) -> dict[str, np.ndarray]:
    out = {}
    for name, ragged in batch.items():
        rows = np.empty(ragged.row_splits.size - 1, dtype=object)
        rows[:] = np.split(ragged.values, ragged.row_splits[1:-1])
        out[name] = rows
    return out


def as_sparse_tensor(batch: dict[str, embedding.RaggedIds]):
    indices, values, shapes = {}, {}, {}
    for name, ragged in batch.items():
        lengths = np.diff(ragged.row_splits)
        rows = np.repeat(np.arange(lengths.size), lengths)
        cols = np.arange(ragged.values.size) - ragged.row_splits[rows]
        indices[name] = np.stack([rows, cols], axis=1).astype(np.int64)
        values[name] = ragged.values
        shapes[name] = np.array([lengths.size, MAX_VALENCY], np.int64)
    return indices, values, shapes


def table_kwargs(limits: dict[str, int]) -> list[dict]:
    return [
        dict(name=f"t{t}", vocabulary_size=VOCABULARY, embedding_dim=DIM, combiner="sum", **limits)
        for t in range(TABLES)
    ]


def our_specs(limits: dict[str, int]) -> dict[str, embedding.FeatureSpec]:
    specs = {}
    for t, kwargs in enumerate(table_kwargs(limits)):
        table = embedding.TableSpec(
            initializer=embedding.initializers.Constant(0.0),
            optimizer=embedding.SGDOptimizerSpec(),
            **kwargs,
        )
        specs[f"f{t}"] = embedding.FeatureSpec(
            name=f"f{t}",
            table_spec=table,
            input_shape=[HOST_BATCH, MAX_VALENCY],
            output_shape=[HOST_BATCH, DIM],
        )
    return specs


def fdo_limits(batches) -> dict[str, int]:
    """Limits from a stats pass over the batches, as the FDO job sets them.

    Stats are counted before any dropping, so the pass may drop freely.
    """
    specs = our_specs(dict(max_ids_per_partition=256, max_unique_ids_per_partition=256))
    max_ids = max_unique = buffer = 0
    for batch in batches:
        _, stats = run_ours(batch, specs, allow_id_dropping=True)
        max_ids = max(max_ids, *(int(v.max()) for v in stats.max_ids_per_partition.values()))
        max_unique = max(
            max_unique, *(int(v.max()) for v in stats.max_unique_ids_per_partition.values())
        )
        buffer = max(
            buffer,
            *(
                int(v.max()) * PARTITIONS_PER_DEVICE
                for v in stats.required_buffer_size_per_sc.values()
            ),
        )
    return dict(
        max_ids_per_partition=max_ids,
        max_unique_ids_per_partition=max_unique,
        suggested_coo_buffer_size_per_device=buffer,
    )


def run_ours(features, specs, allow_id_dropping=False, enable_minibatching=False):
    return embedding.preprocess_sparse_dense_matmul_input(
        features,
        None,
        specs,
        DEVICES,
        DEVICES,
        num_sc_per_device=PARTITIONS_PER_DEVICE,
        allow_id_dropping=allow_id_dropping,
        enable_minibatching=enable_minibatching,
    )


def minibatching_figures(batches, limits: dict[str, int], repeats: int, ids: int) -> dict:
    """Throughput with minibatching forced (unique-id limit at half the observed
    maximum, which splits these batches into about 4 minibatches: a hot column
    counts once, so no single bucket breaks it)."""
    forcing = dict(limits, max_unique_ids_per_partition=limits["max_unique_ids_per_partition"] // 2)
    specs = our_specs(forcing)
    out, stats = run_ours(batches[0], specs, enable_minibatching=True)
    rate = throughput(lambda x: run_ours(x, specs, enable_minibatching=True), batches, repeats, ids)
    return dict(
        minibatching_ids_per_s=round(rate),
        minibatching_num_minibatches=int(out.num_minibatches[0]),
        minibatching_drops=int(sum(stats.id_drop_counters.values())),
    )


def peer(limits: dict[str, int]):
    """(object-input fn, sparse-tensor fn) of jax-tpu-embedding, or None."""
    try:
        import jax
        from jax_tpu_embedding.sparsecore.lib.nn import embedding as jte
        from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec as jte_spec
    except ImportError:
        return None
    specs = {}
    for t, kwargs in enumerate(table_kwargs(limits)):
        table = jte_spec.TableSpec(
            initializer=jax.nn.initializers.zeros, optimizer=jte_spec.SGDOptimizerSpec(), **kwargs
        )
        specs[f"f{t}"] = jte_spec.FeatureSpec(
            name=f"f{t}",
            table_spec=table,
            input_shape=[HOST_BATCH, MAX_VALENCY],
            output_shape=[HOST_BATCH, DIM],
        )
    jte.prepare_feature_specs_for_training(specs, DEVICES, PARTITIONS_PER_DEVICE)
    common = dict(num_sc_per_device=PARTITIONS_PER_DEVICE, allow_id_dropping=True)

    def objects(features):
        return jte.preprocess_sparse_dense_matmul_input(
            features, None, specs, DEVICES, DEVICES, **common
        )

    def sparse(tensor):
        return jte.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
            *tensor, specs, DEVICES, DEVICES, **common
        )

    return objects, sparse


def same_layout(ours, theirs, stats_ours, stats_theirs) -> bool:
    """Equal stats and drop counts, and equal buffers up to each slot's aligned end.

    The peer leaves the unused tail of a slot uninitialized, so only the
    segments the row pointers cover (and their padding) are compared.
    """
    n = DEVICES * PARTITIONS_PER_DEVICE
    slots, width = n, max(n, 8)
    stat_fields = (
        "max_ids_per_partition",
        "max_unique_ids_per_partition",
        "required_buffer_size_per_sc",
        "id_drop_counters",
    )
    for name in ours.lhs_row_pointers:
        for field in stat_fields:
            a, b = getattr(stats_ours, field)[name], getattr(stats_theirs, field)[name]
            if not np.array_equal(a, b):
                return False
        pointers = ours.lhs_row_pointers[name]
        if not np.array_equal(pointers, theirs.lhs_row_pointers[name]):
            return False
        capacity = ours.lhs_embedding_ids[name].size // slots
        for slot in range(slots):
            end = -(-int(pointers[slot * width + n - 1]) // 8) * 8
            window = slice(slot * capacity, slot * capacity + end)
            for field in ("lhs_embedding_ids", "lhs_sample_ids", "lhs_gains"):
                a, b = getattr(ours, field)[name][window], getattr(theirs, field)[name][window]
                if not np.array_equal(a, b, equal_nan=True):
                    return False
    return True


def throughput(fn, inputs, repeats: int, ids: int) -> float:
    """Median ids/s over `repeats` passes over all inputs (after one warm-up)."""
    return alternated_throughputs([fn], [inputs], repeats, ids)[0]


def alternated_throughputs(fns, inputs, repeats: int, ids: int) -> list[float]:
    """Median ids/s of each `fns[k]` over `inputs[k]`, passes alternated.

    Alternating pass by pass (after one warm-up pass each) exposes every
    function to the same drift of a shared machine.
    """
    for fn, xs in zip(fns, inputs):
        for x in xs:
            fn(x)
    rates = [[] for _ in fns]
    for _ in range(repeats):
        for fn, xs, out in zip(fns, inputs, rates):
            start = time.perf_counter()
            for x in xs:
                fn(x)
            out.append(ids * len(xs) / (time.perf_counter() - start))
    return [statistics.median(r) for r in rates]


def limit_settings(batches) -> dict[str, dict[str, int]]:
    """The limits measured, by the suffix of their result keys."""
    settings = {
        str(n): dict(max_ids_per_partition=n, max_unique_ids_per_partition=n) for n in FIXED_LIMITS
    }
    settings["fdo"] = fdo_limits(batches)
    return settings


def against_peer(label: str, limits: dict[str, int], objects, repeats: int, ids: int) -> dict:
    """Object-input ids/s of both libraries at one limit setting, and their ratio."""
    specs = our_specs(limits)

    def ours(x):
        return run_ours(x, specs, allow_id_dropping=True)

    ours_out, ours_stats = ours(objects[0])
    result = {f"drops_{label}": int(sum(ours_stats.id_drop_counters.values()))}
    fns = peer(limits)
    if fns is None:
        result[f"ours_object_ids_per_s_{label}"] = round(throughput(ours, objects, repeats, ids))
        return result
    theirs = fns[0]
    theirs_out, theirs_stats = theirs(objects[0])
    ours_rate, theirs_rate = alternated_throughputs(
        [ours, theirs], [objects, objects], repeats, ids
    )
    result.update(
        {
            f"ours_object_ids_per_s_{label}": round(ours_rate),
            f"jax_tpu_embedding_object_ids_per_s_{label}": round(theirs_rate),
            f"layouts_identical_{label}": same_layout(
                ours_out, theirs_out, ours_stats, theirs_stats
            ),
            f"ratio_vs_jax_tpu_embedding_{label}": round(ours_rate / theirs_rate, 3),
        }
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    batches = make_batches(args.batches, args.seed)
    ids_per_batch = int(np.mean([sum(r.values.size for r in b.values()) for b in batches]))
    settings = limit_settings(batches)
    limits = settings["fdo"]
    specs = our_specs(limits)
    objects = [as_object_rows(b) for b in batches]
    result = dict(
        benchmark="preprocess",
        host_batch=HOST_BATCH,
        tables=TABLES,
        devices=DEVICES,
        partitions_per_device=PARTITIONS_PER_DEVICE,
        ids_per_batch=ids_per_batch,
        fdo_limits=limits,
    )
    for label, setting in settings.items():
        result.update(against_peer(label, setting, objects, args.repeats, ids_per_batch))

    def ours_flat(x):
        return run_ours(x, specs)

    fns = peer(limits)
    if fns is None:
        flat_rate = throughput(ours_flat, batches, args.repeats, ids_per_batch)
        result["jax_tpu_embedding"] = "not installed (make bench-env)"
    else:
        sparse = [as_sparse_tensor(b) for b in batches]
        flat_rate, peer_sparse = alternated_throughputs(
            [ours_flat, fns[1]], [batches, sparse], args.repeats, ids_per_batch
        )
        result.update(
            jax_tpu_embedding_sparse_tensor_ids_per_s=round(peer_sparse),
            ratio_vs_jax_tpu_embedding_flat_inputs=round(flat_rate / peer_sparse, 3),
        )
    result.update(ours_ragged_ids_per_s=round(flat_rate))
    result.update(minibatching_figures(batches, limits, args.repeats, ids_per_batch))
    result["minibatching_on_vs_off"] = round(result["minibatching_ids_per_s"] / flat_rate, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
