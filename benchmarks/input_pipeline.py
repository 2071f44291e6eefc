"""Input pipeline throughput and the input stall of a training loop, on the demo config.

The demo config (`configs/demo.yaml`: 10 features on 8 tables, global batch
512, 8 virtual CPU devices x 2 partitions) over a synthetic ArrayRecord
dataset written to a temporary directory, read through the Grain path with a
global shuffle:

  * throughput: preprocessed host batches per second with 0, 1 and 2 Grain
    worker processes (after the first batch, so worker start-up is reported
    apart);
  * input stall: a jitted training-like step on the device batch (a chain of
    matmuls on the dense features plus reductions of every layout array,
    calibrated to `--step-ms`, a stand-in for the demo model's step) runs
    `--steps` times fed (a) from device batches already in memory and (b) by
    the live pipeline (`DeviceIterator` over the Grain iterator with
    `--loop-workers` workers), in the same run. The stall fraction is the
    share of the live loop's time not spent in steps: `1 - t_in_memory /
    t_live`; `ratio_vs_in_memory` is live steps/s over in-memory steps/s.

Every step is waited for, as a loop that reads its loss each step would. The
machine's core count and load average are printed with the figures: worker
processes and the step share its cores. The last line printed is one JSON
object.

    python benchmarks/input_pipeline.py [--batches 20] [--steps 30] [--step-ms 25]
"""

from __future__ import annotations

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import pipelines  # noqa: E402
from sparseflow._config import RunConfig, load_config  # noqa: E402

CONFIG = os.path.join(os.path.dirname(__file__), os.pardir, "configs", "demo.yaml")
WIDTH = 512
DEVICE_BUFFER = 2
WORKER_BUFFER = pipelines.GrainOptions().worker_buffer_size


def make_iterator(
    config: RunConfig, data: list[str], workers: int, epochs: int
) -> pipelines.HostIterator:
    """The Grain path over `data` with the config's specs and preprocessing."""
    preprocess = pipelines.PreprocessConfig(
        feature_specs=config.feature_specs,
        layout=config.synthetic.feature_layout(),
        local_device_count=config.mesh.devices,
        global_device_count=config.mesh.devices,
        num_sc_per_device=config.mesh.partitions_per_device,
        allow_id_dropping=config.preprocessing.allow_id_dropping,
        invalid_id_policy=config.preprocessing.invalid_id_policy,
    )
    batching = pipelines.BatchingConfig(
        global_batch_size=config.global_batch_size, num_epochs=epochs, shuffle_seed=config.seed
    )
    return pipelines.make_grain_iterator(
        data,
        batching=batching,
        preprocess=preprocess,
        options=pipelines.GrainOptions(worker_count=workers),
        log_interval_s=None,
    )


def measure_throughput(config: RunConfig, data: list[str], workers: int, batches: int) -> dict:
    """Host batches/s once the workers run, and the seconds to the first batch."""
    start = time.perf_counter()
    with make_iterator(config, data, workers, epochs=1_000) as iterator:
        next(iterator)
        first = time.perf_counter()
        # Batches the workers buffered while the first one was awaited come free.
        for _ in range(workers * WORKER_BUFFER):
            next(iterator)
        warm = time.perf_counter()
        for _ in range(batches):
            next(iterator)
        seconds = time.perf_counter() - warm
    return {"batches_per_s": batches / seconds, "startup_s": first - start}


@jax.jit
def step(weights: jax.Array, repeats: jax.Array, batch: pipelines.DeviceBatch) -> jax.Array:
    """A training-like step reading every array of a device batch; `repeats` matmuls long."""
    hidden = jnp.tanh(batch.dense @ weights[: batch.dense.shape[1]])
    hidden = jax.lax.fori_loop(0, repeats, lambda _, h: jnp.tanh(h @ weights), hidden)
    layout = jax.tree.leaves(batch.preprocessed)
    touched = sum(jnp.nansum(leaf.astype(jnp.float32)) * 1e-12 for leaf in layout)
    return hidden.sum() + touched + batch.labels.sum()


def calibrate(batch: pipelines.DeviceBatch, weights: jax.Array, step_ms: float) -> tuple:
    """The repeat count that makes a step last about `step_ms`, and the step's seconds."""
    repeats = 1
    while True:
        count, seconds = time_loop(weights, repeats, [batch] * 6, warmup=1)
        per_step = seconds / count
        if per_step * 1e3 >= step_ms or repeats >= 4096:
            return repeats, per_step
        repeats = max(repeats + 1, int(repeats * step_ms / 1e3 / max(per_step, 1e-6)))


def time_loop(weights: jax.Array, repeats: int, batches, *, warmup: int) -> tuple[int, float]:
    """(steps timed, seconds): `warmup` untimed steps, then the rest, each waited for."""
    iterator = iter(batches)
    repeats = jnp.int32(repeats)
    for _ in range(warmup):
        step(weights, repeats, next(iterator)).block_until_ready()
    count, start = 0, time.perf_counter()
    for batch in iterator:
        step(weights, repeats, batch).block_until_ready()
        count += 1
    return count, time.perf_counter() - start


def measure_stall(
    config: RunConfig, data: list[str], mesh: Mesh, workers: int, steps: int, step_ms: float
) -> dict:
    with make_iterator(config, data, 0, epochs=1_000) as host:
        in_memory = [pipelines.to_device_batch(next(host), mesh) for _ in range(min(steps, 8))]
    replicated = NamedSharding(mesh, PartitionSpec())
    key = jax.random.key(config.seed)
    weights = jax.device_put(jax.random.normal(key, (WIDTH, WIDTH)) / WIDTH**0.5, replicated)
    repeats, step_s = calibrate(in_memory[0], weights, step_ms)
    memory_batches = [in_memory[i % len(in_memory)] for i in range(steps + 1)]
    memory_steps, memory_s = time_loop(weights, repeats, memory_batches, warmup=1)
    host = make_iterator(config, data, workers, epochs=1_000)
    with pipelines.DeviceIterator(host, mesh, buffer_size=DEVICE_BUFFER) as live:
        # The batches buffered while the workers start are consumed untimed.
        warmup = 1 + DEVICE_BUFFER + max(workers, 1) * WORKER_BUFFER
        live_batches = (next(live) for _ in range(steps + warmup))
        live_steps, live_s = time_loop(weights, repeats, live_batches, warmup=warmup)
    memory_rate, live_rate = memory_steps / memory_s, live_steps / live_s
    return {
        "step_ms": step_s * 1e3,
        "loop_workers": workers,
        "in_memory_steps_per_s": memory_rate,
        "live_steps_per_s": live_rate,
        "input_stall_fraction": max(0.0, 1 - memory_s / memory_steps * live_steps / live_s),
        "ratio_vs_in_memory": live_rate / memory_rate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--examples", type=int, default=16_384)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-ms", type=float, default=25.0)
    parser.add_argument("--loop-workers", type=int, default=2)
    args = parser.parse_args()

    config = load_config(args.config)
    mesh = Mesh(np.array(jax.devices()[: config.mesh.devices]), ("x",))
    with tempfile.TemporaryDirectory() as directory:
        files = pipelines.write_synthetic_dataset(
            config.synthetic,
            directory,
            num_examples=args.examples,
            seed=config.seed,
            formats=("arrayrecord",),
        )["arrayrecord"]
        throughput = {}
        for workers in (0, 1, 2):
            throughput[workers] = measure_throughput(config, files, workers, args.batches)
            print(f"{workers} workers: {throughput[workers]}", flush=True)
        stall = measure_stall(config, files, mesh, args.loop_workers, args.steps, args.step_ms)
    result = {
        "benchmark": "input_pipeline",
        "config": os.path.relpath(args.config),
        "global_batch": config.global_batch_size,
        "devices": config.mesh.devices,
        "host_batches_per_s": {w: round(t["batches_per_s"], 2) for w, t in throughput.items()},
        "worker_startup_s": {w: round(t["startup_s"], 1) for w, t in throughput.items()},
        **{key: round(value, 3) for key, value in stall.items()},
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
