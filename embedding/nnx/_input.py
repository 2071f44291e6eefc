"""What an `Embed` layer takes as a batch: the checks and the placement.

A `PreprocessedInput` fits a layer when it was made for the layer's feature
specs and geometry: the same stacks, and buffers of the sizes
`embedding.preprocessed_input_shapes` gives for the layer's mesh, partitions
per device and minibatching. Checking that up front names the mismatch in
the layer's terms, before anything is traced.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

import embedding
from embedding._variables import row_sharding
from embedding.nnx._lookup import LookupConfig

_FIELDS = ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids", "lhs_gains")


def check_input(preprocessed_input: Any, config: LookupConfig) -> None:
    """Raises unless `preprocessed_input` was made for the layer of `config`.

    Host numpy leaves hold this process's devices (`mesh.local_mesh.size`);
    device arrays and traced values hold all of the mesh's devices.

    Raises:
      TypeError: not a `PreprocessedInput`.
      ValueError: other stacks, or buffers of other sizes (other specs,
        limits, device counts, partitions per device or minibatching).
    """
    if not isinstance(preprocessed_input, embedding.PreprocessedInput):
        raise TypeError(
            "Embed takes the PreprocessedInput of "
            "embedding.preprocess_sparse_dense_matmul_input, got "
            f"{type(preprocessed_input).__name__}."
        )
    mesh = config.mesh
    per_device = embedding.preprocessed_input_shapes(
        config.feature_specs,
        1,
        mesh.size,
        num_sc_per_device=config.num_sc_per_device,
        enable_minibatching=config.enable_minibatching,
    )
    expected_stacks = sorted(per_device.lhs_row_pointers)
    for field in _FIELDS:
        given = getattr(preprocessed_input, field)
        if sorted(given) != expected_stacks:
            raise ValueError(
                f"preprocessed_input.{field} holds stacks {sorted(given)}, but this layer's "
                f"feature specs define {expected_stacks}; preprocess the batch with the "
                "layer's feature_specs."
            )
        for stack in expected_stacks:
            _check_size(
                given[stack], getattr(per_device, field)[stack], f"{field}[{stack!r}]", config
            )
    _check_size(
        preprocessed_input.num_minibatches, per_device.num_minibatches, "num_minibatches", config
    )


def _check_size(value: Any, per_device: jax.ShapeDtypeStruct, what: str, config) -> None:
    mesh = config.mesh
    devices = mesh.local_mesh.size if isinstance(value, np.ndarray) else mesh.size
    expected = math.prod(per_device.shape) * devices
    size = math.prod(np.shape(value))
    if size != expected:
        raise ValueError(
            f"preprocessed_input.{what} has {size} entries, but this layer expects "
            f"{expected} ({devices} devices x {expected // devices}) for its feature specs "
            f"on {mesh.size} devices x {config.num_sc_per_device} partitions per device, "
            f"minibatching {'on' if config.enable_minibatching else 'off'}; preprocess the "
            "batch with the layer's feature_specs, device counts, num_sc_per_device and "
            "enable_minibatching."
        )


def on_mesh(preprocessed_input: embedding.PreprocessedInput, mesh: Mesh) -> Any:
    """The input with its host numpy leaves made global arrays, rows split over `mesh`.

    A numpy leaf is this process's part (`[L * n]`, or `[L, n]` with a
    leading dimension) and becomes `[G * n]`; device arrays and traced
    values pass through.
    """
    sharding = row_sharding(mesh)

    def place(value):
        if isinstance(value, np.ndarray):
            return jax.make_array_from_process_local_data(sharding, value.reshape(-1))
        return value

    return jax.tree.map(place, preprocessed_input)
