"""The lookup's path in the CPU kernels (`_routing.LookupPath`), `KERNEL_PATH`.

Each phase is one `jax.ffi` call of `_cpu_kernels` reading the layout's
arrays as they are: no decoded copy of the entries, and a plan that is the
exchanged `send_rows` plus one flat index per entry. The owner's update runs
in a kernel for the optimizers that have one (`_cpu_kernels.updates_in_kernel`)
and in XLA (`_xla_path.XLA_PATH`) for the others.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import jax

from embedding import _cpu_kernels
from embedding._feature_blocks import pooled_positions
from embedding._variables import EmbeddingVariables
from embedding._xla_path import XLA_PATH

if TYPE_CHECKING:
    # Annotations only: `_routing` picks the path, so it imports this.
    from embedding._routing import OwnerUpdate
    from embedding._stack_geometry import LayoutArrays, StackGeometry


class KernelStackInput(NamedTuple):
    """One stack's layout on one device, for the kernels (the path's stack input).

    Attributes:
      layout: this device's layout arrays, which the kernels read as they
        are, but for its sample ids, which are their `pooled_positions`.
      segment: `int32[S, C]` the entries' `minibatch * N + partition`, -1 for
        padding (for the `LayoutIndex`; the kernels route from the row pointers).
    """

    layout: LayoutArrays
    segment: jax.Array


class KernelPlan(NamedTuple):
    """One minibatch's routing of one device's stack (the path's plan).

    Attributes:
      send_rows: `int32[S, G, U]` row in the owner's shard of every distinct
        row; `S * R` (out of range) where unused.
      entry_index: `int32[S, C]` each entry's flat index into `[S, G, U]`
        (its row among the distinct rows), -1 for entries outside the
        minibatch.
    """

    send_rows: jax.Array
    entry_index: jax.Array


@dataclasses.dataclass(frozen=True)
class KernelPath:
    """`_routing.LookupPath` in the CPU kernels: stack input `KernelStackInput`,
    plan `KernelPlan`. Only where `_cpu_kernels.enabled`.

    Stateless; use the singleton `KERNEL_PATH`.
    """

    def read_layout(
        self, layout: LayoutArrays, g: StackGeometry, segment: jax.Array | None = None
    ) -> KernelStackInput:
        if segment is None:
            segment = _cpu_kernels.segments(layout.row_pointers, layout.embedding_ids, g)
        positions = pooled_positions(layout.sample_ids, g)
        return KernelStackInput(layout._replace(sample_ids=positions), segment)

    def plan_minibatch(
        self, stack: KernelStackInput, g: StackGeometry, minibatch: int | jax.Array
    ) -> KernelPlan:
        layout = stack.layout
        send_rows, entry_index = _cpu_kernels.route(
            layout.row_pointers, layout.embedding_ids, minibatch, g
        )
        return KernelPlan(send_rows, entry_index)

    def gather_owned(self, table: jax.Array, owned: jax.Array) -> jax.Array:
        return _cpu_kernels.gather_rows(table, owned)

    def pool(
        self, stack: KernelStackInput, plan: KernelPlan, rows: jax.Array, g: StackGeometry
    ) -> jax.Array:
        layout = stack.layout
        return _cpu_kernels.pool(plan.entry_index, layout.sample_ids, layout.gains, rows, g.samples)

    def row_gradients(
        self,
        stack: KernelStackInput,
        plan: KernelPlan,
        sample_grads: jax.Array,
        g: StackGeometry,
    ) -> jax.Array:
        layout = stack.layout
        return _cpu_kernels.pool_transpose(
            plan.entry_index,
            layout.sample_ids,
            layout.gains,
            sample_grads,
            (g.slots, g.devices, g.uniques, g.dim),
        )

    def apply_update(self, update: OwnerUpdate, g: StackGeometry) -> EmbeddingVariables:
        if not _cpu_kernels.updates_in_kernel(g.optimizer):
            # The other optimizers' rules exist in `_optimizer_updates` only.
            return XLA_PATH.apply_update(update, g)
        variables = update.variables
        table, slots = _cpu_kernels.apply_update(
            g.optimizer,
            update.rows,
            update.grads,
            variables.table,
            variables.slots,
            update.learning_rate,
            update.step,
            g,
        )
        return EmbeddingVariables(table, slots)


KERNEL_PATH = KernelPath()
