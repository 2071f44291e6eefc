"""Layer construction (manual, by cost) and stage construction (uniform, DP)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel.pipeshard import (
    AutoLayerOption,
    AutoStageOption,
    ManualLayerOption,
    MarkerKind,
    UniformStageOption,
    mark_pipeline_boundary,
)
from parallel.pipeshard._layers import _balanced_cuts, _min_max_segment, construct_layers
from parallel.pipeshard._markers import is_marker
from parallel.pipeshard._stages import construct_stages


def _forward(fun, *shapes):
    return jax.make_jaxpr(fun)(*[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])


def _dot_layers(closed, layers):
    """Layer of each matrix product, in program order."""
    return [
        layer
        for eqn, layer in zip(closed.jaxpr.eqns, layers.eqn_layers)
        if eqn.primitive.name == "dot_general"
    ]


def test_manual_layers_cut_at_boundaries_and_skip_empty_ones():
    def loss(w, x):
        mark_pipeline_boundary()  # nothing before it: opens no layer
        h = x @ w
        mark_pipeline_boundary()
        mark_pipeline_boundary()  # two in a row: still one cut
        h = h @ w
        mark_pipeline_boundary()
        return jnp.sum(h @ w)

    closed = _forward(loss, (4, 4), (2, 4))
    layers = construct_layers(closed, ManualLayerOption())
    assert layers.num_layers == 3
    assert _dot_layers(closed, layers) == [0, 1, 2]
    boundaries = [i for i, e in enumerate(closed.jaxpr.eqns) if is_marker(e, MarkerKind.BOUNDARY)]
    assert all(layers.eqn_layers[i] == -1 for i in boundaries)


def test_automatic_layers_balance_flops():
    """Six equal products into 3 layers: two each; markers are ignored."""

    def loss(w, x):
        for _ in range(6):
            x = x @ w
            mark_pipeline_boundary()
        return jnp.sum(x)

    closed = _forward(loss, (16, 16), (8, 16))
    layers = construct_layers(closed, AutoLayerOption(layer_num=3))
    assert _dot_layers(closed, layers) == [0, 0, 1, 1, 2, 2]


def test_automatic_layers_cut_where_the_activation_is_narrow():
    """Three equal products into 2 layers: 1 + 2 and 2 + 1 balance within 10%.

    After the first product the activation is 64 wide, after the second 4
    wide: the cut goes after the second, although filling the constant
    makes the first layer of the other cut slightly lighter.
    """

    def loss(a, b, c):
        x = jnp.ones((32, 4))
        return jnp.sum(((x @ a) @ b) @ c)  # 4 -> 64 -> 4 -> 64

    closed = _forward(loss, (4, 64), (64, 4), (4, 64))
    layers = construct_layers(closed, AutoLayerOption(layer_num=2, flops_tolerance=0.1))
    assert _dot_layers(closed, layers) == [0, 0, 1]
    strict = construct_layers(closed, AutoLayerOption(layer_num=2, flops_tolerance=0.0))
    assert _dot_layers(closed, strict) == [0, 1, 1]


@pytest.mark.parametrize(
    ("flops", "k", "want"),
    [([1, 1, 1, 1], 2, 2), ([5, 1, 1, 1], 2, 5), ([1, 2, 3, 4, 5], 3, 6), ([3], 1, 3)],
)
def test_min_max_segment(flops, k, want):
    assert _min_max_segment(np.array(flops, float), k) == pytest.approx(want)


def test_balanced_cuts_take_the_cheapest_cut_among_balanced_ones():
    flops = np.ones(4)
    # Cutting before position 1, 2 or 3 is balanced enough at 100% tolerance;
    # position 3 carries the fewest bytes.
    cut_bytes = np.array([0, 50, 40, 10, 0])
    assert _balanced_cuts(flops, cut_bytes, 2, tolerance=1.0) == [0, 3]
    assert _balanced_cuts(flops, cut_bytes, 2, tolerance=0.0) == [0, 2]


def _timer(costs):
    """Stage time: its layers' cost over its devices, plus a fixed 0.5."""
    return lambda i, j, d: sum(costs[i : j + 1]) / d + 0.5


def _brute_force(costs, num_devices, sizes, m):
    best = np.inf
    n = len(costs)
    for num_stages in range(1, n + 1):
        for cuts in itertools.combinations(range(1, n), num_stages - 1):
            bounds = list(zip((0, *cuts), (*cuts, n)))
            for devs in itertools.product(sizes, repeat=num_stages):
                if sum(devs) != num_devices:
                    continue
                times = [_timer(costs)(a, b - 1, d) for (a, b), d in zip(bounds, devs)]
                best = min(best, sum(times) + (m - 1) * max(times))
    return best


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("costs", [[1, 1, 1, 1], [8, 1, 1, 1, 1], [2, 3, 5, 7]])
def test_automatic_stages_minimize_pipeline_latency(costs, m):
    sizes = (1, 2, 4)
    plan = construct_stages(
        AutoStageOption(submesh_sizes=sizes),
        num_layers=len(costs),
        num_devices=8,
        num_microbatches=m,
        timer=_timer(costs),
    )
    times = [
        _timer(costs)(layers[0], layers[-1], d)
        for layers, d in zip(plan.stage_layer_ids, plan.device_counts)
    ]
    assert sum(plan.device_counts) == 8
    assert sum(times) + (m - 1) * max(times) == pytest.approx(_brute_force(costs, 8, sizes, m))


def test_uniform_stages_deal_devices_evenly():
    plan = construct_stages(
        UniformStageOption(num_stages=3),
        num_layers=6,
        num_devices=8,
        num_microbatches=1,
        timer=None,
    )
    assert plan.stage_layer_ids == ((0, 1), (2, 3), (4, 5))
    assert plan.device_counts == (3, 3, 2)
    assert plan.stage_of_layer == (0, 0, 1, 1, 2, 2)


def test_automatic_stages_without_a_device_cover():
    with pytest.raises(ValueError, match="uses every device"):
        construct_stages(
            AutoStageOption(num_stages=2, submesh_sizes=(3,)),
            num_layers=2,
            num_devices=8,
            num_microbatches=1,
            timer=lambda i, j, d: 1.0,
        )
