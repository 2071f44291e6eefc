"""Progress bar and TensorBoard scalars of a training run."""

from __future__ import annotations

from pathlib import Path

import tqdm


class MetricsWriter:
    """TensorBoard scalars in `directory` (a no-op when it is None)."""

    def __init__(self, directory: Path | None):
        self._writer = None
        if directory:
            # TensorFlow takes seconds to import: only a run that writes metrics does.
            import tensorflow as tf

            self._writer = tf.summary.create_file_writer(str(directory))
            self._scalar = tf.summary.scalar

    def scalar(self, name: str, value: float, step: int) -> None:
        if self._writer is None:
            return
        with self._writer.as_default():
            self._scalar(name, value, step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()


class Progress:
    """A live bar of trained steps with the latest loss (tqdm, to stderr)."""

    def __init__(self, *, total: int, initial: int, enabled: bool):
        self._bar = tqdm.tqdm(
            total=total,
            initial=initial,
            unit="step",
            # None: tqdm turns the bar off where stderr is not a terminal.
            disable=None if enabled else True,
            dynamic_ncols=True,
        )
        self._postfix: dict[str, str] = {}

    def update(self, trained: int, loss: float | None) -> None:
        self._bar.update(trained - self._bar.n)
        if loss is not None:
            self._postfix["loss"] = f"{loss:.4f}"
            self._bar.set_postfix(self._postfix, refresh=False)

    def throughput(self, examples_per_s: float, input_wait: float) -> None:
        """Shows the last log window's examples/s and its share waiting for input."""
        self._postfix["examples/s"] = f"{examples_per_s:,.0f}"
        self._postfix["input wait"] = f"{100 * input_wait:.0f}%"
        self._bar.set_postfix(self._postfix, refresh=False)

    def close(self) -> None:
        self._bar.close()
