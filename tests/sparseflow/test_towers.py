"""`sparseflow.towers`: the NNX towers against the trainer's functional tower.

The reference is `sparseflow._model` as the trainer runs it: `forward` and
`loss_fn` on the lookup's activations, `jax.value_and_grad` with respect to
the dense parameters and the activations, and for a training step the
lookup (`embedding.sparse_dense_matmul`), `embedding.apply_gradients` and
`_model.dense_optimizer`.
"""

import doctest

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import embedding
import embedding.nnx as enx
from sparseflow import _model, towers
from sparseflow._tower_config import DcnV2Tower

BATCH, NUM_DENSE, DEVICES = 16, 5, 2
DENSE = nnx.All(nnx.Param, nnx.Not(enx.EmbeddingParam))
# (tower class, its config, the embedding dims of features "u" and "v").
CASES = {
    "dlrm": (
        towers.Dlrm,
        _model.ModelConfig(bottom_mlp=(8, 4), top_mlp=(8,)),
        {"u": 4, "v": 6},
    ),
    "dlrm_without_projection": (
        towers.Dlrm,
        _model.ModelConfig(bottom_mlp=(8, 4), top_mlp=(8,), feature_projection=False),
        {"u": 4, "v": 4},
    ),
    "dcn_v2": (
        towers.DcnV2,
        _model.ModelConfig(bottom_mlp=(8, 4), tower=DcnV2Tower(cross_layers=2, mlp=(8,))),
        {"u": 4, "v": 6},
    ),
}


def _embed(dims: dict[str, int]) -> enx.Embed:
    specs = {
        name: embedding.FeatureSpec(
            name=name,
            table_spec=embedding.TableSpec(
                name=name,
                vocabulary_size=40,
                embedding_dim=dim,
                initializer=embedding.initializers.Normal(stddev=0.5),
                optimizer=embedding.RowWiseAdagradOptimizerSpec(learning_rate=0.2),
                combiner="sum",
            ),
            input_shape=[BATCH, 3],
            output_shape=[BATCH, dim],
        )
        for name, dim in dims.items()
    }
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("x",))
    return enx.Embed(specs, mesh, num_sc_per_device=1, rngs=nnx.Rngs(0))


def _start(case: str):
    """The case's tower (from its config) holding the functional tower's initial
    parameters, those parameters, and a batch: dense features, labels, activations."""
    cls, config, dims = CASES[case]
    tower = towers.from_config(_embed(dims), config, NUM_DENSE, rngs=nnx.Rngs(1))
    assert type(tower) is cls
    params = _model.init_params(jax.random.key(2), config, NUM_DENSE, dims)
    tower.load_dense_params(params)
    rng = np.random.default_rng(3)
    dense = rng.normal(size=(BATCH, NUM_DENSE)).astype(np.float32)
    labels = rng.integers(0, 2, BATCH).astype(np.int32)
    activations = {k: rng.normal(size=(BATCH, d)).astype(np.float32) for k, d in dims.items()}
    return tower, params, dense, labels, activations


def tower_loss(tower, activations, dense, labels):
    """The tower's loss with `activations` in place of its layer's lookup."""
    with enx.provided_activations({tower.embed: activations}):
        return towers.sigmoid_cross_entropy(tower(None, dense), labels)


def _as_params(tower, grads: nnx.State) -> _model.Params:
    """`nnx.grad`'s gradients of `tower`'s dense parameters in `_model.Params` form."""
    holder = nnx.clone(tower)
    nnx.update(holder, grads)
    return holder.dense_params()


def _assert_trees(got, want, **tolerance) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if tolerance:
            np.testing.assert_allclose(a, b, **tolerance)
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_gradients_equal_the_functional_tower(case):
    tower, params, dense, labels, activations = _start(case)
    _assert_trees(tower.dense_params(), params)

    with enx.provided_activations({tower.embed: activations}):
        logits = tower(None, dense)
    loss, (param_grads, activation_grads) = nnx.value_and_grad(
        tower_loss, argnums=(nnx.DiffState(0, DENSE), 1)
    )(tower, activations, dense, labels)

    want_logits = _model.forward(params, dense, activations)
    (want_loss, _), (want_param_grads, want_activation_grads) = jax.value_and_grad(
        _model.loss_fn, argnums=(0, 2), has_aux=True
    )(params, dense, activations, labels)
    assert logits.shape == (BATCH,) and logits.dtype == np.float32
    np.testing.assert_array_equal(logits, want_logits)
    np.testing.assert_array_equal(loss, want_loss)
    _assert_trees(_as_params(tower, param_grads), want_param_grads)
    _assert_trees(activation_grads, want_activation_grads)


@pytest.mark.parametrize("case", list(CASES))
def test_a_training_step_equals_the_functional_path(case):
    tower, params, dense, labels, _ = _start(case)
    layer, config = tower.embed, CASES[case][1]
    ids = np.random.default_rng(4).integers(0, 40, (BATCH, 3))
    batch, _ = embedding.preprocess_sparse_dense_matmul_input(
        {name: ids for name in layer.feature_specs},
        None,
        layer.feature_specs,
        DEVICES,
        DEVICES,
        num_sc_per_device=1,
    )
    variables = jax.tree.map(np.copy, layer.embedding_variables())
    tx = _model.dense_optimizer(config)
    optimizer = enx.PartitionedOptimizer(tower, tx)

    def loss_fn(tower):
        return towers.sigmoid_cross_entropy(tower(batch, dense), labels)

    loss, grads = nnx.value_and_grad(loss_fn)(tower)
    optimizer.update(tower, grads)

    specs, mesh = layer.feature_specs, layer.mesh
    activations = embedding.sparse_dense_matmul(batch, variables, specs, mesh)
    (want_loss, _), (param_grads, activation_grads) = jax.value_and_grad(
        _model.loss_fn, argnums=(0, 2), has_aux=True
    )(params, dense, activations, labels)
    want_variables = embedding.apply_gradients(activation_grads, batch, variables, specs, mesh, 0)
    updates, _ = tx.update(param_grads, tx.init(params), params)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    _assert_trees(tower.dense_params(), optax.apply_updates(params, updates), rtol=1e-5, atol=1e-7)
    _assert_trees(layer.embedding_variables(), want_variables, rtol=1e-5, atol=1e-7)
    assert int(layer.step[...]) == 1


def test_parameters_of_another_tower_or_size_are_refused():
    tower, params, *_ = _start("dlrm")
    dcn_params = _model.init_params(
        jax.random.key(0), CASES["dcn_v2"][1], NUM_DENSE, CASES["dcn_v2"][2]
    )
    with pytest.raises(ValueError, match="this Dlrm holds a PyTreeDef"):
        tower.load_dense_params(dcn_params)
    wider = jax.tree.map(np.asarray, params)
    wider["bottom"][0]["w"] = np.zeros((NUM_DENSE + 1, 8), np.float32)
    with pytest.raises(ValueError, match=r"params\['bottom'\]\[0\]\['w'\] has shape \[6, 8\]"):
        tower.load_dense_params(wider)
    _assert_trees(tower.dense_params(), params)


def test_a_tower_needs_an_embed_layer_over_a_dict_of_features():
    with pytest.raises(TypeError, match="got Linear"):
        towers.Dlrm(
            nnx.Linear(2, 1, rngs=nnx.Rngs(0)), 3, bottom_mlp=[4], top_mlp=[4], rngs=nnx.Rngs(0)
        )
    over_a_dict = _embed({"u": 4})
    over_a_list = enx.Embed(
        list(over_a_dict.feature_specs.values()),
        over_a_dict.mesh,
        num_sc_per_device=1,
        rngs=nnx.Rngs(0),
    )
    with pytest.raises(TypeError, match="got Embed over a list"):
        towers.Dlrm(over_a_list, 3, bottom_mlp=[4], top_mlp=[4], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="every embedding dim must be"):
        towers.Dlrm(
            _embed({"u": 4, "v": 6}),
            3,
            bottom_mlp=[4],
            top_mlp=[4],
            feature_projection=False,
            rngs=nnx.Rngs(0),
        )


def test_the_package_docstring_example_runs():
    results = doctest.testmod(towers, optionflags=doctest.ELLIPSIS)
    assert results.attempted > 0
    assert results.failed == 0
