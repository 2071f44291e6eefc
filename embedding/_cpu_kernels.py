"""CPU kernels for the hot part of the lookup and the update, through `jax.ffi`.

On CPU, XLA runs the lookup's gathers and scatters element by element over
whole buffers (their size is the layout's capacity, not the batch's ids),
finds the layout's segments with a scatter and a prefix count, and merges a
row's gradients through a buffer the size of the table shard. The kernels in
`_cpu_kernels/` do the same work in linear passes over the entries and the
received rows (`benchmarks/lookup.py` measures the difference):

* `route`: one pass over a slot's layout gives every entry's place among
  the distinct rows and the rows to request from each device;
* `pool` and its transpose: gain times row, summed per sample (and back);
* `apply_update`: the owner merges the sorted runs of rows it received and
  applies SGD, Adagrad, row-wise Adagrad, LaProp, Adagrad with momentum or
  F2A once per row, in place;
* `pairwise_dots` and its transpose: the DLRM interaction of a batch's
  activations (`_interaction.py`).

The kernels that read an exchanged buffer (the gather, the pooling, the
update) take it in the pieces the all-to-all leaves, one per device, so that
XLA does not join them into one buffer first; those that make one to send
(the route, the gather, the pooling's transpose) give it in pieces, so that
XLA does not cut it up first.

The pure-JAX path (`_xla_path.py`) stays the reference and the path of
every other platform; set `SPARSEFLOW_CPU_KERNELS=0` to use it on CPU too.
`_kernel_path.py` puts these kernels behind the lookup's path interface
(`_routing.LookupPath`).

The library is compiled with the machine's C++ compiler (g++, or `$CXX`) on
first use (`make` builds it ahead) into `embedding/` when writable, else the
user's cache folder (`~/.cache/sparseflow`), under a name of two keys: the
machine's (the CPU as the compiler resolves `-march=native` here, the
compiler's identity and version, jaxlib's version: `_machine_key`) and the
sources' (every file of `_cpu_kernels/`, with the flags: `_source_key`). A
folder shared between machines (a venv, a home, an image) holds one library
per machine, and a process loads only its own machine's: another CPU's may
hold instructions this one lacks, a crash no fallback catches. Without a
compiler the machine's key is unknown, so no library loads: the pure-JAX
path runs, after one warning line. A build deletes only libraries of its own
machine built from another source, and only in `embedding/`, where no other
source can ask for them; the cache folder, which installs of other versions
may share, keeps every library (about 0.4 MB each; delete the folder to
reclaim them).

Floating point: with `-march=native` the compiler fuses multiplies and adds
(FMA) where the CPU has them, so results are bitwise the same for one
library (one source on one machine's key) on any thread count and in every
run (work is cut into chunks by its size alone), and may differ in the last
bits between machines. `-ffp-contract=off` would make them the same on every
x86-64 machine, but cost up to 7% of a kernel's time where it mattered (the
row-wise Adagrad update and the interaction; docs/benchmarks.md, "Measured
in the CPU kernels' design").
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from embedding._optimizers import (
    AdagradMomentumOptimizerSpec,
    AdagradOptimizerSpec,
    F2AOptimizerSpec,
    LaPropOptimizerSpec,
    OptimizerSpec,
    RowWiseAdagradOptimizerSpec,
    RowWiseAdamOptimizerSpec,
    SGDOptimizerSpec,
)

_LOG = logging.getLogger(__name__)
# The kernels' sources: every file in the folder. The library is compiled
# from `_UNIT`, which includes the others (one translation unit).
_SOURCES = Path(__file__).with_suffix("")
_UNIT = "kernels.cc"
_TARGETS = {
    "SfSegments": "sparseflow_segments",
    "SfRoute": "sparseflow_route",
    "SfGatherRows": "sparseflow_gather_rows",
    "SfPool": "sparseflow_pool",
    "SfPoolTranspose": "sparseflow_pool_transpose",
    "SfUpdateSgd": "sparseflow_update_sgd",
    "SfUpdateAdagrad": "sparseflow_update_adagrad",
    "SfUpdateRowWiseAdagrad": "sparseflow_update_rowwise_adagrad",
    "SfUpdateLaProp": "sparseflow_update_laprop",
    "SfUpdateAdagradMomentum": "sparseflow_update_adagrad_momentum",
    "SfUpdateF2A": "sparseflow_update_f2a",
    "SfUpdateRowWiseAdam": "sparseflow_update_rowwise_adam",
    "SfPairwiseDots": "sparseflow_pairwise_dots",
    "SfPairwiseDotsTranspose": "sparseflow_pairwise_dots_transpose",
}
_UPDATE_TARGETS = {
    SGDOptimizerSpec: "sparseflow_update_sgd",
    AdagradOptimizerSpec: "sparseflow_update_adagrad",
    RowWiseAdagradOptimizerSpec: "sparseflow_update_rowwise_adagrad",
    LaPropOptimizerSpec: "sparseflow_update_laprop",
    AdagradMomentumOptimizerSpec: "sparseflow_update_adagrad_momentum",
    F2AOptimizerSpec: "sparseflow_update_f2a",
    RowWiseAdamOptimizerSpec: "sparseflow_update_rowwise_adam",
}
# The rules that read the learning rate alone; the others read all of the
# spec's `get_hyperparameters(step)`, as `_optimizer_updates` passes them.
_LEARNING_RATE_ONLY = (SGDOptimizerSpec, AdagradOptimizerSpec, RowWiseAdagradOptimizerSpec)
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")
_PREFIX = "_cpu_kernels-"


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _compiler() -> str:
    """The C++ compiler: `$CXX`, else g++ or c++ on the PATH.

    Raises:
      RuntimeError: there is none, saying what to install.
    """
    named = os.environ.get("CXX")
    compiler = shutil.which(named) if named else shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        where = f" at $CXX={named!r}" if named else ""
        raise RuntimeError(f"no C++ compiler{where} (install g++, or name one in $CXX)")
    return compiler


def _machine_key(compiler: str) -> str:
    """What the library is built for: the CPU, the compiler and jaxlib.

    The CPU is the compiler's own answer to what `-march=native` means here
    (its driver's `-###` listing: the resolved CPU name and each instruction
    set on or off, beside the compiler's version and configuration), not
    /proc/cpuinfo: the compiler's answer is what decides the instructions
    in the library, so two machines share a library exactly when this
    compiler would build the same one for both, while /proc/cpuinfo exists on
    Linux only and lists kernel and errata flags the code does not depend on.
    jaxlib's version stands for the FFI headers the library is built against.
    """
    # From a fixed folder: clang's listing names the working directory.
    probe = subprocess.run(
        [compiler, "-###", "-march=native", "-E", "-x", "c++", os.devnull, "-o", os.devnull],
        capture_output=True,
        text=True,
        check=False,
        cwd=os.sep,
    )
    if probe.returncode != 0:
        raise RuntimeError(f"{compiler} cannot tell what -march=native means: {probe.stderr}")
    return _digest((probe.stdout + probe.stderr + jaxlib.__version__).encode())


def _source_key() -> str:
    """What the library is built from: every source file, by name and
    content (in the order of their names), and the flags."""
    files = sorted(path for path in _SOURCES.iterdir() if path.is_file())
    # One digest per file keeps the key unambiguous: text moved from one file
    # to the next changes it.
    parts = [
        hashlib.sha256(f"{path.name}\0".encode() + path.read_bytes()).digest() for path in files
    ]
    return _digest(b"".join(parts) + " ".join(_FLAGS).encode())


def _library_name(machine: str) -> str:
    return f"{_PREFIX}{machine}-{_source_key()}.so"


def _build_folders() -> list[Path]:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sparseflow"
    return [_SOURCES.parent, cache]


def build() -> Path:
    """Compiles the kernels (once per source version and machine) and returns the library.

    Raises:
      RuntimeError: no C++ compiler, or the compilation failed (with its output).
    """
    compiler = _compiler()
    machine = _machine_key(compiler)
    name = _library_name(machine)
    for folder in _build_folders():
        if (folder / name).exists():
            return folder / name
    for folder in _build_folders():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(suffix=".so", dir=folder)
        except OSError:
            continue
        os.close(handle)
        command = [compiler, *_FLAGS, "-isystem", jax.ffi.include_dir(), str(_SOURCES / _UNIT)]
        result = subprocess.run(
            [*command, "-o", temporary], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            os.unlink(temporary)
            first_error = next(
                (line for line in result.stderr.splitlines() if "error" in line),
                f"{compiler} exited with status {result.returncode}",
            )
            raise RuntimeError(f"building the CPU kernels failed: {first_error}\n{result.stderr}")
        # Renaming into place is atomic: concurrent builds never load a half file.
        os.replace(temporary, folder / name)
        if folder == _SOURCES.parent:
            # Beside the sources, a library of this machine and another source
            # is one no source can ask for any more. Other machines' libraries
            # stay (a folder shared between machines serves each its own),
            # and nothing leaves the cache folder, which other installs of
            # other versions may share.
            for stale in folder.glob(f"{_PREFIX}{machine}-*.so"):
                if stale.name != name:
                    stale.unlink(missing_ok=True)
        return folder / name
    raise RuntimeError(f"no writable folder for the CPU kernels among {_build_folders()}")


def prebuild() -> None:
    """What `make` runs: builds the kernels ahead of their first use, or,
    without a C++ compiler, notes so and returns (the pure-JAX path runs)."""
    try:
        _compiler()
    except RuntimeError as e:
        print(f"note: the CPU kernels are not built, the pure-JAX path runs: {e}")
        return
    print(build())


@functools.cache
def _registered() -> bool:
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
    except (RuntimeError, OSError) as e:
        # One line, once per process: a build failure's first line names its
        # first error (build() raises with the compiler's whole output).
        _LOG.warning("CPU kernels unavailable, the pure-JAX path runs: %s", str(e).splitlines()[0])
        return False
    for symbol, target in _TARGETS.items():
        jax.ffi.register_ffi_target(
            target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu"
        )
    return True


# Set inside `without_cpu_kernels`.
_OFF = contextvars.ContextVar("sparseflow_cpu_kernels_off", default=False)


@contextlib.contextmanager
def without_cpu_kernels():
    """Programs traced inside it use XLA's operations, never the kernels: for a program
    that runs elsewhere (`jax.export`, `jax2tf`), which cannot carry their custom calls."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def enabled(platform: str) -> bool:
    """Whether the lookup on `platform` uses the kernels: on CPU, unless
    `SPARSEFLOW_CPU_KERNELS=0` or inside `without_cpu_kernels`, when they build and load."""
    if platform != "cpu" or os.environ.get("SPARSEFLOW_CPU_KERNELS", "1") == "0" or _OFF.get():
        return False
    return _registered()


def updates_in_kernel(optimizer: OptimizerSpec) -> bool:
    """Whether the owner's merge and update of `optimizer` run in a kernel
    (the others gather, apply `_optimizer_updates` and scatter in XLA)."""
    return type(optimizer) in _UPDATE_TARGETS


def _i64(value: int) -> np.int64:
    return np.int64(value)


def _result(shape: tuple[int, ...], dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A kernel's output type, varying over the same mesh axes as `like`
    (inside `shard_map`, where a kernel's result is per device)."""
    like = jax.typeof(like)
    return jax.ShapeDtypeStruct(
        shape,
        dtype,
        sharding=NamedSharding(like.sharding.mesh, PartitionSpec()),
        manual_axis_type=like.mat,
    )


def segments(row_pointers: jax.Array, ids: jax.Array, g) -> jax.Array:
    """`int32[S, C]` as `_xla_path.find_segments` gives it."""
    return jax.ffi.ffi_call("sparseflow_segments", _result((g.slots, g.capacity), jnp.int32, ids))(
        row_pointers,
        ids,
        slots=_i64(g.slots),
        partitions=_i64(g.partitions),
        minibatches=_i64(g.minibatches),
        width=_i64(g.row_pointer_width),
    )


def route(row_pointers: jax.Array, ids: jax.Array, minibatch, g) -> tuple[jax.Array, jax.Array]:
    """`(send_rows int32[S, G, U], entry_index int32[S, C])` of one minibatch.

    `send_rows` as `_xla_path.Routing` has it; `entry_index` is each entry's
    flat index into `[S, G, U]`, -1 for entries outside the minibatch.
    """
    piece = _result((g.slots, 1, g.uniques), jnp.int32, ids)
    entry_index, *send_rows = jax.ffi.ffi_call(
        "sparseflow_route",
        (_result((g.slots, g.capacity), jnp.int32, ids), *[piece] * g.devices),
    )(
        row_pointers,
        ids,
        jnp.asarray(minibatch, jnp.int32).reshape(1),
        slots=_i64(g.slots),
        minibatches=_i64(g.minibatches),
        width=_i64(g.row_pointer_width),
        rows=_i64(g.rows),
    )
    return _joined(send_rows), entry_index


def _pieces(x: jax.Array) -> list[jax.Array]:
    """`[S, G, ...]` as G arrays `[S, ...]`, what each device sent.

    Straight after an all-to-all these are its results as they are (XLA
    drops the join and the cut), so a kernel that takes the pieces reads the
    exchanged buffer without a copy.
    """
    return [x[:, h] for h in range(x.shape[1])]


def _joined(pieces: list[jax.Array]) -> jax.Array:
    """G arrays `[S, 1, ...]` as one `[S, G, ...]`, piece h for device h.

    The inverse of `_pieces` for a kernel's outputs: when the join goes
    straight into an all-to-all, XLA sends the pieces as they are instead of
    joining them and cutting the join again (one copy and G small programs
    less per exchange).
    """
    return jnp.concatenate(pieces, axis=1)


@jax.custom_vjp
def gather_rows(table: jax.Array, rows: jax.Array) -> jax.Array:
    """`float32[S, G, U, D]`: `table[rows]`, zero for rows out of range
    (`int32[S, G, U]`, as an all-to-all received them).

    Differentiable with respect to `table` (a scatter-add, as XLA's gather).
    """
    s, g, u = rows.shape
    piece = _result((s, 1, u, table.shape[1]), jnp.float32, rows)
    return _joined(
        jax.ffi.ffi_call("sparseflow_gather_rows", [piece] * g)(
            table, *_pieces(rows), slots=_i64(s)
        )
    )


def _gather_rows_forward(table, rows):
    return gather_rows(table, rows), (rows, table.shape)


def _gather_rows_backward(residuals, grads):
    rows, shape = residuals
    table_grads = (
        jnp.zeros(shape, grads.dtype)
        .at[rows.reshape(-1)]
        .add(grads.reshape(-1, shape[1]), mode="drop")
    )
    return table_grads, np.zeros(rows.shape, jax.dtypes.float0)


gather_rows.defvjp(_gather_rows_forward, _gather_rows_backward)


def _pool(entry_index, samples, gains, rows, num_samples):
    slots = entry_index.shape[0]
    return jax.ffi.ffi_call(
        "sparseflow_pool",
        _result((slots, num_samples, rows.shape[-1]), jnp.float32, entry_index),
    )(entry_index, samples, gains, *_pieces(rows))


def pool_transpose(entry_index, samples, gains, grads, shape: tuple[int, ...]) -> jax.Array:
    """`float32[S, G, U, D]` (`shape`): per distinct row, the sum of gain
    times the gradient `float32[S, P, D]` of the samples of its entries."""
    s, g, u, d = shape
    piece = _result((s, 1, u, d), jnp.float32, entry_index)
    return _joined(
        jax.ffi.ffi_call("sparseflow_pool_transpose", [piece] * g)(
            entry_index, samples, gains, grads
        )
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def pool(entry_index, samples, gains, rows, num_samples: int) -> jax.Array:
    """`float32[S, P, D]`: per sample, the sum of gain times row over its entries.

    Args:
      entry_index: `int32[S, C]` from `route`.
      samples: `int32[S * C]` each entry's sample in its slot.
      gains: `float32[S * C]`.
      rows: `float32[S, G, U, D]` the distinct rows in `route`'s order, as
        their owners sent them.
      num_samples: P.

    Differentiable with respect to `rows` (by `pool_transpose`).
    """
    return _pool(entry_index, samples, gains, rows, num_samples)


def _pool_forward(entry_index, samples, gains, rows, num_samples):
    return _pool(entry_index, samples, gains, rows, num_samples), (
        entry_index,
        samples,
        gains,
        rows.shape,
    )


def _pool_backward(num_samples, residuals, grads):
    del num_samples
    entry_index, samples, gains, shape = residuals
    return None, None, None, pool_transpose(entry_index, samples, gains, grads, shape)


pool.defvjp(_pool_forward, _pool_backward)


def _hyperparameters(optimizer: OptimizerSpec, learning_rate, step) -> jax.Array:
    """`float32[k]`: the scalars the kernel's rule reads (a bool as 0 or 1)."""
    if isinstance(optimizer, _LEARNING_RATE_ONLY):
        values = (learning_rate,)
    else:
        values = optimizer.get_hyperparameters(step)
    return jnp.stack([jnp.asarray(value, jnp.float32) for value in values])


def apply_update(
    optimizer: OptimizerSpec,
    received_rows: jax.Array,
    received_grads: jax.Array,
    table: jax.Array,
    slots,
    learning_rate: jax.Array,
    step: jax.Array,
    g,
):
    """Merges the received gradients per row and applies `optimizer` in place.

    Args:
      optimizer: one with a kernel (`updates_in_kernel`).
      received_rows: `int32[S, G, U]`, as the all-to-all received them: runs
        of U shard rows, one per slot and source device, each ascending and
        padded with `S * R`.
      received_grads: `float32[S, G, U, D]` the rows' gradients.
      table: `float32[S * R, D]`, this device's shard (donated).
      slots: the optimizer's slots of the shard (donated).
      learning_rate: scalar.
      step: scalar, the training step (the rules with a bias correction or
        a frequency boost read it through `get_hyperparameters`).
      g: the stack's geometry.

    Returns:
      `(table, slots)` updated.
    """
    starts = jnp.asarray([start for start, _ in g.table_dims], jnp.int32)
    dims = jnp.asarray([dim for _, dim in g.table_dims], jnp.int32)
    state = (table, *slots)
    outputs = jax.ffi.ffi_call(
        _UPDATE_TARGETS[type(optimizer)],
        tuple(_result(x.shape, x.dtype, x) for x in state),
        input_output_aliases={3 + i: i for i in range(len(state))},
    )(
        _hyperparameters(optimizer, learning_rate, step),
        starts,
        dims,
        *state,
        *_pieces(received_rows),
        *_pieces(received_grads),
        slots=_i64(received_rows.shape[0]),
        rows_per_partition=_i64(g.rows),
        epsilon=np.float32(getattr(optimizer, "epsilon", 0.0)),
    )
    return outputs[0], type(slots)(*outputs[1:])


def pairwise_dots(stacked: jax.Array) -> jax.Array:
    """`float32[B, n (n - 1) / 2]`: the dots of every pair of `stacked:
    float32[B, n, d]`'s vectors per sample, in `np.triu_indices(n, k=1)` order."""
    b, n, _ = stacked.shape
    return jax.ffi.ffi_call(
        "sparseflow_pairwise_dots", jax.ShapeDtypeStruct((b, n * (n - 1) // 2), jnp.float32)
    )(stacked)


def pairwise_dots_transpose(stacked: jax.Array, grads: jax.Array) -> jax.Array:
    """`float32[B, n, d]`: the gradient of `pairwise_dots(stacked)` for `grads`."""
    return jax.ffi.ffi_call(
        "sparseflow_pairwise_dots_transpose", jax.ShapeDtypeStruct(stacked.shape, jnp.float32)
    )(stacked, grads)
