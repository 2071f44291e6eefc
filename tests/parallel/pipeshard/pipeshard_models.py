"""Small models and train steps for the pipeshard tests.

Every model has a `loss(params, batch)` with boundary markers, `init`
parameters and a `batch`. `train_step(value_and_grad, tx)` builds the same
step around either `jax.value_and_grad` (the unparallelized reference) or
`pipeshard.value_and_grad`. `check_dependencies` checks a schedule's clocks.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from parallel import pipeshard
from parallel.pipeshard import TaskKind


class TrainState(NamedTuple):
    params: Any
    opt_state: Any


def train_step(value_and_grad, tx, loss):
    """`step(state, batch) -> (new_state, loss, grads)` with optax `tx`."""

    def step(state, batch):
        value, grads = value_and_grad(loss)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return TrainState(jax.tree.map(jnp.add, state.params, updates), opt_state), value, grads

    return step


def _normal(rng, shape, scale=1.0):
    return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)


# ---- MLP: tanh layers (4 by default) with a boundary between each ------------

MLP_LAYERS = 4


def mlp_init(rng, width=8, tied=False, layers=MLP_LAYERS):
    params = {f"w{i}": _normal(rng, (width, width), width**-0.5) for i in range(layers)}
    params |= {f"b{i}": _normal(rng, (width,), 0.1) for i in range(layers)}
    if tied:  # The last layer reuses the first layer's weights, transposed.
        del params[f"w{layers - 1}"]
    return params


def mlp_loss(params, batch):
    h = batch["x"]
    layers = sum(name.startswith("b") for name in params)
    for i in range(layers):
        w = params[f"w{i}"] if f"w{i}" in params else params["w0"].T
        h = jnp.tanh(h @ w + params[f"b{i}"])
        if i < layers - 1:
            pipeshard.mark_pipeline_boundary()
    return jnp.mean((h - batch["y"]) ** 2)


def mlp_batch(rng, size=32, width=8):
    return {
        "x": rng.normal(size=(size, width)).astype(np.float32),
        "y": rng.normal(size=(size, width)).astype(np.float32),
    }


# ---- Transformer: tied embedding, pre-LN blocks, a boundary between blocks ----

VOCAB, WIDTH, HEADS, SEQ, BLOCKS = 16, 16, 2, 4, 4


def transformer_init(rng):
    params = {"embedding": _normal(rng, (VOCAB, WIDTH), 0.5)}
    for b in range(BLOCKS):
        params[f"block{b}"] = {
            "qkv": _normal(rng, (WIDTH, 3 * WIDTH), WIDTH**-0.5),
            "out": _normal(rng, (WIDTH, WIDTH), WIDTH**-0.5),
            "up": _normal(rng, (WIDTH, 2 * WIDTH), WIDTH**-0.5),
            "down": _normal(rng, (2 * WIDTH, WIDTH), (2 * WIDTH) ** -0.5),
            "scale": jnp.ones((WIDTH,), jnp.float32),
        }
    return params


def _layer_norm(x, scale):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def _block(p, h):
    x = _layer_norm(h, p["scale"])
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
    heads = lambda t: t.reshape(*t.shape[:-1], HEADS, WIDTH // HEADS)  # noqa: E731
    scores = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / np.sqrt(WIDTH // HEADS)
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    attention = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    mixed = jnp.einsum("bhqk,bkhd->bqhd", attention, heads(v)).reshape(h.shape)
    h = h + mixed @ p["out"]
    return h + jax.nn.gelu(_layer_norm(h, p["scale"]) @ p["up"]) @ p["down"]


def transformer_loss(params, batch):
    h = params["embedding"][batch["tokens"]]
    for b in range(BLOCKS):
        h = _block(params[f"block{b}"], h)
        if b < BLOCKS - 1:
            pipeshard.mark_pipeline_boundary()
    logits = h @ params["embedding"].T
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, batch["labels"][..., None], axis=-1))


def transformer_batch(rng, size=16):
    return {
        "tokens": rng.integers(0, VOCAB, (size, SEQ)).astype(np.int32),
        "labels": rng.integers(0, VOCAB, (size, SEQ)).astype(np.int32),
    }


def check_dependencies(clocks, p, v=1):
    """Every task once, after its inputs; one task per device group per clock.

    Returns `{(stage, microbatch, kind): clock}`.
    """
    chunks = p * v
    done_at = {}
    for clock, tasks in enumerate(clocks):
        assert len({t.stage % p for t in tasks}) == len(tasks), "a group runs two tasks at once"
        for task in tasks:
            key = (task.stage, task.microbatch, task.kind)
            assert key not in done_at
            done_at[key] = clock
    for (stage, k, kind), clock in done_at.items():
        if kind is TaskKind.FORWARD and stage > 0:
            assert done_at[(stage - 1, k, TaskKind.FORWARD)] < clock
        if kind is TaskKind.BACKWARD:
            assert done_at[(stage, k, TaskKind.FORWARD)] < clock
            if stage < chunks - 1:
                assert done_at[(stage + 1, k, TaskKind.BACKWARD)] < clock
        if kind is TaskKind.WEIGHT:
            assert done_at[(stage, k, TaskKind.BACKWARD)] < clock
    return done_at
