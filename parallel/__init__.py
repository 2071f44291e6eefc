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

from parallel import allreduce
from parallel.sc_tc import (
    CurrentStepInput,
    LastStepInput,
    PipelineState,
    ScBwdStageFun,
    ScFwdStageFun,
    StepBeforeLastStepInput,
    TcStageFun,
    get_initial_state,
    get_pipeline_state_sharding,
    get_pipeline_train_steps,
    host_driven_step,
    is_output_valid,
    jit_step,
    step,
    unstacked_tc_function,
)

__all__ = [
    "CurrentStepInput",
    "LastStepInput",
    "PipelineState",
    "ScBwdStageFun",
    "ScFwdStageFun",
    "StepBeforeLastStepInput",
    "TcStageFun",
    "allreduce",
    "get_initial_state",
    "get_pipeline_state_sharding",
    "get_pipeline_train_steps",
    "host_driven_step",
    "is_output_valid",
    "jit_step",
    "pipeshard",
    "step",
    "unstacked_tc_function",
]

_LAZY_SUBMODULES = frozenset({"pipeshard"})


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
