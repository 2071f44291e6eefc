"""Input pipelines: record files, parsing, synthetic datasets.

Records are serialized `tf.train.Example`s in ArrayRecord or TFRecord files;
`parse_examples` turns a batch of them into ragged ids (`embedding.RaggedIds`),
dense features and labels, reading the keys a `RecordSchema` names.

`make_grain_iterator` and `make_tfdata_iterator` are the one-call paths;
`ParseRecords` and `LayOutBatch` (Grain transforms) and `TFDataPreprocess`
(a tf.data map) put the same parsing and preprocessing into a pipeline of
one's own.
"""

from pipelines._array_record import ArrayRecordReader
from pipelines._batching import BatchingConfig, BatchPlan
from pipelines._dense_moments import DENSE_MOMENTS_NAME, dense_moments_content, load_dense_moments
from pipelines._device import (
    DEFAULT_INPUT_TIMEOUT_S,
    DeviceBatch,
    DeviceIterator,
    to_device_batch,
)
from pipelines._errors import DataError, InputTimeoutError, InputWorkerError
from pipelines._grain import (
    GrainOptions,
    WorkerPriority,
    batch_layout_stats,
    batch_record_indices,
    init_grain_worker,
    make_grain_iterator,
    num_records,
)
from pipelines._grain_transforms import LayOutBatch, ParseRecords
from pipelines._host_iterator import HostIterator
from pipelines._packing import PackedInput, PackedLayout, pack, packed_shape
from pipelines._parse import (
    BadRecordError,
    FeatureLayout,
    ParsedBatch,
    parse_examples,
    parse_examples_lenient,
)
from pipelines._preprocess_stage import (
    BadRecordPolicy,
    HostAgreementError,
    HostBatch,
    InputRecordError,
    PreprocessConfig,
    PreprocessStage,
)
from pipelines._records import RecordFileWriter, RecordFormat, list_record_files, read_records
from pipelines._schema import (
    DenseColumn,
    DenseTransform,
    IdType,
    LabelColumn,
    RecordSchema,
    SparseColumn,
    ValueType,
)
from pipelines._shuffle import batch_plan
from pipelines._stats import BatchReport, PipelineStats
from pipelines._synthetic import SyntheticDataset, SyntheticFeature, write_synthetic_dataset
from pipelines._tfdata import make_tfdata_iterator
from pipelines._tfdata_map import TFDataPreprocess

__all__ = [
    "ArrayRecordReader",
    "PreprocessStage",
    "dense_moments_content",
    "DEFAULT_INPUT_TIMEOUT_S",
    "DENSE_MOMENTS_NAME",
    "BadRecordError",
    "BadRecordPolicy",
    "BatchReport",
    "BatchPlan",
    "BatchingConfig",
    "DataError",
    "DenseColumn",
    "DenseTransform",
    "DeviceBatch",
    "DeviceIterator",
    "FeatureLayout",
    "GrainOptions",
    "HostAgreementError",
    "HostBatch",
    "HostIterator",
    "IdType",
    "InputRecordError",
    "InputTimeoutError",
    "InputWorkerError",
    "LayOutBatch",
    "LabelColumn",
    "PackedInput",
    "PackedLayout",
    "ParseRecords",
    "ParsedBatch",
    "PipelineStats",
    "PreprocessConfig",
    "RecordFileWriter",
    "RecordFormat",
    "RecordSchema",
    "SparseColumn",
    "SyntheticDataset",
    "SyntheticFeature",
    "TFDataPreprocess",
    "ValueType",
    "WorkerPriority",
    "batch_layout_stats",
    "batch_plan",
    "batch_record_indices",
    "init_grain_worker",
    "list_record_files",
    "load_dense_moments",
    "make_grain_iterator",
    "make_tfdata_iterator",
    "num_records",
    "pack",
    "packed_shape",
    "parse_examples",
    "parse_examples_lenient",
    "read_records",
    "to_device_batch",
    "write_synthetic_dataset",
]
