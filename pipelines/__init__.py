"""Input pipelines: record files, parsing, synthetic datasets.

Records are serialized `tf.train.Example`s in ArrayRecord or TFRecord files;
`parse_examples` turns a batch of them into ragged ids (`embedding.RaggedIds`),
dense features and labels.
"""

from pipelines._parse import (
    BadRecordError,
    FeatureLayout,
    ParsedBatch,
    parse_examples,
    parse_examples_lenient,
)
from pipelines._records import list_record_files, read_records
from pipelines._synthetic import SyntheticDataset, SyntheticFeature, write_synthetic_dataset

__all__ = [
    "BadRecordError",
    "FeatureLayout",
    "ParsedBatch",
    "SyntheticDataset",
    "SyntheticFeature",
    "list_record_files",
    "parse_examples",
    "parse_examples_lenient",
    "read_records",
    "write_synthetic_dataset",
]
