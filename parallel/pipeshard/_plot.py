"""Drawing an executed schedule as a stage x time timeline PNG."""

from __future__ import annotations

import enum
import os

from parallel.pipeshard._schedules import ExecutedSchedule, TaskKind

_HATCH = {TaskKind.FORWARD: None, TaskKind.BACKWARD: "//", TaskKind.WEIGHT: ".."}


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

    One row per device group, one box per task: forwards light, backwards
    dark and hatched, weight gradients (zero bubble) dark and dotted,
    coloured by microbatch, labelled `F3` / `B3` / `W3` (with virtual stages
    `F3.1`: microbatch 3 of the group's second chunk). Empty stretches of a
    row are the pipeline's bubbles; the title gives their share against the
    schedule's theoretical one (`theoretical_bubble_fraction`).
    """
    # Imported here: models mark pipeline boundaries through this package,
    # and a training process that never draws needs no matplotlib.
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

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
        row, chunk = task.stage % p, task.stage // p
        ax.broken_barh(
            [(start, span)],
            (row - 0.4, 0.8),
            facecolors=colours(task.microbatch % colours.N),
            edgecolor="black",
            alpha=0.55 if forward else 1.0,
            hatch=_HATCH[task.kind],
        )
        ax.text(
            start + span / 2,
            row,
            f"{task.kind.value}{task.microbatch}"
            + (f".{chunk}" if schedule.virtual_stages > 1 else ""),
            ha="center",
            va="center",
            fontsize=7,
        )
    ax.set_xlim(0, width)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(
        range(p), [f"group {s}" if schedule.virtual_stages > 1 else f"stage {s}" for s in range(p)]
    )
    ax.set_xlabel("clock" if axis is TimelineAxis.CLOCK else "time (ms)")
    ax.set_title(
        f"{schedule.schedule.value}: {p} stages"
        + (f" x {schedule.virtual_stages} virtual" if schedule.virtual_stages > 1 else "")
        + f", {m} microbatches, bubble {bubble:.1%} "
        f"(theory {schedule.theoretical_bubble_fraction():.1%})"
    )
    ax.legend(
        handles=[
            Patch(facecolor="lightgray", edgecolor="black", label="forward"),
            Patch(facecolor="gray", edgecolor="black", hatch="//", label="backward"),
            Patch(facecolor="gray", edgecolor="black", hatch="..", label="weight gradient"),
        ],
        loc="upper right",
        fontsize=7,
    )
    figure.tight_layout()
    FigureCanvasAgg(figure).print_png(os.fspath(path))
