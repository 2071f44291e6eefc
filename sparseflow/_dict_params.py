"""Checkpoints of a shipped tower whose dense parameters are a plain dict.

A shipped tower's `TrainState.params` is its `nnx.State`: its `nnx.Param`s
under the tower's `params` attribute (`{"params": {"bottom": {0: {"b": Param,
"w": Param}}, ...}}`). Checkpoints of earlier sparseflow versions hold the
plain dict of `sparseflow._model.init_params` there (`{"bottom": [{"b",
"w"}, ...], ...}`): the same arrays in the same order, so the dense
optimizer's state (Adam over the flattened parameters) is the same too.
Such a checkpoint is read in its own layout and its arrays put into the state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from sparseflow import _run_identity
from sparseflow._checkpoint import ReadAs, Reading, Snapshot

_PARAMS = "['state'].params"


def as_dict(state: Any) -> Any:
    """The leaves of a tower's `nnx.State` in the plain dict of `_model.init_params`
    (lists for the layers), or None if `state` is not a tower's (not all under `params`)."""
    paths = _dict_paths(state)
    if paths is None:
        return None
    tree: dict = {}
    for path, leaf in zip(paths, jax.tree.leaves(state), strict=True):
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return _lists(tree)


def from_dict(state: Any, params: Any) -> Any:
    """`state` (a tower's `nnx.State`) holding the arrays of `params`, its `as_dict` layout.

    Raises:
      ValueError: `params` has other entries than `as_dict(state)`.
    """
    by_path = {
        tuple(_key(k) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    paths = _dict_paths(state)
    if paths is None or set(by_path) != set(paths):
        raise ValueError(
            f"The params hold {sorted(map(str, by_path))}; the tower holds "
            f"{sorted(map(str, paths or ()))}."
        )
    return jax.tree.unflatten(jax.tree.structure(state), [by_path[p] for p in paths])


def reading_dict_params(read_as: ReadAs | None, run: Mapping[str, Any] | None) -> ReadAs:
    """`read_as` (`Checkpoints.restore_latest`'s), also reading a checkpoint whose
    `state.params` are the plain dict of this run's tower into this run's state.

    Args:
      read_as: how the run reads its checkpoints otherwise (None: as its own).
      run: the run's identity, which such a checkpoint must have been written by.
    """

    def read(metadata: dict, like: Any) -> Reading | None:
        reading = None if read_as is None else read_as(metadata, like)
        target = like if reading is None else reading.like
        state = target.get("state") if isinstance(target, Mapping) else None
        params = None if state is None else as_dict(state.params)
        if params is None:
            return reading
        saved_like = dict(target, state=state._replace(params=params))
        if not _holds(metadata, saved_like):
            return reading
        if reading is None:
            reading = Reading(run, like)

        def adapt(snapshot: Snapshot) -> Snapshot:
            saved = snapshot.arrays["state"]
            restored = saved._replace(params=from_dict(state.params, saved.params))
            return reading.adapt(snapshot._replace(arrays=dict(snapshot.arrays, state=restored)))

        return reading._replace(like=saved_like, adapt=adapt)

    return read


def _holds(metadata: Mapping[str, Any], like: Any) -> bool:
    """Whether the checkpoint's parameters are laid out as `like`'s (by their paths)."""
    saved = {p for p in metadata.get("arrays_layout", {}) if p.startswith(_PARAMS)}
    return bool(saved) and saved == {
        p for p in _run_identity.array_layout(like) if p.startswith(_PARAMS)
    }


def _dict_paths(state: Any) -> list[tuple] | None:
    """Every leaf's path in the plain dict, in the state's leaf order; None for
    leaves outside the tower's `params`."""
    paths = []
    for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [_key(k) for k in path if not isinstance(k, jax.tree_util.GetAttrKey)]
        if len(keys) < 2 or keys[0] != "params":
            return None
        paths.append(tuple(keys[1:]))
    return paths


def _key(key: Any) -> Any:
    if isinstance(key, jax.tree_util.SequenceKey):
        return key.idx
    if isinstance(key, jax.tree_util.DictKey):
        return key.key
    return key.name


def _lists(node: Any) -> Any:
    """`node` with every dict keyed 0..n-1 made a list (the layers of an MLP)."""
    if not isinstance(node, dict):
        return node
    items = {key: _lists(value) for key, value in node.items()}
    if items and set(items) == set(range(len(items))):
        return [items[i] for i in range(len(items))]
    return items
