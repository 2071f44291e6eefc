"""TensorFlow, imported when first used.

Only the TFRecord files, the tf.data input path, the parser's
`tf.io.parse_example` fallback and the TensorBoard summaries use it. Importing
it takes seconds and hundreds of megabytes, and it logs as it loads, so the
ArrayRecord path (and every Grain worker process) does without it:
`from pipelines._tensorflow import tf` gives a stand-in that imports
TensorFlow on its first attribute access (`tf.data`, `tf.errors`, ...).
"""

from __future__ import annotations

import importlib


class _LazyTensorFlow:
    """Forwards attribute reads to the `tensorflow` module, importing it on the first."""

    def __getattr__(self, name: str):
        return getattr(importlib.import_module("tensorflow"), name)


tf = _LazyTensorFlow()
