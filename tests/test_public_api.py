"""Every package's `__all__` names exist and import."""

import importlib

import pytest

PACKAGES = [
    "embedding",
    "embedding.nnx",
    "pipelines",
    "parallel",
    "beam_jobs",
    "sparseflow",
    "sparseflow.towers",
    "sparseflow.retrieval",
]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_imports(package):
    module = importlib.import_module(package)
    public = getattr(module, "__all__", None)
    assert public, f"{package} must declare a non-empty __all__."
    assert len(set(public)) == len(public), f"{package}.__all__ lists a name twice."
    missing = [name for name in public if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names missing attributes: {missing}"
    namespace = {}
    exec(f"from {package} import *", namespace)  # noqa: S102 - the star import itself
    assert set(public) <= set(namespace)
