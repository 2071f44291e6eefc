"""Our training step on the lookup benchmark's batches, as a child process of
`benchmarks/lookup.py`.

The process sees as many CPU devices as its parent asked for (through
`XLA_FLAGS=--xla_force_host_platform_device_count=N`, set in its environment
before jax starts) and checks that it got them. Tables are MOD-sharded over
the N devices x `--partitions-per-device` partitions, with limits from a stats
pass over the same batches (as the FDO job sets them), so no id is dropped.
A step is `sparse_dense_matmul`, the gradient of `0.5 * sum(activations^2)`
(the activations themselves) and `apply_gradients`, jitted as one program with
the variables donated, and waited for.

The 8 tables, of one width and optimizer, are stacked into one physical
table (`embedding.stack_tables`), as jax-tpu-embedding stacks such tables and
as TorchRec's table-batched kernel holds them; `--no-stacking` keeps one
physical table each. Limits from the stats pass are the stack's: each table
gets its share (rounded up), and the stack's limit is their sum.

Commands (the line protocol of `_line_protocol.py`):
  * `setup <optimizer>`: drops the previous optimizer's variables, lays out
    every batch (timed: `preprocess_ms`, one time per batch), compiles the
    step for the variables' shapes (`compile_s`), creates the variables
    (timed: `init_s`, with the resident set before and its peak during,
    `state_bytes` of tables and slots, `batch_bytes` of the laid-out
    batches), warms up the step (`warmup_s`), and gives what that work freed
    back to the kernel as the trainer does after its first call
    (`embedding.give_back_freed_memory`). `rowwise_adagrad` needs
    `embedding.RowWiseAdagradOptimizerSpec`; without it setup answers
    `ok: false`.
  * `time <steps>`: runs `steps` steps over the batches in turn; answers
    `step_ms`, one time per step.
  * `memory`: the resident set now and its peak since the last `memory` (or
    the variables' creation), in bytes (`rss`, `peak_rss`).
  * `checkpoint <folder>`: saves the variables with the trainer's own
    checkpoints, drops them and restores them (`_checkpoint_times`).
  * `quit`.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python benchmarks/_lookup_ours.py BATCHES.npz --devices 8 --shape '{...}'

With `--processes P --process-id I --coordinator HOST:PORT` it is one of P
processes of a `jax.distributed` group (gloo collectives; `--devices` counts
the group's devices, this process sees `devices / P`): each lays out its own
share of every batch's samples, the limits come from every share (the same in
every process), and the driver sends every command to all of them.
"""

from __future__ import annotations

import argparse
import functools
import gc
import time
from pathlib import Path
from typing import Any

import _checkpoint_times
import jax
import numpy as np
from _line_protocol import reply_stream, serve
from _lookup_shape import OPTIMIZERS, OURS_ONLY_OPTIMIZERS, LookupShape
from _memory import reset_peak, resident_bytes
from _step_times import step_times
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import embedding
from sparseflow import _launch

Batch = dict[str, embedding.RaggedIds]


def load_batches(path: str, tables: int) -> list[Batch]:
    """The driver's `.npz` (`values_<b>_<t>`, `offsets_<b>_<t>`) as `RaggedIds` by feature."""
    with np.load(path) as data:
        count = sum(1 for name in data.files if name.startswith("values_") and name.endswith("_0"))
        return [
            {
                f"f{t}": embedding.RaggedIds(data[f"values_{b}_{t}"], data[f"offsets_{b}_{t}"])
                for t in range(tables)
            }
            for b in range(count)
        ]


def optimizer_spec(name: str, shape: LookupShape) -> embedding.OptimizerSpec:
    lr, initial = shape.learning_rate, shape.initial_accumulator
    if name == "sgd":
        return embedding.SGDOptimizerSpec(learning_rate=lr)
    if name == "adagrad":
        return embedding.AdagradOptimizerSpec(learning_rate=lr, initial_accumulator_value=initial)
    if name == "rowwise_adagrad":
        if not hasattr(embedding, "RowWiseAdagradOptimizerSpec"):
            raise NotImplementedError("this embedding has no RowWiseAdagradOptimizerSpec")
        return embedding.RowWiseAdagradOptimizerSpec(
            learning_rate=lr, initial_accumulator_value=initial, epsilon=shape.epsilon
        )
    if name == "laprop":
        return embedding.LaPropOptimizerSpec(learning_rate=lr)
    if name == "adagrad_momentum":
        return embedding.AdagradMomentumOptimizerSpec(
            learning_rate=lr, initial_accumulator_value=initial
        )
    if name == "f2a":
        return embedding.F2AOptimizerSpec(learning_rate=lr, initial_accumulator_value=initial)
    if name == "adam":
        return embedding.AdamOptimizerSpec(learning_rate=lr)
    if name == "rowwise_adam":
        return embedding.RowWiseAdamOptimizerSpec(learning_rate=lr, epsilon=shape.epsilon)
    raise ValueError(f"unknown optimizer {name!r}; one of {OPTIMIZERS + OURS_ONLY_OPTIMIZERS}")


def feature_specs(
    shape: LookupShape,
    optimizer: embedding.OptimizerSpec,
    limits: dict[str, int],
    stack_over: tuple[int, int] | None,
) -> dict[str, embedding.FeatureSpec]:
    """One feature per table; with `stack_over = (devices, partitions per
    device)`, the tables stacked into one, `limits` being the stack's."""
    if stack_over is not None:
        limits = {name: -(-limit // shape.tables) for name, limit in limits.items()}
    specs = {}
    for t in range(shape.tables):
        table = embedding.TableSpec(
            name=f"t{t}",
            vocabulary_size=shape.vocabulary,
            embedding_dim=shape.dim,
            initializer=embedding.initializers.TruncatedNormal(0.01),
            optimizer=optimizer,
            combiner="sum",
            **limits,
        )
        specs[f"f{t}"] = embedding.FeatureSpec(
            name=f"f{t}",
            table_spec=table,
            input_shape=[shape.batch, shape.max_valency],
            output_shape=[shape.batch, shape.dim],
        )
    if stack_over is None:
        return specs
    names = [f"t{t}" for t in range(shape.tables)]
    return embedding.stack_tables(specs, names, *stack_over, stack_name="tables")


class OurStep:
    """Our step for one optimizer at a time on `mesh`, driven by commands."""

    def __init__(
        self,
        batches: list[Batch],
        shape: LookupShape,
        mesh: Mesh,
        partitions: int,
        warmup: int,
        stacked: bool,
        processes: int = 1,
    ) -> None:
        self.batches = batches
        self.shape = shape
        self.mesh = mesh
        self.processes = processes
        self.partitions = partitions
        self.warmup = warmup
        self.stack_over = (mesh.size, partitions) if stacked else None
        self.limits = self._stats_limits()
        self._clear()

    def _clear(self) -> None:
        self.step = self.variables = None
        self.inputs: list = []
        self.next_batch = 0
        gc.collect()

    def _preprocess(
        self, batch: Batch, specs, allow_id_dropping: bool = False, process: int | None = None
    ):
        """Lays out the share of `batch` that `process` (by default this one) holds."""
        process = jax.process_index() if process is None else process
        rows = self.shape.batch // self.processes
        share = {
            name: _ragged_rows(ids, process * rows, (process + 1) * rows)
            for name, ids in batch.items()
        }
        return embedding.preprocess_sparse_dense_matmul_input(
            share,
            None,
            specs,
            self.mesh.size // self.processes,
            self.mesh.size,
            num_sc_per_device=self.partitions,
            allow_id_dropping=allow_id_dropping,
        )

    def _stats_limits(self) -> dict[str, int]:
        """Limits from a stats pass (stats count before dropping, so the pass may drop)."""
        # 256 ids per table and partition (the stack's limit is the tables' sum)
        loose_limit = 256 * (self.shape.tables if self.stack_over else 1)
        loose = dict(max_ids_per_partition=loose_limit, max_unique_ids_per_partition=loose_limit)
        specs = feature_specs(self.shape, embedding.SGDOptimizerSpec(), loose, self.stack_over)
        max_ids = max_unique = buffer = 0
        # Every process's share, so that every process sets the same limits.
        shares = [(b, p) for b in self.batches for p in range(self.processes)]
        for batch, process in shares:
            _, stats = self._preprocess(batch, specs, allow_id_dropping=True, process=process)
            max_ids = max(max_ids, *(int(v.max()) for v in stats.max_ids_per_partition.values()))
            max_unique = max(
                max_unique, *(int(v.max()) for v in stats.max_unique_ids_per_partition.values())
            )
            buffer = max(
                buffer,
                *(
                    int(v.max()) * self.partitions
                    for v in stats.required_buffer_size_per_sc.values()
                ),
            )
        return dict(
            max_ids_per_partition=max_ids,
            max_unique_ids_per_partition=max_unique,
            suggested_coo_buffer_size_per_device=buffer,
        )

    def setup(self, name: str) -> dict:
        self._clear()
        specs = feature_specs(
            self.shape, optimizer_spec(name, self.shape), self.limits, self.stack_over
        )
        laid_out, preprocess_ms = [], []
        for batch in self.batches:
            start = time.perf_counter()
            laid_out.append(self._preprocess(batch, specs)[0])  # over a limit raises
            preprocess_ms.append((time.perf_counter() - start) * 1e3)
        rows = NamedSharding(self.mesh, PartitionSpec(self.mesh.axis_names[0]))
        self.inputs = jax.block_until_ready(
            [jax.make_array_from_process_local_data(rows, x) for x in laid_out]
        )
        start = time.perf_counter()
        # Compiled before the baseline, which then holds the program and the
        # compiler's pages of jaxlib (file pages, shared between processes):
        # they are neither tables nor copies of them. What compiling freed is
        # given back first, so that the baseline keeps no free heap for the
        # steps' temporaries.
        self.step = _step_program(specs, self.mesh, self._abstract_variables(specs), self.inputs[0])
        compile_s = time.perf_counter() - start
        embedding.give_back_freed_memory()
        before_init = resident_bytes()["rss"]
        reset_peak()
        start = time.perf_counter()
        self.variables = jax.block_until_ready(
            embedding.init_embedding_variables(
                jax.random.key(0), specs, self.mesh, num_sc_per_device=self.partitions
            )
        )
        init_s = time.perf_counter() - start
        peak_init = resident_bytes()["peak_rss"]
        start = time.perf_counter()
        self._run(1 + self.warmup)
        # As the trainer does after its first call: what initializing and
        # compiling freed goes back to the kernel.
        embedding.give_back_freed_memory()
        return {
            "optimizer": name,
            "preprocess_ms": preprocess_ms,
            "init_s": round(init_s, 3),
            "compile_s": round(compile_s, 2),
            "warmup_s": round(time.perf_counter() - start, 2),
            "state_bytes": _bytes(self.variables),
            "batch_bytes": _bytes(self.inputs),
            "rss_before_init": before_init,
            "peak_rss_init": peak_init,
        }

    def _abstract_variables(self, specs) -> Any:
        """What `embedding.init_embedding_variables` makes, without making it: every
        array's rows sharded over the mesh."""
        rows = NamedSharding(self.mesh, PartitionSpec(self.mesh.axis_names[0]))
        shapes = jax.eval_shape(
            lambda key: embedding.init_embedding_variables(
                key, specs, self.mesh, num_sc_per_device=self.partitions
            ),
            jax.random.key(0),
        )
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows), shapes)

    def memory(self, _: str = "") -> dict:
        """The resident set now and its peak since the last call (or setup's init)."""
        figures = resident_bytes()
        reset_peak()
        return figures

    def checkpoint(self, folder: str) -> dict:
        """Saves the variables with the trainer's checkpoints, drops them, restores them."""
        if self.variables is None:
            raise RuntimeError("no variables: `setup <optimizer>` first (or it failed)")
        figures, like, total = _checkpoint_times.save(self.variables, Path(folder))
        self.variables = None
        gc.collect()
        restored, self.variables = _checkpoint_times.restore(Path(folder), like, total)
        return {**figures, **restored}

    def time(self, steps: str) -> dict:
        if self.step is None:
            raise RuntimeError("no step: `setup <optimizer>` first (or it failed)")
        return {"step_ms": self._run(int(steps))}

    def _run(self, steps: int) -> list[float]:
        def run_step(batch) -> None:
            self.variables = jax.block_until_ready(self.step(self.variables, batch))

        times = step_times(run_step, self.inputs, self.next_batch, steps)
        self.next_batch += steps
        return times


def _bytes(tree) -> int:
    """What this process holds of the arrays of `tree`."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)


def _ragged_rows(ids: embedding.RaggedIds, start: int, stop: int) -> embedding.RaggedIds:
    """Rows `start:stop` of `ids`."""
    splits = ids.row_splits[start : stop + 1]
    return embedding.RaggedIds(ids.values[splits[0] : splits[-1]], splits - splits[0])


def _step_program(specs, mesh: Mesh, variables, batch) -> jax.stages.Compiled:
    """The step compiled for `variables` (abstract: shapes, dtypes and shardings) and
    batches like `batch`."""

    @functools.partial(jax.jit, donate_argnums=0)
    def step(variables, preprocessed):
        activations = embedding.sparse_dense_matmul(preprocessed, variables, specs, mesh)
        # d(0.5 * sum(a^2)) / da = a
        return embedding.apply_gradients(activations, preprocessed, variables, specs, mesh, 0)

    return step.lower(variables, batch).compile()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("batches", help=".npz of values_<b>_<t> and offsets_<b>_<t>")
    parser.add_argument("--shape", required=True, help="a LookupShape as JSON")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--partitions-per-device", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--no-stacking", dest="stacked", action="store_false", help="one physical table each"
    )
    parser.add_argument("--processes", type=int, default=1, help="of a jax.distributed group")
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--coordinator", help="host:port of process 0's coordinator")
    args = parser.parse_args()
    replies = reply_stream()
    if args.processes > 1:
        _launch.initialize_distributed(args.coordinator, args.processes, args.process_id)
    if jax.device_count() != args.devices:
        raise SystemExit(
            f"asked for {args.devices} devices, jax has {jax.device_count()}: set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={args.devices} in the environment"
        )
    shape = LookupShape.from_json(args.shape)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    ours = OurStep(
        load_batches(args.batches, shape.tables),
        shape,
        mesh,
        args.partitions_per_device,
        args.warmup,
        args.stacked,
        args.processes,
    )
    greeting = {"devices": mesh.size, "stacked": args.stacked, "limits": ours.limits}
    commands = {
        "setup": ours.setup,
        "time": ours.time,
        "memory": ours.memory,
        "checkpoint": ours.checkpoint,
    }
    serve(replies, commands, greeting=greeting)


if __name__ == "__main__":
    main()
