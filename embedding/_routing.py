"""The lookup's two paths behind one interface, and the phases they share.

Per slot and minibatch, the layout's entries (docs/design.md section 2) are
sorted by partition and local id, so the distinct rows each owner device
must send come out of one pass. Both paths run the same phases of a
minibatch, for the lookup and for the update: plan (route), exchange the
requested rows, gather the owned rows, exchange them back, pool per sample
(or, backwards, sum per distinct row), and, for the update, merge each
owned row's gradients and apply the optimizer. The exchanges are the same
on both paths and live here: those of all stacked tables travel in one
all-to-all (`exchange_group`), since each collective is a rendezvous of
every device, and on CPU, devices that share cores pay for each one.

What differs is `LookupPath`: `_kernel_path.KERNEL_PATH` in the CPU
kernels (`_cpu_kernels`) on CPU, `_xla_path.XLA_PATH` in XLA ops elsewhere,
where the kernels do not load, or with `SPARSEFLOW_CPU_KERNELS=0` (the
tests' reference). `select_path` picks one per call, in
`_stack_geometry.prepare_call`; the lookup and the update take it as a
static argument and never ask again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar

import jax
import jax.numpy as jnp

from embedding import _cpu_kernels
from embedding._kernel_path import KERNEL_PATH, KernelPath
from embedding._variables import EmbeddingVariables
from embedding._xla_path import XLA_PATH, XlaPath

if TYPE_CHECKING:
    from embedding._stack_geometry import LayoutArrays, StackGeometry


class StackInput(Protocol):
    """One stack's layout on one device, as a path reads it once for all
    minibatches."""

    @property
    def segment(self) -> jax.Array:
        """`int32[S, C]` each entry's `minibatch * N + partition`, -1 for padding."""
        ...


class MinibatchPlan(Protocol):
    """One stack's routing of one minibatch on one device, as a path plans it."""

    @property
    def send_rows(self) -> jax.Array:
        """`int32[S, G, U]` row in the owner's shard of every distinct row
        the slot needs from device h (`[:, h]`); `S * R` (out of range)
        where unused."""
        ...


class OwnerUpdate(NamedTuple):
    """One stack's update on its owner device in one minibatch.

    Attributes:
      rows: `int32[S, G, U]` shard rows (`S * R` where unused), as received:
        per slot and source device, ascending.
      grads: `float32[S, G, U, D]` their gradients.
      variables: this device's shard (donated).
      learning_rate: scalar `float32`.
      step: scalar `int32`.
    """

    rows: jax.Array
    grads: jax.Array
    variables: EmbeddingVariables
    learning_rate: jax.Array
    step: jax.Array


StackT = TypeVar("StackT", bound=StackInput)
PlanT = TypeVar("PlanT", bound=MinibatchPlan)


class LookupPath(Protocol[StackT, PlanT]):
    """What the XLA path and the CPU kernels do differently (inside `shard_map`).

    Each path has its own stack input `StackT` and plan `PlanT`; a plan goes
    back only to the path that made it. Implementations are stateless and
    hashable (they are static arguments of `jax.jit`), and no two paths are
    equal, so a program traced on one path never serves the other. Both
    compute the same sums; the kernels' may differ from XLA's in the last
    bits (their floating-point contract, `_cpu_kernels`).
    """

    def read_layout(
        self, layout: LayoutArrays, g: StackGeometry, segment: jax.Array | None = None
    ) -> StackT:
        """Reads one device's layout of one stack.

        Args:
          layout: this device's arrays: row pointers `int32[S * K * W]`, ids,
            samples and gains `[S * C]`.
          g: the stack's geometry.
          segment: `int32[S, C]` the entries' segments if already known (from
            the forward's `LayoutIndex`), else None to find them.
        """
        ...

    def plan_minibatch(self, stack: StackT, g: StackGeometry, minibatch: int | jax.Array) -> PlanT:
        """Routes the entries of minibatch `minibatch` (an int, or a traced
        `int32` scalar in the minibatch loop): which distinct rows each slot
        needs from each owner, and each entry's place among them."""
        ...

    def gather_owned(self, table: jax.Array, owned: jax.Array) -> jax.Array:
        """`float32[S, G, U, D]`: the owner's rows `owned` (`int32[S, G, U]`,
        as received) of its shard `table` (`float32[S * R, D]`), zero where
        unused. Differentiable with respect to `table`."""
        ...

    def pool(self, stack: StackT, plan: PlanT, rows: jax.Array, g: StackGeometry) -> jax.Array:
        """`float32[S, P, D]`: the minibatch's rows (`float32[S, G, U, D]`, as
        received from their owners), scaled by gain and summed per sample.
        Differentiable with respect to `rows` (by `row_gradients`)."""
        ...

    def row_gradients(
        self, stack: StackT, plan: PlanT, sample_grads: jax.Array, g: StackGeometry
    ) -> jax.Array:
        """`float32[S, G, U, D]`: the transpose of `pool`, per distinct row the
        sum of gain times its samples' gradients (`float32[S, P, D]`)."""
        ...

    def apply_update(self, update: OwnerUpdate, g: StackGeometry) -> EmbeddingVariables:
        """The owner's update: merges the gradients of each received row and
        applies the stack's optimizer (`g.optimizer`) once per row, in place.
        Returns the updated shard; rows not in `update.rows` keep their bits."""
        ...


def select_path(platform: str) -> XlaPath | KernelPath:
    """The lookup's path on `platform`: the CPU kernels where they run
    (on CPU, unless `SPARSEFLOW_CPU_KERNELS=0`, when they build and load:
    `_cpu_kernels.enabled`), else the XLA path."""
    return KERNEL_PATH if _cpu_kernels.enabled(platform) else XLA_PATH


Carry = TypeVar("Carry")


def over_minibatches(
    g: StackGeometry,
    num_minibatches: jax.Array,
    body: Callable[[int | jax.Array, Carry], Carry],
    init: Carry,
) -> Carry:
    """`body(k, carry)` for k in 0..num_minibatches-1; a single call without
    minibatching (which keeps the lookup differentiable in reverse mode)."""
    if g.minibatches == 1:
        return body(0, init)
    return jax.lax.fori_loop(0, num_minibatches[0], body, init)


def exchange(x: jax.Array, axis: str) -> jax.Array:
    """All-to-all over dim 1: `[S, G, ...]`, block `[:, h]` goes to device h,
    and block `[:, h]` of the result came from device h."""
    return jax.lax.all_to_all(x, axis, 1, 1, tiled=True)


def exchange_group(arrays: list[jax.Array], axis: str) -> list[jax.Array]:
    """`exchange` of several `[S, G, ...]` arrays of one dtype in one all-to-all."""
    if len(arrays) == 1:
        return [exchange(arrays[0], axis)]
    s, g = arrays[0].shape[:2]
    flat = [x.reshape(s, g, -1) for x in arrays]
    sizes = [x.shape[2] for x in flat]
    exchanged = exchange(jnp.concatenate(flat, axis=2), axis)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [
        exchanged[:, :, start : start + size].reshape(x.shape)
        for x, start, size in zip(arrays, starts, sizes)
    ]
