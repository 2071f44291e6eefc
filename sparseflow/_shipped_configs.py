"""The run configs shipped inside the package (`sparseflow/configs/*.yaml`).

They are package data, so an installed wheel finds them without the source
tree: `sparseflow demo` and `sparseflow stats --config benchmark` name them.
"""

from __future__ import annotations

from pathlib import Path

from sparseflow._errors import UsageError

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def shipped_config_names() -> tuple[str, ...]:
    """The names of the shipped configs (file names without `.yaml`), sorted."""
    return tuple(sorted(path.stem for path in CONFIG_DIR.glob("*.yaml")))


def shipped_config(name: str) -> Path:
    """The file of the shipped config `name` (e.g. `"demo"`).

    Raises:
      UsageError: no shipped config has that name; the message lists them.
    """
    path = CONFIG_DIR / f"{name}.yaml"
    if name not in shipped_config_names():
        raise UsageError(
            f"no shipped config named {name!r}; shipped configs: "
            f"{', '.join(shipped_config_names())} (or pass a YAML file's path)"
        )
    return path
