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
    machine's contention.

The machine's core count and load average are printed with the figures: the
workers, the step and anything else running share its cores.
`idle_cpu_ms_per_step` is the CPU time the in-memory steps leave unused
(cores x step time - the process's CPU time), in the configured worker
count's loop: the budget the input work of one batch has to fit in without
taking CPU from the step. The last line printed is one JSON object.

    python benchmarks/input_pipeline.py [--batches 40] [--loop-workers 0,1,2]
        [--pairs 16] [--block-steps 24] [--cpu-load-fractions 0.25,0.5,1]
"""

from __future__ import annotations

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import queue  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import scipy.stats  # noqa: E402

import beam_jobs  # noqa: E402
import pipelines  # noqa: E402
from sparseflow import _fdo_command, _train, shipped_config  # noqa: E402
from sparseflow._config import RunConfig, load_config  # noqa: E402
from sparseflow._metrics import MetricsWriter  # noqa: E402

CONFIG = shipped_config("demo")
# Steps at the start of each block left out: the workers refill their buffers
# there, or the CPU load still works off the previous block's requests.
BLOCK_SETTLE_STEPS = 6
# More in-memory batches than the caches hold: the in-memory steps read
# their batches from memory, as the live steps do.
IN_MEMORY_BATCHES = 64
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def demo_inputs(config: RunConfig, directory: str) -> tuple[str, Path]:
    """The demo's training set and FDO stats, written under `directory`."""
    pipelines.write_synthetic_dataset(
        config.synthetic.dataset,
        directory,
        num_examples=config.synthetic.examples,
        seed=config.seed,
        num_shards=config.synthetic.shards,
        formats=("arrayrecord",),
    )
    data = os.path.join(directory, "arrayrecord")
    fdo_dir = Path(directory) / "fdo"
    beam_jobs.run_fdo_job(_fdo_command.job_config(config), [data], str(fdo_dir))
    return data, fdo_dir


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
        for _ in range(workers * pipelines.GrainOptions().worker_buffer_size):
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
        "startup_s": first - start,
    }


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
    """Per treatment (a worker count or a load fraction): its `paired_figures`.

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
    loop(itertools.cycle(in_memory), pairs=0)  # compiles
    figures = {}
    for workers in loop_workers:
        epochs = epochs_for(run.config, (pairs + 1) * block_steps)
        config = with_training(run.config, workers=workers, epochs=epochs)
        with _train._iterator(
            config, run.options, run.specs, run.mesh, data, training=True
        ) as batches:
            figures[workers] = paired_figures(*loop(batches, pairs=pairs))
        print(f"{workers} workers in the loop: {figures[workers]}", flush=True)
    for name, cpu_ms in cpu_loads:
        with CpuLoad(cpu_ms) as load:
            treated = load.each_batch(itertools.cycle(in_memory))
            figures[name] = paired_figures(*loop(treated, pairs=pairs))
        figures[name]["burned_cpu_ms_per_batch"] = load.burned_s / load.requests * 1e3
        print(f"CPU load {name}: {figures[name]}", flush=True)
    return figures, placement_ms


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
        data, fdo_dir = demo_inputs(config, directory)
        options = _train.TrainOptions(data=data, fdo_dir=fdo_dir, progress=False)
        run = _train._Run(config, options, _train.make_mesh())
        throughput = {}
        for workers in _counts(args.throughput_workers):
            throughput[workers] = measure_throughput(run, data, workers, args.batches)
            print(f"{workers} workers: {throughput[workers]}", flush=True)
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
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


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
