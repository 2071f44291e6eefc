"""Row-wise optimizer updates as pure functions of (rows, slots, grads, hyperparameters).

Every function takes the rows an update touches, `float32[rows, dim]`, the
same rows of each slot variable, and the rows' summed gradients, and returns
the new rows and slots; the rules of jax-tpu-embedding's optimizers (Adam,
LaProp, Adagrad with momentum, F2A) take the scalars of the spec's
`get_hyperparameters(step)`, in its order, as the reference's primitives do.
The sharded update (`_update.py`) gathers the touched rows, calls
`apply_optimizer` and scatters the results back; rows without a gradient in the batch are never
passed here, so they and their slots keep their values bit for bit ("lazy"
updates).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from embedding._optimizers import (
    AdagradMomentumOptimizerSpec,
    AdagradOptimizerSpec,
    AdagradSlots,
    AdamOptimizerSpec,
    F2AOptimizerSpec,
    FTRLOptimizerSpec,
    FTRLSlots,
    LaPropOptimizerSpec,
    OptimizerSpec,
    RowWiseAdagradOptimizerSpec,
    RowWiseAdagradSlots,
    RowWiseAdamOptimizerSpec,
    SGDOptimizerSpec,
    SGDSlots,
)


def sgd(rows: jax.Array, grads: jax.Array, *, learning_rate: Any) -> jax.Array:
    """`w - lr * g`."""
    return rows - learning_rate * grads


def adagrad(
    rows: jax.Array, accumulator: jax.Array, grads: jax.Array, *, learning_rate: Any
) -> tuple[jax.Array, jax.Array]:
    """`a' = a + g^2; w' = w - lr * g / sqrt(a')`. Returns `(w', a')`."""
    accumulator = accumulator + grads * grads
    return rows - learning_rate * grads / jnp.sqrt(accumulator), accumulator


def rowwise_adagrad(
    rows: jax.Array,
    accumulator: jax.Array,
    grads: jax.Array,
    *,
    learning_rate: Any,
    epsilon: float,
    row_dims: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """`a' = a + sum(g^2) / dim; w' = w - lr * g / (sqrt(a') + eps)`.

    Args:
      rows: `float32[n, D]`.
      accumulator: `float32[n]`.
      grads: `float32[n, D]`, zero in the padding columns.
      row_dims: `float32[n]`, each row's table's embedding dim.

    Returns `(w', a')`.
    """
    accumulator = accumulator + jnp.sum(grads * grads, axis=1) / row_dims
    return rows - learning_rate * grads / (jnp.sqrt(accumulator) + epsilon)[:, None], accumulator


def adam(
    rows: jax.Array,
    momentum: jax.Array,
    velocity: jax.Array,
    grads: jax.Array,
    alpha_t: Any,
    beta_1: Any,
    beta_2: Any,
    epsilon_hat: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Adam with the bias correction in `alpha_t` and `epsilon_hat`
    (`AdamOptimizerSpec.get_hyperparameters`).

    `m' = b1 m + (1 - b1) g`, `v' = b2 v + (1 - b2) g^2` and
    `w' = w - alpha_t * m' / (sqrt(v') + epsilon_hat)`, which is
    `w - lr * m_hat / (sqrt(v_hat) + eps)` with `m_hat = m' / (1 - b1^t)`,
    `v_hat = v' / (1 - b2^t)`. Returns `(w', m', v')`.
    """
    momentum = beta_1 * momentum + (1 - beta_1) * grads
    velocity = beta_2 * velocity + (1 - beta_2) * grads * grads
    rows = rows - alpha_t * momentum / (jnp.sqrt(velocity) + epsilon_hat)
    return rows, momentum, velocity


def rowwise_adam(
    rows: jax.Array,
    momentum: jax.Array,
    velocity: jax.Array,
    grads: jax.Array,
    learning_rate: Any,
    beta_1: Any,
    beta_2: Any,
    epsilon: Any,
    weight_decay: Any,
    t: Any,
    *,
    row_dims: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Row-wise Adam (`RowWiseAdamOptimizerSpec`) at time `t`, its scalars those of
    `get_hyperparameters`.

    Args:
      rows, momentum, grads: `float32[n, D]` (grads zero in the padding columns).
      velocity: `float32[n]`.
      row_dims: `float32[n]`, each row's table's embedding dim.

    Returns `(w', m', v')`.
    """
    momentum = beta_1 * momentum + (1 - beta_1) * grads
    velocity = beta_2 * velocity + (1 - beta_2) * jnp.sum(grads * grads, axis=1) / row_dims
    denominator = jnp.sqrt(velocity / (1 - beta_2**t)) + epsilon
    direction = momentum / (1 - beta_1**t) / denominator[:, None] + weight_decay * rows
    return rows - learning_rate * direction, momentum, velocity


def laprop(
    rows: jax.Array,
    mu: jax.Array,
    nu: jax.Array,
    grads: jax.Array,
    learning_rate: Any,
    b1: Any,
    decay_rate: Any,
    eps: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """LaProp (`LaPropOptimizerSpec`): `nu' = d nu + (1 - d)(g^2 + eps)`,
    `mu' = b1 mu + sqrt(1 - b1^2) g / sqrt(nu')`, `w' = w - lr mu'`.
    Returns `(w', mu', nu')`."""
    nu = decay_rate * nu + (1 - decay_rate) * (grads * grads + eps)
    mu = b1 * mu + jnp.sqrt(1 - b1 * b1) * grads / jnp.sqrt(nu)
    return rows - learning_rate * mu, mu, nu


def adagrad_momentum(
    rows: jax.Array,
    accumulator: jax.Array,
    momentum: jax.Array,
    grads: jax.Array,
    learning_rate: Any,
    momentum_decay: Any,
    beta2: Any,
    epsilon: Any,
    exponent: Any,
    use_nesterov: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Adagrad with momentum (`AdagradMomentumOptimizerSpec`). Returns
    `(w', a', m')`."""
    squared = grads * grads
    accumulator = jnp.where(
        beta2 == 1, accumulator + squared, beta2 * accumulator + (1 - beta2) * squared
    )
    scaled = (accumulator + epsilon) ** (-1 / exponent) * grads
    momentum = momentum_decay * momentum + scaled
    step = jnp.where(use_nesterov, momentum_decay * momentum + scaled, momentum)
    return rows - learning_rate * step, accumulator, momentum


def f2a(
    rows: jax.Array,
    accumulator: jax.Array,
    local_step: jax.Array,
    grads: jax.Array,
    learning_rate: Any,
    rho: Any,
    l1: Any,
    l2: Any,
    max_lr_multiplier: Any,
    global_step: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Frequency-aware Adagrad (`F2AOptimizerSpec`). Returns `(w', a', n')`."""
    local_step = local_step + 1
    boost = jnp.minimum((jnp.maximum(global_step, 1) / local_step) ** rho, max_lr_multiplier)
    accumulator = accumulator + grads * grads
    update = boost * grads / jnp.sqrt(accumulator) + l1 * jnp.sign(rows) + l2 * rows
    return rows - learning_rate * update, accumulator, local_step


def ftrl(
    rows: jax.Array,
    accumulator: jax.Array,
    linear: jax.Array,
    grads: jax.Array,
    *,
    learning_rate: Any,
    learning_rate_power: float,
    l1: float,
    l2: float,
    beta: float,
    multiply_linear_by_learning_rate: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """FTRL-Proximal as TensorFlow's `ApplyFtrl`, plus Keras' `beta`.

    With `k = -learning_rate_power`, `a' = a + g^2` and `sigma = a'^k - a^k`:
    `l' = l + g - sigma / lr * w`; `w' = (clip(l', -l1, l1) - l') /
    (a'^k / lr + 2 * l2 + beta / lr)`. With `multiply_linear_by_learning_rate`
    the linear slot holds `lr` times that: `l' = l + lr * g - sigma * w` and
    `w' = (clip(l', -l1 * lr, l1 * lr) - l') / (a'^k + 2 * l2 * lr + beta)`.
    (`beta / lr` equals Keras' `l2 + beta / (2 lr)` adjustment.) Returns
    `(w', a', l')`.
    """
    new_accumulator = accumulator + grads * grads
    power_new = new_accumulator ** (-learning_rate_power)
    sigma = power_new - accumulator ** (-learning_rate_power)
    if multiply_linear_by_learning_rate:
        linear = linear + learning_rate * grads - sigma * rows
        bound = l1 * learning_rate
        denominator = power_new + 2 * l2 * learning_rate + beta
    else:
        linear = linear + grads - sigma / learning_rate * rows
        bound = l1
        denominator = (power_new + beta) / learning_rate + 2 * l2
    rows = (jnp.clip(linear, -bound, bound) - linear) / denominator
    return rows, new_accumulator, linear


def _apply_sgd(spec, rows, slots, grads, learning_rate, step, row_dims):
    del spec, slots, step, row_dims
    return sgd(rows, grads, learning_rate=learning_rate), SGDSlots()


def _apply_adagrad(spec, rows, slots, grads, learning_rate, step, row_dims):
    del spec, step, row_dims
    rows, accumulator = adagrad(rows, slots.accumulator, grads, learning_rate=learning_rate)
    return rows, AdagradSlots(accumulator)


def _apply_rowwise_adagrad(
    spec: RowWiseAdagradOptimizerSpec, rows, slots, grads, learning_rate, step, row_dims
):
    del step
    rows, accumulator = rowwise_adagrad(
        rows,
        slots.accumulator,
        grads,
        learning_rate=learning_rate,
        epsilon=spec.epsilon,
        row_dims=row_dims,
    )
    return rows, RowWiseAdagradSlots(accumulator)


def _with_hyperparameters(
    rule: Callable[..., tuple[jax.Array, ...]], *, row_wise: bool = False
) -> Callable[..., Any]:
    """The `_UPDATES` entry of a rule called as `rule(rows, *slots, grads,
    *spec.get_hyperparameters(step))` (and `row_dims=` if `row_wise`), returning
    `(rows, *slots)`."""

    def apply(spec, rows, slots, grads, learning_rate, step, row_dims):
        del learning_rate  # the hyperparameters hold it
        keywords = {"row_dims": row_dims} if row_wise else {}
        rows, *new_slots = rule(rows, *slots, grads, *spec.get_hyperparameters(step), **keywords)
        return rows, spec.slots_type(*new_slots)

    return apply


def _apply_ftrl(spec: FTRLOptimizerSpec, rows, slots, grads, learning_rate, step, row_dims):
    del step, row_dims
    rows, accumulator, linear = ftrl(
        rows,
        slots.accumulator,
        slots.linear,
        grads,
        learning_rate=learning_rate,
        learning_rate_power=spec.learning_rate_power,
        l1=spec.l1_regularization_strength,
        l2=spec.l2_regularization_strength,
        beta=spec.beta,
        multiply_linear_by_learning_rate=spec.multiply_linear_by_learning_rate,
    )
    return rows, FTRLSlots(accumulator, linear)


_UPDATES: dict[type, Callable[..., tuple[jax.Array, Any]]] = {
    SGDOptimizerSpec: _apply_sgd,
    AdagradOptimizerSpec: _apply_adagrad,
    RowWiseAdagradOptimizerSpec: _apply_rowwise_adagrad,
    AdamOptimizerSpec: _with_hyperparameters(adam),
    FTRLOptimizerSpec: _apply_ftrl,
    LaPropOptimizerSpec: _with_hyperparameters(laprop),
    AdagradMomentumOptimizerSpec: _with_hyperparameters(adagrad_momentum),
    F2AOptimizerSpec: _with_hyperparameters(f2a),
    RowWiseAdamOptimizerSpec: _with_hyperparameters(rowwise_adam, row_wise=True),
}


def check_optimizer(spec: OptimizerSpec, stack_name: str) -> None:
    """Raises `TypeError` if no update rule exists for `spec`'s type."""
    if type(spec) not in _UPDATES:
        known = ", ".join(t.__name__ for t in _UPDATES)
        raise TypeError(
            f"Table {stack_name!r}: no update rule for optimizer "
            f"{type(spec).__name__}; use one of {known}."
        )


def apply_optimizer(
    spec: OptimizerSpec,
    rows: jax.Array,
    slots: Any,
    grads: jax.Array,
    *,
    learning_rate: Any,
    step: Any,
    row_dims: jax.Array,
) -> tuple[jax.Array, Any]:
    """Applies `spec`'s rule to touched rows.

    Args:
      spec: the table's optimizer.
      rows: `float32[n, dim]` current rows.
      slots: the same rows of each slot variable, a `spec.slots_type`
        (`float32[n, dim]` each, `float32[n]` for row-wise Adagrad).
      grads: `float32[n, dim]` summed gradient of each row.
      learning_rate: scalar, `spec.get_learning_rate(step)`.
      step: scalar int, the training step (0 for the first update).
      row_dims: `float32[n]`, the embedding dim of each row's table (the
        stack pads all its tables to one dim).

    Returns:
      `(new rows, new slots)`, the slots a `spec.slots_type`.
    """
    return _UPDATES[type(spec)](spec, rows, slots, grads, learning_rate, step, row_dims)
