"""Input pipeline throughput and the input stall of the demo's training loop.

Everything is the demo's (`configs/demo.yaml`: 10 features on 8 tables,
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
    `--steps` steps fed (a) from device batches already in memory and (b) by
    the live pipeline (`DeviceIterator` over the Grain iterator, as the demo
    builds it) with each worker count of `--loop-workers`, in the same run,
    `--repeats` times each, in the order in-memory, 0, 1, 2 workers, then
    2, 1, 0, in-memory, ...: the load of a shared machine drifts within a
    run, and alternating the loops spreads the drift over all of them. The
    stall fraction is the share of the live loop's time not explained by the
    steps: `1 - t_in_memory / t_live`, each time the mean over the repeats
    and over the steps after the first `WARMUP_STEPS` of each loop
    (compilation, worker start-up).
    `ratio_vs_in_memory` is live steps/s over in-memory steps/s for the
    configured worker count (`training.workers`);
  * contention: the in-memory loop once more per `--cpu-load-fractions`,
    alternated with the others, while a thread sorts with numpy (the GIL
    released) for that fraction of the 0-worker pipeline's CPU time per
    batch (host preprocessing plus device placement) for every batch the
    loop asks for. That work shares no lock and little memory with the
    step, so its stall is about the least that input work of that CPU time
    costs the step on this machine: the pipeline's stall against it tells
    the pipeline's own overhead from the machine's contention.

The machine's core count and load average are printed with the figures: the
workers, the step and anything else running share its cores.
`idle_cpu_ms_per_step` is the CPU time the in-memory loop leaves unused per
step (cores x step time - the process's CPU time): the budget the input
work of one batch has to fit in without taking CPU from the step. The last line
printed is one JSON object.

    python benchmarks/input_pipeline.py [--batches 40] [--steps 60] [--loop-workers 0,1,2]
        [--repeats 2] [--cpu-load-fractions 0.25,0.5,1]
"""

from __future__ import annotations

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import queue  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from _alternating import add_repeats_argument, alternating  # noqa: E402

import beam_jobs  # noqa: E402
import pipelines  # noqa: E402
from sparseflow import _fdo_command, _train  # noqa: E402
from sparseflow._config import RunConfig, load_config  # noqa: E402
from sparseflow._metrics import MetricsWriter  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
WARMUP_STEPS = 4
IN_MEMORY_BATCHES = 8
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def demo_inputs(config: RunConfig, directory: str) -> tuple[str, Path]:
    """The demo's training set and FDO stats, written under `directory`."""
    pipelines.write_synthetic_dataset(
        config.synthetic,
        directory,
        num_examples=config.dataset.examples,
        seed=config.seed,
        num_shards=config.dataset.shards,
        formats=("arrayrecord",),
    )
    data = os.path.join(directory, "arrayrecord")
    fdo_dir = Path(directory) / "fdo"
    beam_jobs.run_fdo_job(_fdo_command.job_config(config), [data], str(fdo_dir))
    return data, fdo_dir


def with_workers(config: RunConfig, workers: int) -> RunConfig:
    return dataclasses.replace(
        config, training=dataclasses.replace(config.training, workers=workers)
    )


def host_iterator(run: _train._Run, data: str, workers: int) -> pipelines.HostIterator:
    """The demo's training iterator without device placement."""
    device_iterator = _train._iterator(
        with_workers(run.config, workers), run.options, run.specs, run.mesh, data, training=True
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


def time_loop(run: _train._Run, batches: Iterator, steps: int) -> tuple[float, float]:
    """(seconds, CPU seconds of this process) per step of the demo loop after the warm-up.

    A step runs from one batch request to the next: the wait for the batch,
    the call, and the loss read-back. The CPU time includes the step's own
    (XLA runs in this process) and the input work done in this process.
    """
    first = next(batches)
    if run.pipelined:
        run.pipeline_state = _train._initial_pipeline_state(run, first)
    timed = _Timed(batches)
    _train._loop(run, timed, steps, 0, first, None, MetricsWriter(None))
    (start, start_cpu), *rest = timed.asked[WARMUP_STEPS - 1 :]
    end, end_cpu = rest[-1]
    return (end - start) / len(rest), (end_cpu - start_cpu) / len(rest)


def measure_stall(
    run: _train._Run,
    data: str,
    loop_workers: list[int],
    steps: int,
    repeats: int,
    host_cpu_ms: float,
    load_fractions: list[str],
) -> dict:
    """Per loop ("in_memory", a worker count, or a load fraction): its figures.

    Args:
      host_cpu_ms: the host pipeline's CPU ms per batch with 0 workers.
      load_fractions: per loaded in-memory loop (`CpuLoad`), its CPU ms per
        batch as a fraction (text) of `host_cpu_ms` plus the placement's.
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

    def memory_batches(count: int) -> Iterator:
        return (in_memory[i % len(in_memory)] for i in range(count))

    def in_memory_loop() -> tuple[float, float]:
        return time_loop(run, memory_batches(steps), steps)

    def live_loop(workers: int) -> tuple[float, float]:
        config = with_workers(run.config, workers)
        with _train._iterator(
            config, run.options, run.specs, run.mesh, data, training=True
        ) as batches:
            return time_loop(run, batches, steps)

    burned: dict[str, list[float]] = {name: [] for name, _ in cpu_loads}

    def loaded_loop(name: str, cpu_ms: float) -> tuple[float, float]:
        with CpuLoad(cpu_ms) as load:
            timed = time_loop(run, load.each_batch(memory_batches(steps)), steps)
        burned[name].append(load.burned_s / load.requests * 1e3)
        return timed

    time_loop(run, memory_batches(WARMUP_STEPS + 2), WARMUP_STEPS + 2)  # compiles
    loops = (
        [("in_memory", in_memory_loop)]
        + [(workers, functools.partial(live_loop, workers)) for workers in loop_workers]
        + [(name, functools.partial(loaded_loop, name, ms)) for name, ms in cpu_loads]
    )
    timed: dict = {name: [] for name, _ in loops}
    for repeat, (name, loop) in alternating(loops, repeats):
        timed[name].append(loop())
        print(f"loop {name} (repeat {repeat}): {timed[name][-1]}", flush=True)
    figures = {}
    for name, times in timed.items():
        step_s, cpu_s = (statistics.mean(column) for column in zip(*times, strict=True))
        figures[name] = {"step_ms": step_s * 1e3, "cpu_ms_per_step": cpu_s * 1e3}
    in_memory_ms = figures["in_memory"]["step_ms"]
    for name in timed.keys() - {"in_memory"}:
        figures[name]["input_stall_fraction"] = max(
            0.0, 1 - in_memory_ms / figures[name]["step_ms"]
        )
    for name, values in burned.items():
        figures[name]["burned_cpu_ms_per_batch"] = statistics.mean(values)
    figures["in_memory"]["placement_cpu_ms_per_batch"] = placement_ms
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--throughput-workers", default="0,1,2")
    parser.add_argument("--loop-workers", default="0,1,2")
    parser.add_argument(
        "--cpu-load-fractions",
        default="0.25,0.5,1",
        help="CPU loads of the contention loops, as fractions of the 0-worker pipeline's CPU "
        "ms per batch (host preprocessing plus placement); empty: no contention loops. "
        "Needs 0 in --throughput-workers.",
    )
    add_repeats_argument(parser)
    args = parser.parse_args()
    if args.steps < WARMUP_STEPS + 2:
        parser.error(f"--steps must be at least {WARMUP_STEPS + 2} (warm-up steps + 2).")
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
        loops = measure_stall(
            run,
            data,
            _counts(args.loop_workers),
            args.steps,
            args.repeats,
            host_ms,
            fractions,
        )
    in_memory = loops.pop("in_memory")
    loads = {fraction: loops.pop(fraction) for fraction in fractions}
    configured = config.training.workers
    headline = loops.get(configured, next(iter(loops.values())))
    result = {
        "benchmark": "input_pipeline",
        "config": os.path.relpath(args.config),
        "global_batch": config.global_batch_size,
        "devices": config.mesh.devices,
        "limits": "fdo",
        "repeats": args.repeats,
        "host_batches_per_s": _rounded(throughput, "batches_per_s", 1),
        "input_cpu_ms_per_batch": _rounded(throughput, "cpu_ms_per_batch", 2),
        "worker_startup_s": _rounded(throughput, "startup_s", 1),
        "pipelined": run.pipelined,
        "in_memory_step_ms": round(in_memory["step_ms"], 1),
        "live_step_ms": _rounded(loops, "step_ms", 1),
        "in_memory_cpu_ms_per_step": round(in_memory["cpu_ms_per_step"], 1),
        "idle_cpu_ms_per_step": round(idle_cpu_ms_per_step(in_memory), 1),
        "live_cpu_ms_per_step": _rounded(loops, "cpu_ms_per_step", 1),
        "input_stall_fraction_by_workers": _rounded(loops, "input_stall_fraction", 3),
        "configured_workers": configured,
        "worker_priority": config.training.worker_priority.value,
        "input_stall_fraction": round(headline["input_stall_fraction"], 3),
        "ratio_vs_in_memory": round(in_memory["step_ms"] / headline["step_ms"], 3),
        "placement_cpu_ms_per_batch": round(in_memory["placement_cpu_ms_per_batch"], 2),
        "cpu_load_ms_per_batch": _rounded(loads, "burned_cpu_ms_per_batch", 2),
        "cpu_load_step_ms": _rounded(loads, "step_ms", 1),
        "cpu_load_stall_fraction": _rounded(loads, "input_stall_fraction", 3),
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


def idle_cpu_ms_per_step(in_memory: dict) -> float:
    """CPU ms per step the in-memory loop leaves unused on this machine's cores.

    The input work of a batch fits beside the step without slowing it only
    if it needs less than this, and in the gaps the step leaves: compare it
    with `input_cpu_ms_per_batch`.
    """
    return (os.cpu_count() or 1) * in_memory["step_ms"] - in_memory["cpu_ms_per_step"]


def _counts(text: str) -> list[int]:
    return [int(count) for count in text.split(",")]


def _positive_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def _rounded(figures: dict, key: str, digits: int) -> dict:
    return {workers: round(values[key], digits) for workers, values in figures.items()}


if __name__ == "__main__":
    main()
