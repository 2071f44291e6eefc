"""Optimizer specs for embedding tables: data only, no update math.

The classes take the same arguments, in the same order, as jax-tpu-embedding's
optimizer specs, so code written against that package constructs them
unchanged. Each spec names the `NamedTuple` of its slot variables (as Optax
keeps an optimizer's state), their initial values and their shapes; the
update rules live with the lookup (they need the sharded layout).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

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


class SGDSlots(NamedTuple):
    """SGD keeps no slot variables."""


class AdagradSlots(NamedTuple):
    """Adagrad's state.

    Attributes:
      accumulator: `float32[rows, dim]`, the sum of squared gradients per element.
    """

    accumulator: Any


class RowWiseAdagradSlots(NamedTuple):
    """Row-wise Adagrad's state.

    Attributes:
      accumulator: `float32[rows]`, the sum over steps of each row's mean
        squared gradient (1/dim of Adagrad's slot memory).
    """

    accumulator: Any


class AdamSlots(NamedTuple):
    """Adam's state.

    Attributes:
      momentum: `float32[rows, dim]`, the first moment.
      velocity: `float32[rows, dim]`, the second moment.
    """

    momentum: Any
    velocity: Any


class FTRLSlots(NamedTuple):
    """FTRL's state.

    Attributes:
      accumulator: `float32[rows, dim]`, the sum of squared gradients.
      linear: `float32[rows, dim]`, the linear term.
    """

    accumulator: Any
    linear: Any


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """Base of the optimizer specs.

    Attributes:
      learning_rate: a float, or a schedule `step -> float` (a callable of one
        argument, the step) or `() -> float`.
    """

    learning_rate: LearningRate = 0.001
    short_name: ClassVar[str] = "base"
    slots_type: ClassVar[type] = SGDSlots

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

    def slot_initial_values(self) -> Any:
        """The initial value of every slot variable, as a `slots_type`."""
        return self.slots_type()

    def slot_shapes(self, rows: int, dim: int) -> Any:
        """The shape of every slot variable of a `[rows, dim]` table, as a
        `slots_type`: the table's own shape, unless the optimizer says otherwise."""
        return self.slots_type(*((rows, dim),) * len(self.slots_type._fields))


@dataclasses.dataclass(frozen=True)
class SGDOptimizerSpec(OptimizerSpec):
    """Plain SGD: `w -= lr * g`. No slots."""

    short_name: ClassVar[str] = "sgd"


@dataclasses.dataclass(frozen=True)
class AdagradOptimizerSpec(OptimizerSpec):
    """Adagrad, one accumulator per element: `a += g*g; w -= lr * g / sqrt(a)`.

    Attributes:
      initial_accumulator_value: starting value of the accumulator slot (> 0).
    """

    initial_accumulator_value: float = 0.1
    short_name: ClassVar[str] = "adagrad"
    slots_type: ClassVar[type] = AdagradSlots

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.initial_accumulator_value > 0:
            raise ValueError(
                "AdagradOptimizerSpec: initial_accumulator_value must be > 0 (it is "
                f"a divisor), got {self.initial_accumulator_value!r}."
            )

    def slot_initial_values(self) -> AdagradSlots:
        return AdagradSlots(float(self.initial_accumulator_value))


@dataclasses.dataclass(frozen=True)
class RowWiseAdagradOptimizerSpec(OptimizerSpec):
    """Row-wise Adagrad, as FBGEMM's `EXACT_ROWWISE_ADAGRAD` and TorchRec's
    `RowWiseAdagrad` define it: one accumulator per row,

        a' = a + sum(g * g) / dim,    w' = w - lr * g / (sqrt(a') + epsilon),

    where `g` is the row's summed gradient in the batch and `dim` the table's
    embedding dim (without the stack's padding columns). The usual optimizer
    of production recommenders: it keeps 1/dim of Adagrad's slot memory.

    Attributes:
      initial_accumulator_value: starting value of the accumulator, >= 0.
      epsilon: added to the accumulator's root, >= 0; the two must not both
        be 0 (the root is a divisor).
    """

    initial_accumulator_value: float = 0.0
    epsilon: float = 1e-8
    short_name: ClassVar[str] = "rowwise_adagrad"
    slots_type: ClassVar[type] = RowWiseAdagradSlots

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = "RowWiseAdagradOptimizerSpec"
        _check_non_negative(
            owner, initial_accumulator_value=self.initial_accumulator_value, epsilon=self.epsilon
        )
        if self.initial_accumulator_value == 0 and self.epsilon == 0:
            raise ValueError(
                f"{owner}: initial_accumulator_value and epsilon are both 0, so a row's first "
                "update divides by zero; make one of them positive."
            )

    def slot_initial_values(self) -> RowWiseAdagradSlots:
        return RowWiseAdagradSlots(float(self.initial_accumulator_value))

    def slot_shapes(self, rows: int, dim: int) -> RowWiseAdagradSlots:
        del dim
        return RowWiseAdagradSlots((rows,))


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
    slots_type: ClassVar[type] = AdamSlots

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("beta_1", "beta_2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"AdamOptimizerSpec: {name} must be in [0, 1), got {value!r}.")
        _check_non_negative("AdamOptimizerSpec", epsilon=self.epsilon)

    def slot_initial_values(self) -> AdamSlots:
        return AdamSlots(0.0, 0.0)


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
    slots_type: ClassVar[type] = FTRLSlots

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

    def slot_initial_values(self) -> FTRLSlots:
        return FTRLSlots(float(self.initial_accumulator_value), float(self.initial_linear_value))
