"""Parsing and preprocessing as Grain transforms, for a Grain pipeline of one's own.

A pipeline that reads, orders and batches records itself ends in two maps:

    grain.MapDataset.source(grain.sources.ArrayRecordDataSource(files))
      .batch(host_batch, batch_fn=list)   # this host's rows of each global batch
      .map(ParseRecords(layout))           # -> ParsedBatch
      .map_with_index(LayOutBatch(config)) # -> HostBatch, its index the batch number
      .to_iter_dataset()
      .mp_prefetch(options, worker_init_fn=init_grain_worker)

`make_grain_iterator` runs the same parsing (`parse_examples`) and the same
layout (`PreprocessStage.lay_out`), with its own record order and bad-record
fill-ins on top, so both give equal batches for equal records.

`LayOutBatch` takes the dataset index as the batch number, the key on which
the hosts agree on a batch's minibatching: every host must lay out the same
global batch at the same index, and with worker processes, `init_grain_worker`
as `worker_init_fn` makes worker w join agreement group w.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import grain
import numpy as np

from pipelines._grain import check_worker_batch
from pipelines._parse import FeatureLayout, ParsedBatch, parse_examples
from pipelines._preprocess_stage import HostBatch, PreprocessConfig, PreprocessStage


class ParseRecords(grain.transforms.Map):
    """A Grain map: a batch of serialized `tf.train.Example`s -> `ParsedBatch`.

    Args:
      layout: what the records hold.

    The element is a list (or 1-D object array) of `bytes` (batch with
    `batch_fn=list`: Grain's default batch of bytes is a fixed-width array
    that has lost the records' trailing zero bytes, and is refused). A bad record
    raises `BadRecordError` naming its index in the batch: skipping bad
    records and filling their rows is `make_grain_iterator`'s
    (`on_bad_record="skip"`), which knows the records that follow a batch.
    """

    def __init__(self, layout: FeatureLayout):
        if not isinstance(layout, FeatureLayout):
            raise TypeError(f"layout must be a FeatureLayout, got {type(layout).__name__}.")
        self._layout = layout

    def map(self, element: Sequence[bytes] | np.ndarray) -> ParsedBatch:
        return parse_examples(element, self._layout)


class LayOutBatch(grain.transforms.MapWithIndex):
    """A Grain map with index: (batch number, `ParsedBatch`) -> `HostBatch`.

    Lays this host's rows of a global batch out for its local devices under
    the specs' limits, dropping ids or minibatching as `config` says (the
    hosts agree on the split with key `2 * batch number`). The batch's
    `report` counts its records and the layout's seconds and drops.

    Args:
      config: the specs, devices and policies (its `layout` and
        `on_bad_record` are `ParseRecords`' business and unused here).

    Call `close()` when done, in the process that built it: it stops this
    process's all-reduce node, if minibatching made one.
    """

    def __init__(self, config: PreprocessConfig):
        if not isinstance(config, PreprocessConfig):
            raise TypeError(f"config must be a PreprocessConfig, got {type(config).__name__}.")
        self._stage = PreprocessStage(config)

    def map_with_index(self, index: int, element: ParsedBatch) -> HostBatch:
        batch_number = int(index)
        check_worker_batch(batch_number)
        if not isinstance(element, ParsedBatch):
            raise TypeError(
                f"Batch {batch_number}: expected a ParsedBatch (from ParseRecords), got "
                f"{type(element).__name__}."
            )
        start = time.perf_counter()
        laid_out = self._stage.lay_out(batch_number, element, where=f"batch {batch_number}")
        report = laid_out.report(
            records=len(element.labels),
            bad_records=0,
            read_s=0.0,
            parse_s=0.0,
            preprocess_s=time.perf_counter() - start,
        )
        return HostBatch(batch_number, laid_out.sparse, element.dense, element.labels, report)

    def close(self) -> None:
        self._stage.close()
