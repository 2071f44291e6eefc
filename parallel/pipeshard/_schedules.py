"""Pipeline schedules as clocks of tasks, and the record of an executed one.

A schedule is a sequence of clocks; a clock is a set of tasks that may run
at the same time, at most one per device group. Task `(stage, microbatch,
kind)` runs the forward (F) or backward (B) of one stage on one microbatch.
The forward of stage `s` needs the forward of stage `s - 1` of the same
microbatch from an earlier clock; the backward of stage `s` needs the
backward of stage `s + 1` and its own forward.

With `v` virtual stages (interleaved 1F1B), the model is cut into `p * v`
stages and stage `s` runs on device group `s % p`: each group holds `v`
non-adjacent chunks of the model. The zero-bubble schedule splits each
backward into B, the gradient of the stage's inputs (what the stage before
waits for), and W, the gradient of its weights, which nothing waits for and
which fills the clocks a B would leave idle.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Sequence

from parallel.pipeshard._options import PipelineSchedule


class TaskKind(enum.Enum):
    """A part of a stage's work on a microbatch.

    FORWARD: the forward pass.
    BACKWARD: the backward pass; under the zero-bubble schedule only the
      gradient of the stage's inputs.
    WEIGHT: the gradient of the stage's weights (zero-bubble schedule only).
    """

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    """One stage's forward or backward on one microbatch."""

    stage: int
    microbatch: int
    kind: TaskKind


Clocks = tuple[tuple[Task, ...], ...]


def build_schedule(
    kind: PipelineSchedule, num_microbatches: int, num_stages: int, virtual_stages: int = 1
) -> Clocks:
    """The clocks of `kind` for `num_microbatches` over `num_stages` device groups.

    Args:
      kind: the schedule.
      num_microbatches: m.
      num_stages: p, the device groups (the pipeline's depth in devices).
      virtual_stages: v, model chunks per device group; only the
        interleaved schedule takes more than 1. Tasks then name the chunk,
        `0 .. p * v - 1`, as their stage.

    Raises:
      ValueError: `virtual_stages > 1` with a schedule other than
        interleaved 1F1B.
    """
    if virtual_stages != 1 and kind is not PipelineSchedule.INTERLEAVED_ONE_F_ONE_B:
        raise ValueError(
            f"virtual_stages={virtual_stages} needs the interleaved_1f1b schedule, not "
            f"{kind.value!r}; use virtual_stages=1 with {kind.value!r}."
        )
    if kind is PipelineSchedule.GPIPE:
        return _gpipe(num_microbatches, num_stages)
    if kind is PipelineSchedule.ONE_F_ONE_B:
        return _one_f_one_b(num_microbatches, num_stages)
    if kind is PipelineSchedule.INTERLEAVED_ONE_F_ONE_B:
        return _interleaved(num_microbatches, num_stages, virtual_stages)
    return _zero_bubble_h1(num_microbatches, num_stages)


def _gpipe(m: int, p: int) -> Clocks:
    """All forwards in a wavefront, then all backwards: 2 (m + p - 1) clocks."""
    forward = [
        tuple(
            Task(stage=s, microbatch=t - s, kind=TaskKind.FORWARD)
            for s in range(p)
            if 0 <= t - s < m
        )
        for t in range(m + p - 1)
    ]
    backward = [
        tuple(
            Task(stage=s, microbatch=t - (p - 1 - s), kind=TaskKind.BACKWARD)
            for s in reversed(range(p))
            if 0 <= t - (p - 1 - s) < m
        )
        for t in range(m + p - 1)
    ]
    return tuple(forward + backward)


def _one_f_one_b(m: int, p: int) -> Clocks:
    """PipeDream-flush: warm-up forwards, one-forward-one-backward, cool-down.

    Each stage works through its own order, `p - s - 1` forwards first, and
    a clock runs every stage whose next task's inputs were produced in an
    earlier clock.
    """
    orders = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        order = [Task(stage=s, microbatch=k, kind=TaskKind.FORWARD) for k in range(warmup)]
        for k in range(m - warmup):
            order.append(Task(stage=s, microbatch=warmup + k, kind=TaskKind.FORWARD))
            order.append(Task(stage=s, microbatch=k, kind=TaskKind.BACKWARD))
        order += [Task(stage=s, microbatch=k, kind=TaskKind.BACKWARD) for k in range(m - warmup, m)]
        orders.append(order)
    return _clocked(orders, p, group_of=lambda stage: stage)


def _inputs_done(task: Task, done: set, p: int) -> bool:
    return all(d in done for d in _dependencies(task, p))


def _interleaved(m: int, p: int, v: int) -> Clocks:
    """Megatron-LM's interleaved 1F1B over `p * v` chunks, chunk `c` on group `c % p`.

    Each group runs the forwards of its chunks in rounds of `p` microbatches
    (chunk by chunk within a round) and the backwards in the same rounds,
    chunks reversed. It starts with the warm-up forwards Megatron-LM gives
    it, `2 (p - d - 1) + (v - 1) p`, then alternates, so that with `m` a
    multiple of `p` the bubble shrinks to `(p - 1) / (v m + p - 1)`.
    """
    orders = []
    for d in range(p):
        chunks = [d + j * p for j in range(v)]
        forwards = _rounds(m, p, chunks, TaskKind.FORWARD)
        backwards = _rounds(m, p, chunks[::-1], TaskKind.BACKWARD)
        warmup = min(2 * (p - d - 1) + (v - 1) * p, len(forwards))
        order = forwards[:warmup]
        for forward, backward in itertools.zip_longest(forwards[warmup:], backwards):
            order += [t for t in (forward, backward) if t is not None]
        orders.append(order)
    return _clocked(orders, p * v, group_of=lambda stage: stage % p)


def _rounds(m: int, p: int, chunks: Sequence[int], kind: TaskKind) -> list[Task]:
    return [
        Task(stage=c, microbatch=k, kind=kind)
        for first in range(0, m, p)
        for c in chunks
        for k in range(first, min(first + p, m))
    ]


def _zero_bubble_h1(m: int, p: int) -> Clocks:
    """ZB-H1: 1F1B with each stage's weight gradients deferred into its bubbles.

    Stage `s` starts with `p - s` forwards (one more than 1F1B's warm-up),
    then per microbatch runs its B, the W that leaves `s` of them pending,
    and its next F; the pending Ws close the run. A B then waits only for
    the Bs downstream, not for their Ws, and with F, B and W of equal time
    and `m >= 2p` the schedule takes `3m + p - 1` clocks: a bubble of `p - 1`
    clocks instead of 1F1B's `3 (p - 1)`. Every stage holds at most `p`
    microbatches' activations (from F to W), 1F1B's peak (its first stage).
    """
    orders = []
    for s in range(p):
        warmup = min(p - s, m)
        order = [Task(stage=s, microbatch=k, kind=TaskKind.FORWARD) for k in range(warmup)]
        pending: list[int] = []
        for k in range(m):
            order.append(Task(stage=s, microbatch=k, kind=TaskKind.BACKWARD))
            pending.append(k)
            while len(pending) > s:
                order.append(Task(stage=s, microbatch=pending.pop(0), kind=TaskKind.WEIGHT))
            if warmup + k < m:
                order.append(Task(stage=s, microbatch=warmup + k, kind=TaskKind.FORWARD))
        order += [Task(stage=s, microbatch=k, kind=TaskKind.WEIGHT) for k in pending]
        orders.append(order)
    return _clocked(orders, p, group_of=lambda stage: stage)


def _clocked(orders: Sequence[Sequence[Task]], num_chunks: int, group_of) -> Clocks:
    """Clocks running each group's tasks in its order, each as soon as its inputs are done."""
    done: set[tuple[int, int, TaskKind]] = set()
    cursor = [0] * len(orders)
    clocks = []
    while any(c < len(o) for c, o in zip(cursor, orders)):
        ready = [
            o[c]
            for c, o in zip(cursor, orders)
            if c < len(o) and _inputs_done(o[c], done, num_chunks)
        ]
        if not ready:
            raise RuntimeError("A pipeline schedule's task orders wait on each other.")
        for task in ready:
            cursor[group_of(task.stage)] += 1
        done |= {(t.stage, t.microbatch, t.kind) for t in ready}
        clocks.append(tuple(ready))
    return tuple(clocks)


def clock_bubble_fraction(clocks: Clocks, num_stages: int) -> float:
    """Idle share of the group-clock slots: `(p - 1) / (m + p - 1)` for GPipe.

    `num_stages` is p, the device groups; every task takes one clock.
    """
    busy = sum(len(clock) for clock in clocks)
    return 1.0 - busy / (num_stages * len(clocks))


def theoretical_bubble_fraction(
    kind: PipelineSchedule, num_microbatches: int, num_stages: int, virtual_stages: int = 1
) -> float:
    """The bubble the literature gives, with equal forward and backward times.

    GPipe and 1F1B: `(p - 1) / (m + p - 1)`. Interleaved 1F1B with `v`
    virtual stages: `(p - 1) / (v m + p - 1)` (for m a multiple of p).
    ZB-H1, with F, B and W of equal time: `(p - 1) / (3 m + p - 1)`, about
    a third of 1F1B's. In clock units every schedule here matches it.
    """
    m, p, v = num_microbatches, num_stages, virtual_stages
    if kind is PipelineSchedule.INTERLEAVED_ONE_F_ONE_B:
        return (p - 1) / (v * m + p - 1)
    if kind is PipelineSchedule.ZERO_BUBBLE:
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


def max_inflight_microbatches(
    tasks: Sequence[Task], stage: int, num_stages: int | None = None
) -> int:
    """Most activations device group `stage` held at once, in (chunk, microbatch) units.

    A stage's activations of a microbatch are held from its forward to its
    last backward task (W where the schedule has them, else B). With
    virtual stages, pass `num_stages` (p): group `stage` holds chunks
    `stage, stage + p, ...`, each about `1 / v` of a stage's activations.
    """
    has_weight = {(t.stage, t.microbatch) for t in tasks if t.kind is TaskKind.WEIGHT}
    inflight, peak = set(), 0
    for task in tasks:
        if (task.stage if num_stages is None else task.stage % num_stages) != stage:
            continue
        key = (task.stage, task.microbatch)
        if task.kind is TaskKind.FORWARD:
            inflight.add(key)
        elif task.kind is TaskKind.WEIGHT or key not in has_weight:
            inflight.discard(key)
        peak = max(peak, len(inflight))
    return peak


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskRecord:
    """One executed task, with host times in seconds from the step start.

    Attributes:
      task: what ran.
      clock: the schedule clock it belongs to.
      dispatch_start: when the driver began preparing it.
      dispatch_end: when the driver was done with it.
      wait: time the driver waited inside it for another program (the
        XLA:CPU rule of one collective program in flight at a time).
      launch_start: when the runtime's execute call began.
      launch: time spent inside the execute call (XLA:CPU may run a program
        inline there, making this most of its run time).
      finish: when its outputs were ready, when tasks are timed; else None.
    """

    task: Task
    clock: int
    dispatch_start: float
    dispatch_end: float
    wait: float
    launch_start: float
    launch: float
    finish: float | None

    @property
    def overhead(self) -> float:
        """Driver time spent on the task: waits and the execute call excluded."""
        return self.dispatch_end - self.dispatch_start - self.wait - self.launch

    @property
    def duration(self) -> float | None:
        """Run time of the task's program, from its launch, when timed."""
        return None if self.finish is None else self.finish - self.launch_start


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutedSchedule:
    """The tasks one call of a pipeshard function ran, in dispatch order."""

    schedule: PipelineSchedule
    num_stages: int
    num_microbatches: int
    records: tuple[TaskRecord, ...]
    virtual_stages: int = 1

    @property
    def num_clocks(self) -> int:
        return 1 + max(r.clock for r in self.records)

    @property
    def clocks(self) -> Clocks:
        grouped: list[list[Task]] = [[] for _ in range(self.num_clocks)]
        for record in self.records:
            grouped[record.clock].append(record.task)
        return tuple(tuple(c) for c in grouped)

    def clock_bubble_fraction(self) -> float:
        """Idle share of stage-clock slots of the recorded clocks."""
        return clock_bubble_fraction(self.clocks, self.num_stages)

    @property
    def num_chunks(self) -> int:
        """Stages of the model: `num_stages * virtual_stages`."""
        return self.num_stages * self.virtual_stages

    def theoretical_bubble_fraction(self) -> float:
        """The literature's bubble for this schedule and shape (see the function)."""
        return theoretical_bubble_fraction(
            self.schedule, self.num_microbatches, self.num_stages, self.virtual_stages
        )

    def max_inflight_microbatches(self, stage: int) -> int:
        """Most activations group `stage` held at once, read off the dispatch order."""
        return max_inflight_microbatches([r.task for r in self.records], stage, self.num_stages)

    def simulated_timeline(self) -> dict[Task, tuple[float, float]]:
        """Start and end of every task with measured durations and ideal overlap.

        Each task starts when its stage is free and its inputs are done,
        taking its measured duration; this is the timeline a driver without
        per-task waits would reach, read off a timed run.

        Raises:
          ValueError: the run was not timed (`time_tasks=False`).
        """
        if any(r.duration is None for r in self.records):
            raise ValueError(
                "The schedule was recorded without task times; run with "
                "PipeshardParallel(..., time_tasks=True) to get a measured timeline."
            )
        end: dict[tuple[int, int, TaskKind], float] = {}
        stage_free = [0.0] * self.num_stages
        timeline = {}
        for record in sorted(self.records, key=lambda r: r.clock):
            task = record.task
            group = task.stage % self.num_stages
            ready = max((end[d] for d in _dependencies(task, self.num_chunks)), default=0.0)
            start = max(ready, stage_free[group])
            finish = start + record.duration
            end[(task.stage, task.microbatch, task.kind)] = finish
            stage_free[group] = finish
            timeline[task] = (start, finish)
        return timeline

    def measured_bubble_fraction(self) -> float:
        """Idle share of the simulated timeline (see `simulated_timeline`)."""
        timeline = self.simulated_timeline()
        span = max(e for _, e in timeline.values())
        busy = sum(e - s for s, e in timeline.values())
        return 1.0 - busy / (self.num_stages * span)


def _dependencies(task: Task, p: int) -> list[tuple[int, int, TaskKind]]:
    """What `task` waits for, with `p` stages in the chain (chunks, when virtual)."""
    if task.kind is TaskKind.FORWARD:
        return [] if task.stage == 0 else [(task.stage - 1, task.microbatch, TaskKind.FORWARD)]
    if task.kind is TaskKind.WEIGHT:
        return [(task.stage, task.microbatch, TaskKind.BACKWARD)]
    deps = [(task.stage, task.microbatch, TaskKind.FORWARD)]
    if task.stage < p - 1:
        deps.append((task.stage + 1, task.microbatch, TaskKind.BACKWARD))
    return deps
