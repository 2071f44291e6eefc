"""Apache Beam jobs: offline FDO statistics (docs/design.md section 8) and imports.

`run_fdo_job` reads a dataset, forms the run's global batches, lays them out
with the online preprocessing and writes an FDO stats file
(`embedding.FdoStats`) whose limits `embedding.apply_fdo` puts into the specs.
The transforms and CombineFns it is made of are public for other pipelines.
`plot_fdo_stats` imports matplotlib when first used: the job's workers need
none of it.

`run_import_job` turns CSV/TSV or Parquet files into sharded record files of
`tf.train.Example`s (docs/import.md).
"""

import importlib

from beam_jobs._batch_stats import BatchStats
from beam_jobs._batches import SparseRows
from beam_jobs._columns import (
    LABEL_KEY,
    Column,
    ColumnKind,
    ColumnSpec,
    ColumnSpecError,
    criteo_spec,
    parse_columns,
    spec_from_names,
)
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
from beam_jobs._import_sources import InputFormat, first_line, parquet_spec
from beam_jobs._job_config import FdoJobConfig, TrainingOrder
from beam_jobs._lines import BadLine, split_line
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
from beam_jobs.import_records import (
    IMPORT_METRICS_NAMESPACE,
    SUMMARY_NAME,
    ImportConfig,
    ImportRecords,
    ImportResult,
    run_import_job,
)

__all__ = [
    "DEAD_LETTERS_NAME",
    "IMPORT_METRICS_NAMESPACE",
    "LABEL_KEY",
    "METRICS_NAMESPACE",
    "PERCENTILES",
    "SUMMARY_NAME",
    "BadLine",
    "BatchStats",
    "Column",
    "ColumnKind",
    "ColumnSpec",
    "ColumnSpecError",
    "CombineFdoStats",
    "ComputeBatchStats",
    "ComputeFdoStats",
    "ElementwiseMaxFn",
    "FdoJobConfig",
    "FdoJobResult",
    "FdoStatsFn",
    "IdFrequencyFn",
    "ImportConfig",
    "ImportRecords",
    "ImportResult",
    "InputFormat",
    "IntHistogramFn",
    "MergeAccumulatorsFn",
    "PartialCombineFn",
    "ReadGlobalBatches",
    "SparseRows",
    "TrainingOrder",
    "WriteDeadLetters",
    "WriteFdoStatsFile",
    "criteo_spec",
    "first_line",
    "histogram_percentiles",
    "make_pipeline",
    "parquet_spec",
    "parse_columns",
    "plot_fdo_stats",
    "run_fdo_job",
    "run_import_job",
    "spec_from_names",
    "split_line",
]

_LAZY_EXPORTS = {"plot_fdo_stats": "beam_jobs._plot"}


def __getattr__(name: str):
    if name in _LAZY_EXPORTS:
        return getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
