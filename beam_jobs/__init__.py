"""Offline FDO statistics with Apache Beam (docs/design.md section 8).

`run_fdo_job` reads a dataset, forms the run's global batches, lays them out
with the online preprocessing and writes an FDO stats file
(`embedding.FdoStats`) whose limits `embedding.apply_fdo` puts into the specs.
The transforms and CombineFns it is made of are public for other pipelines.
`plot_fdo_stats` imports matplotlib when first used: the job's workers need
none of it.
"""

import importlib

from beam_jobs._batch_stats import BatchStats
from beam_jobs._batches import SparseRows
from beam_jobs._combiners import (
    PERCENTILES,
    ElementwiseMaxFn,
    FdoStatsFn,
    IdFrequencyFn,
    IntHistogramFn,
    MergeAccumulatorsFn,
    PartialCombineFn,
    histogram_percentiles,
)
from beam_jobs._job_config import FdoJobConfig, TrainingOrder
from beam_jobs._transforms import (
    METRICS_NAMESPACE,
    CombineFdoStats,
    ComputeBatchStats,
    ComputeFdoStats,
    ReadGlobalBatches,
    WriteDeadLetters,
    WriteFdoStatsFile,
)
from beam_jobs.fdo_stats import DEAD_LETTERS_NAME, FdoJobResult, make_pipeline, run_fdo_job

__all__ = [
    "DEAD_LETTERS_NAME",
    "METRICS_NAMESPACE",
    "PERCENTILES",
    "BatchStats",
    "CombineFdoStats",
    "ComputeBatchStats",
    "ComputeFdoStats",
    "ElementwiseMaxFn",
    "FdoJobConfig",
    "FdoJobResult",
    "FdoStatsFn",
    "IdFrequencyFn",
    "IntHistogramFn",
    "MergeAccumulatorsFn",
    "PartialCombineFn",
    "ReadGlobalBatches",
    "SparseRows",
    "TrainingOrder",
    "WriteDeadLetters",
    "WriteFdoStatsFile",
    "histogram_percentiles",
    "make_pipeline",
    "plot_fdo_stats",
    "run_fdo_job",
]

_LAZY_EXPORTS = {"plot_fdo_stats": "beam_jobs._plot"}


def __getattr__(name: str):
    if name in _LAZY_EXPORTS:
        return getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
