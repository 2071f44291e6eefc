"""Optimizer specs for embedding tables: data only, no update math.

The classes take the same arguments, in the same order, as jax-tpu-embedding's
optimizer specs, so code written against that package constructs them
unchanged. Each spec names its slot variables and their initial values; the
row-wise update rules live with the lookup (they need the sharded layout).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

LearningRate = float | Callable[..., Any]
"""A constant, or a schedule called with the step (or with no argument)."""


def _check_learning_rate(learning_rate: LearningRate, owner: str) -> None:
    if callable(learning_rate):
        return
    if not np.isfinite(learning_rate) or learning_rate < 0:
        raise ValueError(
            f"{owner}: learning_rate must be a finite number >= 0 or a callable "
            f"schedule, got {learning_rate!r}."
        )


def _check_non_negative(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not np.isfinite(value) or value < 0:
            raise ValueError(f"{owner}: {name} must be finite and >= 0, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """Base of the optimizer specs.

    Attributes:
      learning_rate: a float, or a schedule `step -> float` (a callable of one
        argument, the step) or `() -> float`.
    """

    learning_rate: LearningRate = 0.001
    short_name: ClassVar[str] = "base"
    slot_names: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        _check_learning_rate(self.learning_rate, type(self).__name__)

    def get_learning_rate(self, step: Any = None) -> Any:
        """Returns the learning rate at `step` (a float or a scalar array)."""
        learning_rate = self.learning_rate
        if not callable(learning_rate):
            return learning_rate
        if not inspect.signature(learning_rate).parameters:
            return learning_rate()
        if step is None:
            raise ValueError(
                f"{type(self).__name__}: the learning-rate schedule {learning_rate!r} "
                "takes the step; pass `step`."
            )
        return learning_rate(step)

    def slot_initial_values(self) -> dict[str, float]:
        """Initial value of every slot variable, by slot name (in order)."""
        return {}


@dataclasses.dataclass(frozen=True)
class SGDOptimizerSpec(OptimizerSpec):
    """Plain SGD: `w -= lr * g`. No slots."""

    short_name: ClassVar[str] = "sgd"


@dataclasses.dataclass(frozen=True)
class AdagradOptimizerSpec(OptimizerSpec):
    """Row-wise Adagrad: `a += g*g; w -= lr * g / sqrt(a)`.

    Attributes:
      initial_accumulator_value: starting value of the accumulator slot (> 0).
    """

    initial_accumulator_value: float = 0.1
    short_name: ClassVar[str] = "adagrad"
    slot_names: ClassVar[tuple[str, ...]] = ("accumulator",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.initial_accumulator_value > 0:
            raise ValueError(
                "AdagradOptimizerSpec: initial_accumulator_value must be > 0 (it is "
                f"a divisor), got {self.initial_accumulator_value!r}."
            )

    def slot_initial_values(self) -> dict[str, float]:
        return {"accumulator": float(self.initial_accumulator_value)}


@dataclasses.dataclass(frozen=True)
class AdamOptimizerSpec(OptimizerSpec):
    """Adam with bias correction (Kingma & Ba, section 2.1).

    Attributes:
      beta_1: decay of the first moment, in [0, 1).
      beta_2: decay of the second moment, in [0, 1).
      epsilon: added to the root of the second moment.
    """

    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-8
    short_name: ClassVar[str] = "adam"
    slot_names: ClassVar[tuple[str, ...]] = ("momentum", "velocity")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("beta_1", "beta_2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"AdamOptimizerSpec: {name} must be in [0, 1), got {value!r}.")
        _check_non_negative("AdamOptimizerSpec", epsilon=self.epsilon)

    def slot_initial_values(self) -> dict[str, float]:
        return {"momentum": 0.0, "velocity": 0.0}


@dataclasses.dataclass(frozen=True)
class FTRLOptimizerSpec(OptimizerSpec):
    """FTRL-Proximal (McMahan et al. 2013), as in TensorFlow's `ApplyFtrl`.

    Attributes:
      learning_rate_power: usually -0.5; must be <= 0.
      l1_regularization_strength: L1 strength, >= 0.
      l2_regularization_strength: L2 strength, >= 0.
      beta: added to the accumulator's power term, >= 0.
      initial_accumulator_value: starting accumulator, > 0.
      initial_linear_value: starting linear slot.
      multiply_linear_by_learning_rate: keep the linear slot scaled by the
        learning rate (so that a changing rate does not rescale history).
    """

    learning_rate: LearningRate = 0.01
    learning_rate_power: float = -0.5
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    beta: float = 0.0
    initial_accumulator_value: float = 0.1
    initial_linear_value: float = 0.0
    multiply_linear_by_learning_rate: bool = False
    short_name: ClassVar[str] = "ftrl"
    slot_names: ClassVar[tuple[str, ...]] = ("accumulator", "linear")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.learning_rate_power > 0:
            raise ValueError(
                "FTRLOptimizerSpec: learning_rate_power must be <= 0, got "
                f"{self.learning_rate_power!r}."
            )
        _check_non_negative(
            "FTRLOptimizerSpec",
            l1_regularization_strength=self.l1_regularization_strength,
            l2_regularization_strength=self.l2_regularization_strength,
            beta=self.beta,
        )
        if not self.initial_accumulator_value > 0:
            raise ValueError(
                "FTRLOptimizerSpec: initial_accumulator_value must be > 0, got "
                f"{self.initial_accumulator_value!r}."
            )

    def slot_initial_values(self) -> dict[str, float]:
        return {
            "accumulator": float(self.initial_accumulator_value),
            "linear": float(self.initial_linear_value),
        }
