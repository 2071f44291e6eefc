"""sparseflow: the application layer (config loading and the command line).

The library lives in `embedding`, `parallel`, `pipelines` and `beam_jobs`;
this package only wires them together for a run described by a YAML config.
"""

# First: it sets the logging environment before the imports below load TensorFlow and Beam.
from sparseflow import _quiet_imports  # noqa: F401
from sparseflow._errors import SparseflowError, UsageError
from sparseflow._predict import Predictions, PredictOptions, predict
from sparseflow._shipped_configs import shipped_config, shipped_config_names
from sparseflow._train import TrainResult
from sparseflow._trainer import Trainer
from sparseflow._version import __version__
from sparseflow.config import (
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
    "PredictOptions",
    "Predictions",
    "PreprocessingConfig",
    "RunConfig",
    "SparseflowError",
    "TrainResult",
    "Trainer",
    "UsageError",
    "__version__",
    "load_config",
    "predict",
    "shipped_config",
    "shipped_config_names",
]
