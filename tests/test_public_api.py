"""Every package's `__all__` names exist and import."""

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

TOP_LEVEL = ["embedding", "parallel", "pipelines", "beam_jobs", "sparseflow", "sparseflow_serving"]


def _packages() -> list[str]:
    """Every package and subpackage of the project (folders with an `__init__.py`)."""
    found = []
    for top in TOP_LEVEL:
        module = importlib.import_module(top)
        found.append(top)
        found += [
            info.name
            for info in pkgutil.walk_packages(module.__path__, prefix=f"{top}.")
            if info.ispkg and not info.name.rpartition(".")[2].startswith("_")
        ]
    return found


PACKAGES = _packages()


def test_the_subpackages_are_found():
    assert {
        "embedding.fdo",
        "embedding.nnx",
        "parallel.allreduce",
        "parallel.sc_tc",
        "sparseflow.config",
        "sparseflow.retrieval",
        "sparseflow.towers",
    } <= set(PACKAGES)


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


def test_the_names_static_tools_read_from_sparseflow_are_the_names_it_imports_lazily():
    """`sparseflow` imports a public name's module when the name is first used
    (`_MODULES`); editors and type checkers read its `if TYPE_CHECKING:` imports."""
    sparseflow = importlib.import_module("sparseflow")
    tree = ast.parse(Path(sparseflow.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    static = {alias.name: node.module for node in block.body for alias in node.names}
    assert static == sparseflow._MODULES
