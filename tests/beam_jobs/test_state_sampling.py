"""The shorter state-sampling period of in-process runs, and its end."""

import fdo_cases
import pytest
from apache_beam.runners.worker import statesampler
from apache_beam.utils.counters import CounterFactory

import beam_jobs
from beam_jobs._state_sampling import SAMPLING_PERIOD_MS, short_state_sampling


def _period() -> int:
    return statesampler.StateSampler("test", CounterFactory()).sampling_period_ms


def test_samplers_made_inside_sample_often_and_beams_default_returns_after():
    assert _period() == statesampler.DEFAULT_SAMPLING_PERIOD_MS != SAMPLING_PERIOD_MS
    with short_state_sampling():
        assert _period() == SAMPLING_PERIOD_MS
        with short_state_sampling():
            assert _period() == SAMPLING_PERIOD_MS
        # The inner block changed nothing, so it restores nothing.
        assert _period() == SAMPLING_PERIOD_MS
    assert _period() == statesampler.DEFAULT_SAMPLING_PERIOD_MS


def test_beams_default_returns_after_an_error():
    with pytest.raises(RuntimeError, match="boom"), short_state_sampling():
        raise RuntimeError("boom")
    assert _period() == statesampler.DEFAULT_SAMPLING_PERIOD_MS


def test_an_in_process_fdo_job_samples_often(tmp_path, monkeypatch):
    periods = []
    start = statesampler.StateSampler.start

    def recording_start(sampler):
        periods.append(sampler.sampling_period_ms)
        start(sampler)

    monkeypatch.setattr(statesampler.StateSampler, "start", recording_start)
    files, _ = fdo_cases.hand_made_files(str(tmp_path), ".tfrecord")
    config = fdo_cases.job_config(records_per_range=16)
    beam_jobs.run_fdo_job(config, files, str(tmp_path / "fdo"))

    assert periods and set(periods) == {SAMPLING_PERIOD_MS}
    assert _period() == statesampler.DEFAULT_SAMPLING_PERIOD_MS
