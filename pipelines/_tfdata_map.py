"""Parsing and preprocessing as a map of a tf.data pipeline of one's own.

    preprocess = TFDataPreprocess(config)
    dataset = (
        tf.data.TFRecordDataset(files)
        .batch(host_batch, drop_remainder=True)   # this host's rows of each global batch
        .enumerate()                              # the batch number
        .map(preprocess)                          # -> (number, sparse, dense, labels, report)
    )
    for element in dataset.as_numpy_iterator():
        batch = preprocess.host_batch(element)    # a HostBatch

The map runs `parse_examples` and `PreprocessStage.lay_out` (what
`make_tfdata_iterator` and the Grain paths run) inside `tf.numpy_function`,
so it holds the Python GIL while it works: parallel calls
(`num_parallel_calls`) overlap only the parts that release it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import numpy as np

from pipelines._packing import PackedInput, packed_layout
from pipelines._parse import parse_examples
from pipelines._preprocess_stage import HostBatch, PreprocessConfig, PreprocessStage
from pipelines._stats import BatchReport
from pipelines._tensorflow import tf


class TFDataPreprocess:
    """A tf.data map: (batch number, serialized records) -> a host batch's tensors.

    Args:
      config: the layout, specs, devices and policies. A bad record raises
        (`BadRecordError` naming its index in the batch); skipping bad
        records with fill-ins is `make_tfdata_iterator`'s.

    Calling it on `(batch_number: int64[], records: string[host_batch])`
    gives the tuple `(batch_number int64[], sparse int32[L, width], dense
    float32[host_batch, num_dense_features], labels int32[host_batch],
    report string[])` (the packed layout, `PackedInput.data`, and the
    `BatchReport` as JSON); `host_batch` turns the tuple's numpy values into
    a `HostBatch`. The batch number is the key of the hosts' agreement on
    minibatching: every host must give the same global batch the same number.

    Call `close()` when done: it stops this process's all-reduce node, if
    minibatching made one.
    """

    def __init__(self, config: PreprocessConfig):
        if not isinstance(config, PreprocessConfig):
            raise TypeError(f"config must be a PreprocessConfig, got {type(config).__name__}.")
        self._stage = PreprocessStage(config)
        self._packed_layout = packed_layout(
            config.preprocessed_input_shapes(), config.local_device_count
        )
        self._host_batch_size = config.global_batch_size // config.num_hosts

    def __call__(
        self, batch_number: tf.Tensor, records: tf.Tensor
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
        outputs = tf.numpy_function(
            self.numpy_map,
            [batch_number, records],
            [tf.int64, tf.int32, tf.float32, tf.int32, tf.string],
            name="sparseflow_preprocess",
        )
        config = self._stage.config
        rows = self._host_batch_size
        shapes = (
            [],
            [config.local_device_count, None],
            [rows, config.layout.num_dense_features],
            [rows],
            [],
        )
        for tensor, shape in zip(outputs, shapes, strict=True):
            tensor.set_shape(shape)
        return tuple(outputs)

    def numpy_map(
        self, batch_number: int | np.integer, records: Sequence[bytes] | np.ndarray
    ) -> tuple[np.int64, np.ndarray, np.ndarray, np.ndarray, bytes]:
        """The map on numpy values (what `tf.numpy_function` calls).

        Raises:
          ValueError: a batch of another size than this host's rows
            (`global_batch_size / hosts`), or as `PreprocessStage`.
          BadRecordError: a record that does not parse.
        """
        batch_number = int(batch_number)
        if len(records) != self._host_batch_size:
            raise ValueError(
                f"Batch {batch_number} holds {len(records)} records; this host lays out "
                f"{self._host_batch_size} per batch (batch with drop_remainder=True)."
            )
        start = time.perf_counter()
        parsed = parse_examples(records, self._stage.config.layout)
        parsed_at = time.perf_counter()
        laid_out = self._stage.lay_out(batch_number, parsed, where=f"batch {batch_number}")
        report = laid_out.report(
            records=len(records),
            bad_records=0,
            read_s=0.0,
            parse_s=parsed_at - start,
            preprocess_s=time.perf_counter() - parsed_at,
        )
        return (
            np.int64(batch_number),
            laid_out.sparse.data,
            parsed.dense,
            parsed.labels,
            json.dumps(report._asdict()).encode(),
        )

    def host_batch(self, element: Sequence) -> HostBatch:
        """The `HostBatch` of one numpy element of the mapped dataset."""
        batch_number, sparse, dense, labels, report = element
        return HostBatch(
            int(batch_number),
            PackedInput(np.asarray(sparse, np.int32), self._packed_layout),
            np.asarray(dense, np.float32),
            np.asarray(labels, np.int32),
            BatchReport(**json.loads(report)),
        )

    def close(self) -> None:
        self._stage.close()
