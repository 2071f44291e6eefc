"""Test cases and float64 numpy references for the sharded lookup and updates.

The references are written from the math (docs/design.md sections 1 and 5, the
optimizers' papers, TensorFlow's `ApplyFtrl` documentation and the update
rules jax-tpu-embedding publishes for LaProp, Adagrad with momentum and F2A), on dense
logical tables, with explicit loops over samples and ids; they share nothing
with the implementation.

The case: table "a" (300 x 8) read by features "a1" and "a2" (feature
stacking); tables "b" (200 x 5) and "c" (100 x 8) stacked into "bc" (table
stacking, dims padded to 8). Rows have 1..4 ids, with duplicates inside a row
and hot ids shared by many rows and devices, positive weights, and most of
each vocabulary untouched.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh

import embedding

BATCH = 32
TABLES = {"a": (300, 8), "b": (200, 5), "c": (100, 8)}
FEATURE_TABLES = {"a1": "a", "a2": "a", "b1": "b", "c1": "c"}


# jax-tpu-embedding's optimizers whose rules read the step (through
# `get_hyperparameters`): LaProp's bias correction, Adagrad with momentum
# (plain, and Nesterov's with a decayed accumulator and exponent 3) and F2A's
# frequency boost.
JTE_OPTIMIZERS = {
    "laprop": embedding.LaPropOptimizerSpec(
        learning_rate=lambda step: 0.05 / (1.0 + step), b1=0.8, b2=0.9, eps=1e-6
    ),
    "adagrad_momentum": embedding.AdagradMomentumOptimizerSpec(
        learning_rate=lambda step: 0.2 * 0.5**step, momentum=0.8, initial_accumulator_value=0.3
    ),
    "adagrad_momentum_nesterov": embedding.AdagradMomentumOptimizerSpec(
        learning_rate=0.1,
        momentum=0.7,
        beta2=0.9,
        epsilon=1e-3,
        exponent=3.0,
        use_nesterov=True,
        initial_accumulator_value=0.2,
        initial_momentum_value=0.05,
    ),
    # Over three steps a row first updated at step 2 gets the boost
    # sqrt(2 / 1), capped at 1.2; rows updated twice get 1 or less.
    "f2a": embedding.F2AOptimizerSpec(
        learning_rate=lambda step: 0.3 / (1.0 + step),
        rho=0.5,
        initial_accumulator_value=0.2,
        l1_regularization_strength=0.01,
        l2_regularization_strength=0.02,
        max_lr_multiplier=1.2,
    ),
}


# Row-wise Adam with a learning-rate schedule, and with weight decay.
ROWWISE_ADAM_OPTIMIZERS = {
    "rowwise_adam": embedding.RowWiseAdamOptimizerSpec(
        learning_rate=lambda step: 0.05 / (1.0 + step), beta_1=0.8, beta_2=0.9, epsilon=1e-3
    ),
    "rowwise_adam_decay": embedding.RowWiseAdamOptimizerSpec(
        learning_rate=0.02, epsilon=1e-6, weight_decay=0.1
    ),
}


def default_limit(devices: int, slots: int) -> int:
    """Room for the case's busiest partition; small, to keep buffers small."""
    return max(32, 256 // (devices * slots))


def mesh_of(devices: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:devices]), ("x",))


def feature_specs(
    combiner: str,
    optimizer: embedding.OptimizerSpec | dict[str, embedding.OptimizerSpec],
    devices: int,
    slots: int,
    *,
    limit: int | None = None,
) -> dict[str, embedding.FeatureSpec]:
    """The case's specs, with "b" and "c" stacked for `devices` x `slots`.

    `optimizer` is one spec for every table or one per table name ("b" and
    "c" must share theirs).
    """
    limit = limit or default_limit(devices, slots)
    optimizers = optimizer if isinstance(optimizer, dict) else dict.fromkeys(TABLES, optimizer)
    tables = {
        name: embedding.TableSpec(
            name=name,
            vocabulary_size=vocab,
            embedding_dim=dim,
            initializer=embedding.initializers.Normal(stddev=1.0),
            optimizer=optimizers[name],
            combiner=combiner,
            max_ids_per_partition=limit,
            max_unique_ids_per_partition=limit,
        )
        for name, (vocab, dim) in TABLES.items()
    }
    specs = {
        name: embedding.FeatureSpec(
            name=name,
            table_spec=tables[table],
            input_shape=[BATCH, 4],
            output_shape=[BATCH, TABLES[table][1]],
        )
        for name, table in FEATURE_TABLES.items()
    }
    return embedding.stack_tables(specs, ["b", "c"], devices, slots, stack_name="bc")


@dataclasses.dataclass
class Batch:
    """Ragged ids and weights per feature: lists of 1-D arrays, one per row."""

    ids: dict[str, list[np.ndarray]]
    weights: dict[str, list[np.ndarray]]

    def as_input(self) -> tuple[dict, dict]:
        def ragged(rows):
            out = np.empty(len(rows), dtype=object)
            out[:] = rows
            return out

        return (
            {k: ragged(v) for k, v in self.ids.items()},
            {k: ragged(v) for k, v in self.weights.items()},
        )


def make_batch(seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    ids, weights = {}, {}
    for feature, table in FEATURE_TABLES.items():
        vocab = TABLES[table][0]
        rows, row_weights = [], []
        for _ in range(BATCH):
            count = int(rng.integers(1, 5))
            hot = rng.random(count) < 0.5
            row = np.where(hot, rng.integers(0, 6, count), rng.integers(0, vocab // 3, count))
            rows.append(row.astype(np.int64))
            row_weights.append(rng.uniform(0.5, 2.0, count).astype(np.float32))
        ids[feature], weights[feature] = rows, row_weights
    return Batch(ids, weights)


def gather_all(variables, specs, mesh, slots) -> tuple[dict, dict]:
    """(`{table: float64[vocab, dim]}`, `{table: {slot: float64[vocab, dim] or [vocab]}}`)."""

    def gather(stacks):
        logical = embedding.gather_tables(stacks, specs, mesh, num_sc_per_device=slots)
        return {k: v.astype(np.float64) for k, v in logical.items()}

    tables = gather({name: v.table for name, v in variables.items()})
    slot_values = {table: {} for table in tables}
    for name, v in variables.items():
        for slot, values in v.slots._asdict().items():
            for table, logical in gather({name: values}).items():
                slot_values[table][slot] = logical
    return tables, slot_values


def activation_grads(seed: int, *, positive: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    grads = {
        f: rng.normal(size=(BATCH, TABLES[t][1])).astype(np.float32)
        for f, t in FEATURE_TABLES.items()
    }
    return {f: np.abs(g) for f, g in grads.items()} if positive else grads


def preprocess(batch: Batch, specs, devices: int, slots: int, **kwargs):
    ids, weights = batch.as_input()
    preprocessed, _ = embedding.preprocess_sparse_dense_matmul_input(
        ids, weights, specs, devices, devices, num_sc_per_device=slots, **kwargs
    )
    return preprocessed


def gains(weights: np.ndarray, combiner: str) -> np.ndarray:
    w = weights.astype(np.float64)
    if combiner == "sum":
        return w
    if combiner == "mean":
        return w / w.sum()
    return w / math.sqrt((w * w).sum())


def activations(tables: dict[str, np.ndarray], batch: Batch, combiner: str) -> dict:
    """`float64[BATCH, dim]` per feature: sum over a row's ids of gain * row."""
    out = {}
    for feature, table in FEATURE_TABLES.items():
        values = np.zeros((BATCH, TABLES[table][1]))
        for sample in range(BATCH):
            row_ids = batch.ids[feature][sample]
            row_gains = gains(batch.weights[feature][sample], combiner)
            for i, gain in zip(row_ids, row_gains):
                values[sample] += gain * tables[table][i]
        out[feature] = values
    return out


def row_gradients(batch: Batch, combiner: str, activation_grads: dict) -> dict:
    """Per table, `{id: float64[dim]}`: sum over occurrences of gain * grad."""
    grads: dict[str, dict[int, np.ndarray]] = {t: {} for t in TABLES}
    for feature, table in FEATURE_TABLES.items():
        for sample in range(BATCH):
            row_ids = batch.ids[feature][sample]
            row_gains = gains(batch.weights[feature][sample], combiner)
            for i, gain in zip(row_ids, row_gains):
                previous = grads[table].get(int(i), 0.0)
                grads[table][int(i)] = previous + gain * activation_grads[feature][sample]
    return grads


def _learning_rate(spec: embedding.OptimizerSpec, step: int) -> float:
    rate = spec.learning_rate
    return float(rate(step)) if callable(rate) else float(rate)


def _ftrl(spec: embedding.FTRLOptimizerSpec, w, slots, g, lr):
    """TensorFlow's ApplyFtrl, element by element; beta as Keras adds it."""
    accum, linear = slots["accumulator"], slots["linear"]
    new_accum = accum + g * g
    p = -spec.learning_rate_power
    l1, l2, beta = (
        spec.l1_regularization_strength,
        spec.l2_regularization_strength,
        spec.beta,
    )
    if spec.multiply_linear_by_learning_rate:
        linear = linear + g * lr - (new_accum**p - accum**p) * w
        quadratic = new_accum**p + 2 * l2 * lr + beta
        threshold = l1 * lr
    else:
        linear = linear + g - (new_accum**p - accum**p) / lr * w
        quadratic = new_accum**p / lr + 2 * (l2 + beta / (2 * lr))
        threshold = l1
    new_w = np.zeros_like(w)
    for k in range(w.size):
        if abs(linear[k]) > threshold:
            new_w[k] = (np.sign(linear[k]) * threshold - linear[k]) / quadratic[k]
    return new_w, {"accumulator": new_accum, "linear": linear}


def _laprop(spec: embedding.LaPropOptimizerSpec, w, slots, g, lr, step):
    """LaProp (arXiv:2002.04839) with the squared-gradient average corrected
    for its start at 0, eps added to every squared gradient."""
    b2 = spec.b2
    decay = b2 * (1 - b2**step) / (1 - b2 ** (step + 1))
    nu = decay * slots["nu"] + (1 - decay) * (g * g + spec.eps)
    mu = spec.b1 * slots["mu"] + math.sqrt(1 - spec.b1**2) * g / np.sqrt(nu)
    return w - lr * mu, {"mu": mu, "nu": nu}


def _adagrad_momentum(spec: embedding.AdagradMomentumOptimizerSpec, w, slots, g, lr):
    """Adagrad (summed, or decayed by beta2 < 1) feeding a heavy-ball momentum."""
    if spec.beta2 == 1:
        accumulator = slots["accumulator"] + g * g
    else:
        accumulator = spec.beta2 * slots["accumulator"] + (1 - spec.beta2) * g * g
    scaled = g / (accumulator + spec.epsilon) ** (1 / spec.exponent)
    momentum = spec.momentum * slots["momentum"] + scaled
    step = spec.momentum * momentum + scaled if spec.use_nesterov else momentum
    return w - lr * step, {"accumulator": accumulator, "momentum": momentum}


def _f2a(spec: embedding.F2AOptimizerSpec, w, slots, g, lr, step):
    """Adagrad whose step grows for rows updated less often than every step."""
    local_step = slots["local_step"] + 1
    boost = np.minimum((max(step, 1) / local_step) ** spec.rho, spec.max_lr_multiplier)
    accumulator = slots["accumulator"] + g * g
    decay = spec.l1_regularization_strength * np.sign(w) + spec.l2_regularization_strength * w
    new_w = w - lr * (boost * g / np.sqrt(accumulator) + decay)
    return new_w, {"accumulator": accumulator, "local_step": local_step}


def _rowwise_adam(spec: embedding.RowWiseAdamOptimizerSpec, w, slots, g, lr, step):
    """FBGEMM's PARTIAL_ROWWISE_ADAM: Adam whose second moment is the row's mean
    squared gradient, at t = step + 1, with decoupled weight decay."""
    t = step + 1
    m = spec.beta_1 * slots["momentum"] + (1 - spec.beta_1) * g
    v = spec.beta_2 * slots["velocity"] + (1 - spec.beta_2) * np.mean(g * g)
    m_hat, v_hat = m / (1 - spec.beta_1**t), v / (1 - spec.beta_2**t)
    new_w = w - lr * (m_hat / (np.sqrt(v_hat) + spec.epsilon) + spec.weight_decay * w)
    return new_w, {"momentum": m, "velocity": v}


def update_row(spec: embedding.OptimizerSpec, w, slots: dict, g, step: int):
    """One optimizer step on one row (float64)."""
    lr = _learning_rate(spec, step)
    if isinstance(spec, embedding.SGDOptimizerSpec):
        return w - lr * g, {}
    if isinstance(spec, embedding.AdagradOptimizerSpec):
        accumulator = slots["accumulator"] + g * g
        return w - lr * g / np.sqrt(accumulator), {"accumulator": accumulator}
    if isinstance(spec, embedding.RowWiseAdagradOptimizerSpec):
        # FBGEMM's EXACT_ROWWISE_ADAGRAD: the mean over the row's own dim.
        accumulator = slots["accumulator"] + np.mean(g * g)
        return w - lr * g / (np.sqrt(accumulator) + spec.epsilon), {"accumulator": accumulator}
    if isinstance(spec, embedding.AdamOptimizerSpec):
        t = step + 1
        m = spec.beta_1 * slots["momentum"] + (1 - spec.beta_1) * g
        v = spec.beta_2 * slots["velocity"] + (1 - spec.beta_2) * g * g
        m_hat, v_hat = m / (1 - spec.beta_1**t), v / (1 - spec.beta_2**t)
        return w - lr * m_hat / (np.sqrt(v_hat) + spec.epsilon), {"momentum": m, "velocity": v}
    if isinstance(spec, embedding.LaPropOptimizerSpec):
        return _laprop(spec, w, slots, g, lr, step)
    if isinstance(spec, embedding.RowWiseAdamOptimizerSpec):
        return _rowwise_adam(spec, w, slots, g, lr, step)
    if isinstance(spec, embedding.AdagradMomentumOptimizerSpec):
        return _adagrad_momentum(spec, w, slots, g, lr)
    if isinstance(spec, embedding.F2AOptimizerSpec):
        return _f2a(spec, w, slots, g, lr, step)
    return _ftrl(spec, w, slots, g, lr)


def apply_update(optimizers: dict, tables: dict, slots: dict, grads: dict, step: int) -> None:
    """Updates the touched rows of dense float64 `tables` and `slots` in place.

    Args:
      optimizers: `{table: OptimizerSpec}`.
      tables: `{table: float64[vocab, dim]}`.
      slots: `{table: {slot name: float64[vocab, dim]}}`.
      grads: `row_gradients(...)`.
    """
    for table, rows in grads.items():
        for i, g in rows.items():
            row_slots = {name: values[i] for name, values in slots[table].items()}
            new_w, new_slots = update_row(optimizers[table], tables[table][i], row_slots, g, step)
            tables[table][i] = new_w
            for name, value in new_slots.items():
                slots[table][name][i] = value


def touched(*batches: Batch) -> dict[str, np.ndarray]:
    """Per table, `bool[vocab]`: the ids some batch looks up."""
    out = {t: np.zeros(vocab, bool) for t, (vocab, _) in TABLES.items()}
    for batch in batches:
        for feature, table in FEATURE_TABLES.items():
            for row in batch.ids[feature]:
                out[table][row] = True
    return out
