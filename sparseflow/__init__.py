"""sparseflow: the application layer (config loading and the command line).

The library lives in `embedding`, `parallel`, `pipelines` and `beam_jobs`;
this package only wires them together for a run described by a YAML config.
"""

import os

# TensorFlow (record parsing) logs its C++ start-up banners unless told not to;
# an explicit setting by the user wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from sparseflow._config import (  # noqa: E402
    ConfigError,
    DatasetConfig,
    MeshConfig,
    PreprocessingConfig,
    RunConfig,
    load_config,
)

__all__ = [
    "ConfigError",
    "DatasetConfig",
    "MeshConfig",
    "PreprocessingConfig",
    "RunConfig",
    "load_config",
]
