"""A warning that a hostile peer can trigger at will, logged at a bounded rate."""

from __future__ import annotations

import logging
import threading
import time


class ThrottledWarning:
    """Logs at most one warning per `interval_s`; the next one says how many were dropped.

    Args:
      logger: where the warnings go.
      interval_s: the shortest time between two warnings.
    """

    def __init__(self, logger: logging.Logger, interval_s: float):
        self._logger = logger
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._next = 0.0
        self._dropped = 0

    def warning(self, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._dropped += 1
                return
            dropped, self._dropped = self._dropped, 0
            self._next = now + self._interval_s
        if dropped:
            message += f" ({dropped} more since the last such warning)"
        self._logger.warning("%s", message)
