"""`embedding.nnx.provided_activations`: a model's dense part run on given activations.

The reference is the same dense computation written as a function of the
activations and the dense parameters, differentiated with
`jax.value_and_grad`, as a trainer's dense stage does today.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from lookup_reference import (
    BATCH,
    FEATURE_TABLES,
    TABLES,
    feature_specs,
    make_batch,
    mesh_of,
    preprocess,
)

import embedding
import embedding.nnx as enx

SGD = embedding.SGDOptimizerSpec(learning_rate=0.1)
DENSE = nnx.All(nnx.Param, nnx.Not(enx.EmbeddingParam))
# The activations' width: features a1, a2 (dim 8), b1 (5), c1 (8).
WIDTH = 29
TARGETS = np.linspace(-1.0, 1.0, BATCH, dtype=np.float32)


class Model(nnx.Module):
    """The layer and a linear head on the activations side by side (in name order)."""

    def __init__(self, devices: int, *, rngs: nnx.Rngs):
        specs = feature_specs("sum", SGD, devices, 1)
        self.embed = enx.Embed(specs, mesh_of(devices), num_sc_per_device=1, rngs=rngs)
        self.head = nnx.Linear(WIDTH, 1, rngs=rngs)

    def __call__(self, batch):
        per_feature = self.embed(batch)
        return self.head(jnp.concatenate([per_feature[k] for k in sorted(per_feature)], 1))[:, 0]


def model_loss(model, activations, targets):
    """The model's loss with `activations` in place of its layer's lookup."""
    with enx.provided_activations({enx.embed_layers(model)["embed"]: activations}):
        return jnp.mean((model(None) - targets) ** 2)


def dense_loss(activations, params, targets):
    """`model_loss` written as a function of the activations and the head's parameters."""
    x = jnp.concatenate([activations[k] for k in sorted(activations)], 1)
    return jnp.mean(((x @ params["kernel"] + params["bias"])[:, 0] - targets) ** 2)


def given_activations(seed: int, rows: int = BATCH) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        feature: rng.normal(size=(rows, TABLES[table][1])).astype(np.float32)
        for feature, table in FEATURE_TABLES.items()
    }


def _copy(tree):
    return jax.tree.map(np.array, tree)


@pytest.mark.parametrize("devices", [1, 8])
def test_gradients_equal_the_dense_computation_and_the_tables_are_untouched(devices):
    model = Model(devices, rngs=nnx.Rngs(0))
    tables = _copy(model.embed.embedding_variables())
    head = _copy(nnx.to_pure_dict(nnx.state(model.head, nnx.Param)))
    activations = given_activations(1)
    graphdef, params, rest = nnx.split(model, DENSE, ...)

    def split_loss(params, activations):
        return model_loss(nnx.merge(graphdef, params, rest), activations, TARGETS)

    # As a trainer's dense stage runs it: jit, value_and_grad and nnx.merge.
    loss, (param_grads, activation_grads) = jax.jit(jax.value_and_grad(split_loss, argnums=(0, 1)))(
        params, activations
    )
    # And through NNX's own transform, eagerly.
    nnx_loss, (nnx_param_grads, nnx_activation_grads) = nnx.value_and_grad(
        model_loss, argnums=(nnx.DiffState(0, DENSE), 1)
    )(model, activations, TARGETS)

    want_loss, (want_activation_grads, want_head_grads) = jax.jit(
        jax.value_and_grad(dense_loss, argnums=(0, 1))
    )(activations, head, TARGETS)
    for got_loss, got_params, got_activations in [
        (loss, param_grads, activation_grads),
        (nnx_loss, nnx_param_grads, nnx_activation_grads),
    ]:
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
        assert sorted(got_activations) == sorted(want_activation_grads)
        for feature, grad in want_activation_grads.items():
            np.testing.assert_allclose(got_activations[feature], grad, rtol=1e-6, atol=1e-9)
        got_head = nnx.to_pure_dict(got_params)
        assert list(got_head) == ["head"]
        for key in ("kernel", "bias"):
            np.testing.assert_allclose(
                got_head["head"][key], want_head_grads[key], rtol=1e-6, atol=1e-9
            )

    # The traced loss holds no lookup (a custom_vjp), which it does without
    # given activations; the tables and the step are as they were.
    assert "custom_vjp" not in str(jax.make_jaxpr(split_loss)(params, activations))
    batch = preprocess(make_batch(0), model.embed.feature_specs, devices, 1)
    assert "custom_vjp" in str(jax.make_jaxpr(lambda m: m(batch))(model))
    for name, variables in model.embed.embedding_variables().items():
        np.testing.assert_array_equal(variables.table, tables[name].table)
    assert int(model.embed.step[...]) == 0


def test_a_given_layer_checks_the_batch_it_is_called_with():
    model = Model(2, rngs=nnx.Rngs(0))
    activations = given_activations(2)
    fits = preprocess(make_batch(3), model.embed.feature_specs, 2, 1)
    other_limits = preprocess(make_batch(3), feature_specs("sum", SGD, 2, 1, limit=64), 2, 1)

    with enx.provided_activations({model.embed: activations}):
        assert model.embed(fits) is activations
        assert model.embed(None) is activations
        with pytest.raises(ValueError, match=r"lhs_embedding_ids\['a'\] has \d+ entries.*expects"):
            model.embed(other_limits)
        with pytest.raises(TypeError, match="PreprocessedInput"):
            model.embed({"a1": np.zeros((BATCH, 4), np.int32)})


def test_activations_that_do_not_fit_the_layer_are_refused():
    model = Model(1, rngs=nnx.Rngs(0))
    activations = given_activations(4)

    def refused(given, layer=model.embed):
        with enx.provided_activations({layer: given}):
            pytest.fail("entered")

    without_b1 = {k: v for k, v in activations.items() if k != "b1"}
    with pytest.raises(ValueError, match=r"miss \['b1'\] and hold \[\] beyond"):
        refused(without_b1)
    with pytest.raises(ValueError, match=r"miss \[\] and hold \['d1'\] beyond"):
        refused({**activations, "d1": activations["a1"]})
    with pytest.raises(ValueError, match=r"feature 'b1' have shape \[32, 8\].*float\[rows, 5\]"):
        refused({**activations, "b1": activations["a1"]})
    with pytest.raises(ValueError, match=r"rows \{'a1': 32, 'a2': 32, 'b1': 32, 'c1': 16\}"):
        refused({**activations, "c1": activations["c1"][:16]})
    with pytest.raises(TypeError, match="by embedding.nnx.Embed layer, got a key of type Linear"):
        refused(activations, model.head)
    # A microbatch: fewer rows, the same for every feature.
    with enx.provided_activations({model.embed: given_activations(5, rows=8)}):
        assert model(None).shape == (8,)


class TwoLayers(nnx.Module):
    """Two layers of equal specs, and one of them a second time under another name."""

    def __init__(self, rngs: nnx.Rngs):
        specs, mesh = feature_specs("sum", SGD, 2, 1), mesh_of(2)
        self.x = enx.Embed(specs, mesh, num_sc_per_device=1, rngs=rngs)
        self.y = enx.Embed(specs, mesh, num_sc_per_device=1, rngs=rngs)
        self.x_again = self.x


def test_blocks_nest_and_the_context_is_back_after_an_exception():
    model = TwoLayers(nnx.Rngs(0))
    assert enx.embed_layers(model) == {"x": model.x, "y": model.y}
    batch = preprocess(make_batch(6), model.x.feature_specs, 2, 1)
    looked_up = {"x": model.x(batch), "y": model.y(batch)}
    outer, inner_x, inner_y = (given_activations(seed) for seed in (7, 8, 9))

    def returns(layer, expected):
        got = layer(batch)
        for feature, value in expected.items():
            np.testing.assert_array_equal(got[feature], value)

    with enx.provided_activations({model.x: outer}):
        returns(model.x, outer)
        returns(model.y, looked_up["y"])  # equal specs, another layer
        with enx.provided_activations({model.x: inner_x, model.y: inner_y}):
            returns(model.x, inner_x)
            returns(model.y, inner_y)
            # A merged copy (what NNX transforms call) is the same layer.
            returns(nnx.merge(*nnx.split(model)).x, inner_x)
        returns(model.x, outer)
        returns(model.y, looked_up["y"])
        with pytest.raises(RuntimeError, match="inside"):
            with enx.provided_activations({model.y: inner_y}):
                raise RuntimeError("inside")
        returns(model.y, looked_up["y"])
    returns(model.x, looked_up["x"])


def test_a_model_without_a_layer_is_named():
    with pytest.raises(ValueError, match="Linear holds no embedding.nnx.Embed layer"):
        enx.embed_layers(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
