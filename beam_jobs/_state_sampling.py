"""A shorter period of Beam's state sampler while a job runs in process.

Beam's SDK worker times the steps of every bundle with a sampler thread (for
its msec metrics) that sleeps between samples, its sleep growing from 2 ms
to 200 ms; the bundle's end waits for that thread to wake. The in-process
runner runs the FDO job's steps one after the other, so each step's end waits
up to 200 ms, a random 0.02-0.2 s of a run that the work does not need. The
period is no pipeline option, only the default of the sampler's constructor.
"""

from __future__ import annotations

import contextlib
import threading

from apache_beam.runners.worker import statesampler

SAMPLING_PERIOD_MS = 2
_lock = threading.Lock()


@contextlib.contextmanager
def short_state_sampling():
    """Samplers made inside sample every `SAMPLING_PERIOD_MS` (left alone unless Beam's
    sampler takes its period as its constructor's one default, as Beam 2.x does)."""
    init = statesampler.StateSampler.__init__
    with _lock:
        patched = init.__defaults__ == (statesampler.DEFAULT_SAMPLING_PERIOD_MS,)
        if patched:
            init.__defaults__ = (SAMPLING_PERIOD_MS,)
    try:
        yield
    finally:
        if patched:
            with _lock:
                init.__defaults__ = (statesampler.DEFAULT_SAMPLING_PERIOD_MS,)
