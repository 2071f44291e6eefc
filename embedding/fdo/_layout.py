"""What FDO stats depend on: the layout of a run's batches, not the rest of its config.

The stats count ids per partition of every global batch. They change with the
tables' vocabularies and dimensions, the features and the tables they read,
the table stacks, the mesh, the global batch and the preprocessing switches;
they do not change with learning rates, initializers, the dense tower or the
configured limits (the job counts before any dropping). Stats carry these
entries; a run whose layout has the same `FdoLayout.key` (a hash of the
entries only) may use them, and a mismatch names the entries that changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from embedding._specs import FeatureSpec
from embedding.fdo._geometry import FdoGeometry

# A layout entry's value: what a JSON file keeps exactly.
LayoutValue = str | int | bool | list[int]
_MISSING = object()


@dataclasses.dataclass(frozen=True, kw_only=True)
class FdoLayout:
    """The entries FDO stats depend on, e.g. `{"tables.users.vocabulary_size": 500}`.

    Attributes:
      entries: dotted name -> value (a string, integer, bool or list of integers).
    """

    entries: Mapping[str, LayoutValue]

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", dict(sorted(self.entries.items())))

    @property
    def key(self) -> str:
        """sha256 hex digest of the entries as canonical JSON."""
        text = json.dumps(self.entries, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def differences(self, stats_entries: Mapping[str, Any]) -> list[str]:
        """Per entry that differs: `name: <value in the stats> in the stats, <value> now`."""
        return [
            f"{name}: {_shown(stats_entries.get(name, _MISSING))} in the stats, "
            f"{_shown(self.entries.get(name, _MISSING))} now"
            for name in sorted(set(self.entries) | set(stats_entries))
            if stats_entries.get(name, _MISSING) != self.entries.get(name, _MISSING)
        ]


def _shown(value: Any) -> str:
    return "absent" if value is _MISSING else json.dumps(value)


def fdo_layout(
    feature_specs: Mapping[str, FeatureSpec],
    geometry: FdoGeometry,
    *,
    extra: Mapping[str, LayoutValue] = {},  # noqa: B006 (never mutated)
) -> FdoLayout:
    """The layout of a run's batches.

    Args:
      feature_specs: per feature, its spec with the run's table stacks applied.
      geometry: the batch geometry.
      extra: further entries that shape the batches, e.g. the preprocessing
        switches (`"preprocessing.invalid_id_policy": "raise"`).
    """
    entries: dict[str, LayoutValue] = {
        f"geometry.{f.name}": getattr(geometry, f.name) for f in dataclasses.fields(geometry)
    }
    for name, spec in feature_specs.items():
        table = spec.table_spec
        entries[f"features.{name}.table"] = table.name
        entries[f"features.{name}.input_shape"] = [int(d) for d in spec.input_shape]
        entries[f"tables.{table.name}.vocabulary_size"] = table.vocabulary_size
        entries[f"tables.{table.name}.embedding_dim"] = table.embedding_dim
        stack = table.setting_in_stack
        entries[f"tables.{table.name}.stack"] = table.name if stack is None else stack.stack_name
    entries.update(extra)
    return FdoLayout(entries=entries)
