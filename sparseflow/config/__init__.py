"""A run's YAML config: loaded, checked key by key, and read into typed sections.

`load_config` reads one file into a `RunConfig` (the mesh, the batch, the
tables and features, the record layout, the data, preprocessing, the model
and training, and for `make-data` and the demo the synthetic data). A
missing, unknown or mistyped key is a `ConfigError` naming the file and the
entry's YAML path. Each section has its own private module here; the
names below are also exported by `sparseflow`.
"""

from sparseflow.config._checker import ConfigError
from sparseflow.config._dataset import DatasetConfig
from sparseflow.config._mesh import MeshConfig
from sparseflow.config._preprocessing import PreprocessingConfig
from sparseflow.config._run_config import RunConfig, load_config
from sparseflow.config._training import ModelConfig, TrainingConfig

__all__ = [
    "ConfigError",
    "DatasetConfig",
    "MeshConfig",
    "ModelConfig",
    "PreprocessingConfig",
    "RunConfig",
    "TrainingConfig",
    "load_config",
]
