"""sparseflow: the application layer (config loading and the command line).

The library lives in `embedding`, `parallel`, `pipelines` and `beam_jobs`;
this package only wires them together for a run described by a YAML config.

A public name's module is imported the first time the name is used, so that
`import sparseflow` stays cheap and the `sparseflow` script (in this
package) starts before JAX and the rest are imported (`sparseflow._script`).
"""

from importlib import import_module as _import_module
from typing import TYPE_CHECKING

# First: it sets the logging environment before anything here loads TensorFlow and Beam.
from sparseflow import _quiet_imports  # noqa: F401
from sparseflow._version import __version__ as __version__

if TYPE_CHECKING:  # what editors and type checkers read: the names of `_MODULES`, from its modules
    from sparseflow._errors import SparseflowError as SparseflowError
    from sparseflow._errors import UsageError as UsageError
    from sparseflow._predict import Predictions as Predictions
    from sparseflow._predict import PredictOptions as PredictOptions
    from sparseflow._predict import predict as predict
    from sparseflow._shipped_configs import shipped_config as shipped_config
    from sparseflow._shipped_configs import shipped_config_names as shipped_config_names
    from sparseflow._train import TrainResult as TrainResult
    from sparseflow._trainer import Trainer as Trainer
    from sparseflow.config import ConfigError as ConfigError
    from sparseflow.config import DatasetConfig as DatasetConfig
    from sparseflow.config import MeshConfig as MeshConfig
    from sparseflow.config import PreprocessingConfig as PreprocessingConfig
    from sparseflow.config import RunConfig as RunConfig
    from sparseflow.config import load_config as load_config

# Each public name and the module that defines it (tests/test_public_api.py keeps the
# imports above alike).
_MODULES = {
    "ConfigError": "sparseflow.config",
    "DatasetConfig": "sparseflow.config",
    "MeshConfig": "sparseflow.config",
    "PredictOptions": "sparseflow._predict",
    "Predictions": "sparseflow._predict",
    "PreprocessingConfig": "sparseflow.config",
    "RunConfig": "sparseflow.config",
    "SparseflowError": "sparseflow._errors",
    "TrainResult": "sparseflow._train",
    "Trainer": "sparseflow._trainer",
    "UsageError": "sparseflow._errors",
    "load_config": "sparseflow.config",
    "predict": "sparseflow._predict",
    "shipped_config": "sparseflow._shipped_configs",
    "shipped_config_names": "sparseflow._shipped_configs",
}

__all__ = sorted([*_MODULES, "__version__"])


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'sparseflow' has no attribute {name!r}")
    value = getattr(_import_module(_MODULES[name]), name)
    globals()[name] = value  # the next use is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULES})
