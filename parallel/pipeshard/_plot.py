"""Drawing an executed schedule as a stage x time timeline PNG."""

from __future__ import annotations

import enum
import os

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from parallel.pipeshard._schedules import ExecutedSchedule, TaskKind


class TimelineAxis(enum.Enum):
    """What the horizontal axis of the timeline measures.

    CLOCK: schedule clocks, one unit per task.
    MEASURED: milliseconds, each task as long as it measured, placed as
      early as its stage and inputs allow (needs `time_tasks=True`).
    """

    CLOCK = "clock"
    MEASURED = "measured"


def plot_schedule(
    schedule: ExecutedSchedule, path: str | os.PathLike, *, timing: TimelineAxis | str = "clock"
) -> None:
    """Writes the timeline of `schedule` to the PNG file `path`.

    One row per stage, one box per task: forwards light, backwards dark and
    hatched, coloured by microbatch, labelled `F3` / `B3`. Empty stretches of
    a row are the pipeline's bubbles; the title gives their share against
    the ideal `(p - 1) / (m + p - 1)`.
    """
    axis = TimelineAxis(timing)
    p, m = schedule.num_stages, schedule.num_microbatches
    if axis is TimelineAxis.CLOCK:
        spans = {r.task: (float(r.clock), 1.0) for r in schedule.records}
        bubble = schedule.clock_bubble_fraction()
    else:
        spans = {t: (1e3 * s, 1e3 * (e - s)) for t, (s, e) in schedule.simulated_timeline().items()}
        bubble = schedule.measured_bubble_fraction()
    width = max(s + w for s, w in spans.values())
    figure = Figure(figsize=(min(4 + 0.45 * len(spans) / p, 30), 1.2 + 0.7 * p), dpi=100)
    ax = figure.add_subplot()
    colours = colormaps["tab20"]
    for task, (start, span) in spans.items():
        forward = task.kind is TaskKind.FORWARD
        ax.broken_barh(
            [(start, span)],
            (task.stage - 0.4, 0.8),
            facecolors=colours(task.microbatch % colours.N),
            edgecolor="black",
            alpha=0.55 if forward else 1.0,
            hatch=None if forward else "//",
        )
        ax.text(
            start + span / 2,
            task.stage,
            f"{task.kind.value}{task.microbatch}",
            ha="center",
            va="center",
            fontsize=7,
        )
    ax.set_xlim(0, width)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.set_xlabel("clock" if axis is TimelineAxis.CLOCK else "time (ms)")
    ax.set_title(
        f"{schedule.schedule.value}: {p} stages, {m} microbatches, bubble {bubble:.1%} "
        f"(ideal {(p - 1) / (m + p - 1):.1%})"
    )
    ax.legend(
        handles=[
            Patch(facecolor="lightgray", edgecolor="black", label="forward"),
            Patch(facecolor="gray", edgecolor="black", hatch="//", label="backward"),
        ],
        loc="upper right",
        fontsize=7,
    )
    figure.tight_layout()
    FigureCanvasAgg(figure).print_png(os.fspath(path))
