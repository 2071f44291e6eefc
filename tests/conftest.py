"""Test-wide setup that must run before anything imports jax."""

import atexit
import gc
import os
import shutil
import tempfile

import pytest
from memory_maps import memory_maps_over
from worker_count import worker_count

# Eight virtual CPU devices, the shape every multi-device test assumes. XLA
# reads the flag once, when jax initializes its backend, so it is set here.
_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()

# The commands' compiled programs go to this session's own cache folder (the
# processes the tests start inherit it): never to the user's, and no test
# depends on what an earlier session left there. pytest-xdist's workers
# inherit the controller's environment, so they share its folder (a program
# one worker's commands compiled, another's load), and the controller, which
# outlives them, removes it.
_SESSION_CACHE = "SPARSEFLOW_TEST_SESSION_COMPILATION_CACHE"
if _SESSION_CACHE not in os.environ:
    os.environ[_SESSION_CACHE] = tempfile.mkdtemp(prefix="sparseflow-test-compilation-cache-")
    atexit.register(shutil.rmtree, os.environ[_SESSION_CACHE], ignore_errors=True)
os.environ["SPARSEFLOW_COMPILATION_CACHE"] = os.environ[_SESSION_CACHE]

try:
    from absl import flags
except ImportError:
    pass
else:
    # Grain reads absl flags; under pytest nothing parses the command line.
    flags.FLAGS.mark_as_parsed()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: the cores this process may use and the memory holds
    (`worker_count`), not pytest-xdist's count of the host's physical cores,
    which in a container can be far more than it runs on. pytest-xdist's
    PYTEST_XDIST_AUTO_NUM_WORKERS still decides where it is set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return worker_count()


_CACHE_SETTINGS = (
    "jax_enable_compilation_cache",
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
    "jax_remove_custom_partitioning_ptr_from_cache_key",
)


@pytest.fixture(autouse=True)
def _compilation_cache_as_before():
    """JAX's persistent compilation cache as it was before the test.

    A command run in-process (`_cli.main(["train", ...])`) turns the cache on
    for the whole process, as it should for a user; in a test process every
    later test would then serialize each program it compiles, so what a test
    does would depend on which tests ran before it in the same worker.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    before = {name: getattr(jax.config, name) for name in _CACHE_SETTINGS}
    yield
    if any(getattr(jax.config, name) != value for name, value in before.items()):
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


@pytest.fixture(autouse=True)
def _compiled_programs_within_the_mapping_limit():
    """Frees the compiled programs JAX keeps once they hold half the mappings a
    process may have.

    Each XLA:CPU executable is loaded as three mappings of its own (code,
    constants, data), and JAX's caches keep every program a test compiled: a
    test worker that runs a few hundred trainings in one process reached
    Linux's limit (65,530 by default), and the next compilation failed to map
    its code and died of a segmentation fault or an abort. Cleared, later
    tests compile their programs again; nothing else changes.
    """
    yield
    if memory_maps_over(0.5):
        import jax

        jax.clear_caches()
        gc.collect()
