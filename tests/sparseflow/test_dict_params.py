"""Checkpoints of a shipped tower holding its dense parameters as the plain dict of
`sparseflow._model.init_params` resume into the tower's `nnx.State`."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from train_cases import assert_bitwise_equal_runs

import embedding
from sparseflow import _dict_params, _model, _train
from sparseflow._checkpoint import Checkpoints


def _run(config, data: str) -> _train._Run:
    options = _train.TrainOptions(data=data, progress=False, pipelined=False)
    return _train._Run(config, options, _train.make_mesh(config.mesh.devices))


def test_the_state_as_a_dict_is_the_towers_own_dense_params_and_back(small_run):
    _, _, config, data = small_run
    run = _run(config, data)
    state = run.state.params
    plain = run.dense_model.merged(state).dense_params()
    functional = _model.init_params(
        jax.random.key(0),
        config.model,
        config.layout.num_dense_features,
        embedding.feature_dims(config.feature_specs),
    )
    assert jax.tree.structure(plain) == jax.tree.structure(functional)

    got = _dict_params.as_dict(state)
    assert jax.tree.structure(got) == jax.tree.structure(plain)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Every array goes back to its own place: the dict's arrays, shifted apart.
    shifted = jax.tree.map(lambda x: np.asarray(x) + 1.0, plain)
    back = run.dense_model.merged(_dict_params.from_dict(state, shifted)).dense_params()
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(shifted), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)

    with pytest.raises(ValueError, match="the tower holds"):
        _dict_params.from_dict(state, {"bottom": plain["bottom"]})
    assert _dict_params.as_dict({"head": state["params"]["bottom"]}) is None


def test_a_checkpoint_with_the_params_as_a_dict_resumes_exactly(small_run):
    tmp, _, config, data = small_run
    options = dict(data=data, progress=False, pipelined=False)
    whole = _train.train(config, _train.TrainOptions(**options, steps=4))
    written = tmp / "dict-params-written"
    _train.train(config, _train.TrainOptions(**options, steps=2, checkpoint_dir=written))

    # The step-2 checkpoint again, with `state.params` the plain dict, saved as
    # the trainer saved it when it held that dict.
    run = _run(config, data)
    reader = Checkpoints(written, run=None, read_only=True)
    snapshot = reader.restore_latest(run.arrays())
    reader.close()
    state = snapshot.arrays["state"]
    plain = run.dense_model.merged(state.params).dense_params()
    arrays = dict(snapshot.arrays, state=state._replace(params=plain))
    metadata = {k: v for k, v in snapshot.metadata.items() if k not in ("run", "arrays_layout")}
    old = tmp / "dict-params-old"
    writer = Checkpoints(old, run=snapshot.metadata["run"])
    writer.save(snapshot._replace(arrays=arrays, metadata=metadata))
    layout = writer.newest_metadata()["arrays_layout"]
    writer.close()
    assert "['state'].params['bottom'][0]['w']" in layout
    assert not any(path.startswith("['state'].params['params']") for path in layout)

    resumed = _train.train(
        config, _train.TrainOptions(**options, steps=4, checkpoint_dir=old, resume=True)
    )
    assert_bitwise_equal_runs(resumed, whole)
