"""JAX's persistent compilation cache under `sparseflow train`: filled once, then loaded.

Every run here is a real training run in a fresh process (the cache is
read and written once per process), counting JAX's own cache events.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import pytest
from tiny_config import tiny_config

import pipelines
from sparseflow import _compilation_cache, load_config

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
HITS = "/jax/compilation_cache/cache_hits"
WRITES = "/jax/compilation_cache/cache_misses"  # recorded once an entry is written
STEPS = 3


def _train(
    tmp: Path, name: str, cache: Path, *flags: str, devices: int = 1, env: dict | None = None
) -> dict:
    """A 3-step run of the tiny config on `devices` CPU devices (with `env` added to the
    environment); its exit, events, losses and stderr."""
    checkpoints = tmp / f"checkpoints_{name}"
    argv = ["train", "--config", str(tmp / "tiny.yaml"), "--devices", str(devices)]
    argv += ["--steps", str(STEPS), "--no-progress", "--checkpoint-dir", str(checkpoints), *flags]
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, **(env or {})}
    env.update(PYTHONPATH=str(REPO), SPARSEFLOW_COMPILATION_CACHE=str(cache))
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    result = subprocess.run(
        [sys.executable, str(HERE / "compilation_cache_process.py"), *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.splitlines()[-1])
    # The last checkpoint (a pipelined run's last call is past its last step) has every loss.
    last = max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    metadata = checkpoints / str(last) / "metadata" / "metadata"
    outcome["losses"] = json.loads(metadata.read_text())["losses"]
    outcome["stderr"] = result.stderr
    return outcome


def _entries(folder: Path) -> dict[str, int]:
    """The folder's files and when each was written; none when there is no folder."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*-cache")}


def _tiny_run_folder(tmp_path_factory, name: str) -> Path:
    tmp = tmp_path_factory.mktemp(name)
    config = load_config(tiny_config(tmp))
    pipelines.write_synthetic_dataset(
        config.synthetic.dataset, config.dataset.dir, num_examples=150, seed=0, num_shards=2
    )
    return tmp


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run without the cache, then twice with it, and the cache after each."""
    tmp = _tiny_run_folder(tmp_path_factory, "cache_runs")
    cache, unused = tmp / "cache", tmp / "unused_cache"
    unused.mkdir()
    uncached = _train(tmp, "uncached", unused, "--no-compilation-cache")
    first = _train(tmp, "first", cache)
    after_first = _entries(cache)
    second = _train(tmp, "second", cache)
    return {
        "uncached": uncached,
        "unused_cache": list(unused.iterdir()),
        "first": first,
        "after_first": after_first,
        "second": second,
        "after_second": _entries(cache),
    }


def test_the_first_run_fills_the_cache(runs):
    first = runs["first"]
    assert first["events"].get(WRITES, 0) > 0 and HITS not in first["events"]
    # One file per program written (JAX's cache keeps one `<key>-cache` file each).
    assert len(runs["after_first"]) == first["events"][WRITES]


def test_the_second_run_loads_every_program_and_trains_bitwise_the_same(runs):
    first, second = runs["first"], runs["second"]
    assert second["events"].get(HITS) == first["events"][WRITES]
    assert WRITES not in second["events"]
    assert runs["after_second"] == runs["after_first"]
    assert len(second["losses"]) == STEPS
    # Floats through JSON keep every bit; compare their bit patterns all the same.
    assert [x.hex() for x in second["losses"]] == [x.hex() for x in first["losses"]]


def test_the_entries_are_in_a_folder_of_this_code(runs, tmp_path):
    folders = {Path(name).parent for name in runs["after_first"]}
    assert folders == {Path(f"code-{_compilation_cache._sources_fingerprint()}")}


def test_a_multi_device_runs_custom_partitioned_step_loads_from_the_cache(tmp_path_factory):
    """The interaction's kernels are custom-partitioned on several devices: their
    program is keyed without the pointer JAX puts in it, which differs in every
    process."""
    tmp = _tiny_run_folder(tmp_path_factory, "cache_runs_4_devices")
    first = _train(tmp, "first", tmp / "cache", devices=4)
    second = _train(tmp, "second", tmp / "cache", devices=4)
    assert second["events"].get(HITS) == first["events"][WRITES]
    assert WRITES not in second["events"]
    assert [x.hex() for x in second["losses"]] == [x.hex() for x in first["losses"]]


def _misses(run: dict) -> collections.Counter:
    """The programs each process of the run did not find in the cache, by name."""
    return collections.Counter(re.findall(r"CACHE MISS for '(\w+)'", run["stderr"]))


@pytest.fixture(scope="module")
def group_runs(tmp_path_factory):
    """Two runs of 2 processes of one device each, pipelined, with the cache: JAX's
    cache misses in the output."""
    tmp = _tiny_run_folder(tmp_path_factory, "cache_runs_2_processes")
    flags = ("--num-processes", "2", "--verbose")
    env = {"JAX_EXPLAIN_CACHE_MISSES": "1"}
    first = _train(tmp, "first", tmp / "cache", *flags, devices=2, env=env)
    return first, _train(tmp, "second", tmp / "cache", *flags, devices=2, env=env)


def test_every_process_of_a_group_loads_the_programs_over_its_devices(group_runs):
    """JAX writes the entries of process 0 only, and keys a CPU program by the
    devices its process's client holds: unless the processes key a program over
    all their devices alike, process 1 compiles it again at every start."""
    first, second = group_runs
    # The dense parameters' initialization and the training step run on both processes' devices.
    over_the_group = {"jit_initial_train_state", *(n for n in _misses(first) if "step" in n)}
    assert len(over_the_group) == 2, _misses(first)
    assert all(_misses(first)[name] == 2 for name in over_the_group), _misses(first)
    assert not over_the_group & set(_misses(second)), _misses(second)
    assert [x.hex() for x in second["losses"]] == [x.hex() for x in first["losses"]]


def test_processes_of_one_device_each_save_a_pipelined_run_and_train_as_one(runs, group_runs):
    """Placeholders of the pipeline state copied onto such a group's devices were
    arrays orbax could not save: the first checkpoint failed."""
    for run in group_runs:
        np.testing.assert_allclose(run["losses"], runs["first"]["losses"], rtol=1e-6)


class _Fingerprint(NamedTuple):
    value: int

    def fingerprint(self) -> int:
        return self.value


class _Store:
    """The group's key-value store as one process sees it: what the others published."""

    def __init__(self, published: dict[str, str]):
        self.values = dict(published)

    def key_value_set(self, key: str, value: str) -> None:
        self.values[key] = value

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        if key not in self.values:
            raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: {key} within {timeout_ms} ms")
        return self.values[key]


@dataclasses.dataclass(frozen=True)
class _Device:
    process_index: int


@pytest.fixture
def as_a_process_of_two(monkeypatch):
    """`share(index, cpus, published)`: runs `share_between_processes` as process
    `index` of 2, each process's CPU described by `cpus[p]` and the store holding
    `published`; returns the accelerator hash it leaves, and restores JAX's."""
    from jax._src import cache_key, distributed
    from jax._src.lib import xla_client

    jax.devices()  # the backend started before the store is replaced
    jax.config.update("jax_enable_compilation_cache", True)  # restored by the conftest
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    original = cache_key._hash_accelerator_config
    monkeypatch.setattr(cache_key, "_hash_accelerator_config", original)

    def share(index: int, cpus: tuple[int, int], published: dict[str, str]):
        monkeypatch.setattr(jax, "process_index", lambda: index)
        monkeypatch.setattr(
            xla_client, "get_topology_for_devices", lambda _: _Fingerprint(cpus[index])
        )
        monkeypatch.setattr(distributed.global_state, "client", _Store(published))
        _compilation_cache.share_between_processes(timeout_s=0.1)
        left = cache_key._hash_accelerator_config
        cache_key._hash_accelerator_config = original
        return left

    return share


def _digest(hash_accelerator_config, process_indices: list[int]) -> bytes:
    digest = hashlib.sha256()
    hash_accelerator_config(digest, np.array([_Device(p) for p in process_indices], object))
    return digest.digest()


def test_the_processes_of_a_group_key_a_program_over_their_devices_alike(as_a_process_of_two):
    from jax._src import cache_key

    key = "sparseflow/cpu_topology/{}".format
    on_0 = as_a_process_of_two(0, (10, 11), {key(1): "11"})
    on_1 = as_a_process_of_two(1, (10, 11), {key(0): "10"})
    assert _digest(on_0, [0, 1]) == _digest(on_1, [0, 1])
    # A group whose process 1 runs on another CPU keys it apart.
    other_cpu = as_a_process_of_two(0, (10, 12), {key(1): "12"})
    assert _digest(other_cpu, [0, 1]) != _digest(on_0, [0, 1])
    # A program over one process's devices keeps JAX's key.
    jaxs = cache_key._hash_accelerator_config
    assert _digest(on_0, [0]) == _digest(jaxs, [0]) != _digest(on_0, [0, 1])


def test_a_process_that_never_publishes_leaves_jaxs_keys_with_a_warning(
    as_a_process_of_two, caplog
):
    from jax._src import cache_key

    with caplog.at_level(logging.WARNING, logger="sparseflow._compilation_cache"):
        left = as_a_process_of_two(0, (10, 11), {})
    assert left is cache_key._hash_accelerator_config
    assert "did not exchange their CPUs' descriptions within 0 s" in caplog.text


def test_no_compilation_cache_neither_reads_nor_writes_and_trains_the_same(runs):
    uncached = runs["uncached"]
    assert runs["unused_cache"] == []
    assert HITS not in uncached["events"] and WRITES not in uncached["events"]
    assert [x.hex() for x in uncached["losses"]] == [x.hex() for x in runs["first"]["losses"]]


def test_a_folder_that_cannot_be_written_warns_once_and_trains(tmp_path):
    config = load_config(tiny_config(tmp_path))
    pipelines.write_synthetic_dataset(
        config.synthetic.dataset, config.dataset.dir, num_examples=150, seed=0, num_shards=2
    )
    # Under a regular file no folder can be made, whoever runs the test (root too).
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    run = _train(tmp_path, "unwritable", blocker / "cache")
    assert HITS not in run["events"] and WRITES not in run["events"]
    assert len(run["losses"]) == STEPS
    lines = run["stderr"].splitlines()
    assert lines == [
        f"WARNING sparseflow._compilation_cache: The compilation cache folder {blocker / 'cache'} "
        "cannot be written (Not a directory); compiling without the cache."
    ], lines


@pytest.fixture
def no_jax_cache_folder(monkeypatch):
    """JAX's own `jax_compilation_cache_dir` unset for the test (a run in this process sets it)."""
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.delenv(_compilation_cache.ENV, raising=False)
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_the_cache_lives_in_the_users_cache_folder(no_jax_cache_folder, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _compilation_cache.folder() == tmp_path / "xdg" / "sparseflow" / "jax-compilation-cache"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home" / ".cache" / "sparseflow" / "jax-compilation-cache"
    assert _compilation_cache.folder() == expected
    monkeypatch.setenv(_compilation_cache.ENV, str(tmp_path / "named"))
    assert _compilation_cache.folder() == tmp_path / "named"


def test_the_code_fingerprint_imports_nothing_it_hashes():
    """`train` does not import Apache Beam; hashing `beam_jobs`' sources must not either."""
    probe = (
        "import sys\n"
        "from sparseflow import _compilation_cache\n"
        "print(_compilation_cache._sources_fingerprint())\n"
        "print('apache_beam' in sys.modules, 'beam_jobs' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    fingerprint, imported = out.stdout.splitlines()[-2:]
    assert fingerprint == _compilation_cache._sources_fingerprint()
    assert imported == "False False"
