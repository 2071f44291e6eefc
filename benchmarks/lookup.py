"""One training step on sharded tables against the dense baseline, side by side.

8 tables of 1M rows x dim 16, one feature each, global batch 4096, Zipf(1.1)
ids, 1..20 ids per sample, 8 virtual CPU devices. A step is the lookup, the
gradient of `0.5 * sum(activations^2)` (so the activation gradient is the
activation) and an Adagrad update (one accumulator per table entry, as optax),
jitted as one program with the variables donated.

  * sparseflow: `sparse_dense_matmul` + `apply_gradients` on tables MOD-sharded
    over 8 devices x S partitions; limits from a stats pass over the same
    batches, as the FDO job would set them. Preprocessing runs beforehand and
    is not timed (`benchmarks/preprocess.py` measures it).
  * dense baseline (what one writes first): every table replicated on every
    device, the batch split over the devices, `jnp.take` + segment sum, the
    dense gradient of each table (all-reduced), optax Adagrad. Every device
    repeats the dense update, so on virtual devices sharing a few cores it
    pays for it 8 times over.
  * TorchRec's EmbeddingBagCollection with fused row-wise Adagrad, when
    `torchrec` is importable (not part of the project's environment).

Every step is waited for before the next is dispatched (XLA:CPU must not run
two programs with collectives at once). The last line printed is one JSON
object.

    python benchmarks/lookup.py [--steps 20] [--partitions-per-device 1]
"""

from __future__ import annotations

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import _zipf_batches  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import embedding  # noqa: E402

TABLES = 8
VOCABULARY = 1_000_000
DIM = 16
BATCH = 4096
DEVICES = 8
ZIPF = 1.1
MAX_VALENCY = 20
LEARNING_RATE = 0.05
INITIAL_ACCUMULATOR = 0.1


def make_batches(num_batches: int, seed: int) -> list[dict[str, embedding.RaggedIds]]:
    return _zipf_batches.make_batches(
        num_batches,
        seed,
        tables=TABLES,
        rows=BATCH,
        vocabulary=VOCABULARY,
        zipf=ZIPF,
        max_valency=MAX_VALENCY,
    )


def make_specs(limits: dict[str, int]) -> dict[str, embedding.FeatureSpec]:
    optimizer = embedding.AdagradOptimizerSpec(
        learning_rate=LEARNING_RATE, initial_accumulator_value=INITIAL_ACCUMULATOR
    )
    specs = {}
    for t in range(TABLES):
        table = embedding.TableSpec(
            name=f"t{t}",
            vocabulary_size=VOCABULARY,
            embedding_dim=DIM,
            initializer=embedding.initializers.TruncatedNormal(0.01),
            optimizer=optimizer,
            combiner="sum",
            **limits,
        )
        specs[f"f{t}"] = embedding.FeatureSpec(
            name=f"f{t}",
            table_spec=table,
            input_shape=[BATCH, MAX_VALENCY],
            output_shape=[BATCH, DIM],
        )
    return specs


def preprocess(batch, specs, slots: int, allow_id_dropping: bool = False):
    return embedding.preprocess_sparse_dense_matmul_input(
        batch,
        None,
        specs,
        DEVICES,
        DEVICES,
        num_sc_per_device=slots,
        allow_id_dropping=allow_id_dropping,
    )


def fdo_limits(batches, slots: int) -> dict[str, int]:
    """Limits from a stats pass (stats count before dropping, so it may drop)."""
    specs = make_specs(dict(max_ids_per_partition=256, max_unique_ids_per_partition=256))
    max_ids = max_unique = buffer = 0
    for batch in batches:
        _, stats = preprocess(batch, specs, slots, allow_id_dropping=True)
        max_ids = max(max_ids, *(int(v.max()) for v in stats.max_ids_per_partition.values()))
        max_unique = max(
            max_unique, *(int(v.max()) for v in stats.max_unique_ids_per_partition.values())
        )
        buffer = max(
            buffer, *(int(v.max()) * slots for v in stats.required_buffer_size_per_sc.values())
        )
    return dict(
        max_ids_per_partition=max_ids,
        max_unique_ids_per_partition=max_unique,
        suggested_coo_buffer_size_per_device=buffer,
    )


def timed_steps(step, state, inputs, steps: int) -> tuple[object, float]:
    """Runs `steps` steps (after 2 warm-up steps); returns (state, median seconds)."""
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        state = jax.block_until_ready(step(state, inputs[i % len(inputs)]))
        times.append(time.perf_counter() - start)
    return state, statistics.median(times[2:])


def per_device_bytes(tree) -> int:
    """Bytes of `tree`'s arrays that device 0 holds."""
    device = jax.devices()[0]
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for shard in leaf.addressable_shards
        if shard.device == device
    )


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_sharded(batches, slots: int, steps: int, mesh: Mesh) -> dict:
    limits = fdo_limits(batches, slots)
    specs = make_specs(limits)
    start = time.perf_counter()
    laid_out = [preprocess(b, specs, slots, allow_id_dropping=True) for b in batches]
    preprocess_s = (time.perf_counter() - start) / len(batches)
    drops = sum(sum(stats.id_drop_counters.values()) for _, stats in laid_out)
    rows = NamedSharding(mesh, PartitionSpec("x"))
    inputs = jax.block_until_ready([jax.device_put(i, rows) for i, _ in laid_out])
    variables = jax.block_until_ready(
        embedding.init_embedding_variables(jax.random.key(0), specs, mesh, num_sc_per_device=slots)
    )

    @functools.partial(jax.jit, donate_argnums=0)
    def step(variables, preprocessed):
        activations = embedding.sparse_dense_matmul(preprocessed, variables, specs, mesh)
        return embedding.apply_gradients(activations, preprocessed, variables, specs, mesh, 0)

    variables, seconds = timed_steps(step, variables, inputs, steps)
    result = dict(
        sharded_step_ms=round(seconds * 1e3, 2),
        sharded_steps_per_s=round(1 / seconds, 3),
        sharded_table_bytes_per_device=per_device_bytes([v.table for v in variables.values()]),
        sharded_preprocess_ms_per_batch=round(preprocess_s * 1e3, 1),
        sharded_max_rss_mib=round(max_rss_mib()),
        partitions_per_device=slots,
        id_drops=drops,
        **limits,
    )
    del variables
    return result


def dense_lookup(tables, ids, samples, batch_size):
    return [
        jax.ops.segment_sum(
            jnp.take(table, i, axis=0, mode="fill", fill_value=0), s, num_segments=batch_size
        )
        for table, i, s in zip(tables, ids, samples, strict=True)
    ]


def dense_inputs(batch, mesh: Mesh):
    """Per table, ids and their sample of each device's part of the batch,
    padded to one static length (-1 ids read a zero row)."""
    per_device = BATCH // DEVICES
    ids, samples = [], []
    for t in range(TABLES):
        ragged = batch[f"f{t}"]
        cuts = ragged.row_splits[::per_device]
        width = int(np.diff(cuts).max())
        block_ids = np.full((DEVICES, width), VOCABULARY, np.int32)
        block_samples = np.zeros((DEVICES, width), np.int32)
        for d in range(DEVICES):
            part = slice(cuts[d], cuts[d + 1])
            lengths = np.diff(ragged.row_splits[d * per_device : (d + 1) * per_device + 1])
            block_ids[d, : cuts[d + 1] - cuts[d]] = ragged.values[part]
            block_samples[d, : cuts[d + 1] - cuts[d]] = np.repeat(np.arange(per_device), lengths)
        ids.append(block_ids)
        samples.append(block_samples)
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    return jax.device_put((ids, samples), sharding)


def run_dense(batches, steps: int, mesh: Mesh) -> dict:
    replicated = NamedSharding(mesh, PartitionSpec())
    optimizer = optax.adagrad(LEARNING_RATE, initial_accumulator_value=INITIAL_ACCUMULATOR)
    init = jax.jit(
        lambda key: [
            embedding.initializers.TruncatedNormal(0.01)(k, (VOCABULARY, DIM))
            for k in jax.random.split(key, TABLES)
        ],
        out_shardings=replicated,
    )
    tables = jax.block_until_ready(init(jax.random.key(0)))
    state = (tables, jax.jit(optimizer.init, out_shardings=replicated)(tables))
    inputs = jax.block_until_ready([dense_inputs(b, mesh) for b in batches])
    per_device = BATCH // DEVICES

    def device_loss(tables, ids, samples):
        activations = dense_lookup(tables, [i[0] for i in ids], [s[0] for s in samples], per_device)
        return sum(0.5 * jnp.sum(a * a) for a in activations)

    def device_grads(tables, ids, samples):
        grads = jax.grad(device_loss)(tables, ids, samples)
        return jax.lax.psum(grads, "x")

    grads_fn = jax.shard_map(
        device_grads,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec("x"), PartitionSpec("x")),
        out_specs=PartitionSpec(),
    )

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, inputs):
        tables, opt_state = state
        grads = grads_fn(tables, *inputs)
        updates, opt_state = optimizer.update(grads, opt_state, tables)
        return optax.apply_updates(tables, updates), opt_state

    state, seconds = timed_steps(step, state, inputs, steps)
    result = dict(
        dense_step_ms=round(seconds * 1e3, 2),
        dense_steps_per_s=round(1 / seconds, 3),
        dense_table_bytes_per_device=per_device_bytes(state[0]),
        dense_max_rss_mib=round(max_rss_mib()),
    )
    del state
    return result


def run_torchrec(batches, steps: int) -> dict:
    """TorchRec's fused row-wise Adagrad EmbeddingBagCollection on CPU, if installed."""
    try:
        import torch
        import torchrec
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    except ImportError:
        return dict(torchrec="not installed")
    collection = FusedEmbeddingBagCollection(
        tables=[
            torchrec.EmbeddingBagConfig(
                name=f"t{t}",
                embedding_dim=DIM,
                num_embeddings=VOCABULARY,
                feature_names=[f"f{t}"],
            )
            for t in range(TABLES)
        ],
        optimizer_type=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        optimizer_kwargs={"lr": LEARNING_RATE},
        device=torch.device("cpu"),
    )
    keys = [f"f{t}" for t in range(TABLES)]
    inputs = [
        torchrec.KeyedJaggedTensor(
            keys=keys,
            values=torch.from_numpy(np.concatenate([b[k].values for k in keys]).astype(np.int64)),
            lengths=torch.from_numpy(np.concatenate([np.diff(b[k].row_splits) for k in keys])),
        )
        for b in batches
    ]
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        pooled = collection(inputs[i % len(inputs)]).values()
        (0.5 * (pooled * pooled).sum()).backward()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[2:])
    return dict(
        torchrec_step_ms=round(seconds * 1e3, 2), torchrec_steps_per_s=round(1 / seconds, 3)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--partitions-per-device", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-dense", action="store_true")
    args = parser.parse_args()

    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("x",))
    batches = make_batches(args.batches, args.seed)
    ids_per_step = int(np.mean([sum(r.values.size for r in b.values()) for b in batches]))
    result = dict(
        benchmark="lookup",
        tables=TABLES,
        vocabulary=VOCABULARY,
        dim=DIM,
        global_batch=BATCH,
        devices=DEVICES,
        ids_per_step=ids_per_step,
        **run_sharded(batches, args.partitions_per_device, args.steps, mesh),
    )
    result["sharded_ids_per_s"] = round(ids_per_step * 1e3 / result["sharded_step_ms"])
    if not args.skip_dense:
        result.update(run_dense(batches, args.steps, mesh))
        result["dense_ids_per_s"] = round(ids_per_step * 1e3 / result["dense_step_ms"])
        result["ratio_vs_dense_baseline"] = round(
            result["dense_step_ms"] / result["sharded_step_ms"], 2
        )
        result["table_memory_ratio_vs_dense"] = round(
            result["sharded_table_bytes_per_device"] / result["dense_table_bytes_per_device"], 4
        )
    torchrec = run_torchrec(batches, args.steps)
    result.update(torchrec)
    if "torchrec_steps_per_s" in torchrec:
        result["ratio_vs_torchrec"] = round(
            torchrec["torchrec_step_ms"] / result["sharded_step_ms"], 2
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
