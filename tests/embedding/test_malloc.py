"""Creating or looking up tables keeps the memory a step frees for the next step (glibc)."""

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

_PROGRAM = textwrap.dedent(
    """
    import ctypes, json, resource, sys
    import jax, jax.numpy as jnp, numpy as np
    import embedding
    from lookup_reference import TABLES, feature_specs, make_batch, mesh_of, preprocess

    # A fixed 1 MiB threshold, as a process's allocation history can leave
    # glibc's adaptive one: every block above it is a fresh mapping.
    ctypes.CDLL(None).mallopt(-3, 2**20)  # M_MMAP_THRESHOLD
    specs, mesh = feature_specs("sum", embedding.SGDOptimizerSpec(), 1, 1), mesh_of(1)
    if sys.argv[1] == "tables":
        embedding.init_embedding_variables(jax.random.key(0), specs, mesh, num_sc_per_device=1)
    if sys.argv[1] == "lookup":  # tables restored, not created: a prediction
        logical = {name: np.ones(shape, np.float32) for name, shape in TABLES.items()}
        stacks = embedding.shard_tables(logical, specs, mesh, num_sc_per_device=1)
        slots = embedding.SGDOptimizerSpec().slot_initial_values()
        variables = {name: embedding.EmbeddingVariables(t, slots) for name, t in stacks.items()}
        preprocessed = preprocess(make_batch(0), specs, 1, 1)
        jax.block_until_ready(
            embedding.sparse_dense_matmul(preprocessed, variables, specs, mesh)
        )

    @jax.jit
    def step(x):  # 8 MiB of temporaries per call
        y = jnp.sort(x)
        return (y * jnp.arange(y.size, dtype=y.dtype)).sum() + jnp.cumsum(y)[-1]

    x = jnp.ones(2**20, jnp.float32)
    temp = step.lower(x).compile().memory_analysis().temp_size_in_bytes
    for _ in range(3):
        step(x).block_until_ready()
    faults = []
    for _ in range(11):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step(x).block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    # The median call: a call that happens to grow another thread's arena
    # faults too, and is not the case measured.
    faults_per_call = float(np.median(faults))
    print(json.dumps({"temp_pages": temp // 4096, "faults_per_call": faults_per_call}))
    """
)


def _run(tmp_path, program: str, *args: str, environment: dict[str, str] | None = None) -> dict:
    """The JSON of the last line `program` prints, run in a fresh process without the
    environment's malloc settings, with `environment`'s."""
    script = tmp_path / "program.py"
    script.write_text(program)
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("MALLOC_") and name != "GLIBC_TUNABLES"
    }
    env.update(
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]),
    )
    env.update(environment or {})
    done = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _faults(tmp_path, mode: str, environment: dict[str, str] | None = None) -> dict:
    return _run(tmp_path, _PROGRAM, mode, environment=environment)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")
def test_after_creating_or_looking_up_tables_a_step_does_not_map_its_temporaries_again(tmp_path):
    without = _faults(tmp_path, "no-tables")
    # The case the thresholds are for: each call maps its temporaries afresh
    # (about three faults per page of them, the mapping zeroed and freed).
    assert without["faults_per_call"] > without["temp_pages"], without
    for mode in ("tables", "lookup"):
        after = _faults(tmp_path, mode)
        assert after["faults_per_call"] < without["faults_per_call"] / 5, (mode, without, after)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")
def test_a_threshold_the_environment_sets_is_kept(tmp_path):
    # The user's (the same 1 MiB) threshold stays: each call maps its temporaries.
    for environment in ({"MALLOC_MMAP_THRESHOLD_": "1048576"},
                        {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}):  # fmt: skip
        kept = _faults(tmp_path, "tables", environment)
        assert kept["faults_per_call"] > kept["temp_pages"], (environment, kept)


_FREED = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import embedding
    from embedding import _malloc

    def resident():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))

    assert _malloc.keep_freed_memory()
    # One-time work: 96 MiB in blocks below the mmap threshold (heap blocks),
    # touched, then freed: less than the trim threshold, so the heap keeps it.
    blocks = [np.ones(2**20, np.float32) for _ in range(24)]
    before = resident()
    del blocks
    kept = resident()
    given_back = embedding.give_back_freed_memory()
    after = before - resident()
    print(json.dumps({"kept": before - kept, "after": after, "given_back": given_back}))
    """
)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_memory_freed_by_one_time_work_is_given_back(tmp_path):
    freed = _run(tmp_path, _FREED)
    blocks = 24 * 4 * 2**20
    assert freed["kept"] < blocks / 4, freed  # the thresholds keep it resident
    assert freed["given_back"] and freed["after"] > 0.9 * blocks, freed
