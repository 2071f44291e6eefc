"""Keeps third-party import-time notices off the `sparseflow` command's stderr.

`sparseflow/__init__.py` imports this module before anything else, so the
command line (whose entry point lives in this package) and the processes it
starts (Grain workers, the launched hosts inherit the environment) set these
before TensorFlow or Beam is imported. A variable the user sets wins.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# TensorFlow 2.21 logs "oneDNN custom operations are on" (and absl's notice
# that logging is not initialized) from the static initializers of two of its
# libraries, before it reads TF_CPP_MIN_LOG_LEVEL: only turning the oneDNN ops
# off stops it. sparseflow runs no TensorFlow math (it parses records, reads
# files and writes summaries with it), so those ops do nothing for it.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
# TensorFlow's INFO lines (the CPU feature guard's); warnings and errors show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

# `apache_beam.io` imports Beam's BigQuery I/O (and after it, in the same try
# block, Pub/Sub and GCS) if it can; without the GCP extras (apitools), that
# import logs "apitools not found ..." on the root logger, and the I/O cannot
# work anyway. sparseflow uses none of them: a None entry makes the import
# raise the ImportError Beam expects of missing extras, so it skips them.
if importlib.util.find_spec("apitools") is None:
    sys.modules.setdefault("apache_beam.io.gcp.bigquery", None)
