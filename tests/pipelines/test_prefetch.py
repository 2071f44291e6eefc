"""The compiled loops' software prefetch: a hint, with no effect on results."""

import numba
import numpy as np

from pipelines._prefetch import prefetch


@numba.njit
def _sum_prefetching(data, ahead):
    total = 0
    for i in range(data.size):
        prefetch(data, i + ahead)  # past the end too: a hint never faults
        total += data[i]
    return total


def test_prefetching_leaves_results_alone_in_and_out_of_bounds():
    data = np.random.default_rng(0).integers(0, 255, 100_000, dtype=np.uint8)
    expected = int(data.astype(np.int64).sum())
    for ahead in (0, 8, 4096, 10**9, -(10**6)):
        assert _sum_prefetching(data, ahead) == expected
