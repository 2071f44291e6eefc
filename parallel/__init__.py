"""Cross-host agreement and parallel execution on top of `embedding`.

`parallel.allreduce`: the gRPC OR all-reduce hosts use to agree on
minibatching.

`parallel.sc_tc` (its names exported here too): SC/TC step pipelining, the
sparse update and lookup of one batch beside the dense forward/backward pass
of the previous one.

`parallel.pipeshard`: pipeline stages of the dense model on sub-meshes,
data parallel inside each (Alpa-style pipeshard execution). It is imported
on first use (`parallel.pipeshard`, `from parallel import pipeshard`): it
brings optax and matplotlib, which the input pipeline and its Grain workers,
using only the all-reduce, never need.
"""

import importlib

from parallel import allreduce, sc_tc
from parallel.sc_tc import *  # noqa: F403 - the names sc_tc's __all__ lists, exported here too

__all__ = ["allreduce", "pipeshard", *sc_tc.__all__]  # noqa: F405 - pipeshard: see __getattr__

_LAZY_SUBMODULES = frozenset({"pipeshard"})


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
