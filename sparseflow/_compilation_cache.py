"""JAX's persistent compilation cache, on for the commands that compile (`train`, `demo`).

A second run of a config loads its compiled programs from disk instead of
compiling them again (the times are in docs/benchmarks.md, the
`train_vs_torchrec.py` row). The folder is `$SPARSEFLOW_COMPILATION_CACHE`,
else JAX's own `JAX_COMPILATION_CACHE_DIR`, else
`$XDG_CACHE_HOME/sparseflow/jax-compilation-cache` (`~/.cache/...`).
`--no-compilation-cache` or JAX's `JAX_ENABLE_COMPILATION_CACHE=false` turn
it off.

JAX keys an entry by the program, the compile options and XLA flags, the
devices and the jaxlib version, so a loaded program is the one the compiler
would give again: results are bitwise the same. One exception, by design:
a program with `custom_partitioning` calls (the interaction's CPU kernels on
several devices) holds a pointer that differs in every process, and JAX
keys it without that pointer only when told to (else such a program, the
pipelined step of every multi-device run, never loads from the cache). So
told, the key no longer holds the Python partitioners the pointer stood
for: the entries go into a subfolder named by a fingerprint of this
library's sources (`code-<hash>`), and a change to them starts a new one.
A model of the user's own with `custom_partitioning` whose partitioner
changes without its program changing needs `--no-compilation-cache` (or an
emptied folder) once. The processes of a multi-process run on CPU key a
program over all their devices alike (`share_between_processes`), so that
each of them loads what process 0, the only one JAX lets write, compiled.
The CPU kernels are
`jax.ffi` targets called by name; a program that calls them is traced, and
so looked up, only after `embedding._cpu_kernels` registered them in this
process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import tempfile
from pathlib import Path

import jax

ENV = "SPARSEFLOW_COMPILATION_CACHE"
# This library's packages, found without importing them (`beam_jobs` would
# import Apache Beam into every command).
_PACKAGES = ("embedding", "parallel", "pipelines", "beam_jobs", "sparseflow")

_log = logging.getLogger(__name__)

# On CPU even the small programs of a run (44 of the demo's 48) take far
# longer to compile than to load from the cache (docs/benchmarks.md), and
# each entry is a few kilobytes. So every program is cached.
_SETTINGS = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}


def folder() -> Path:
    """Where the cache lives (see the module's documentation)."""
    named = os.environ.get(ENV)
    if named:
        return Path(named).expanduser()
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(home) / "sparseflow" / "jax-compilation-cache"


def enable() -> Path | None:
    """Turns the cache on; to be called before anything compiles.

    Returns:
      The folder of this library version's entries (`code-<hash>` in
      `folder()`), or None when the cache stays off: JAX's own switch
      is off, or the folder cannot be created or written (one warning is
      logged, and the run compiles as it would without the cache).
    """
    if not jax.config.jax_enable_compilation_cache:
        return None
    try:
        path = folder()
    except RuntimeError as e:  # no home folder to find the user's cache folder in
        _log.warning("Found no compilation cache folder (%s); compiling without the cache.", e)
        return disable()
    try:
        # Entries are native code this process runs: a folder it creates is
        # the user's alone.
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        _log.warning(
            "The compilation cache folder %s cannot be written (%s); compiling without the cache.",
            path,
            e.strerror or e,
        )
        return disable()
    programs = path / f"code-{_sources_fingerprint()}"
    programs.mkdir(mode=0o700, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(programs))
    jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", True)
    for name, value in _SETTINGS.items():
        if name.upper() not in os.environ:  # a value the user set for JAX wins
            jax.config.update(name, value)
    return programs


@functools.cache
def _sources_fingerprint() -> str:
    """16 hex digits of a hash of every Python source of this library's packages."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        root = Path(importlib.util.find_spec(package).origin).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def disable() -> None:
    """Keeps the cache off, even where JAX's own `JAX_COMPILATION_CACHE_DIR` names a folder."""
    jax.config.update("jax_enable_compilation_cache", False)


def share_between_processes(timeout_s: float = 120.0) -> None:
    """Lets every process of a `jax.distributed` group on CPU load the programs
    process 0 wrote; to be called once the group has formed, before anything
    compiles, by every process of it.

    JAX keys a CPU program by the topology of its devices as this process's
    client describes it: the process's own devices and its CPU's target
    options. The processes of one group then key the same program over the
    group's devices apart, and since JAX writes the entries of process 0 only,
    every other process compiled every program again at every start, and the
    group waited for it at the first collective. Here the processes exchange
    their fingerprints through the group's key-value store, and a program over
    the devices of several processes is keyed by all of them: alike in every
    process of the group, and still apart for a group whose hosts have another
    CPU. Programs over one process's devices keep JAX's key.
    """
    from jax._src import cache_key, distributed
    from jax._src.lib import xla_client

    if (
        not jax.config.jax_enable_compilation_cache
        or jax.process_count() == 1
        or jax.default_backend() != "cpu"
    ):
        return
    client = distributed.global_state.client
    own = xla_client.get_topology_for_devices(jax.local_devices()).fingerprint()
    client.key_value_set(f"sparseflow/cpu_topology/{jax.process_index()}", str(own))
    try:
        fingerprints = [
            client.blocking_key_value_get(f"sparseflow/cpu_topology/{p}", int(timeout_s * 1000))
            for p in range(jax.process_count())
        ]
    except jax.errors.JaxRuntimeError as error:
        _log.warning(
            "The processes did not exchange their CPUs' descriptions within %.0f s (%s); "
            "each process compiles the programs it does not find under its own key.",
            timeout_s,
            error,
        )
        return
    group = hashlib.sha256(",".join(fingerprints).encode()).digest()
    hash_one_process = cache_key._hash_accelerator_config

    def hash_accelerator_config(hash_obj, accelerators) -> None:
        if len({device.process_index for device in accelerators.flat}) > 1:
            hash_obj.update(group)
        else:
            hash_one_process(hash_obj, accelerators)

    # JAX has no public hook for this part of its key: the pinned JAX's private
    # function is wrapped, and the tests run a group twice to see it loads.
    cache_key._hash_accelerator_config = hash_accelerator_config
