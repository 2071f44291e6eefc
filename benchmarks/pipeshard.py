"""Pipeshard schedules against one data-parallel jit, on the same 8 CPU devices.

Model: an MLP of `--layers` tanh layers of width `--width` with a boundary
marker between layers, mean squared error, Adam. Baseline: the same train
step with `jax.value_and_grad`, jitted once over all 8 devices (batch
sharded, parameters replicated). Each pipeshard configuration (stages x
microbatches x schedule: GPipe, 1F1B, interleaved 1F1B with 2 virtual
stages, zero bubble ZB-H1) reports:

  * step time (median over `--steps` steps, after a warm-up step) and
    throughput ratio against the baseline;
  * driver overhead per scheduled task: host time the driver spends on a
    task (gathering and moving its inputs, bookkeeping), excluding waits
    for other programs and the runtime's execute call, which is reported
    apart as the launch time (XLA:CPU runs small programs inline there);
    (target: below 0.3 ms);
  * bubble fraction: of the recorded clocks, and of the timeline rebuilt
    from measured task times (a run with `time_tasks=True`), against the
    schedule's theory: (p - 1) / (m + p - 1) for GPipe and 1F1B,
    (p - 1) / (v m + p - 1) for interleaved, (p - 1) / (3 m + p - 1) for
    ZB-H1, about a third of 1F1B's (`bubble_vs_1f1b`);
  * peak activations held per stage, in bytes: the values a stage's
    forward of a microbatch keeps for its backward, from the forward to
    the last backward task (W under zero bubble), replayed in the
    recorded dispatch order (target: 1F1B and interleaved at most GPipe's
    when m >= 2p);

On CPU every device is a thread of the same few cores, so pipelining cannot
beat data parallelism here: stages cannot run truly in parallel when the
cores are already busy, and XLA:CPU programs with collectives are run one
at a time (see `parallel.pipeshard._runtime`). The figures measure the
driver, the schedule and the cost of the split, not a speed-up.

    python benchmarks/pipeshard.py [--steps 10] [--plot schedule.png]

The last line printed is one JSON object.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from parallel import pipeshard  # noqa: E402

CONFIGS = [  # (stages, microbatches, schedule); the first is the headline.
    (4, 8, "1f1b"),
    (4, 8, "gpipe"),
    (4, 8, "interleaved_1f1b"),
    (4, 8, "zero_bubble"),
    (2, 4, "gpipe"),
    (2, 8, "1f1b"),
    (2, 8, "interleaved_1f1b"),
    (2, 8, "zero_bubble"),
]
VIRTUAL_STAGES = 2  # of the interleaved configurations
OVERHEAD_TARGET_MS = 0.3


class State(NamedTuple):
    params: dict
    opt_state: optax.OptState


def make_loss(num_layers: int):
    def loss(params, batch):
        h = batch["x"]
        for i in range(num_layers):
            h = jnp.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
            if i < num_layers - 1:
                pipeshard.mark_pipeline_boundary()
        return jnp.mean((h - batch["y"]) ** 2)

    return loss


def make_step(value_and_grad, loss, tx):
    def step(state, batch):
        value, grads = value_and_grad(loss)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return State(optax.apply_updates(state.params, updates), opt_state), value

    return step


def make_inputs(args, tx):
    rng = np.random.default_rng(0)
    w = args.width
    params = {
        f"w{i}": jnp.asarray(rng.normal(size=(w, w)) / np.sqrt(w), jnp.float32)
        for i in range(args.layers)
    }
    params |= {f"b{i}": jnp.zeros((w,), jnp.float32) for i in range(args.layers)}
    batch = {
        "x": rng.normal(size=(args.batch, w)).astype(np.float32),
        "y": rng.normal(size=(args.batch, w)).astype(np.float32),
    }
    return State(params, tx.init(params)), batch


def time_steps(step, state, batch, steps: int) -> tuple[float, State]:
    state, loss = step(state, batch)  # warm-up (and compilation)
    jax.block_until_ready((state, loss))
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        state, loss = step(state, batch)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - began)
    return statistics.median(times), state


def baseline(args, loss, tx, state, batch) -> float:
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    sharded = NamedSharding(mesh, PartitionSpec("data"))
    step = jax.jit(
        make_step(jax.value_and_grad, loss, tx),
        in_shardings=(replicated, sharded),
        out_shardings=(replicated, replicated),
    )
    seconds, _ = time_steps(step, state, batch, args.steps)
    return seconds


def activation_bytes(executable) -> dict[int, int]:
    """Per stage (chunk), bytes its forward of one microbatch keeps for its backward.

    The values the stage's F piece takes from other stages or makes itself
    that its B or W piece reads: they live from the forward to the last
    backward task of that microbatch.
    """
    held = {}
    for piece in executable.program.pieces:
        if piece.kind is not pipeshard.TaskKind.FORWARD:
            continue
        later = {
            v
            for p in executable.program.pieces
            if p.stage == piece.stage and p.kind is not pipeshard.TaskKind.FORWARD
            for v in p.transfer_inputs
        }
        kept = [v for v in (*piece.transfer_inputs, *piece.transfer_outputs) if v in later]
        held[piece.stage] = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in kept)
    return held


def peak_activation_bytes(executable, record) -> list[int]:
    """Per device group, the most activation bytes held at once over the recorded run."""
    sizes = activation_bytes(executable)
    tasks = [r.task for r in sorted(record.records, key=lambda r: r.clock)]
    has_weight = {(t.stage, t.microbatch) for t in tasks if t.kind is pipeshard.TaskKind.WEIGHT}
    held, peak = [0] * record.num_stages, [0] * record.num_stages
    for task in tasks:
        group, size = task.stage % record.num_stages, sizes.get(task.stage, 0)
        if task.kind is pipeshard.TaskKind.FORWARD:
            held[group] += size
        elif (
            task.kind is pipeshard.TaskKind.WEIGHT
            or (task.stage, task.microbatch) not in has_weight
        ):
            held[group] -= size
        peak[group] = max(peak[group], held[group])
    return peak


def run_config(args, loss, tx, state, batch, stages, m, schedule) -> dict:
    interleaved = schedule == "interleaved_1f1b"
    method = pipeshard.PipeshardParallel(
        num_micro_batches=m,
        stage_option=pipeshard.UniformStageOption(num_stages=stages),
        pipeline_schedule=schedule,
        virtual_stages=VIRTUAL_STAGES if interleaved else 1,
    )
    step = pipeshard.parallelize(make_step(pipeshard.value_and_grad, loss, tx), method=method)
    began = time.perf_counter()
    step.get_executable(state, batch)
    compile_seconds = time.perf_counter() - began
    seconds, _ = time_steps(step, state, batch, args.steps)
    records = step.last_schedule.records
    overhead = [r.overhead for r in records]
    launch = [r.launch for r in records]
    timed = step.with_runtime_options(time_tasks=True)
    for _ in range(3):
        timed(state, batch)
    record = timed.last_schedule
    if args.plot:
        root, ext = os.path.splitext(args.plot)
        name = f"{root}_p{stages}_m{m}_{schedule}"
        timed.plot_schedule(f"{name}{ext}", timing="clock")
        timed.plot_schedule(f"{name}_measured{ext}", timing="measured")
    theory = record.theoretical_bubble_fraction()
    clock_bubble = record.clock_bubble_fraction()
    # Each schedule's tasks take equal times in its own clocks (a ZB task
    # is a third of a 1F1B backward, a chunk's a v-th), so clock fractions
    # are time fractions and compare across schedules.
    one_f_one_b = (stages - 1) / (m + stages - 1)
    overhead_ms = 1e3 * statistics.mean(overhead)
    return {
        "stages": stages,
        "microbatches": m,
        "schedule": schedule,
        "virtual_stages": record.virtual_stages,
        "compile_s": round(compile_seconds, 2),
        "step_ms": round(1e3 * seconds, 3),
        "tasks": len(records),
        "driver_overhead_ms_per_task": round(overhead_ms, 4),
        "driver_overhead_within_target": overhead_ms < OVERHEAD_TARGET_MS,
        "driver_overhead_ms_per_task_p90": round(1e3 * float(np.quantile(overhead, 0.9)), 4),
        "launch_ms_per_task": round(1e3 * statistics.mean(launch), 4),
        "collective_wait_ms_per_step": round(1e3 * sum(r.wait for r in records), 3),
        "bubble_clock": round(clock_bubble, 4),
        "bubble_measured": round(record.measured_bubble_fraction(), 4),
        "bubble_theory": round(theory, 4),
        "bubble_vs_1f1b": round(clock_bubble / one_f_one_b, 4),
        "peak_activation_bytes_per_stage": peak_activation_bytes(
            timed.get_executable(state, batch), record
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--plot", help="write the headline schedule's timeline PNG here")
    args = parser.parse_args()

    tx = optax.adam(1e-3)
    loss = make_loss(args.layers)
    state, batch = make_inputs(args, tx)
    base_seconds = baseline(args, loss, tx, state, batch)
    print(f"single jit over {jax.device_count()} devices: {1e3 * base_seconds:.2f} ms/step")
    results = []
    for stages, m, schedule in CONFIGS:
        result = run_config(args, loss, tx, state, batch, stages, m, schedule)
        result["ratio_vs_single_jit"] = round(base_seconds / (result["step_ms"] / 1e3), 4)
        results.append(result)
        print(
            f"p={stages} m={m} {schedule:16s}: {result['step_ms']:.2f} ms/step "
            f"(x{result['ratio_vs_single_jit']:.2f} throughput), driver "
            f"{result['driver_overhead_ms_per_task']:.3f} ms/task, bubble clock "
            f"{result['bubble_clock']:.3f} measured {result['bubble_measured']:.3f} theory "
            f"{result['bubble_theory']:.3f}, peak activations "
            f"{result['peak_activation_bytes_per_stage']} B"
        )
    _compare_activations(results)
    headline = results[0]
    print(
        json.dumps(
            {
                "benchmark": "pipeshard",
                "devices": jax.device_count(),
                "cpu_cores": os.cpu_count(),
                "load_average_1m": round(os.getloadavg()[0], 2),
                "model": {"layers": args.layers, "width": args.width, "batch": args.batch},
                "single_jit_step_ms": round(1e3 * base_seconds, 3),
                "pipeshard_step_ms": headline["step_ms"],
                "ratio_vs_single_jit": headline["ratio_vs_single_jit"],
                "driver_overhead_ms_per_task": headline["driver_overhead_ms_per_task"],
                "bubble_measured": headline["bubble_measured"],
                "bubble_theory": headline["bubble_theory"],
                "driver_overhead_target_ms": OVERHEAD_TARGET_MS,
                "configs": results,
            }
        )
    )


def _compare_activations(results: list[dict]) -> None:
    """Marks each 1F1B / interleaved result whose peak is within GPipe's (m >= 2p)."""
    gpipe = {
        (r["stages"], r["microbatches"]): max(r["peak_activation_bytes_per_stage"])
        for r in results
        if r["schedule"] == "gpipe"
    }
    for r in results:
        key = (r["stages"], r["microbatches"])
        if r["schedule"] in ("1f1b", "interleaved_1f1b") and key in gpipe:
            r["activations_within_gpipe"] = max(r["peak_activation_bytes_per_stage"]) <= gpipe[key]


if __name__ == "__main__":
    main()
