"""A Beam runner on a Dask distributed cluster, for batch pipelines such as the FDO job.

Beam's own `apache_beam.runners.dask.dask_runner.DaskRunner` (Beam 2.77)
translates a pipeline into Dask bags, and this runner keeps its translation
of `GroupByKey` and `Flatten`, its overrides and its options
(`--dask_client_address`, `--dask_connection_timeout`, `--dask_npartitions`,
...). It departs where Beam's runner would give wrong results for the FDO job:

- `Impulse` (the root of `beam.Impulse()` and of every `beam.Create`) becomes
  a one-element bag; Beam's runner leaves it untranslated.
- A `ParDo`'s tagged outputs reach only the consumers of that tag; Beam's
  runner mixes every output into each of them.
- What `finish_bundle` outputs is kept; Beam's runner drops it.
- Side inputs are computed once, as dependencies of the consuming tasks,
  instead of being computed again inside every task that reads them.
- Every sink is computed, not only the last step visited.
- Counters (`beam.metrics.Metrics.counter`) are collected per bundle and
  summed: `result.metrics()` answers queries as other runners do.

A grouped PCollection is spread over `--dask_npartitions` partitions (default:
one per worker thread); a task holds a partition's outputs in memory (for the
FDO job, its share of the batches), so a large dataset wants more of them,
e.g. one per few hundred thousand records.

Name it as `--runner=beam_jobs.dask_runner.DaskRunner`. Needs
`dask[distributed]` (`pip install 'sparseflow[dask]'`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import dask
import dask.bag as db
import distributed
from apache_beam import pvalue
from apache_beam.metrics.execution import MetricKey, MetricResult, MetricsContainer
from apache_beam.metrics.metric import MetricResults
from apache_beam.pipeline import AppliedPTransform, PipelineVisitor, PTransformOverride
from apache_beam.runners import common
from apache_beam.runners.dask import dask_runner as beam_dask
from apache_beam.runners.dask import overrides as beam_overrides
from apache_beam.runners.dask import transform_evaluator as beam_ops
from apache_beam.runners.runner import PipelineResult, PipelineState
from apache_beam.runners.worker import statesampler
from apache_beam.transforms import core
from apache_beam.transforms.sideinputs import SideInputMap
from apache_beam.utils import counters

__all__ = ["DaskOptions", "DaskRunner", "DaskRunnerResult"]

DaskOptions = beam_dask.DaskOptions
# Beam's `Create` translation warns at every run unless a partitioning is given.
_DEFAULT_PARTITION_SIZE = 128

# The tag of a bundle's counters among its outputs (outputs are (tag, value)).
_METRICS = "__sparseflow_metrics__"


class _ImpulseOverride(PTransformOverride):
    def matches(self, applied_ptransform: AppliedPTransform) -> bool:
        return isinstance(applied_ptransform.transform, core.Impulse)

    def get_replacement_transform_for_applied_ptransform(self, applied_ptransform):
        # An Impulse emits one empty byte string in the global window.
        return beam_overrides._Create((b"",))


class _TagReceiver(common.Receiver):
    def __init__(self, tag: str | None, outputs: list):
        self._tag = tag
        self._outputs = outputs

    def receive(self, windowed_value) -> None:
        self._outputs.append((self._tag, windowed_value.value))


class _Receivers(dict):
    """Per output tag a receiver, all writing `(tag, value)` into one list."""

    def __init__(self):
        super().__init__()
        self.outputs: list = []

    def __missing__(self, tag):
        self[tag] = _TagReceiver(tag, self.outputs)
        return self[tag]


def _run_bundle(
    items: Iterable, step: str, transform, window_fn, views: list, *side_values: Sequence
) -> list:
    """Runs a DoFn over one Dask partition (a bundle): its `(tag, value)` outputs and counters."""
    receivers = _Receivers()
    invoker = _invoker(step, transform, window_fn, receivers, views, side_values)
    container = MetricsContainer(step)
    sampler = statesampler.StateSampler("", counters.CounterFactory())
    statesampler.set_current_tracker(sampler)
    try:
        with sampler.scoped_state(step, "process", metrics_container=container):
            invoker.invoke_setup()
            invoker.invoke_start_bundle()
            for item in items:
                invoker.invoke_process(beam_ops.get_windowed_value(item, window_fn))
            invoker.invoke_finish_bundle()
            invoker.invoke_teardown()
    finally:
        statesampler.set_current_tracker(None)
    receivers.outputs.append((_METRICS, container.get_cumulative().counters))
    return receivers.outputs


def _invoker(
    step: str, transform, window_fn, receivers: _Receivers, views: list, side_values: Sequence
) -> common.DoFnInvoker:
    """The DoFn of `transform`, its outputs going to `receivers`, its side inputs filled."""
    handler = common._OutputHandler(
        window_fn=window_fn,
        main_receivers=receivers[None],
        tagged_receivers=receivers,
        per_element_output_counter=None,
        output_batch_converter=None,
        process_yields_batches=False,
        process_batch_yields_elements=False,
    )
    args, kwargs = transform.raw_side_inputs
    side_inputs = [
        SideInputMap(view_class, view_options, values)
        for (view_class, view_options), values in zip(views, side_values)
    ]
    return common.DoFnInvoker.create_invoker(
        common.DoFnSignature(transform.fn),
        handler,
        context=common.DoFnContext(step, state=None),
        side_inputs=side_inputs,
        input_args=list(args),
        input_kwargs=kwargs,
        user_state_context=None,
        bundle_finalizer_param=core.DoFn.BundleFinalizerParam(),
    )


def _windowed(partitions: list[list], window_fn) -> list:
    return [beam_ops.get_windowed_value(v, window_fn) for values in partitions for v in values]


@dataclasses.dataclass
class _BagVisitor(PipelineVisitor):
    """Translates every primitive transform into bags, one per output PCollection."""

    bag_kwargs: dict
    partitions: int  # of every grouped PCollection
    bags: dict = dataclasses.field(default_factory=dict)  # PCollection -> Bag
    consumed: set = dataclasses.field(default_factory=set)  # PCollections read by a step
    metrics: list = dataclasses.field(default_factory=list)  # bags of counters

    def visit_transform(self, node: AppliedPTransform) -> None:
        inputs = [self.bags.get(p) for p in node.inputs if not isinstance(p, pvalue.PBegin)]
        self.consumed.update(node.inputs)
        self.consumed.update(view.pvalue for view in node.side_inputs)
        if isinstance(node.transform, core.ParDo):
            self._par_do(node, inputs)
            return
        if isinstance(node.transform, beam_overrides._GroupByKeyOnly):
            # A task shuffle keeps the number of partitions: spread them first,
            # or a step fed by one element (a list of files) runs on one worker.
            spread = inputs[0].repartition(npartitions=self.partitions)
            self.bags[node.outputs[None]] = spread.groupby(_key).map(_key_and_values)
            return
        op_class = beam_ops.TRANSLATIONS.get(node.transform.__class__, beam_ops.NoOp)
        op = op_class(node, bag_kwargs=self.bag_kwargs)
        if isinstance(op, beam_ops.Flatten):
            bag = op.apply(inputs)
        else:
            bag = op.apply(inputs[0] if inputs else None)
        for output in node.outputs.values():
            self.bags[output] = bag

    def _par_do(self, node: AppliedPTransform, inputs: list) -> None:
        main_input = next(iter(node.main_inputs.values()))
        window_fn = main_input.windowing.windowfn
        # The partitions unoptimized: they keep the keys other consumers see,
        # so the step behind a side input runs once.
        side_values = [
            dask.delayed(_windowed)(
                self.bags[view.pvalue].to_delayed(optimize_graph=False), view._window_mapping_fn
            )
            for view in node.side_inputs
        ]
        # A side input's options hold its PCollection: taken here, on the client.
        views = [(type(view), view._view_options()) for view in node.side_inputs]
        outputs = inputs[0].map_partitions(
            _run_bundle, node.full_label, node.transform, window_fn, views, *side_values
        )
        self.metrics.append(_values_of(outputs, _METRICS))
        # The main output's tag is None, spelled "None" in some Beam versions.
        for tag, output in node.outputs.items():
            self.bags[output] = _values_of(outputs, None if tag == "None" else tag)

    def sink_bags(self) -> list:
        """The bags no step reads: computing them runs the whole pipeline."""
        return [bag for p, bag in self.bags.items() if p not in self.consumed and bag is not None]


def _key(element: tuple) -> Any:
    return element[0]


def _key_and_values(grouped: tuple) -> tuple:
    # The values stay windowed (as `ReifyWindows` made them): Beam's
    # `GroupAlsoByWindow`, the next step, reads their windows.
    key, elements = grouped
    return key, [value for _, value in elements]


def _values_of(outputs: db.Bag, tag: str | None) -> db.Bag:
    # One task per partition (a filter, then a map, would take two).
    return outputs.map_partitions(_tagged_values, tag)


def _tagged_values(outputs: list, tag: str | None) -> list:
    return [value for output_tag, value in outputs if output_tag == tag]


class _CounterResults(MetricResults):
    """The summed counters of a finished pipeline (other metrics are not collected)."""

    def __init__(self, totals: dict[MetricKey, int]):
        self._totals = totals

    def query(self, filter=None) -> dict[str, list]:
        counters_found = [
            MetricResult(key, value, value)
            for key, value in self._totals.items()
            if self.matches(filter, key)
        ]
        return {
            self.COUNTERS: counters_found,
            self.DISTRIBUTIONS: [],
            self.GAUGES: [],
            self.STRINGSETS: [],
            self.BOUNDED_TRIES: [],
            self.HISTOGRAMS: [],
        }


class DaskRunnerResult(PipelineResult):
    """A pipeline running on Dask; `wait_until_finish` raises a failed task's error."""

    def __init__(self, client: distributed.Client, sinks: list, metrics: distributed.Future):
        super().__init__(PipelineState.RUNNING)
        self._client = client
        self._sinks = sinks
        self._metrics_future = metrics
        self._totals: dict[MetricKey, int] | None = None

    def wait_until_finish(self, duration=None) -> str:
        """Waits for the end (or `duration` ms: then the state is still RUNNING)."""
        timeout = None if duration is None else duration / 1000
        try:
            distributed.wait(self._sinks + [self._metrics_future], timeout=timeout)
        except TimeoutError:
            return self._state
        try:
            # Gathering raises a task's exception here, on the client.
            for future in self._sinks:
                future.result()
            self._totals = _sum_counters(self._metrics_future.result())
            self._state = PipelineState.DONE
        except BaseException:
            self._state = PipelineState.FAILED
            raise
        finally:
            self._client.close()
        return self._state

    def cancel(self) -> str:
        self._client.cancel(self._sinks + [self._metrics_future])
        self._client.close()
        self._state = PipelineState.CANCELLED
        return self._state

    def metrics(self) -> MetricResults:
        if self._totals is None:
            raise RuntimeError("The pipeline's counters are known once it has finished.")
        return _CounterResults(self._totals)


def _sum_counters(bundles: list[dict[MetricKey, int]]) -> dict[MetricKey, int]:
    totals: dict[MetricKey, int] = collections.Counter()
    for bundle in bundles:
        totals.update(bundle)
    return dict(totals)


class DaskRunner(beam_dask.DaskRunner):
    """Runs a batch pipeline on the Dask cluster at `--dask_client_address`.

    Example:
      options = PipelineOptions(["--runner=beam_jobs.dask_runner.DaskRunner",
                                 "--dask_client_address=tcp://127.0.0.1:8786"])
    """

    def run_pipeline(self, pipeline, options) -> DaskRunnerResult:
        dask_options: dict[str, Any] = options.view_as(DaskOptions).get_all_options(
            drop_default=True, current_only=True
        )
        bag_kwargs = DaskOptions._extract_bag_kwargs(dask_options)
        if not bag_kwargs:
            bag_kwargs["partition_size"] = _DEFAULT_PARTITION_SIZE
        pipeline.replace_all([_ImpulseOverride(), *beam_overrides.dask_overrides()])
        client = distributed.Client(**dask_options)
        # One partition per worker thread unless `--dask_npartitions` says:
        # every partition adds tasks at every step, and the scheduler's cost
        # per task dominates a small job.
        partitions = bag_kwargs.get("npartitions") or sum(client.nthreads().values())
        visitor = _BagVisitor(bag_kwargs, max(1, partitions))
        pipeline.visit(visitor)
        # One graph: a step that several sinks and side inputs read runs once.
        *sinks, metrics = client.compute([*visitor.sink_bags(), db.concat(visitor.metrics)])
        return DaskRunnerResult(client, sinks, metrics)
