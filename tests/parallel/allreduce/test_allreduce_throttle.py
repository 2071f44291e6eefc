"""Warnings a hostile peer can trigger are logged at a bounded rate."""

import logging
import time

from parallel.allreduce._throttle import ThrottledWarning


def test_repeats_within_the_interval_are_counted_not_logged(caplog):
    logger = logging.getLogger("test_throttle")
    warning = ThrottledWarning(logger, interval_s=0.2)
    with caplog.at_level(logging.WARNING, logger="test_throttle"):
        for i in range(5):
            warning.warning(f"bad message {i}")
        time.sleep(0.25)
        warning.warning("bad message 5")
    assert [r.getMessage() for r in caplog.records] == [
        "bad message 0",
        "bad message 5 (4 more since the last such warning)",
    ]
