"""What the `sparseflow` command shows on stderr: its own log lines, in one format.

By default the command shows the warnings of sparseflow's packages, and only
errors of the libraries under them (JAX, Grain, orbax, Beam, TensorFlow),
whose warnings are about their own setup, not about a run. `--verbose` adds
sparseflow's progress (INFO) and the libraries' warnings, Python `warnings`
included (through the `py.warnings` logger).
"""

from __future__ import annotations

import logging
import warnings

FORMAT = "%(levelname)s %(name)s: %(message)s"
OWN_PACKAGES = ("embedding", "parallel", "pipelines", "beam_jobs", "sparseflow")


class ShownRecords(logging.Filter):
    """Passes sparseflow's records from `own_level` up, other libraries' from `other_level` up."""

    def __init__(self, *, own_level: int, other_level: int):
        super().__init__()
        self._own_level = own_level
        self._other_level = other_level

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name.partition(".")[0] in OWN_PACKAGES
        return record.levelno >= (self._own_level if own else self._other_level)


def configure(*, verbose: bool) -> None:
    """Sets up the root logger and the warnings filters for one command run."""
    own_level = logging.INFO if verbose else logging.WARNING
    # force: a library may have set up the root logger already (a warning
    # Beam logs calls basicConfig), keeping its own level and format.
    logging.basicConfig(level=own_level, format=FORMAT, force=True)
    shown = ShownRecords(
        own_level=own_level, other_level=logging.WARNING if verbose else logging.ERROR
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(shown)
    logging.captureWarnings(True)
    warnings.simplefilter("default" if verbose else "ignore")
    for package in OWN_PACKAGES:
        warnings.filterwarnings("default", module=rf"{package}(\.|$)")
