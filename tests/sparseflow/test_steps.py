"""The training stages: stacking of per-feature activations and gradients, and the step's
XLA options."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

import parallel
from sparseflow import _steps, _train


def _stages(dims: dict[str, int]) -> _steps.Stages:
    specs = {
        name: SimpleNamespace(table_spec=SimpleNamespace(embedding_dim=d))
        for name, d in dims.items()
    }
    return _steps.Stages(specs, mesh=None, optimizer=None, enable_minibatching=False)


def test_stack_puts_features_side_by_side_in_name_order_and_unstack_inverts_it():
    dims = {"query": 3, "ad": 2, "user": 4, "geo": 2}
    stages = _stages(dims)
    rng = np.random.default_rng(0)
    per_feature = {name: rng.normal(size=(6, d)).astype(np.float32) for name, d in dims.items()}

    stacked = np.asarray(stages.stack(per_feature))
    expected = np.concatenate(
        [per_feature[name] for name in ("ad", "geo", "query", "user")], axis=1
    )
    np.testing.assert_array_equal(stacked, expected)

    back = stages.unstack(stacked)
    assert sorted(back) == sorted(dims)
    for name, value in per_feature.items():
        np.testing.assert_array_equal(np.asarray(back[name]), value)


def _mesh_stages(devices) -> _steps.Stages:
    mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
    return _steps.Stages({}, mesh=mesh, optimizer=None, enable_minibatching=False)


@pytest.mark.parametrize(
    "cores, devices, scheduler_off", [(2, 8, True), (8, 8, False), (2, 1, False)]
)
def test_the_concurrency_scheduler_is_off_where_the_devices_outnumber_the_cores(
    monkeypatch, cores, devices, scheduler_off
):
    monkeypatch.setattr(_steps, "_usable_cores", lambda: cores)
    options = _mesh_stages(jax.devices()[:devices]).step_compiler_options
    expected = {"xla_cpu_enable_concurrency_optimized_scheduler": False} if scheduler_off else None
    assert options == expected


@pytest.mark.parametrize(
    ("pipeshard", "driver"), [(None, "jit_step"), ("a pipeline", "host_driven_step")]
)
def test_the_pipelined_step_is_compiled_with_the_stages_options(monkeypatch, pipeshard, driver):
    """Pipeshard's host-driven step too: its sparse program runs on every device."""
    given = {}
    monkeypatch.setattr(parallel, driver, lambda *stage_functions, **options: given.update(options))
    stages = SimpleNamespace(
        pipeshard=pipeshard,
        sc_fwd="sc_fwd",
        tc="tc",
        pipeshard_tc="pipeshard_tc",
        sc_bwd="sc_bwd",
        step_compiler_options={"an_option": False},
    )
    _train._pipelined_step(stages)
    assert given == {"compiler_options": {"an_option": False}}
