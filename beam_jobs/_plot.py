"""A figure of the ids per partition and batch, one panel per stacked table.

Each panel shows, per partition, the distribution over batches of the
partition's max ids per batch (max over hosts and devices): a box from the
25th to the 75th percentile with the median, whiskers from the minimum to
the maximum. A horizontal line marks the limit FDO chooses
(`embedding.fdo_limits` at the given headroom), a dotted one the configured
limit when given. Skew shows as a few partitions far above the others.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import numpy as np
from matplotlib.figure import Figure

import embedding

_COLUMNS = 2


def _box(counts: np.ndarray) -> dict:
    """`Axes.bxp` statistics of the values a histogram row counts."""
    cumulative = np.cumsum(counts)
    total = cumulative[-1]

    def quantile(q: float) -> int:
        return int(np.searchsorted(cumulative, max(1, math.ceil(q * total)), side="left"))

    return {
        "med": quantile(0.5),
        "q1": quantile(0.25),
        "q3": quantile(0.75),
        "whislo": int(np.flatnonzero(counts)[0]),
        "whishi": int(np.flatnonzero(counts)[-1]),
        "fliers": [],
    }


def plot_fdo_stats(
    stats: embedding.FdoStats,
    path: str | os.PathLike,
    *,
    headroom: float = 1.1,
    configured_limits: Mapping[str, int] | None = None,
) -> str:
    """Saves the figure (PNG or any format matplotlib knows by the extension).

    Args:
      stats: offline stats (with partition histograms).
      path: the image file.
      headroom: for the FDO limit line.
      configured_limits: per stack, the configured `max_ids_per_partition`.

    Returns:
      The path.

    Raises:
      ValueError: the stats have no partition histograms (online stats).
    """
    stacks = {n: s for n, s in stats.stacks.items() if s.partition_histogram is not None}
    if not stacks:
        raise ValueError(
            "These FDO stats hold no per-partition histograms (only the offline job writes "
            "them); plot the stats of `sparseflow fdo`."
        )
    limits = embedding.fdo_limits(stats, headroom=headroom)
    rows = math.ceil(len(stacks) / _COLUMNS)
    columns = min(_COLUMNS, len(stacks))
    # A bare Figure, not pyplot: no global backend or figure registry to touch.
    figure = Figure(figsize=(7 * columns, 3.4 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    for ax, (name, stack) in zip(axes.flat, stacks.items()):
        _panel(
            ax,
            name,
            stack,
            limits[name].max_ids_per_partition,
            headroom,
            (configured_limits or {}).get(name),
        )
    for ax in list(axes.flat)[len(stacks) :]:
        ax.set_visible(False)
    g = stats.geometry
    figure.suptitle(
        f"Max ids per partition per batch over {stats.batches} batches "
        f"(global batch {g.global_batch_size}, {g.devices} devices x "
        f"{g.partitions_per_device} partitions, {g.processes} host(s))"
    )
    figure.savefig(path, dpi=110)
    return os.fspath(path)


def _panel(ax, name: str, stack, fdo_limit: int, headroom: float, configured: int | None):
    histogram = stack.partition_histogram
    ax.bxp(
        [_box(row) for row in histogram],
        positions=np.arange(len(histogram)),
        showfliers=False,
        widths=0.6,
    )
    label = f"FDO limit {fdo_limit} (headroom {headroom:g})"
    ax.axhline(fdo_limit, color="tab:red", linestyle="--", label=label)
    top = max(fdo_limit, histogram.shape[1] - 1)
    if configured is not None:
        # A configured limit far above the data would flatten the boxes: it
        # is then only named in the legend.
        shown = configured <= 3 * top
        ax.axhline(
            configured if shown else top,
            color="tab:gray",
            linestyle=":",
            alpha=1 if shown else 0,
            label=f"configured limit {configured}" + ("" if shown else " (off the chart)"),
        )
        top = max(top, configured) if shown else top
    ax.set_ylim(0, 1.15 * top)
    ax.set_title(name)
    ax.set_xlabel("partition")
    ax.set_ylabel("max ids / batch")
    step = max(1, len(histogram) // 16)
    ax.set_xticks(np.arange(0, len(histogram), step))
    ax.legend(loc="upper right", fontsize="small")
