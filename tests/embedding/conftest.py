"""The CPU kernels for the tests that need them, and the lookup and update
tests on both of their paths."""

import pytest

from embedding import _cpu_kernels


@pytest.fixture
def compiler() -> str:
    """The C++ compiler the kernels build with; the test is skipped where there is none."""
    try:
        return _cpu_kernels._compiler()
    except RuntimeError as e:
        pytest.skip(f"the CPU kernels cannot be built here: {e}")


@pytest.fixture
def cpu_kernels(compiler, monkeypatch):
    """The CPU kernels built and registered (skipped without a C++ compiler)."""
    monkeypatch.setenv("SPARSEFLOW_CPU_KERNELS", "1")
    # With a compiler they must build: a failed build is a failure, not a
    # skip, or a kernel run would silently test the pure-JAX path.
    assert _cpu_kernels.enabled("cpu"), "the CPU kernels did not build"


@pytest.fixture(params=["cpu_kernels", "pure_jax"])
def lookup_path(request, monkeypatch):
    """The CPU kernels and the pure-JAX reference path, in turn."""
    if request.param == "cpu_kernels":
        request.getfixturevalue("cpu_kernels")
    else:
        monkeypatch.setenv("SPARSEFLOW_CPU_KERNELS", "0")
        assert not _cpu_kernels.enabled("cpu")
    return request.param
