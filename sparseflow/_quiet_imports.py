"""Keeps third-party import-time notices off the `sparseflow` command's stderr.

`sparseflow/__init__.py` imports this module before anything else, so the
command line (whose entry point lives in this package) and the processes it
starts (Grain workers, the launched hosts inherit the environment) set these
before TensorFlow or Beam is imported. A variable the user sets wins.
"""

from __future__ import annotations

import logging
import os

# TensorFlow 2.21 logs "oneDNN custom operations are on" (and absl's notice
# that logging is not initialized) from the static initializers of two of its
# libraries, before it reads TF_CPP_MIN_LOG_LEVEL: only turning the oneDNN ops
# off stops it. sparseflow runs no TensorFlow math (it parses records, reads
# files and writes summaries with it), so those ops do nothing for it.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
# TensorFlow's INFO lines (the CPU feature guard's); warnings and errors show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

_BEAM_APITOOLS_NOTICE = (
    "apitools not found, and bigquery client libraries are not available despite the "
    "import not raising an ImportError."
)


class BeamApitoolsNoticeFilter(logging.Filter):
    """Drops the one warning Beam logs on import when the GCP extras are absent.

    sparseflow uses none of Beam's GCP I/O, so the notice is never about a
    problem of a sparseflow run; every other record passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _BEAM_APITOOLS_NOTICE


# Beam logs the notice on the root logger as it is imported.
logging.getLogger().addFilter(BeamApitoolsNoticeFilter())
