"""Feedback-directed limits: FDO stats files, the limits they give, and raises.

A stats file records, per stacked table, how many ids and unique ids each
partition received in observed batches (`FdoStats`, written and read by
`FdoClient` and the `*_fdo_stats` functions, checked against the run's
`FdoLayout` and `FdoGeometry`); `apply_fdo` turns stats into a run's
buffer limits; `LimitRaises` records limits a run had to raise. The names
are also exported by `embedding`.
"""

from embedding.fdo._batch_order import FdoBatchOrder
from embedding.fdo._client import (
    FdoClient,
    OnMismatch,
    fdo_stats_file_name,
    load_fdo_stats,
    merge_fdo_stats,
    write_fdo_stats,
)
from embedding.fdo._file import FdoStats, FdoStatsError, StackFdoStats, TableIdFrequency
from embedding.fdo._geometry import FdoGeometry
from embedding.fdo._layout import FdoLayout, fdo_layout
from embedding.fdo._limits import (
    StackLimits,
    apply_fdo,
    batch_fdo_stats,
    exceeds,
    fdo_limits,
    max_limits,
    set_stack_limits,
    stack_limits,
)
from embedding.fdo._raises import (
    LimitRaises,
    limit_raises_path,
    load_limit_raises,
    write_limit_raises,
)

__all__ = [
    "FdoBatchOrder",
    "FdoClient",
    "FdoGeometry",
    "FdoLayout",
    "FdoStats",
    "FdoStatsError",
    "LimitRaises",
    "OnMismatch",
    "StackFdoStats",
    "StackLimits",
    "TableIdFrequency",
    "apply_fdo",
    "batch_fdo_stats",
    "exceeds",
    "fdo_layout",
    "fdo_limits",
    "fdo_stats_file_name",
    "limit_raises_path",
    "load_fdo_stats",
    "load_limit_raises",
    "max_limits",
    "merge_fdo_stats",
    "set_stack_limits",
    "stack_limits",
    "write_fdo_stats",
    "write_limit_raises",
]
