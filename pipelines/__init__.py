"""Input pipelines: record files, parsing, synthetic datasets.

Records are serialized `tf.train.Example`s in ArrayRecord or TFRecord files;
`parse_examples` turns a batch of them into ragged ids (`embedding.RaggedIds`),
dense features and labels, reading the keys a `RecordSchema` names.
"""

from pipelines._batching import BatchingConfig
from pipelines._dense_moments import DENSE_MOMENTS_NAME, load_dense_moments
from pipelines._device import DeviceBatch, DeviceIterator, to_device_batch
from pipelines._grain import (
    GrainOptions,
    WorkerPriority,
    batch_record_indices,
    make_grain_iterator,
)
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
)
from pipelines._records import list_record_files, read_records
from pipelines._schema import (
    DenseColumn,
    DenseTransform,
    IdType,
    LabelColumn,
    RecordSchema,
    SparseColumn,
    ValueType,
)
from pipelines._stats import BatchReport, PipelineStats
from pipelines._synthetic import SyntheticDataset, SyntheticFeature, write_synthetic_dataset
from pipelines._tfdata import make_tfdata_iterator

__all__ = [
    "DENSE_MOMENTS_NAME",
    "BadRecordError",
    "BadRecordPolicy",
    "BatchReport",
    "BatchingConfig",
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
    "LabelColumn",
    "PackedInput",
    "PackedLayout",
    "ParsedBatch",
    "PipelineStats",
    "PreprocessConfig",
    "RecordSchema",
    "SparseColumn",
    "SyntheticDataset",
    "SyntheticFeature",
    "ValueType",
    "WorkerPriority",
    "batch_record_indices",
    "list_record_files",
    "load_dense_moments",
    "make_grain_iterator",
    "make_tfdata_iterator",
    "pack",
    "packed_shape",
    "parse_examples",
    "parse_examples_lenient",
    "read_records",
    "to_device_batch",
    "write_synthetic_dataset",
]
