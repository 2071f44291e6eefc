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

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "AdagradMomentumOptimizerSpec",
    "AdagradMomentumSlots",
    "AdagradOptimizerSpec",
    "AdagradSlots",
    "AdamOptimizerSpec",
    "AdamSlots",
    "F2AOptimizerSpec",
    "F2ASlots",
    "FTRLOptimizerSpec",
    "FTRLSlots",
    "LaPropOptimizerSpec",
    "LaPropSlots",
    "OptimizerSpec",
    "RowWiseAdagradOptimizerSpec",
    "RowWiseAdagradSlots",
    "RowWiseAdamOptimizerSpec",
    "RowWiseAdamSlots",
    "SGDOptimizerSpec",
    "SGDSlots",
]

LearningRate = float | Callable[..., Any]
"""A constant, or a schedule called with the step (or with no argument)."""


_Check = Callable[[Any], None]
"""One rule of a spec's fields, called with the spec; raises ValueError if it is broken."""


@dataclasses.dataclass(frozen=True)
class _Rule:
    """A condition each of `fields` must meet on its own; the error says `requirement`."""

    requirement: str
    holds: Callable[[Any], bool]
    fields: tuple[str, ...]

    def __call__(self, spec: Any) -> None:
        for name in self.fields:
            value = getattr(spec, name)
            if not self.holds(value):
                raise ValueError(
                    f"{type(spec).__name__}: {name} {self.requirement}, got {value!r}."
                )


def _non_negative(*fields: str) -> _Rule:
    return _Rule("must be finite and >= 0", lambda value: np.isfinite(value) and value >= 0, fields)


def _decay(*fields: str) -> _Rule:
    return _Rule("must be in [0, 1)", lambda value: 0 <= value < 1, fields)


def _positive(reason: str, *fields: str) -> _Rule:
    return _Rule(
        f"must be finite and > 0 ({reason})",
        lambda value: np.isfinite(value) and value > 0,
        fields,
    )


_LEARNING_RATE = _Rule(
    "must be a finite number >= 0 or a callable schedule",
    lambda value: callable(value) or (np.isfinite(value) and value >= 0),
    ("learning_rate",),
)


def _accumulator_or_epsilon(consequence: str) -> _Check:
    """`initial_accumulator_value` and `epsilon` not both 0, else `consequence` follows."""

    def check(spec: Any) -> None:
        if spec.initial_accumulator_value == 0 and spec.epsilon == 0:
            raise ValueError(
                f"{type(spec).__name__}: initial_accumulator_value and epsilon are both 0, so "
                f"{consequence}; make one of them positive."
            )

    return check


def _no_rms_clip_threshold(spec: Any) -> None:
    if spec.rms_clip_threshold is not None:
        raise ValueError(
            f"{type(spec).__name__}: rms_clip_threshold is not supported (jax-tpu-embedding does "
            f"not support it either); got {spec.rms_clip_threshold!r}, pass None."
        )


def _float32(*values: Any) -> tuple[jax.Array, ...]:
    return tuple(jnp.asarray(value, jnp.float32) for value in values)


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


class LaPropSlots(NamedTuple):
    """LaProp's state.

    Attributes:
      mu: `float32[rows, dim]`, the momentum of the normalized gradients.
      nu: `float32[rows, dim]`, the moving average of squared gradients.
    """

    mu: Any
    nu: Any


class AdagradMomentumSlots(NamedTuple):
    """Adagrad with momentum's state.

    Attributes:
      accumulator: `float32[rows, dim]`, the (decayed) sum of squared gradients.
      momentum: `float32[rows, dim]`, the momentum of the scaled gradients.
    """

    accumulator: Any
    momentum: Any


class F2ASlots(NamedTuple):
    """Frequency-aware Adagrad's state.

    Attributes:
      accumulator: `float32[rows, dim]`, the sum of squared gradients.
      local_step: `float32[rows, dim]`, the number of updates each row got
        (kept per element, as the reference keeps it).
    """

    accumulator: Any
    local_step: Any


class RowWiseAdamSlots(NamedTuple):
    """Row-wise Adam's state.

    Attributes:
      momentum: `float32[rows, dim]`, the first moment, per element.
      velocity: `float32[rows]`, the second moment of each row's mean
        squared gradient (1/dim of Adam's second-moment memory).
    """

    momentum: Any
    velocity: Any


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """Base of the optimizer specs.

    Attributes:
      learning_rate: a float, or a schedule `step -> float` (a callable of one
        argument, the step) or `() -> float`.
    """

    learning_rate: LearningRate = 0.001
    config_type: ClassVar[str] = "base"
    slots_type: ClassVar[type] = SGDSlots
    # A spec's own rules, run in order after the learning rate's.
    _checks: ClassVar[tuple[_Check, ...]] = ()
    # The fields the update takes after the learning rate, in jax-tpu-embedding's order.
    _hyperparameters: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for check in (_LEARNING_RATE, *self._checks):
            check(self)

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

    def short_name(self) -> str:
        """The optimizer's name in configs (`optimizer: {type: ...}`), e.g. "adagrad"."""
        return self.config_type

    def get_hyperparameters(self, step: Any = None) -> tuple[jax.Array, ...]:
        """The update's scalar hyperparameters at `step`, `float32[]` each, in
        jax-tpu-embedding's order: the learning rate, then the spec's own."""
        return _float32(
            self.get_learning_rate(step), *(getattr(self, name) for name in self._hyperparameters)
        )

    def slot_initial_values(self) -> Any:
        """The initial value of every slot variable, as a `slots_type`."""
        return self.slots_type()

    def slot_variables_initializers(self) -> Any:
        """A `slots_type` of `jax.nn.initializers.constant` of each slot's initial value."""
        return self.slots_type(*map(jax.nn.initializers.constant, self.slot_initial_values()))

    def slot_shapes(self, rows: int, dim: int) -> Any:
        """The shape of every slot variable of a `[rows, dim]` table, as a
        `slots_type`: the table's own shape, unless the optimizer says otherwise."""
        return self.slots_type(*((rows, dim),) * len(self.slots_type._fields))


@dataclasses.dataclass(frozen=True)
class SGDOptimizerSpec(OptimizerSpec):
    """Plain SGD: `w -= lr * g`. No slots."""

    config_type: ClassVar[str] = "sgd"


@dataclasses.dataclass(frozen=True)
class AdagradOptimizerSpec(OptimizerSpec):
    """Adagrad, one accumulator per element: `a += g*g; w -= lr * g / sqrt(a)`.

    Attributes:
      initial_accumulator_value: starting value of the accumulator slot (> 0).
    """

    initial_accumulator_value: float = 0.1
    config_type: ClassVar[str] = "adagrad"
    slots_type: ClassVar[type] = AdagradSlots
    _checks = (
        _Rule(
            "must be > 0 (it is a divisor)", lambda value: value > 0, ("initial_accumulator_value",)
        ),
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
    config_type: ClassVar[str] = "rowwise_adagrad"
    slots_type: ClassVar[type] = RowWiseAdagradSlots
    _checks = (
        _non_negative("initial_accumulator_value", "epsilon"),
        _accumulator_or_epsilon("a row's first update divides by zero"),
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
    config_type: ClassVar[str] = "adam"
    slots_type: ClassVar[type] = AdamSlots
    _checks = (_decay("beta_1", "beta_2"), _non_negative("epsilon"))

    def get_hyperparameters(self, step: Any = None) -> tuple[jax.Array, ...]:
        """`(alpha_t, beta_1, beta_2, epsilon_hat)` at time `t = step + 1` (step
        None is 0): `alpha_t = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)` and
        `epsilon_hat = epsilon * sqrt(1 - beta_2^t)`, the bias correction folded
        into the step size (Kingma & Ba, section 2.1)."""
        step = 0 if step is None else step
        beta_1, beta_2, epsilon = _float32(self.beta_1, self.beta_2, self.epsilon)
        root_correction = jnp.sqrt(1.0 - jnp.power(beta_2, step + 1))
        (learning_rate,) = super().get_hyperparameters(step)
        alpha_t = learning_rate * root_correction / (1.0 - jnp.power(beta_1, step + 1))
        return alpha_t, beta_1, beta_2, epsilon * root_correction

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
    config_type: ClassVar[str] = "ftrl"
    slots_type: ClassVar[type] = FTRLSlots
    _checks = (
        _Rule("must be <= 0", lambda value: not value > 0, ("learning_rate_power",)),
        _non_negative("l1_regularization_strength", "l2_regularization_strength", "beta"),
        _Rule("must be > 0", lambda value: value > 0, ("initial_accumulator_value",)),
    )
    _hyperparameters = (
        "learning_rate_power",
        "l1_regularization_strength",
        "l2_regularization_strength",
        "beta",
    )

    def slot_initial_values(self) -> FTRLSlots:
        return FTRLSlots(float(self.initial_accumulator_value), float(self.initial_linear_value))


@dataclasses.dataclass(frozen=True)
class LaPropOptimizerSpec(OptimizerSpec):
    """LaProp (Ziyin et al. 2020, arXiv:2002.04839), as jax-tpu-embedding
    defines it: per element, with `d = decay_rate(step)`,

        nu' = d * nu + (1 - d) * (g^2 + eps)
        mu' = b1 * mu + sqrt(1 - b1^2) * g / sqrt(nu')
        w'  = w - lr * mu'

    The decay `d = b2 (1 - b2^step) / (1 - b2^(step + 1))` makes `nu'` the
    bias-corrected average of the squared gradients (0 at step 0, so the
    first `nu'` is `g^2 + eps`).

    Attributes:
      b1: decay of the momentum, in [0, 1).
      b2: decay of the squared-gradient average, in [0, 1).
      eps: added to every squared gradient, > 0 (a padding column's `nu'`
        is `eps` alone, a divisor).
      rms_clip_threshold: must be None (the reference does not support it).
      initial_slot_value: starting value of both slots, >= 0.
    """

    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-30
    rms_clip_threshold: float | None = None
    initial_slot_value: float = 0.0
    config_type: ClassVar[str] = "laprop"
    slots_type: ClassVar[type] = LaPropSlots
    _checks = (
        _decay("b1", "b2"),
        _positive("it is a divisor", "eps"),
        _non_negative("initial_slot_value"),
        _no_rms_clip_threshold,
    )

    def get_decay_rate(self, step: Any = None) -> jax.Array:
        """`float32[]`: the squared-gradient decay at `step`; `b2` when step is None."""
        if step is None:
            return jnp.asarray(self.b2, jnp.float32)
        b2 = self.b2
        return jnp.asarray(
            b2 * (1.0 - jnp.power(b2, step)) / (1.0 - jnp.power(b2, step + 1.0)), jnp.float32
        )

    def get_hyperparameters(self, step: Any = None) -> tuple[jax.Array, ...]:
        """`(learning_rate, b1, decay_rate(step), eps)`."""
        learning_rate, b1, eps = _float32(self.get_learning_rate(step), self.b1, self.eps)
        return learning_rate, b1, self.get_decay_rate(step), eps

    def slot_initial_values(self) -> LaPropSlots:
        return LaPropSlots(float(self.initial_slot_value), float(self.initial_slot_value))


@dataclasses.dataclass(frozen=True)
class AdagradMomentumOptimizerSpec(OptimizerSpec):
    """Adagrad with momentum, as jax-tpu-embedding defines it: per element,

        a' = a + g^2                      (beta2 == 1)
        a' = beta2 * a + (1 - beta2) g^2  (otherwise)
        s  = (a' + epsilon)^(-1 / exponent) * g
        m' = momentum * m + s
        w' = w - lr * (momentum * m' + s if use_nesterov else m')

    Attributes:
      momentum: decay of the momentum slot, >= 0.
      beta2: decay of the accumulator, in (0, 1]; 1 sums (Adagrad).
      epsilon: added to the accumulator, >= 0.
      exponent: the root taken of the accumulator, > 0 (2 for Adagrad).
      use_nesterov: Nesterov's look-ahead form of the momentum step.
      initial_accumulator_value: starting accumulator, >= 0; it and
        `epsilon` must not both be 0 (their sum is raised to a negative power).
      initial_momentum_value: starting momentum.
    """

    momentum: float = 0.9
    beta2: float = 1.0
    epsilon: float = 1e-10
    exponent: float = 2.0
    use_nesterov: bool = False
    initial_accumulator_value: float = 0.1
    initial_momentum_value: float = 0.0
    config_type: ClassVar[str] = "adagrad_momentum"
    slots_type: ClassVar[type] = AdagradMomentumSlots
    _checks = (
        _non_negative("momentum", "epsilon", "initial_accumulator_value"),
        _positive("the root taken of the accumulator", "exponent"),
        _Rule("must be in (0, 1]", lambda value: 0 < value <= 1, ("beta2",)),
        _accumulator_or_epsilon("a padding column's scale is 0 to a negative power"),
    )
    _hyperparameters = ("momentum", "beta2", "epsilon", "exponent")

    def get_hyperparameters(self, step: Any = None) -> tuple[jax.Array, ...]:
        """`(learning_rate, momentum, beta2, epsilon, exponent, use_nesterov)`,
        the last `bool[]`."""
        return (*super().get_hyperparameters(step), jnp.asarray(self.use_nesterov, jnp.bool_))

    def slot_initial_values(self) -> AdagradMomentumSlots:
        return AdagradMomentumSlots(
            float(self.initial_accumulator_value), float(self.initial_momentum_value)
        )


@dataclasses.dataclass(frozen=True)
class F2AOptimizerSpec(OptimizerSpec):
    """Frequency-aware Adagrad (F2A), as jax-tpu-embedding defines it: per
    element of a row the batch updates, at global step `t = max(step, 1)`,

        n' = n + 1                                  (the row's update count)
        f  = min((t / n')^rho, max_lr_multiplier)   (rare rows learn faster)
        a' = a + g^2
        w' = w - lr * (f * g / sqrt(a') + l1 * sign(w) + l2 * w)

    Attributes:
      rho: the frequency boost's exponent, >= 0 (0 is Adagrad with decay).
      initial_accumulator_value: starting accumulator, > 0 (its root is a
        divisor).
      initial_local_step_value: starting update count, >= 0.
      l1_regularization_strength: L1 decay, >= 0.
      l2_regularization_strength: L2 decay, >= 0.
      max_lr_multiplier: the cap on `f`, > 0.
    """

    learning_rate: LearningRate = 0.01
    rho: float = 0.5
    initial_accumulator_value: float = 0.1
    initial_local_step_value: float = 0.0
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    max_lr_multiplier: float = 1e6
    config_type: ClassVar[str] = "f2a"
    slots_type: ClassVar[type] = F2ASlots
    _checks = (
        _non_negative(
            "rho",
            "initial_local_step_value",
            "l1_regularization_strength",
            "l2_regularization_strength",
        ),
        _positive("its root is a divisor", "initial_accumulator_value"),
        _positive("the cap on the boost", "max_lr_multiplier"),
    )
    _hyperparameters = (
        "rho",
        "l1_regularization_strength",
        "l2_regularization_strength",
        "max_lr_multiplier",
    )

    def get_hyperparameters(self, step: Any = None) -> tuple[jax.Array, ...]:
        """`(learning_rate, rho, l1, l2, max_lr_multiplier, step)`; step None is 0."""
        step = 0 if step is None else step
        return (*super().get_hyperparameters(step), *_float32(step))

    def slot_initial_values(self) -> F2ASlots:
        return F2ASlots(float(self.initial_accumulator_value), float(self.initial_local_step_value))


@dataclasses.dataclass(frozen=True)
class RowWiseAdamOptimizerSpec(OptimizerSpec):
    """Row-wise Adam, as FBGEMM's `PARTIAL_ROWWISE_ADAM` (TorchRec's
    `EmbOptimType.PARTIAL_ROWWISE_ADAM`) defines it: the first moment per
    element, the second per row, at `t = step + 1`,

        m' = b1 * m + (1 - b1) * g
        v' = b2 * v + (1 - b2) * sum(g * g) / dim
        w' = w - lr * (m' / (1 - b1^t) / (sqrt(v' / (1 - b2^t)) + epsilon) + weight_decay * w)

    where `g` is the row's summed gradient in the batch and `dim` the table's
    embedding dim (without the stack's padding columns). FBGEMM runs it on
    GPUs only; here it runs wherever the update does.

    Attributes:
      beta_1: decay of the first moment, in [0, 1).
      beta_2: decay of the second moment, in [0, 1).
      epsilon: added to the root of the second moment, >= 0.
      weight_decay: the decoupled decay of the row's weights, >= 0.
    """

    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-8
    weight_decay: float = 0.0
    config_type: ClassVar[str] = "rowwise_adam"
    slots_type: ClassVar[type] = RowWiseAdamSlots
    _checks = (_decay("beta_1", "beta_2"), _non_negative("epsilon", "weight_decay"))
    _hyperparameters = ("beta_1", "beta_2", "epsilon", "weight_decay")

    def get_hyperparameters(self, step: Any = None) -> tuple[jax.Array, ...]:
        """`(learning_rate, beta_1, beta_2, epsilon, weight_decay, t)` with `t =
        step + 1` (step None is 0), `float32[]` each."""
        step = 0 if step is None else step
        return (*super().get_hyperparameters(step), *_float32(step + 1))

    def slot_initial_values(self) -> RowWiseAdamSlots:
        return RowWiseAdamSlots(0.0, 0.0)

    def slot_shapes(self, rows: int, dim: int) -> RowWiseAdamSlots:
        return RowWiseAdamSlots((rows, dim), (rows,))
