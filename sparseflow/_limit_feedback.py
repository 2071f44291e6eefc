"""Limits that follow the data: FDO limits at the start, raised when a batch breaches them.

At the start (`initial_specs`), the tables' limits come from the config, or
from the FDO stats with `--fdo DIR`: when the stats cover exactly the batches
this run draws (`FdoStats.batch_order`: same records, shuffle seed, and at
least as many epochs), the headroom alone is added; otherwise the spread
margin too (`embedding.fdo_limits`). Limits an earlier run had to raise
(`embedding.load_limit_raises`, next to the stats) are kept if larger.

During the run (`FeedbackIterator`), a batch that still breaches a limit
with dropping off is counted again in this process, every id kept; the
stacks it breaches get the limits it needs, with headroom and spread
margin; the input is rebuilt under them from the same position and the step
recompiled once; the raise is logged and recorded next to the stats, for the
next run. Checkpoints record the limits in effect (`limits_metadata`), so a
resumed run lays its batches out as the run that wrote them did.

In a run of several processes each host lays out its own rows of a batch,
so one may breach where the others do not: after every batch the hosts tell
each other whether theirs breached (`agree`); if one did, each counts its
rows of that batch and they take the larger of every limit over the hosts,
so all of them lay the batch out again under the same limits and recompile
the same step. The caller lays out a pipelined run's batches in flight again
(`on_new_specs`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

import embedding
import pipelines

_log = logging.getLogger(__name__)

SPREAD_MARGIN = 4.0
"""Square roots of a count added where the stats did not see the run's batches."""


def initial_specs(
    specs: Any,
    *,
    fdo_dir: Path | None,
    layout: embedding.FdoLayout,
    geometry: embedding.FdoGeometry,
    batching: pipelines.BatchingConfig,
    data,
    headroom: float,
) -> Any:
    """The prepared `specs` with the limits from the FDO stats in `fdo_dir` (if any)."""
    if fdo_dir is None:
        return specs
    stats = embedding.load_fdo_stats(
        fdo_dir, expected_config_hash=layout, expected_geometry=geometry
    )
    exact = stats.batch_order is not None and stats.batch_order.covers(
        embedding.FdoBatchOrder(
            records=pipelines.num_records(data),
            shuffle_seed=batching.shuffle_seed,
            epochs=batching.num_epochs,
        )
    )
    margin = 0.0 if exact else SPREAD_MARGIN
    _log.info(
        "FDO limits at headroom %g, spread margin %g: the stats cover %s.",
        headroom,
        margin,
        "exactly this run's batches" if exact else f"other batches ({stats.batch_order})",
    )
    specs = embedding.apply_fdo(specs, stats, headroom=headroom, spread_margin=margin)
    raises = embedding.load_limit_raises(fdo_dir, layout=layout, geometry=geometry)
    if raises is None:
        return specs
    _log.info(
        "Limits raised by earlier runs (%s): %s", embedding.limit_raises_path(fdo_dir), raises
    )
    return _with_limits(specs, geometry, _larger(embedding.stack_limits(specs), raises.stacks))


def _larger(
    current: Mapping[str, embedding.StackLimits], other: Mapping[str, embedding.StackLimits]
) -> dict[str, embedding.StackLimits]:
    return {name: embedding.max_limits(current[name], other[name]) for name in other}


def _with_limits(specs, geometry: embedding.FdoGeometry, limits) -> Any:
    return embedding.set_stack_limits(
        specs,
        limits,
        global_device_count=geometry.devices,
        num_sc_per_device=geometry.partitions_per_device,
    )


def limits_metadata(specs) -> dict[str, dict[str, int | None]]:
    """The stacks' limits in effect, JSON-able (for a checkpoint)."""
    return {
        name: {
            "max_ids_per_partition": limits.max_ids_per_partition,
            "max_unique_ids_per_partition": limits.max_unique_ids_per_partition,
            "suggested_coo_buffer_size_per_device": limits.suggested_coo_buffer_size_per_device,
        }
        for name, limits in embedding.stack_limits(specs).items()
    }


def specs_with_metadata(specs, geometry: embedding.FdoGeometry, metadata: Mapping | None) -> Any:
    """`specs` with the limits of `limits_metadata` (None: unchanged, e.g. an older checkpoint)."""
    if metadata is None:
        return specs
    limits = {name: embedding.StackLimits(**fields) for name, fields in metadata.items()}
    return _with_limits(specs, geometry, limits)


class FeedbackIterator:
    """The training batches, under limits that rise when a batch breaches them.

    Args:
      make: builds the batches (a `pipelines.DeviceIterator`) under given specs.
      specs: the prepared specs to start with.
      batch_stats: `(specs, batch number)` -> this host's layout stats of the
        batch, every id counted (`pipelines.batch_layout_stats`).
      on_new_specs: called with new specs before the batches continue under them.
      geometry: the batch geometry.
      headroom: factor over what a breaching batch needs.
      record: the FDO stats path to record raises next to, and the run's
        layout; None to only log them.
      agree: in a run of several processes, gathers every process's
        `int32[k]` vector (`int32[processes, k]`), called by all of them
        after each batch; None in a run of one.
      position: the batch about to be drawn, from an iterator state
        (`get_state`); needed with `agree`.
    """

    def __init__(
        self,
        make: Callable[[Any], pipelines.DeviceIterator],
        specs: Any,
        *,
        batch_stats: Callable[[Any, int], embedding.SparseDenseMatmulInputStats],
        on_new_specs: Callable[[Any], None],
        geometry: embedding.FdoGeometry,
        headroom: float,
        record: tuple[Path, embedding.FdoLayout] | None,
        agree: Callable[[np.ndarray], np.ndarray] | None = None,
        position: Callable[[bytes], int] | None = None,
    ):
        self._make = make
        self._batch_stats = batch_stats
        self._on_new_specs = on_new_specs
        self._geometry = geometry
        self._headroom = headroom
        self._record = record
        self._agree = agree
        self._position = position
        self.specs = specs
        self._batches = make(specs)

    @property
    def num_batches(self) -> int:
        return self._batches.num_batches

    def __iter__(self) -> FeedbackIterator:
        return self

    def __next__(self) -> pipelines.DeviceBatch:
        if self._agree is not None:
            return self._next_agreed()
        try:
            return next(self._batches)
        except embedding.LimitBreachError as error:
            if error.batch_number is None:
                raise
            needed, wanted = self._limits_for(error.batch_number)
            self._raise_limits(error.batch_number, needed, wanted, error)
        return next(self._batches)

    def _next_agreed(self) -> pipelines.DeviceBatch:
        """The next batch, laid out under limits every host agrees on."""
        before = self._batches.get_state()
        number = self._position(before)
        try:
            batch, breach = next(self._batches), None
        except embedding.LimitBreachError as error:
            if error.batch_number is None:
                raise
            batch, breach = None, error
        breached = np.flatnonzero(self._agree(np.array([breach is not None], np.int32)))
        if not breached.size:
            return batch
        needed, wanted = self._limits_for(number)
        names = sorted(needed)
        mine = np.array([_encoded(needed[n]) + _encoded(wanted[n]) for n in names], np.int32)
        every = self._agree(mine.reshape(-1)).reshape(-1, len(names), 6)
        for host in every:
            for name, row in zip(names, host, strict=True):
                needed[name] = embedding.max_limits(needed[name], _decoded(row[:3]))
                wanted[name] = embedding.max_limits(wanted[name], _decoded(row[3:]))
        if breach is None:
            # Another host breached: this one lays the batch out again too.
            self._batches.set_state(before)
            breach = embedding.LimitBreachError(
                f"Another process's rows of global batch {number} breach the limits."
            )
        hosts = ", ".join(map(str, breached))
        self._raise_limits(number, needed, wanted, breach, f" (the rows of process {hosts})")
        return next(self._batches)

    def get_state(self) -> bytes:
        return self._batches.get_state()

    def set_state(self, state: bytes) -> None:
        self._batches.set_state(state)

    def use_specs(self, specs) -> None:
        """Continues from the same position with batches laid out under `specs`."""
        if embedding.stack_limits(specs) == embedding.stack_limits(self.specs):
            return
        state = self._batches.get_state()
        self._batches.close()
        self._batches = self._make(specs)
        self._batches.set_state(state)
        self.specs = specs
        self._on_new_specs(specs)

    def close(self) -> None:
        self._batches.close()

    def __enter__(self) -> FeedbackIterator:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _limits_for(self, batch: int):
        """`(needed, wanted)` limits by stack of this host's rows of `batch`: exactly, and
        with headroom and spread margin."""
        stats = embedding.batch_fdo_stats(self._batch_stats(self.specs, batch), self._geometry)
        needed = embedding.fdo_limits(stats, headroom=1.0, spread_margin=0.0)
        wanted = embedding.fdo_limits(stats, headroom=self._headroom, spread_margin=SPREAD_MARGIN)
        return needed, wanted

    def _raise_limits(
        self, batch: int, needed, wanted, error: embedding.LimitBreachError, where: str = ""
    ) -> None:
        """Lays batches out under `wanted` where `needed` breaches; else raises `error`."""
        current = embedding.stack_limits(self.specs)
        raised = {
            name: embedding.max_limits(current[name], wanted[name])
            for name in current
            if embedding.exceeds(needed[name], current[name])
        }
        if not raised:
            raise error
        shown = "; ".join(f"{name}: {current[name]} -> {limits}" for name, limits in raised.items())
        recorded = self._write_record(batch, raised)
        _log.warning(
            "Global batch %d breaches the limits%s: %s; raised (recompiling the step)%s.",
            batch,
            where,
            shown,
            f", recorded in {recorded}" if recorded else "",
        )
        self.use_specs(_with_limits(self.specs, self._geometry, raised))

    def _write_record(self, batch: int, raised) -> str | None:
        if self._record is None:
            return None
        fdo_dir, layout = self._record
        earlier = embedding.load_limit_raises(fdo_dir, layout=layout, geometry=self._geometry)
        stacks = {} if earlier is None else dict(earlier.stacks)
        for name, limits in raised.items():
            stacks[name] = embedding.max_limits(stacks[name], limits) if name in stacks else limits
        batches = (batch,) if earlier is None else (*earlier.batches, batch)
        raises = embedding.LimitRaises(
            layout_key=layout.key, geometry=self._geometry, stacks=stacks, batches=batches
        )
        return embedding.write_limit_raises(fdo_dir, raises)


def _encoded(limits: embedding.StackLimits) -> list[int]:
    """`StackLimits` as 3 int32 (a buffer of None as -1), for `agree`."""
    buffer = limits.suggested_coo_buffer_size_per_device
    return [
        limits.max_ids_per_partition,
        limits.max_unique_ids_per_partition,
        -1 if buffer is None else buffer,
    ]


def _decoded(row: np.ndarray) -> embedding.StackLimits:
    return embedding.StackLimits(
        max_ids_per_partition=int(row[0]),
        max_unique_ids_per_partition=int(row[1]),
        suggested_coo_buffer_size_per_device=None if row[2] < 0 else int(row[2]),
    )
