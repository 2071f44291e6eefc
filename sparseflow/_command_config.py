"""The config a command names, loaded once the command lets JAX start.

`mesh.devices: auto` is resolved by asking JAX how many devices it sees,
which starts JAX's backend; XLA_FLAGS (the CPU device count) and
`jax.distributed` must be set up before that. So a command first reads what
it needs for them (the count asked for: `--devices`, or the config's
integer), sets them up, and only then loads the whole config, once.
"""

from __future__ import annotations

import os
from pathlib import Path

from sparseflow._shipped_configs import shipped_config
from sparseflow.config._mesh import AUTO, DeviceCount
from sparseflow.config._run_config import EarlySettings, RunConfig, load_config, read_early_settings


def config_location(config: str | os.PathLike) -> tuple[Path, Path | None]:
    """The file `--config` names and the folder its relative paths start from (None: its own).

    A YAML file, else a shipped config by name, whose relative paths start
    from the working directory: its own folder is inside the installed package.

    Raises:
      UsageError: a bare name that no shipped config has (the message lists them).
    """
    text = os.fspath(config)
    if os.path.exists(text) or os.sep in text or text.endswith((".yaml", ".yml")):
        return Path(text), None
    return shipped_config(text), Path.cwd()


class CommandConfig:
    """A command's config: what it asks for before JAX starts, then the whole of it.

    Args:
      config: `--config`: a YAML file or a shipped config's name.
      devices: `--devices`, in place of the config's `mesh.devices`; None: the config's.
    """

    def __init__(self, config: str | os.PathLike, devices: int | None = None):
        self._path, self._relative_to = config_location(config)
        self._devices = devices
        self._early: EarlySettings | None = None

    def early(self) -> EarlySettings:
        """`mesh.devices` as written and the `training` section (ConfigError if bad)."""
        if self._early is None:
            self._early = read_early_settings(self._path, relative_to=self._relative_to)
        return self._early

    @property
    def requested_devices(self) -> int | None:
        """The device count asked for (`--devices`, else the config's integer); None for auto."""
        if self._devices is not None:
            return self._devices
        written = self.early().devices
        return None if written == AUTO else written

    def load(self) -> RunConfig:
        """The whole config; `auto` is resolved now, so XLA_FLAGS and `jax.distributed` come first.

        Raises:
          ConfigError: as `load_config`.
        """
        devices = None
        if self._devices is not None:
            written = self.early().devices
            devices = DeviceCount(
                self._devices, f"--devices {self._devices} in place of mesh.devices: {written}"
            )
        return load_config(self._path, relative_to=self._relative_to, devices=devices)
