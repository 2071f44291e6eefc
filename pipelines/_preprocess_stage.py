"""From one host batch of serialized records to the devices' preprocessed layout.

`PreprocessStage` parses a host batch (`parse_examples`), deals with bad
records per `on_bad_record`, and lays the sparse features out for the local
devices with `embedding.preprocess_sparse_dense_matmul_input`, under the
limits of the feature specs (set them from FDO statistics to size buffers for
the real data). Ids over a limit are dropped and counted
(`allow_id_dropping`), or the batch is split into minibatches
(`enable_minibatching`), on which all hosts agree through an all-reduce keyed
by the batch number; without either, a breach raises.

The stage is picklable: Grain copies it into its worker processes, and each
process creates its all-reduce node on first use (`LazyAllReduce`).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

import embedding
from embedding.checks import check_int
from parallel import allreduce
from pipelines._batching import BatchingConfig, BatchPlan, RecordReader
from pipelines._errors import DataError
from pipelines._packing import PackedInput, pack
from pipelines._parse import (
    BadRecordError,
    FeatureLayout,
    ParsedBatch,
    parse_examples,
    parse_examples_lenient,
)
from pipelines._stats import BatchReport

_log = logging.getLogger(__name__)


class BadRecordPolicy(str, enum.Enum):
    """What the pipeline does with a record that does not parse."""

    SKIP = "skip"
    """Skip it, count it, log why, and fill the batch with the next good records."""
    RAISE = "raise"
    """Raise `InputRecordError` naming the record, its file and the reason."""


class InputRecordError(DataError):
    """A bad record met with `on_bad_record="raise"`, or too few good records to fill a batch."""


class HostAgreementError(RuntimeError):
    """The hosts could not agree on a batch's minibatching (a host stopped or is too slow)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    """What the preprocessing stage computes for each host batch.

    Attributes:
      feature_specs: the features to lay out, by name (each name a sparse
        feature of `layout`); their tables' limits (e.g. from FDO
        statistics) bound the layout. Prepared or not.
      layout: what the records hold.
      local_device_count: L, devices of this host (`mesh.local_mesh.size`).
      global_device_count: G, devices of all hosts (`mesh.size`).
      num_sc_per_device: S, embedding partitions per device.
      allow_id_dropping: drop and count ids over the limits instead of raising.
      enable_minibatching: split a batch over the limits into minibatches.
      invalid_id_policy: raise on ids outside a vocabulary, or drop and count them.
      on_bad_record: skip or raise on records that do not parse.
      agreement: the all-reduce group of the hosts (rank = this host's
        process index), required for minibatching on several hosts. With
        Grain workers, worker w of every host agrees on the ports of
        `agreement.for_worker(w)`.
    """

    feature_specs: Mapping[str, embedding.FeatureSpec]
    layout: FeatureLayout
    local_device_count: int
    global_device_count: int
    num_sc_per_device: int
    allow_id_dropping: bool = False
    enable_minibatching: bool = False
    invalid_id_policy: embedding.InvalidIdPolicy = embedding.InvalidIdPolicy.RAISE
    on_bad_record: BadRecordPolicy = BadRecordPolicy.RAISE
    agreement: allreduce.AllReduceConfig | None = None

    def __post_init__(self):
        object.__setattr__(self, "feature_specs", dict(self._checked_specs()))
        object.__setattr__(
            self,
            "invalid_id_policy",
            checked_enum(embedding.InvalidIdPolicy, self.invalid_id_policy, "invalid_id_policy"),
        )
        object.__setattr__(
            self,
            "on_bad_record",
            checked_enum(BadRecordPolicy, self.on_bad_record, "on_bad_record"),
        )
        for name in ("local_device_count", "global_device_count", "num_sc_per_device"):
            value = getattr(self, name)
            check_int(value, name, 1)
        if self.global_device_count % self.local_device_count:
            raise ValueError(
                f"local_device_count {self.local_device_count} must divide "
                f"global_device_count {self.global_device_count}."
            )
        self._check_agreement()

    @property
    def num_hosts(self) -> int:
        return self.global_device_count // self.local_device_count

    def _checked_specs(self) -> Mapping[str, embedding.FeatureSpec]:
        specs = self.feature_specs
        if not isinstance(specs, Mapping) or not specs:
            raise TypeError(
                "feature_specs must be a non-empty mapping of feature name -> FeatureSpec, "
                f"got {type(specs).__name__}."
            )
        if not isinstance(self.layout, FeatureLayout):
            raise TypeError(f"layout must be a FeatureLayout, got {type(self.layout).__name__}.")
        for name, spec in specs.items():
            if not isinstance(spec, embedding.FeatureSpec):
                raise TypeError(
                    f"feature_specs[{name!r}] is a {type(spec).__name__}, not a FeatureSpec."
                )
            if name not in self.layout.sparse:
                raise ValueError(
                    f"Feature {name!r} of feature_specs is not a sparse feature of the records "
                    f"(layout.sparse: {list(self.layout.sparse)})."
                )
        return specs

    def _check_agreement(self) -> None:
        if self.agreement is not None:
            if not isinstance(self.agreement, allreduce.AllReduceConfig):
                raise TypeError(
                    f"agreement must be a parallel.allreduce.AllReduceConfig, got "
                    f"{type(self.agreement).__name__}."
                )
            if self.agreement.world_size != self.num_hosts:
                raise ValueError(
                    f"agreement lists {self.agreement.world_size} hosts but the devices "
                    f"make {self.num_hosts} ({self.global_device_count} global / "
                    f"{self.local_device_count} local)."
                )
        elif self.enable_minibatching and self.num_hosts > 1:
            raise ValueError(
                f"Minibatching on {self.num_hosts} hosts needs `agreement` (a "
                "parallel.allreduce.AllReduceConfig listing every host) so that the hosts "
                "agree on each batch's split."
            )

    def preprocessed_input_shapes(self) -> embedding.PreprocessedInput:
        """The layout's shapes and dtypes (`embedding.preprocessed_input_shapes`)."""
        return embedding.preprocessed_input_shapes(
            self.feature_specs,
            self.local_device_count,
            self.global_device_count,
            num_sc_per_device=self.num_sc_per_device,
            enable_minibatching=self.enable_minibatching,
        )

    @property
    def global_batch_size(self) -> int:
        """The global batch of the feature specs (they must all agree)."""
        sizes = {spec.global_batch_size for spec in self.feature_specs.values()}
        if len(sizes) != 1:
            raise ValueError(
                f"The feature specs have different global batch sizes {sorted(sizes)}."
            )
        return sizes.pop()


def checked_enum(cls: type[enum.Enum], value, what: str):
    """`cls(value)`, or a ValueError naming `what` and the choices."""
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(repr(member.value) for member in cls)
        raise ValueError(f"{what} must be one of {choices}; got {value!r}.") from None


def check_batch_sizes(batching: BatchingConfig, preprocess: PreprocessConfig) -> None:
    """Checks that the batching and the specs describe the same batches.

    Raises:
      ValueError: the global batches differ, or the host count differs from
        the devices' host count.
    """
    if preprocess.global_batch_size != batching.global_batch_size:
        raise ValueError(
            f"The feature specs are for a global batch of {preprocess.global_batch_size}, "
            f"the batching config for {batching.global_batch_size}; make them equal."
        )
    if preprocess.num_hosts != batching.process_count:
        raise ValueError(
            f"The devices make {preprocess.num_hosts} hosts ({preprocess.global_device_count} "
            f"global / {preprocess.local_device_count} local) but process_count is "
            f"{batching.process_count}."
        )


class HostBatch(NamedTuple):
    """One host's rows of a global batch, laid out for its local devices (numpy).

    Attributes:
      batch_number: the global batch's index, the same on every host.
      sparse: the layout of every stacked table and the minibatch count,
        packed into one `int32[L, width]` array (`PackedInput`; see
        `embedding.preprocess_sparse_dense_matmul_input` for the arrays).
      dense: `float32[host_batch, num_dense_features]`.
      labels: `int32[host_batch]`.
      report: how preparing the batch went.
    """

    batch_number: int
    sparse: PackedInput
    dense: np.ndarray
    labels: np.ndarray
    report: BatchReport

    @property
    def preprocessed(self) -> embedding.PreprocessedInput:
        """The layout's arrays, unpacked (numpy copies): `row_pointers`
        `int32[L * ...]` etc. per stacked table, `num_minibatches` `int32[L]`."""
        return self.sparse.unpack()


class LaidOutBatch(NamedTuple):
    """A host batch's layout and what laying it out counted.

    Attributes:
      sparse: the layout, packed.
      stats: the preprocessing's statistics.
      num_minibatches: minibatches of the batch (1 without minibatching).
    """

    sparse: PackedInput
    stats: embedding.SparseDenseMatmulInputStats
    num_minibatches: int

    def report(
        self, *, records: int, bad_records: int, read_s: float, parse_s: float, preprocess_s: float
    ) -> BatchReport:
        """The batch's `BatchReport`, with the counts and seconds of the stages before."""
        return BatchReport(
            records=records,
            bad_records=bad_records,
            read_s=read_s,
            parse_s=parse_s,
            preprocess_s=preprocess_s,
            dropped_ids={name: int(n) for name, n in self.stats.id_drop_counters.items()},
            invalid_ids={name: int(n) for name, n in self.stats.invalid_id_counters.items()},
            num_minibatches=self.num_minibatches,
        )


class PreprocessStage:
    """Parses and preprocesses host batches (picklable; see `PreprocessConfig`)."""

    def __init__(self, config: PreprocessConfig):
        self._config = config
        self._all_reduce = (
            allreduce.LazyAllReduce(config.agreement)
            if config.agreement is not None and config.enable_minibatching
            else None
        )

    @property
    def config(self) -> PreprocessConfig:
        return self._config

    def __call__(
        self,
        batch_number: int,
        records: list[bytes],
        *,
        plan: BatchPlan,
        reader: RecordReader,
        read_s: float = 0.0,
        allocate: Callable[[], np.ndarray | None] | None = None,
    ) -> HostBatch:
        """Prepares this host's rows of global batch `batch_number`.

        Args:
          batch_number: the global batch.
          records: its `host_batch` serialized records, in row order.
          plan: the batching, to find fill-in records and name bad ones.
          reader: reads fill-in records.
          read_s: seconds the caller spent reading `records` (reported).
          allocate: returns the `int32[L, width]` array to pack the layout
            into (`packed_shape`), or None for a new one; called once the
            batch is laid out.

        Raises:
          InputRecordError: a bad record with `on_bad_record="raise"`, or too
            few good records to fill the batch.
          HostAgreementError: the hosts could not agree on minibatching.
          ValueError: a limit breach without dropping or minibatching, or an
            invalid id with the "raise" policy (the message names the batch).
        """
        start = time.perf_counter()
        parsed, bad_records, fill = self._parse(batch_number, records, plan, reader)
        parsed_at = time.perf_counter()
        laid_out = self.lay_out(
            batch_number, parsed, where=_where(batch_number, plan), allocate=allocate
        )
        report = laid_out.report(
            records=len(records) + fill.records,
            bad_records=bad_records,
            read_s=read_s + fill.read_s,
            parse_s=parsed_at - start - fill.read_s,
            preprocess_s=time.perf_counter() - parsed_at,
        )
        return HostBatch(batch_number, laid_out.sparse, parsed.dense, parsed.labels, report)

    def lay_out(
        self,
        batch_number: int,
        parsed: ParsedBatch,
        *,
        where: str,
        allocate: Callable[[], np.ndarray | None] | None = None,
    ) -> LaidOutBatch:
        """Lays a parsed host batch out for the local devices, packed.

        Args:
          batch_number: the global batch (the key of the hosts' agreement on
            minibatching).
          parsed: its `host_batch` rows.
          where: names the batch in error messages.
          allocate: as for `__call__`.

        Raises:
          HostAgreementError, ValueError: as `__call__`.
        """
        preprocessed, stats = self._preprocess(batch_number, parsed, where)
        devices = self._config.local_device_count
        sparse = pack(preprocessed, devices, out=None if allocate is None else allocate())
        return LaidOutBatch(sparse, stats, int(preprocessed.num_minibatches[0]))

    def close(self) -> None:
        """Closes this process's all-reduce node, if the stage created one."""
        if self._all_reduce is not None:
            self._all_reduce.close()

    def _parse(self, batch_number: int, records: list[bytes], plan: BatchPlan, reader):
        layout = self._config.layout
        if self._config.on_bad_record is BadRecordPolicy.RAISE:
            try:
                return parse_examples(records, layout), 0, _Fill(0, 0.0)
            except BadRecordError as error:
                record = plan.record_indices(batch_number)[error.index]
                more = f" ({error.others} more bad records in the batch)" if error.others else ""
                raise InputRecordError(
                    f"{_where(batch_number, plan)}: {reader.files.describe(int(record))} is "
                    f"bad: {error.reason}{more}. Repair or remove it, or set "
                    "on_bad_record='skip' to skip bad records."
                ) from error
        parsed, problems = parse_examples_lenient(records, layout)
        if not problems:
            return parsed, 0, _Fill(0, 0.0)
        indices = plan.record_indices(batch_number)
        for row, reason in problems:
            _log.warning(
                "%s: skipping %s: %s",
                _where(batch_number, plan),
                reader.files.describe(int(indices[row])),
                reason,
            )
        bad_rows = {row for row, _ in problems}
        good = [record for row, record in enumerate(records) if row not in bad_rows]
        fill = _fill(good, len(records), batch_number, plan, reader, layout)
        return parse_examples(good, layout), len(problems), fill

    def _preprocess(self, batch_number: int, parsed: ParsedBatch, where: str):
        config = self._config
        names = list(config.feature_specs)
        try:
            return embedding.preprocess_sparse_dense_matmul_input(
                {name: parsed.ids[name] for name in names},
                _weights(parsed, names),
                config.feature_specs,
                config.local_device_count,
                config.global_device_count,
                num_sc_per_device=config.num_sc_per_device,
                allow_id_dropping=config.allow_id_dropping,
                batch_number=batch_number,
                enable_minibatching=config.enable_minibatching,
                all_reduce_interface=self._all_reduce,
                invalid_id_policy=config.invalid_id_policy,
            )
        except allreduce.AllReduceError as error:
            # Raised in a worker process, the error travels to the main one by
            # pickling: this one carries its message only.
            raise HostAgreementError(
                f"{where}: the hosts could not agree on minibatching: "
                f"{error}. Every host must run the same batches: the same dataset size, "
                "global batch, epochs and Grain worker count."
            ) from error
        except ValueError as error:
            error.add_note(f"In {where}.")
            if isinstance(error, embedding.LimitBreachError):
                error.batch_number = batch_number
            raise

    def layout_stats(
        self, batch_number: int, records: list[bytes], *, plan: BatchPlan, reader: RecordReader
    ) -> embedding.SparseDenseMatmulInputStats:
        """The stats of this host's rows of a batch laid out (bad records as in `__call__`).

        With dropping allowed (`PreprocessConfig.allow_id_dropping`), a batch
        over the limits is counted as it is, before anything is dropped.
        """
        parsed, _, _ = self._parse(batch_number, records, plan, reader)
        return self._preprocess(batch_number, parsed, _where(batch_number, plan))[1]


class _Fill(NamedTuple):
    records: int
    read_s: float


def _fill(
    good: list[bytes],
    size: int,
    batch_number: int,
    plan: BatchPlan,
    reader: RecordReader,
    layout: FeatureLayout,
) -> _Fill:
    """Appends to `good` the first good records after the batch, up to `size`."""
    read = 0
    read_s = 0.0
    for indices in plan.following_record_indices(batch_number):
        position = 0
        while position < indices.size and len(good) < size:
            wanted = indices[position : position + size - len(good)]
            position += wanted.size
            chunk_start = time.perf_counter()
            chunk = reader.read(wanted.tolist())
            read_s += time.perf_counter() - chunk_start
            read += len(chunk)
            _, problems = parse_examples_lenient(chunk, layout)
            bad_rows = {row for row, _ in problems}
            good.extend(record for row, record in enumerate(chunk) if row not in bad_rows)
        if len(good) == size:
            return _Fill(read, read_s)
    raise InputRecordError(
        f"{_where(batch_number, plan)}: this host's share of the epoch holds only "
        f"{len(good)} good records for a host batch of {size}; the dataset is mostly "
        "bad records."
    )


def _where(batch_number: int, plan: BatchPlan) -> str:
    config = plan.config
    return f"batch {batch_number} (host {config.process_index} of {config.process_count})"


def _weights(parsed: ParsedBatch, names: list[str]):
    """The weights pytree: None when no feature is weighted.

    An unweighted feature's leaf is None (weight 1 per id), which spares
    building and checking an array of ones per feature and batch.
    """
    if not any(name in parsed.weights for name in names):
        return None
    return {name: parsed.weights.get(name) for name in names}
