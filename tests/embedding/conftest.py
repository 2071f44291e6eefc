"""Runs the lookup and update tests on both of their paths."""

import pytest

from embedding import _cpu_kernels


@pytest.fixture(params=["cpu_kernels", "pure_jax"])
def lookup_path(request, monkeypatch):
    """The CPU kernels and the pure-JAX reference path, in turn."""
    kernels = request.param == "cpu_kernels"
    monkeypatch.setenv("SPARSEFLOW_CPU_KERNELS", "1" if kernels else "0")
    # The kernels build with the machine's compiler; here they must, or the
    # kernel run would silently test the pure-JAX path twice.
    assert _cpu_kernels.enabled("cpu") is kernels
    return request.param
