"""Input pipeline throughput and the input stall of the demo's training loop.

Everything is the demo's (`sparseflow/configs/demo.yaml`: 10 features on 8 tables,
global batch 512, 8 virtual CPU devices x 2 partitions, minibatching on):
its training set is written to a temporary directory (the same records as
`sparseflow demo` writes), the demo's FDO job runs over it, and the tables'
limits and buffers are set from its stats as the demo's training sets them.
Batches go through the Grain path (global shuffle, parse, preprocessing,
device placement).

  * throughput: batches/s of the host iterator with 0, 1 and 2 Grain worker
    processes (at the config's `training.worker_priority`; with idle
    priority they run at full speed here, nothing else wanting the cores),
    after the batches buffered during start-up, and the CPU time
    per batch of this process and of the workers together (on 2 cores the
    input work shares the cores with the training step);
  * input stall: the demo's training loop (`sparseflow._train`: the
    configured SC/TC pipelined step, the loss read back every step) runs
    once per worker count of `--loop-workers`, its steps in blocks of
    `--block-steps`: blocks fed by the live pipeline (`DeviceIterator` over
    the Grain iterator, as the demo builds it) in turn with blocks fed from
    `IN_MEMORY_BATCHES` device batches already in memory, `--pairs` live
    blocks in all after a warm-up block. The load of a shared machine
    drifts by more than the stall within minutes, so loops run one after
    another cannot be compared; blocks of a few hundred ms side by side in
    one loop can. Each live block's stall is `1 - t_in_memory / t_live`, its
    mean step time after the first `BLOCK_SETTLE_STEPS` against the mean of
    the in-memory blocks either side; the figures are the mean, the median
    and a 95% t-interval of the mean over the live blocks.
    `ratio_vs_in_memory` is `1 - the mean stall` for the configured worker
    count (`training.workers`): live steps/s over in-memory steps/s;
  * contention: the same interleaved loop once more per
    `--cpu-load-fractions`, its treated blocks fed from memory while a
    thread sorts with numpy (the GIL released) for that fraction of the
    0-worker pipeline's CPU time per batch (host preprocessing plus device
    placement) for every batch the block asks for. That work shares no lock
    and little memory with the step, so its stall is about the least that
    input work of that CPU time costs the step on this machine: the
    pipeline's stall against it tells the pipeline's own overhead from the
    machine's contention;
  * device-bound stall: the same interleaved loop for the configured worker
    count with the step replaced by a sleep of the measured in-memory step
    time (`device_bound_stall_fraction`). On an accelerator the host's cores
    are free while the device computes; here the step's device threads take
    the cores the input work needs, so this loop tells whether the pipeline
    keeps up with a step that leaves the host alone;
  * against tf.data and jax-tpu-embedding (`_tfdata_jte_peer.py`, the optional
    extra `bench`): the Grain path's host batches against the tf.data
    pipeline a user of jax-tpu-embedding would build over the same records
    (as TFRecord), with the same specs and limits, at each of
    `--peer-workers` Grain workers and tf.data parallel calls, in
    `--peer-rounds` alternated rounds. Both pipelines spread their work over
    threads or processes as they see fit, so batches per CPU second (of this
    process and its workers together) is the figure per core; the median
    over rounds is set against the peer's, and
    `ratio_vs_tfdata_jte_per_core` is the least of these ratios over the
    worker counts. Batches/s per round are printed too.

The machine's core count and load average are printed with the figures: the
workers, the step and anything else running share its cores.
`idle_cpu_ms_per_step` is the CPU time the in-memory steps leave unused
(cores x step time - the process's CPU time), in the configured worker
count's loop: the budget the input work of one batch has to fit in without
taking CPU from the step. The last line printed is one JSON object.

    python benchmarks/input_pipeline.py [--batches 40] [--loop-workers 0,1,2]
        [--pairs 16] [--block-steps 24] [--cpu-load-fractions 0.25,0.5,1]
        [--peer-workers 1,2] [--peer-rounds 5]
"""

from __future__ import annotations

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import queue  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import unittest.mock  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import _tfdata_jte_peer  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import scipy.stats  # noqa: E402
from _alternating import alternating  # noqa: E402

import beam_jobs  # noqa: E402
import pipelines  # noqa: E402
from sparseflow import _fdo_run, _train, shipped_config  # noqa: E402
from sparseflow._metrics import MetricsWriter  # noqa: E402
from sparseflow.config._run_config import RunConfig, load_config  # noqa: E402

CONFIG = shipped_config("demo")
# Steps at the start of each block left out: the workers refill their buffers
# there, or the CPU load still works off the previous block's requests.
BLOCK_SETTLE_STEPS = 6
# More in-memory batches than the caches hold: the in-memory steps read
# their batches from memory, as the live steps do.
IN_MEMORY_BATCHES = 64
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def demo_inputs(config: RunConfig, directory: str) -> tuple[str, list[str], Path]:
    """The demo's training set (ArrayRecord directory, TFRecord files of the
    same records) and FDO stats, written under `directory`."""
    files = pipelines.write_synthetic_dataset(
        config.synthetic.dataset,
        directory,
        num_examples=config.synthetic.examples,
        seed=config.seed,
        num_shards=config.synthetic.shards,
        formats=("arrayrecord", "tfrecord"),
    )
    data = os.path.join(directory, "arrayrecord")
    fdo_dir = Path(directory) / "fdo"
    beam_jobs.run_fdo_job(_fdo_run.job_config(config), [data], str(fdo_dir))
    return data, files["tfrecord"], fdo_dir


def with_training(config: RunConfig, **changes) -> RunConfig:
    """`config` with `changes` to its `training` section."""
    return dataclasses.replace(config, training=dataclasses.replace(config.training, **changes))


def host_iterator(run: _train._Run, data: str, workers: int) -> pipelines.HostIterator:
    """The demo's training iterator without device placement."""
    device_iterator = _train._iterator(
        with_training(run.config, workers=workers),
        run.options,
        run.specs,
        run.mesh,
        data,
        training=True,
    )
    # Placement starts with the device iterator's first next(): never here.
    return device_iterator.host


def children_cpu_s() -> float:
    """CPU seconds used so far by this process's live child processes (the workers)."""
    total = 0
    for child in multiprocessing.active_children():
        try:
            with open(f"/proc/{child.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _CLOCK_TICKS


def measure_throughput(run: _train._Run, data: str, workers: int, batches: int) -> dict:
    """Host batches/s once the workers run, CPU ms per batch, seconds to the first batch."""
    start = time.perf_counter()
    with host_iterator(run, data, workers) as iterator:
        next(iterator)
        first = time.perf_counter()
        # Batches the workers buffered while the first one was awaited come free.
        figures = timed_batches(
            iterator, workers * pipelines.GrainOptions().worker_buffer_size, batches
        )
    return {**figures, "startup_s": first - start}


def timed_batches(iterator: Iterator, skipped: int, batches: int) -> dict:
    """Batches/s and CPU ms per batch (this process and its workers) of
    `batches` batches of `iterator`, after `skipped` batches."""
    for _ in range(skipped):
        next(iterator)
    wall, cpu, children = time.perf_counter(), time.process_time(), children_cpu_s()
    for _ in range(batches):
        next(iterator)
    seconds = time.perf_counter() - wall
    main_ms = (time.process_time() - cpu) / batches * 1e3
    workers_ms = (children_cpu_s() - children) / batches * 1e3
    return {
        "batches_per_s": batches / seconds,
        "cpu_ms_per_batch": main_ms + workers_ms,
        "main_cpu_ms_per_batch": main_ms,
    }


def peer_throughput(
    run: _train._Run, tfrecord_files: list[str], peer_specs: dict, calls: int, batches: int
) -> dict:
    """`timed_batches` of the tf.data + jax-tpu-embedding pipeline at `calls` parallel calls."""
    config = run.config
    pre = config.preprocessing
    iterator = _tfdata_jte_peer.tfdata_jte_batches(
        tfrecord_files,
        config.synthetic.dataset.feature_layout(),
        peer_specs,
        host_batch=config.global_batch_size // jax.process_count(),
        local_devices=run.mesh.local_mesh.size,
        global_devices=run.mesh.size,
        num_sc_per_device=config.mesh.partitions_per_device,
        allow_id_dropping=pre.allow_id_dropping,
        enable_minibatching=pre.enable_minibatching,
        parallel_calls=calls,
        seed=config.seed,
    )
    next(iterator)  # builds the pipeline
    # As for the Grain workers: what was prepared meanwhile comes free.
    return timed_batches(iterator, calls + _tfdata_jte_peer.PREFETCH, batches)


def compare_with_peer(
    run: _train._Run,
    data: str,
    tfrecord_files: list[str],
    workers: list[int],
    rounds: int,
    batches: int,
) -> dict | None:
    """Per worker count: both pipelines' medians and spreads over alternated rounds.

    None when jax-tpu-embedding is not installed.
    """
    peer_specs = _tfdata_jte_peer.peer_feature_specs(
        run.specs, run.mesh.size, run.config.mesh.partitions_per_device
    )
    if peer_specs is None:
        return None
    setups = [(path, count) for count in workers for path in ("ours", "peer")]
    runs: dict[tuple[str, int], list[dict]] = {setup: [] for setup in setups}
    for repeat, (path, count) in alternating(setups, rounds):
        if path == "ours":
            figures = measure_throughput(run, data, count, batches)
        else:
            figures = peer_throughput(run, tfrecord_files, peer_specs, count, batches)
        runs[path, count].append(figures)
        print(f"round {repeat}, {path}, {count} workers: {figures}", flush=True)
    out = {}
    for (path, count), figures in runs.items():
        per_cpu_s = [1e3 / f["cpu_ms_per_batch"] for f in figures]
        rates = [f["batches_per_s"] for f in figures]
        out.setdefault(count, {})[path] = {
            "batches_per_cpu_s": statistics.median(per_cpu_s),
            "batches_per_cpu_s_range": (min(per_cpu_s), max(per_cpu_s)),
            "batches_per_s": statistics.median(rates),
            "batches_per_s_range": (min(rates), max(rates)),
        }
    return out


class _Timed(Iterator):
    """Wraps a batch iterator; notes the time and CPU time of each batch request."""

    def __init__(self, batches: Iterator):
        self._batches = batches
        self.asked: list[tuple[float, float]] = []

    def __next__(self):
        self.asked.append((time.perf_counter(), time.process_time()))
        return next(self._batches)


class CpuLoad:
    """A thread that burns `cpu_ms` of CPU time for every batch asked of `each_batch`.

    The work is numpy sorting of a small array, which releases the GIL: it
    competes with the step for the cores only. Requests queue up when the
    loop asks faster than the thread burns, as batches would with a slow
    pipeline, but the loop never waits for them.
    """

    _SORTED = 4096  # about 0.1 ms a sort: fine enough steps to meet `cpu_ms`

    def __init__(self, cpu_ms: float):
        self._cpu_s = cpu_ms / 1e3
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._burn, name="cpu-load", daemon=True)
        self.burned_s = 0.0
        self.requests = 0

    def __enter__(self) -> CpuLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._requests.put(False)
        self._thread.join()

    def each_batch(self, batches: Iterator) -> Iterator:
        for batch in batches:
            self.requests += 1
            self._requests.put(True)
            yield batch

    def _burn(self) -> None:
        values = np.random.default_rng(0).random(self._SORTED)
        # A request left when the loop ends is dropped: the loop's time is taken.
        while self._requests.get():
            start = time.thread_time()
            while time.thread_time() - start < self._cpu_s:
                np.sort(values)
            self.burned_s += time.thread_time() - start


def interleaved_loop(
    run: _train._Run, treated: Iterator, in_memory: list, pairs: int, block_steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, CPU seconds of this process) of every step of one interleaved loop.

    The loop's steps come in blocks of `block_steps`: a warm-up block fed by
    `treated`, then in-memory and treated blocks in turn, `pairs` treated
    blocks in all, and an in-memory block last. A step runs from one batch
    request to the next: the wait for the batch, the call, and the loss
    read-back.

    Returns:
      `float64[2 * pairs + 2, block_steps]` each, by block and step; NaN for
      the first and the last step, which no request starts or ends.
    """
    blocks = 2 * pairs + 2

    def batches() -> Iterator:
        for step in range(blocks * block_steps):
            if step // block_steps % 2 == 0:
                yield next(treated)
            else:
                yield in_memory[step % len(in_memory)]

    feed = batches()
    first = next(feed)
    if run.pipelined:
        run.pipeline_state = _train._initial_pipeline_state(run, first)
    timed = _Timed(feed)
    _train._loop(run, timed, blocks * block_steps, 0, first, None, MetricsWriter(None))
    gaps = np.diff(np.array(timed.asked), axis=0)
    edge = np.full((1, 2), np.nan)
    steps = np.concatenate([edge, gaps, edge]).reshape(blocks, block_steps, 2)
    return steps[..., 0], steps[..., 1]


def paired_figures(seconds: np.ndarray, cpu: np.ndarray) -> dict:
    """A treatment's figures from its loop's `interleaved_loop` output.

    Each treated block's mean step time after `BLOCK_SETTLE_STEPS` is set
    against the mean of the in-memory blocks either side: its stall is
    `1 - in_memory / treated`. The warm-up block is left out.
    """
    settled = np.s_[:, BLOCK_SETTLE_STEPS:]
    step_ms = np.nanmean(seconds[settled], axis=1) * 1e3
    cpu_ms = np.nanmean(cpu[settled], axis=1) * 1e3
    treated = np.arange(2, len(step_ms) - 1, 2)
    neighbours_ms = (step_ms[treated - 1] + step_ms[treated + 1]) / 2
    stalls = 1 - neighbours_ms / step_ms[treated]
    mean = float(np.mean(stalls))
    half_width = float(
        scipy.stats.t.ppf(0.975, len(stalls) - 1) * np.std(stalls, ddof=1) / np.sqrt(len(stalls))
    )
    return {
        "step_ms": float(np.mean(step_ms[treated])),
        "in_memory_step_ms": float(np.mean(neighbours_ms)),
        "cpu_ms_per_step": float(np.mean(cpu_ms[treated])),
        "in_memory_cpu_ms_per_step": float(np.mean(cpu_ms[1::2])),
        "input_stall_fraction": mean,
        "input_stall_fraction_median": float(np.median(stalls)),
        "input_stall_fraction_ci95": (mean - half_width, mean + half_width),
    }


def measure_stall(
    run: _train._Run,
    data: str,
    loop_workers: list[int],
    pairs: int,
    block_steps: int,
    host_cpu_ms: float,
    load_fractions: list[str],
) -> tuple[dict, float]:
    """Per treatment (a worker count, a load fraction, or "device_bound"): its `paired_figures`.

    Also returns the placement's CPU ms per batch.

    Args:
      host_cpu_ms: the host pipeline's CPU ms per batch with 0 workers.
      load_fractions: per loaded treatment (`CpuLoad`), its CPU ms per batch
        as a fraction (text) of `host_cpu_ms` plus the placement's.
    """
    with host_iterator(run, data, 0) as host:
        host_batches = [next(host) for _ in range(IN_MEMORY_BATCHES)]
    in_memory = [pipelines.to_device_batch(batch, run.mesh) for batch in host_batches]
    # Timed once placement is set up: the first placements cost more.
    cpu = time.process_time()
    for batch in host_batches:
        pipelines.to_device_batch(batch, run.mesh)
    placement_ms = (time.process_time() - cpu) / len(host_batches) * 1e3
    cpu_loads = [(text, float(text) * (host_cpu_ms + placement_ms)) for text in load_fractions]
    loop = functools.partial(interleaved_loop, run, in_memory=in_memory, block_steps=block_steps)
    # Compiles, then steps from memory only: the step time the sleep stands for.
    seconds, _ = loop(itertools.cycle(in_memory), pairs=1)
    step_s = float(np.nanmedian(seconds[1:, BLOCK_SETTLE_STEPS:]))

    def live(workers: int) -> dict:
        epochs = epochs_for(run.config, (pairs + 1) * block_steps)
        config = with_training(run.config, workers=workers, epochs=epochs)
        with _train._iterator(
            config, run.options, run.specs, run.mesh, data, training=True
        ) as batches:
            return paired_figures(*loop(batches, pairs=pairs))

    figures = {}
    for workers in loop_workers:
        figures[workers] = live(workers)
        print(f"{workers} workers in the loop: {figures[workers]}", flush=True)
    for name, cpu_ms in cpu_loads:
        with CpuLoad(cpu_ms) as load:
            treated = load.each_batch(itertools.cycle(in_memory))
            figures[name] = paired_figures(*loop(treated, pairs=pairs))
        figures[name]["burned_cpu_ms_per_batch"] = load.burned_s / load.requests * 1e3
        print(f"CPU load {name}: {figures[name]}", flush=True)
    if run.pipelined:
        with step_replaced_by_sleep(step_s):
            figures["device_bound"] = {
                **live(run.config.training.workers),
                "sleep_ms": step_s * 1e3,
            }
        print(f"device-bound: {figures['device_bound']}", flush=True)
    else:
        print("device-bound loop skipped: it replaces the pipelined step only", flush=True)
    return figures, placement_ms


@contextlib.contextmanager
def step_replaced_by_sleep(step_s: float):
    """The training loop's pipelined step call sleeps `step_s` instead, as a
    host waits for an accelerator, the host's cores left free."""

    def sleep(*args) -> None:
        time.sleep(step_s)

    with unittest.mock.patch.object(_train, "_pipelined_call", sleep):
        yield


def epochs_for(config: RunConfig, batches: int) -> int:
    """Epochs of `config`'s dataset (at least its own) for `batches` training batches."""
    per_epoch = config.synthetic.examples // config.global_batch_size
    return max(config.training.epochs, math.ceil(batches / per_epoch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--throughput-workers", default="0,1,2")
    parser.add_argument("--loop-workers", default="0,1,2")
    parser.add_argument(
        "--pairs",
        type=int,
        default=16,
        help="treated blocks per loop, each set against the in-memory blocks either side",
    )
    parser.add_argument("--block-steps", type=int, default=24)
    parser.add_argument(
        "--peer-workers",
        default="1,2",
        help="Grain workers and tf.data parallel calls compared with tf.data + "
        "jax-tpu-embedding; empty: no comparison",
    )
    parser.add_argument("--peer-rounds", type=int, default=5)
    parser.add_argument(
        "--cpu-load-fractions",
        default="0.25,0.5,1",
        help="CPU loads of the contention loops, as fractions of the 0-worker pipeline's CPU "
        "ms per batch (host preprocessing plus placement); empty: no contention loops. "
        "Needs 0 in --throughput-workers.",
    )
    args = parser.parse_args()
    if args.pairs < 2:
        parser.error(f"--pairs must be at least 2 (for an interval), got {args.pairs}.")
    if args.block_steps < BLOCK_SETTLE_STEPS + 2:
        parser.error(
            f"--block-steps must be at least {BLOCK_SETTLE_STEPS + 2} "
            f"(settling steps + 2), got {args.block_steps}."
        )
    fractions = list(dict.fromkeys(text for text in args.cpu_load_fractions.split(",") if text))
    if not all(_positive_number(text) for text in fractions):
        parser.error(f"--cpu-load-fractions must be positive numbers, got {fractions}.")
    if fractions and 0 not in _counts(args.throughput_workers):
        parser.error("--cpu-load-fractions needs 0 in --throughput-workers.")
    config = load_config(args.config)
    with tempfile.TemporaryDirectory() as directory:
        data, tfrecord_files, fdo_dir = demo_inputs(config, directory)
        options = _train.TrainOptions(data=data, fdo_dir=fdo_dir, progress=False)
        run = _train._Run(config, options, _train.make_mesh(config.mesh.devices))
        throughput = {}
        for workers in _counts(args.throughput_workers):
            throughput[workers] = measure_throughput(run, data, workers, args.batches)
            print(f"{workers} workers: {throughput[workers]}", flush=True)
        peer_workers = _counts(args.peer_workers) if args.peer_workers else []
        against_peer = peer_workers and compare_with_peer(
            run, data, tfrecord_files, peer_workers, args.peer_rounds, args.batches
        )
        # Placement is measured with the in-memory batches: scale the loads there.
        host_ms = throughput[0]["cpu_ms_per_batch"] if fractions else 0.0
        loops, placement_ms = measure_stall(
            run,
            data,
            _counts(args.loop_workers),
            args.pairs,
            args.block_steps,
            host_ms,
            fractions,
        )
    loads = {fraction: loops.pop(fraction) for fraction in fractions}
    device_bound = loops.pop("device_bound", None)
    configured = config.training.workers
    headline = loops.get(configured, next(iter(loops.values())))
    result = {
        "benchmark": "input_pipeline",
        "config": os.path.relpath(args.config),
        "global_batch": config.global_batch_size,
        "devices": config.mesh.devices,
        "limits": "fdo",
        "pairs": args.pairs,
        "block_steps": args.block_steps,
        "host_batches_per_s": _rounded(throughput, "batches_per_s", 1),
        "input_cpu_ms_per_batch": _rounded(throughput, "cpu_ms_per_batch", 2),
        "worker_startup_s": _rounded(throughput, "startup_s", 1),
        "pipelined": run.pipelined,
        "in_memory_step_ms": _rounded(loops, "in_memory_step_ms", 1),
        "live_step_ms": _rounded(loops, "step_ms", 1),
        "in_memory_cpu_ms_per_step": _rounded(loops, "in_memory_cpu_ms_per_step", 1),
        "idle_cpu_ms_per_step": round(idle_cpu_ms_per_step(headline), 1),
        "live_cpu_ms_per_step": _rounded(loops, "cpu_ms_per_step", 1),
        "input_stall_fraction_by_workers": _rounded(loops, "input_stall_fraction", 3),
        "input_stall_median_by_workers": _rounded(loops, "input_stall_fraction_median", 3),
        "input_stall_ci95_by_workers": _rounded(loops, "input_stall_fraction_ci95", 3),
        "configured_workers": configured,
        "worker_priority": config.training.worker_priority.value,
        "input_stall_fraction": round(headline["input_stall_fraction"], 3),
        "ratio_vs_in_memory": round(1 - headline["input_stall_fraction"], 3),
        "placement_cpu_ms_per_batch": round(placement_ms, 2),
        "cpu_load_ms_per_batch": _rounded(loads, "burned_cpu_ms_per_batch", 2),
        "cpu_load_stall_fraction": _rounded(loads, "input_stall_fraction", 3),
        "cpu_load_stall_ci95": _rounded(loads, "input_stall_fraction_ci95", 3),
        **device_bound_figures(device_bound),
        **peer_figures(against_peer, peer_workers),
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


def device_bound_figures(figures: dict | None) -> dict:
    """The JSON keys of the loop whose step is a sleep (empty if it did not run)."""
    if figures is None:
        return {}
    return {
        "device_bound_sleep_ms": round(figures["sleep_ms"], 1),
        "device_bound_in_memory_step_ms": round(figures["in_memory_step_ms"], 1),
        "device_bound_stall_fraction": round(figures["input_stall_fraction"], 3),
        "device_bound_stall_median": round(figures["input_stall_fraction_median"], 3),
        "device_bound_stall_ci95": [round(b, 3) for b in figures["input_stall_fraction_ci95"]],
    }


def peer_figures(against_peer: dict | None, workers: list[int]) -> dict:
    """The JSON keys of the comparison with tf.data + jax-tpu-embedding."""
    if not workers:
        return {}
    if against_peer is None:
        return {"tfdata_jte": "not installed (make bench-env)"}
    ratios = {
        count: paths["ours"]["batches_per_cpu_s"] / paths["peer"]["batches_per_cpu_s"]
        for count, paths in against_peer.items()
    }
    by_path = {
        path: {count: paths[path] for count, paths in against_peer.items()}
        for path in ("ours", "peer")
    }
    return {
        "grain_batches_per_cpu_s": _rounded(by_path["ours"], "batches_per_cpu_s", 2),
        "grain_batches_per_cpu_s_range": _rounded(by_path["ours"], "batches_per_cpu_s_range", 2),
        "tfdata_jte_batches_per_cpu_s": _rounded(by_path["peer"], "batches_per_cpu_s", 2),
        "tfdata_jte_batches_per_cpu_s_range": _rounded(
            by_path["peer"], "batches_per_cpu_s_range", 2
        ),
        "grain_batches_per_s": _rounded(by_path["ours"], "batches_per_s", 1),
        "tfdata_jte_batches_per_s": _rounded(by_path["peer"], "batches_per_s", 1),
        "ratio_vs_tfdata_jte_per_core_by_workers": {
            count: round(ratio, 3) for count, ratio in ratios.items()
        },
        "ratio_vs_tfdata_jte_per_core": round(min(ratios.values()), 3),
    }


def idle_cpu_ms_per_step(figures: dict) -> float:
    """CPU ms per step the in-memory steps of a loop leave unused on this machine's cores.

    The input work of a batch fits beside the step without slowing it only
    if it needs less than this, and in the gaps the step leaves: compare it
    with `input_cpu_ms_per_batch`.
    """
    step_ms, cpu_ms = figures["in_memory_step_ms"], figures["in_memory_cpu_ms_per_step"]
    return (os.cpu_count() or 1) * step_ms - cpu_ms


def _counts(text: str) -> list[int]:
    return [int(count) for count in text.split(",")]


def _positive_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def _rounded(figures: dict, key: str, digits: int) -> dict:
    """`{name: figure}` for `key` of each entry of `figures`, a bound pair as a list."""

    def rounded(value):
        if isinstance(value, tuple):
            return [round(bound, digits) for bound in value]
        return round(value, digits)

    return {name: rounded(values[key]) for name, values in figures.items()}


if __name__ == "__main__":
    main()
