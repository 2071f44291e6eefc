"""Between a stack's slot-major samples and its features' arrays (`_feature_blocks`),
against slicing each feature out in numpy, and back."""

import numpy as np
import pytest

from embedding._feature_blocks import feature_activations, sample_gradients
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


@pytest.mark.parametrize("case", _CASES)
def test_each_features_activations_are_its_samples_slot_by_slot(case):
    slots, dim, features = _CASES[case]
    g = _geometry(slots, dim, features)
    total = np.random.default_rng(0).normal(size=(slots, g.samples, dim)).astype(np.float32)
    got = feature_activations(total, g)
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
    back = sample_gradients(feature_activations(total, g), g)
    np.testing.assert_array_equal(np.asarray(back), total)
