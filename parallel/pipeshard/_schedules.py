"""Pipeline schedules as clocks of tasks, and the record of an executed one.

A schedule is a sequence of clocks; a clock is a set of tasks that may run
at the same time, at most one per stage. Task `(stage, microbatch, kind)`
runs the forward (F) or backward (B) of one stage on one microbatch. The
forward of stage `s` needs the forward of stage `s - 1` of the same
microbatch from an earlier clock; the backward of stage `s` needs the
backward of stage `s + 1` and its own forward.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from parallel.pipeshard._options import PipelineSchedule


class TaskKind(enum.Enum):
    """Forward or backward half of a stage's work on a microbatch."""

    FORWARD = "F"
    BACKWARD = "B"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    """One stage's forward or backward on one microbatch."""

    stage: int
    microbatch: int
    kind: TaskKind


Clocks = tuple[tuple[Task, ...], ...]


def build_schedule(kind: PipelineSchedule, num_microbatches: int, num_stages: int) -> Clocks:
    """The clocks of `kind` for `num_microbatches` over `num_stages` stages."""
    if kind is PipelineSchedule.GPIPE:
        return _gpipe(num_microbatches, num_stages)
    return _one_f_one_b(num_microbatches, num_stages)


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
    done: set[tuple[int, int, TaskKind]] = set()
    cursor = [0] * p
    clocks = []
    while any(cursor[s] < len(orders[s]) for s in range(p)):
        ready = [
            orders[s][cursor[s]]
            for s in range(p)
            if cursor[s] < len(orders[s]) and _inputs_done(orders[s][cursor[s]], done, p)
        ]
        for task in ready:
            cursor[task.stage] += 1
        done |= {(t.stage, t.microbatch, t.kind) for t in ready}
        clocks.append(tuple(ready))
    return tuple(clocks)


def _inputs_done(task: Task, done: set, p: int) -> bool:
    if task.kind is TaskKind.FORWARD:
        return task.stage == 0 or (task.stage - 1, task.microbatch, TaskKind.FORWARD) in done
    own_forward = (task.stage, task.microbatch, TaskKind.FORWARD) in done
    upstream = task.stage == p - 1 or (task.stage + 1, task.microbatch, TaskKind.BACKWARD) in done
    return own_forward and upstream


def clock_bubble_fraction(clocks: Clocks, num_stages: int) -> float:
    """Idle share of the stage-clock slots: `(p - 1) / (m + p - 1)` for GPipe."""
    busy = sum(len(clock) for clock in clocks)
    return 1.0 - busy / (num_stages * len(clocks))


def max_inflight_microbatches(tasks: Sequence[Task], stage: int) -> int:
    """Most microbatches whose forward ran on `stage` and backward did not yet."""
    inflight, peak = set(), 0
    for task in tasks:
        if task.stage != stage:
            continue
        if task.kind is TaskKind.FORWARD:
            inflight.add(task.microbatch)
        else:
            inflight.discard(task.microbatch)
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

    def max_inflight_microbatches(self, stage: int) -> int:
        """Most activations `stage` held at once, read off the dispatch order."""
        return max_inflight_microbatches([r.task for r in self.records], stage)

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
            ready = max((end[d] for d in _dependencies(task, self.num_stages)), default=0.0)
            start = max(ready, stage_free[task.stage])
            finish = start + record.duration
            end[(task.stage, task.microbatch, task.kind)] = finish
            stage_free[task.stage] = finish
            timeline[task] = (start, finish)
        return timeline

    def measured_bubble_fraction(self) -> float:
        """Idle share of the simulated timeline (see `simulated_timeline`)."""
        timeline = self.simulated_timeline()
        span = max(e for _, e in timeline.values())
        busy = sum(e - s for s, e in timeline.values())
        return 1.0 - busy / (self.num_stages * span)


def _dependencies(task: Task, p: int) -> list[tuple[int, int, TaskKind]]:
    if task.kind is TaskKind.FORWARD:
        return [] if task.stage == 0 else [(task.stage - 1, task.microbatch, TaskKind.FORWARD)]
    deps = [(task.stage, task.microbatch, TaskKind.FORWARD)]
    if task.stage < p - 1:
        deps.append((task.stage + 1, task.microbatch, TaskKind.BACKWARD))
    return deps
