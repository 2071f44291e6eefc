"""Between a stack's slot-major samples and its features' arrays (`_feature_blocks`),
against slicing each feature out in numpy, and back."""

import numpy as np
import pytest

from embedding._feature_blocks import feature_activations, pooled_positions, sample_gradients
from embedding._stack_geometry import FeatureSlice, StackGeometry


def _geometry(slots: int, dim: int, features: list[tuple[int, int]]) -> StackGeometry:
    """A stack of `features` given as `(samples_per_slot, dim)`, in slot order."""
    slices, offset = [], 0
    for index, (samples, feature_dim) in enumerate(features):
        slices.append(
            FeatureSlice(index, f"f{index}", slots * samples, samples, offset, feature_dim)
        )
        offset += samples
    return StackGeometry(
        name="stack", optimizer=None, devices=1, slots=slots, rows=8, dim=dim, capacity=4,
        minibatches=1, uniques=4, samples=offset, features=tuple(slices), table_dims=((0, dim),),
    )  # fmt: skip


_CASES = {
    "alike": (3, 4, [(5, 4), (5, 4), (5, 4)]),
    "one feature": (2, 8, [(6, 8)]),
    "narrower feature": (2, 4, [(5, 4), (5, 3)]),
    "other sample counts": (2, 4, [(5, 4), (3, 4), (5, 4)]),
}


def _pooled(by_sample: np.ndarray, g: StackGeometry) -> np.ndarray:
    """`by_sample` (`[S, P, D]`, in the layout's sample order) as the lookup pools it."""
    pooled = np.full_like(by_sample, np.nan)
    pooled[:, np.asarray(pooled_positions(np.arange(g.samples), g))] = by_sample
    return pooled


@pytest.mark.parametrize("case", _CASES)
def test_alike_features_are_pooled_example_by_example_and_others_in_layout_order(case):
    slots, dim, features = _CASES[case]
    g = _geometry(slots, dim, features)
    samples = np.arange(g.samples)
    positions = np.asarray(pooled_positions(samples, g))
    if case == "alike":
        # Sample f * n + r (example r of feature f) at r * F + f.
        feature, example = np.divmod(samples, 5)
        np.testing.assert_array_equal(positions, example * 3 + feature)
    else:
        np.testing.assert_array_equal(positions, samples)
    # Padding's sample ids, outside [0, P), stay where they are.
    np.testing.assert_array_equal(
        np.asarray(pooled_positions(np.array([-1, g.samples]), g)), [-1, g.samples]
    )


@pytest.mark.parametrize("case", _CASES)
def test_each_features_activations_are_its_samples_slot_by_slot(case):
    slots, dim, features = _CASES[case]
    g = _geometry(slots, dim, features)
    total = np.random.default_rng(0).normal(size=(slots, g.samples, dim)).astype(np.float32)
    got = feature_activations(_pooled(total, g), g)
    assert len(got) == len(features)
    for f, value in zip(g.features, got, strict=True):
        expected = total[:, f.sample_offset : f.sample_offset + f.samples_per_slot, : f.dim]
        np.testing.assert_array_equal(np.asarray(value), expected.reshape(-1, f.dim))


@pytest.mark.parametrize("case", _CASES)
def test_the_gradients_go_back_to_the_samples_they_came_from(case):
    slots, dim, features = _CASES[case]
    g = _geometry(slots, dim, features)
    total = np.random.default_rng(1).normal(size=(slots, g.samples, dim)).astype(np.float32)
    for f in g.features:  # the padding of a narrower feature comes back as zeros
        total[:, f.sample_offset : f.sample_offset + f.samples_per_slot, f.dim :] = 0
    pooled = _pooled(total, g)
    back = sample_gradients(feature_activations(pooled, g), g)
    np.testing.assert_array_equal(np.asarray(back), pooled)
