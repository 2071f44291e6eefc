"""The activations given to `Embed` layers in the current context.

A context variable maps a layer to the activations it returns instead of
looking up (`provided_activations` sets it; the layer reads it). A layer is
known by its `LookupConfig` object, not by the module object: NNX
transforms and `nnx.merge` call a copy of the module, and the copy keeps
the same static config object, while a layer built anew has one of its own
even when its specs are equal.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from embedding.nnx._lookup import LookupConfig

# id(config) -> (config, activations), None for none; the config is kept so
# that an id is never matched after its object is gone and the id is reused.
_GIVEN: contextvars.ContextVar[Mapping[int, tuple[LookupConfig, Any]] | None] = (
    contextvars.ContextVar("embedding_nnx_given_activations", default=None)
)


def given(config: LookupConfig) -> Any | None:
    """The activations given to the layer of `config` in this context, or None."""
    entry = (_GIVEN.get() or {}).get(id(config))
    if entry is None or entry[0] is not config:
        return None
    return entry[1]


@contextlib.contextmanager
def giving(pairs: Iterable[tuple[LookupConfig, Any]]) -> Iterator[None]:
    """Gives each layer of `pairs` (its config, its activations) the activations
    until the block ends.

    Pairs, not a mapping by config: equal configs of two layers are two keys.
    An enclosing context's layers keep theirs unless given new ones here;
    the enclosing context is back in force when the block ends, by an
    exception too.
    """
    given_here = {id(config): (config, value) for config, value in pairs}
    token = _GIVEN.set({**(_GIVEN.get() or {}), **given_here})
    try:
        yield
    finally:
        _GIVEN.reset(token)
