"""A batch's layout arrays packed into one `int32` buffer per device.

A preprocessed batch is many arrays (four per stacked table and the
minibatch count) that always travel together. Every array costs a transfer
when the batch is placed and a buffer per device each time a jitted step
takes it (a pipelined step takes two batches' worth). Packed side by side,
device by device, into one `int32[devices, width]` array, the batch is placed
with one transfer and passed as one argument; `PackedInput.unpack` restores
the arrays inside the step with slices and bitcasts that stay on each
device.

Each device's row starts on a 64-byte boundary (rows are padded with zeros
to a multiple of 16 columns): the CPU backend then places a row without
copying it, which halves the placement's CPU time of a demo batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

import embedding

# int32 columns in 64 bytes: rows of this width stay on the 64-byte
# boundaries of `embedding.aligned_empty`.
_ROW_COLUMNS = 16


class PackedLayout(NamedTuple):
    """Where each array sits in a packed buffer (static, hashable).

    Attributes:
      treedef: the structure of the packed `embedding.PreprocessedInput`.
      shapes: per leaf, one device's share: its shape with dim 0 divided by
        the number of devices.
      dtypes: per leaf, its dtype name (4-byte types only).
    """

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]


@jax.tree_util.register_pytree_with_keys_class
class PackedInput:
    """An `embedding.PreprocessedInput` packed into one array.

    Attributes:
      data: `int32[devices, width]`: row d holds device d's share of every
        leaf, in leaf order, float leaves bit-cast to `int32`, then zeros up
        to a `width` that is a multiple of 16. Host numpy over the local
        devices (each row on a 64-byte boundary), or a global `jax.Array`
        sharded by rows.
      layout: the static `PackedLayout` (pytree aux data, so `jax.jit`
        traces `data` only).
    """

    def __init__(self, data: Any, layout: PackedLayout):
        self.data = data
        self.layout = layout

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("data"), self.data),), self.layout

    @classmethod
    def tree_unflatten(cls, layout: PackedLayout, children) -> PackedInput:
        return cls(children[0], layout)

    def unpack(self) -> embedding.PreprocessedInput:
        """The arrays, each `[devices * share_0, ...]` (jit-compatible).

        On a global array sharded by rows, each result keeps device d's
        share on device d: the slices and reshapes never cross a row. On host
        numpy, the results are numpy copies.
        """
        host = isinstance(self.data, np.ndarray)
        devices = self.data.shape[0]
        leaves, offset = [], 0
        for shape, dtype in zip(self.layout.shapes, self.layout.dtypes, strict=True):
            width = int(np.prod(shape))
            part = self.data[:, offset : offset + width]
            offset += width
            if dtype != "int32":
                dtype = np.dtype(dtype)
                part = part.view(dtype) if host else jax.lax.bitcast_convert_type(part, dtype)
            leaves.append(part.reshape(devices * shape[0], *shape[1:]))
        return jax.tree.unflatten(self.layout.treedef, leaves)


def packed_shape(preprocessed: embedding.PreprocessedInput, devices: int) -> tuple[int, int]:
    """`(devices, width)` of the packed array of a batch, from its arrays or their shapes.

    Args:
      preprocessed: numpy leaves, or anything with `shape` and `dtype` such
        as `embedding.preprocessed_input_shapes(...)`.
      devices: the local devices the arrays were laid out for.

    Raises:
      ValueError: as `pack`.
    """
    return devices, _width(packed_layout(preprocessed, devices))


def packed_layout(preprocessed: embedding.PreprocessedInput, devices: int) -> PackedLayout:
    """The `PackedLayout` of a batch, from its arrays or their shapes (as `packed_shape`).

    Raises:
      ValueError: as `pack`.
    """
    return _packed_layout(*jax.tree.flatten(preprocessed), devices)


def pack(
    preprocessed: embedding.PreprocessedInput, devices: int, *, out: np.ndarray | None = None
) -> PackedInput:
    """Packs host arrays whose dim 0 runs over `devices` local devices.

    Args:
      preprocessed: numpy leaves, each `[devices * n, ...]` (device d's share
        is rows `d * n` to `(d + 1) * n`), of 4-byte dtypes.
      devices: the local devices the arrays were laid out for.
      out: `int32[devices, width]` to pack into (`width` as `packed_shape`
        says); None: a new array whose rows start on 64-byte boundaries.

    Raises:
      ValueError: a leaf's dim 0 does not split over `devices`, its dtype is
        not 4 bytes wide, or `out` has another shape or dtype.
    """
    leaves, treedef = jax.tree.flatten(preprocessed)
    layout = _packed_layout(leaves, treedef, devices)
    columns = [np.ascontiguousarray(leaf).reshape(devices, -1).view(np.int32) for leaf in leaves]
    shape = (devices, _width(layout))
    if out is None:
        out = embedding.aligned_empty(shape[0] * shape[1], np.int32).reshape(shape)
    elif out.shape != shape or out.dtype != np.int32:
        raise ValueError(
            f"Cannot pack into an array of shape {list(out.shape)} and dtype {out.dtype}: "
            f"this batch packs into int32{list(shape)}."
        )
    offset = 0
    for column in columns:
        out[:, offset : offset + column.shape[1]] = column
        offset += column.shape[1]
    out[:, offset:] = 0
    return PackedInput(out, layout)


def _packed_layout(leaves: list, treedef, devices: int) -> PackedLayout:
    """The layout of the flattened arrays (or shapes) `leaves` of a `PreprocessedInput`."""
    shapes, dtypes = [], []
    for leaf in leaves:
        shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
        if not shape or shape[0] % devices or dtype.itemsize != 4:
            raise ValueError(
                f"Cannot pack a layout array of shape {list(shape)} and dtype {dtype} "
                f"over {devices} devices: dim 0 must split evenly and the dtype be 4 bytes wide."
            )
        shapes.append((shape[0] // devices, *shape[1:]))
        dtypes.append(dtype.name)
    return PackedLayout(treedef, tuple(shapes), tuple(dtypes))


def _width(layout: PackedLayout) -> int:
    """Columns of a packed row: every leaf's share, rounded up to 16 columns so
    that rows stay on 64-byte boundaries."""
    width = sum(int(np.prod(shape)) for shape in layout.shapes)
    return -(-width // _ROW_COLUMNS) * _ROW_COLUMNS
