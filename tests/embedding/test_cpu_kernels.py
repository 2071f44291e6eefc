"""The CPU kernels: building them, and their work split into chunks."""

import functools
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from jax.sharding import Mesh
from lookup_reference import (
    JTE_OPTIMIZERS,
    ROWWISE_ADAM_OPTIMIZERS,
    TABLES,
    activation_grads,
    feature_specs,
    gather_all,
    make_batch,
    mesh_of,
    preprocess,
)

import embedding
from embedding import _cpu_kernels
from embedding._optimizers import RowWiseAdagradSlots, SGDSlots
from embedding._stack_geometry import StackGeometry


def _package(tmp_path: Path, monkeypatch, source: str) -> Path:
    """A package folder whose kernels' sources are `source` alone (small, so
    that a build takes a moment), as `build` sees it, beside an empty cache
    folder."""
    package = tmp_path / "embedding"
    (package / "_cpu_kernels").mkdir(parents=True, exist_ok=True)
    (package / "_cpu_kernels" / _cpu_kernels._UNIT).write_text(source)
    monkeypatch.setattr(_cpu_kernels, "_SOURCES", package / "_cpu_kernels")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    return package


def _source(version: int) -> str:
    return f'extern "C" int SparseflowSourceVersion() {{ return {version}; }}\n'


@pytest.fixture
def fresh_registration(monkeypatch):
    """`enabled` as in a process that has not built or loaded the kernels yet."""
    monkeypatch.setattr(
        _cpu_kernels, "_registered", functools.cache(_cpu_kernels._registered.__wrapped__)
    )


def test_a_failed_build_names_the_compiler_output_and_logs_one_line(
    tmp_path, monkeypatch, caplog, compiler, fresh_registration
):
    _package(tmp_path, monkeypatch, "this is not C++\n")
    monkeypatch.setattr(_cpu_kernels, "_build_folders", lambda: [tmp_path / "out"])
    with pytest.raises(
        RuntimeError, match="(?s)building the CPU kernels failed: .*error: expected"
    ):
        _cpu_kernels.build()
    assert not list((tmp_path / "out").glob("*.so"))
    monkeypatch.setenv("SPARSEFLOW_CPU_KERNELS", "1")
    with caplog.at_level(logging.WARNING, logger=_cpu_kernels.__name__):
        assert not _cpu_kernels.enabled("cpu")
    [record] = caplog.records
    assert "\n" not in record.getMessage()
    assert re.search("building the CPU kernels failed: .*error: expected", record.getMessage())


def test_no_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(_cpu_kernels, "_build_folders", lambda: [tmp_path])
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler .*no-such-compiler"):
        _cpu_kernels.build()
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler \\(install g\\+\\+"):
        _cpu_kernels.build()


def test_without_a_compiler_the_pure_jax_path_runs_after_one_warning_line(
    tmp_path, monkeypatch, caplog, fresh_registration
):
    """No g++ or c++ on the PATH, no $CXX and an empty build folder: the
    kernels are off, the interaction runs in XLA, and the warning, one line
    saying what to install, comes once."""
    monkeypatch.setattr(_cpu_kernels, "_build_folders", lambda: [tmp_path / "empty"])
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("SPARSEFLOW_CPU_KERNELS", "1")
    vectors = [np.full((2, 4), k, np.float32) for k in (1, 2, 3)]
    with caplog.at_level(logging.WARNING, logger=_cpu_kernels.__name__):
        assert not _cpu_kernels.enabled("cpu")
        forward = jax.jit(lambda vs: embedding.pairwise_dots(vs))
        assert "sparseflow_pairwise_dots" not in forward.lower(vectors).as_text()
        np.testing.assert_array_equal(forward(vectors), np.tile([8.0, 12.0, 24.0], (2, 1)))
        assert not _cpu_kernels.enabled("cpu")
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "\n" not in record.getMessage()
    assert "install g++" in record.getMessage() and "pure-JAX" in record.getMessage()


def test_make_notes_a_missing_compiler_and_goes_on(tmp_path, monkeypatch, capsys):
    _package(tmp_path, monkeypatch, _source(1))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    _cpu_kernels.prebuild()
    assert "note: the CPU kernels are not built" in capsys.readouterr().out
    assert not list(tmp_path.rglob("*.so"))


def test_the_source_key_follows_every_source_file(tmp_path, monkeypatch):
    """An edit to any one file of the kernels' sources names another library
    (else the library built before the edit would load)."""
    sources = tmp_path / "_cpu_kernels"
    shutil.copytree(_cpu_kernels._SOURCES, sources)
    monkeypatch.setattr(_cpu_kernels, "_SOURCES", sources)
    before = _cpu_kernels._library_name("machine")
    files = sorted(sources.iterdir())
    assert len(files) > 1
    for path in files:
        text = path.read_bytes()
        path.write_bytes(text + b"\n")
        assert _cpu_kernels._library_name("machine") != before, path.name
        path.write_bytes(text)
    assert _cpu_kernels._library_name("machine") == before


def test_the_build_reads_every_source_file_and_no_other(compiler):
    """The files the compiler reads for the library, but for the system's and
    jaxlib's headers (in the machine's key), are the kernels' sources: every
    part is in the library, and the source key covers all it is built from."""
    listing = subprocess.run(
        [
            compiler,
            "-MM",
            "-isystem",
            jax.ffi.include_dir(),
            _cpu_kernels._SOURCES / _cpu_kernels._UNIT,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    read = {Path(word).resolve() for word in listing.split()[1:] if word != "\\"}
    assert read == {path.resolve() for path in _cpu_kernels._SOURCES.iterdir()}


def test_the_machine_key_is_stable_and_follows_jaxlib(tmp_path, monkeypatch, compiler):
    """One key wherever the process runs from (else every run would rebuild);
    another for another jaxlib (the FFI headers the library is built against)."""
    key = _cpu_kernels._machine_key(compiler)
    monkeypatch.chdir(tmp_path)
    assert _cpu_kernels._machine_key(compiler) == key
    monkeypatch.setattr(jaxlib, "__version__", jaxlib.__version__ + ".other")
    assert _cpu_kernels._machine_key(compiler) != key


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="builds for a baseline x86-64"
)
def test_a_library_for_another_cpu_is_neither_loaded_nor_deleted(tmp_path, monkeypatch, compiler):
    """A package folder shared with a machine whose CPU is a baseline x86-64:
    each machine builds and loads its own library, and neither's build
    deletes the other's."""
    package = _package(tmp_path, monkeypatch, _source(1))
    ours = _cpu_kernels.build()
    assert ours.parent == package
    made = ours.stat().st_ino
    # The same compiler where -march=native means the x86-64 baseline.
    baseline = tmp_path / "baseline-c++"
    baseline.write_text(
        "#!/bin/sh\n"
        'for a; do shift; [ "$a" = -march=native ] && a=-march=x86-64; set -- "$@" "$a"; done\n'
        f'exec "{compiler}" "$@"\n'
    )
    baseline.chmod(0o755)
    monkeypatch.setenv("CXX", str(baseline))
    theirs = _cpu_kernels.build()
    assert theirs != ours and theirs.parent == package
    assert ours.exists()
    monkeypatch.setenv("CXX", compiler)
    assert _cpu_kernels.build() == ours
    assert ours.stat().st_ino == made  # found, not built again (a build renames a new file)
    assert theirs.exists()


def test_a_build_deletes_only_its_own_machines_libraries_of_another_source(
    tmp_path, monkeypatch, compiler
):
    """Beside the source, a new source's build deletes the library of the
    source before it on this machine, and no other machine's, nor a library
    whose machine it cannot tell; in the cache folder, which installs of
    other versions may share, it deletes nothing."""
    package = _package(tmp_path, monkeypatch, _source(1))
    first = _cpu_kernels.build()
    source_key = first.name.removesuffix(".so").rsplit("-", 1)[1]
    kept = [
        package / f"_cpu_kernels-{'0' * 16}-{source_key}.so",  # another machine's
        package / "_cpu_kernels-0123456789abcdef.so",  # whose machine is not in its name
        package / "other.so",
    ]
    for path in kept:
        path.write_bytes(b"not this machine's library")
    _package(tmp_path, monkeypatch, _source(2))
    second = _cpu_kernels.build()
    assert second.parent == package and second.exists()
    assert not first.exists()
    assert all(path.exists() for path in kept)

    cache = tmp_path / "home-cache" / "sparseflow"
    monkeypatch.setattr(_cpu_kernels, "_build_folders", lambda: [cache])
    in_cache = []
    for version in (1, 2):
        _package(tmp_path, monkeypatch, _source(version))
        in_cache.append(_cpu_kernels.build())
    assert in_cache[0] != in_cache[1] and all(path.parent == cache for path in in_cache)
    assert all(path.exists() for path in in_cache)


def _large_case(optimizer, devices):
    """One table, enough ids that every kernel cuts its work into chunks."""
    vocab, dim, batch = 20_000, 8, 16_384
    rng = np.random.default_rng(5)
    counts = rng.integers(1, 7, batch)
    rows = [rng.integers(0, vocab, c) for c in counts]
    table = embedding.TableSpec(
        name="t",
        vocabulary_size=vocab,
        embedding_dim=dim,
        initializer=embedding.initializers.Normal(stddev=1.0),
        optimizer=optimizer,
        combiner="sum",
        max_ids_per_partition=int(counts.sum()),
        max_unique_ids_per_partition=vocab,
    )
    specs = {
        "f": embedding.FeatureSpec(
            name="f", table_spec=table, input_shape=[batch, 6], output_shape=[batch, dim]
        )
    }
    ids = np.empty(batch, dtype=object)
    ids[:] = rows
    preprocessed, _ = embedding.preprocess_sparse_dense_matmul_input(
        {"f": ids}, None, specs, devices, devices, num_sc_per_device=1
    )
    return specs, rows, preprocessed


def _large_step(optimizer, devices):
    """A step of `0.5 * sum(activations^2)` on `_large_case` over `devices`:
    `(specs, rows, mesh, the table before in float64, the activations, the
    variables after)`."""
    specs, rows, preprocessed = _large_case(optimizer, devices)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    variables = embedding.init_embedding_variables(
        jax.random.key(0), specs, mesh, num_sc_per_device=1
    )
    w = embedding.gather_tables({"t": variables["t"].table}, specs, mesh, num_sc_per_device=1)[
        "t"
    ].astype(np.float64)

    @jax.jit
    def step(variables):
        activations = embedding.sparse_dense_matmul(preprocessed, variables, specs, mesh)
        return activations, embedding.apply_gradients(
            activations, preprocessed, variables, specs, mesh, 0
        )

    return specs, rows, mesh, w, *step(variables)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize(
    "optimizer",
    [
        embedding.SGDOptimizerSpec(learning_rate=0.1),
        embedding.RowWiseAdagradOptimizerSpec(learning_rate=0.1, initial_accumulator_value=0.5),
    ],
)
def test_chunked_kernels_match_float64(optimizer, devices):
    """A step on a batch large enough for the kernels to split the pooling,
    its transpose, the gather and the update."""
    specs, rows, mesh, w, activations, variables = _large_step(optimizer, devices)
    expected = np.stack([w[r].sum(axis=0) for r in rows])
    np.testing.assert_allclose(np.asarray(activations["f"]), expected, rtol=1e-5, atol=1e-4)
    grads = np.zeros_like(w)
    for sample, r in enumerate(rows):
        np.add.at(grads, r, expected[sample])
    touched = np.zeros(len(w), bool)
    touched[np.concatenate(rows)] = True
    if isinstance(optimizer, embedding.SGDOptimizerSpec):
        new_w = w - 0.1 * grads
    else:
        accumulator = 0.5 + (grads * grads).mean(axis=1)
        new_w = w - 0.1 * grads / (np.sqrt(accumulator) + optimizer.epsilon)[:, None]
        got = embedding.gather_tables(
            {"t": variables["t"].slots.accumulator}, specs, mesh, num_sc_per_device=1
        )["t"]
        np.testing.assert_allclose(got[touched], accumulator[touched], rtol=2e-5)
        assert (got[~touched] == np.float32(0.5)).all()
    got = embedding.gather_tables({"t": variables["t"].table}, specs, mesh, num_sc_per_device=1)
    np.testing.assert_allclose(got["t"][touched], new_w[touched], rtol=2e-5, atol=2e-4)
    np.testing.assert_array_equal(got["t"][~touched], w[~touched].astype(np.float32))


def _chunked_outputs() -> dict[str, np.ndarray]:
    """Every kernel's results on work cut into chunks: a row-wise Adagrad
    step of `_large_case` on one device, and the interaction of 8192 samples
    of 27 x 16 and its transpose."""
    assert _cpu_kernels.enabled("cpu")
    optimizer = embedding.RowWiseAdagradOptimizerSpec(
        learning_rate=0.1, initial_accumulator_value=0.5
    )
    specs, _, mesh, _, activations, variables = _large_step(optimizer, 1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8192, 27, 16)).astype(np.float32)
    grads = rng.normal(size=(8192, 27 * 26 // 2)).astype(np.float32)
    tables = {"table": variables["t"].table, "accumulator": variables["t"].slots.accumulator}
    return {
        "activations": np.asarray(activations["f"]),
        **{
            name: embedding.gather_tables({"t": value}, specs, mesh, num_sc_per_device=1)["t"]
            for name, value in tables.items()
        },
        "dots": np.asarray(jax.jit(_cpu_kernels.pairwise_dots)(x)),
        "dots_transpose": np.asarray(jax.jit(_cpu_kernels.pairwise_dots_transpose)(x, grads)),
    }


# XLA's CPU client gives the kernels a thread per device or per CPU, whichever
# are more: this Python, on one device and (where it can be pinned) one CPU,
# gives them one.
_ON_ONE_THREAD = """
import os, sys
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
sys.path.insert(0, sys.argv[1])
import numpy as np
import test_cpu_kernels
np.savez(sys.argv[2], **test_cpu_kernels._chunked_outputs())
"""


@pytest.mark.usefixtures("cpu_kernels")
def test_results_are_bitwise_the_same_on_one_thread_and_on_several(tmp_path):
    """The floating-point contract of one library (`_cpu_kernels`): work is
    cut by its size alone, so the kernels on one thread give the very bits
    they give on this process's eight or more (a thread per device)."""
    assert len(jax.devices()) == 8
    subprocess.run(
        [sys.executable, "-c", _ON_ONE_THREAD, str(Path(__file__).parent), tmp_path / "one.npz"],
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
        check=True,
        timeout=600,
    )
    on_one = np.load(tmp_path / "one.npz")
    for name, got in _chunked_outputs().items():
        np.testing.assert_array_equal(got.view(np.uint32), on_one[name].view(np.uint32), name)


def _owner_geometry(optimizer, devices, rows, dim, uniques):
    """One table of `rows` rows, one slot per device: what `apply_update` needs."""
    return StackGeometry(
        name="t",
        optimizer=optimizer,
        devices=devices,
        slots=1,
        rows=rows,
        dim=dim,
        capacity=uniques,
        minibatches=1,
        uniques=uniques,
        samples=1,
        features=(),
        table_dims=((0, dim),),
    )


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("dim", [4, 16])
@pytest.mark.parametrize("runs", [1, 3, 5, 8, 17, 40])
@pytest.mark.parametrize("rows, uniques", [(50, 12), (9000, 400)])
@pytest.mark.usefixtures("cpu_kernels")
def test_update_merges_runs_in_run_order(rows, uniques, runs, dim, optimizer):
    """The owner's merge of several ascending runs (some empty, rows repeated
    across runs; in a shard of 9000 rows, over several of the merge's windows
    of 4096 rows, with the rows on both sides of each window's edge) sums
    each row's gradients once, against float64, for a width known at compile
    time (16) and one not (4), and leaves untouched rows and slots bit for
    bit."""
    lr, initial, eps = np.float32(0.25), 0.1, 1e-8
    edges = [r for r in (4095, 4096, 8191, 8192) if r < rows]
    rng = np.random.default_rng(runs)
    received = np.full((runs, uniques), rows, np.int32)
    for r in range(runs):
        if r % 3 == 1:
            continue  # a source that sends nothing
        chosen = rng.choice(rows, rng.integers(1, uniques + 1 - len(edges)), replace=False)
        if r % 3 == 0:
            chosen = np.union1d(chosen, edges)
        received[r, : len(chosen)] = np.sort(chosen)
    grads = rng.standard_normal((runs * uniques, dim)).astype(np.float32)
    table = rng.standard_normal((rows, dim)).astype(np.float32)
    if optimizer == "sgd":
        spec, slots = embedding.SGDOptimizerSpec(learning_rate=float(lr)), SGDSlots()
    else:
        spec = embedding.RowWiseAdagradOptimizerSpec(
            learning_rate=float(lr), initial_accumulator_value=initial, epsilon=eps
        )
        slots = RowWiseAdagradSlots(rng.uniform(0.05, 2.0, rows).astype(np.float32))
    g = _owner_geometry(spec, runs, rows, dim, uniques)
    updated, new_slots = jax.jit(
        lambda t, s: _cpu_kernels.apply_update(
            spec,
            jnp.asarray(received.reshape(1, runs, uniques)),
            jnp.asarray(grads.reshape(1, runs, uniques, dim)),
            t,
            s,
            lr,
            0,
            g,
        )
    )(jnp.asarray(table), jax.tree.map(jnp.asarray, slots))
    flat = received.reshape(-1)
    totals = np.zeros((rows, dim))
    np.add.at(totals, flat[flat < rows], grads[flat < rows].astype(np.float64))
    touched = np.isin(np.arange(rows), flat)
    if optimizer == "sgd":
        expected = table.astype(np.float64) - float(lr) * totals
    else:
        accumulator = slots[0].astype(np.float64) + (totals**2).mean(axis=1)
        expected = table - float(lr) * totals / (np.sqrt(accumulator) + eps)[:, None]
        np.testing.assert_allclose(
            np.asarray(new_slots[0])[touched], accumulator[touched], rtol=1e-5
        )
        np.testing.assert_array_equal(np.asarray(new_slots[0])[~touched], slots[0][~touched])
    np.testing.assert_allclose(
        np.asarray(updated)[touched], expected[touched], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(np.asarray(updated)[~touched], table[~touched])


@pytest.mark.parametrize("dim", [8, 12])
@pytest.mark.parametrize("entries", [40, 40_000])
@pytest.mark.parametrize(
    "num_samples, slots, devices",
    [(300, 2, 2), (20_000, 2, 2), (20_000, 1, 1)],
    ids=["in_layout_order", "by_sample", "by_sample_one_run"],
)
@pytest.mark.usefixtures("cpu_kernels")
def test_pool_and_its_transpose_against_float64(num_samples, slots, devices, entries, dim):
    """Pooling by sample and its transpose by row (the rows, and the row
    gradients, in one piece per device, as an all-to-all takes and leaves
    them), on entries with holes
    (-1 rows, also between two entries of one row; padded samples), rows no
    entry names (their gradient is exactly zero), at 40k entries per slot work
    cut into chunks, and rows of a width known at compile time (8) or not (12);
    with sums that fit in a core's cache (added in layout order) and sums
    that do not (sorted by sample first, the rows in several runs or in one)."""
    num_rows = entries // 2  # slots * devices * uniques
    rng = np.random.default_rng(entries)
    # Rows ascend along the layout (slot after slot), as the route gives them.
    index = np.sort(rng.integers(0, num_rows, (slots, entries)).reshape(-1)).reshape(slots, -1)
    index[rng.random(index.shape) < 0.1] = -1
    samples = rng.integers(0, num_samples, slots * entries).astype(np.int32)
    samples[rng.random(samples.shape) < 0.05] = num_samples  # padding
    gains = rng.random(slots * entries).astype(np.float32)
    rows = rng.standard_normal((num_rows, dim)).astype(np.float32)
    sample_grads = rng.standard_normal((slots, num_samples, dim)).astype(np.float32)

    pooled, row_grads = jax.jit(
        lambda r, g: (
            _cpu_kernels.pool(
                index, samples, gains, r.reshape(slots, devices, -1, dim), num_samples
            ),
            _cpu_kernels.pool_transpose(
                index, samples, gains, g, (slots, devices, num_rows // (slots * devices), dim)
            ).reshape(num_rows, dim),
        )
    )(rows, sample_grads)

    valid = (index.reshape(-1) >= 0) & (samples < num_samples)
    slot = np.repeat(np.arange(slots), entries)[valid]
    u, p, w = index.reshape(-1)[valid], samples[valid], gains[valid].astype(np.float64)
    expected_pooled = np.zeros((slots, num_samples, dim))
    np.add.at(expected_pooled, (slot, p), w[:, None] * rows[u])
    expected_grads = np.zeros((num_rows, dim))
    np.add.at(expected_grads, u, w[:, None] * sample_grads[slot, p])
    np.testing.assert_allclose(np.asarray(pooled), expected_pooled, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(row_grads), expected_grads, rtol=1e-5, atol=1e-5)
    unnamed = ~np.isin(np.arange(num_rows), u)
    assert unnamed.any()
    assert (np.asarray(row_grads)[unnamed] == 0).all()


def _huge_page_kib(address: int) -> int | None:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps), or
    None where the file is missing."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            inside = low <= address < high
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1])
    return None


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "missing"
    return text.split("[")[1].split("]")[0]


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages")
@pytest.mark.usefixtures("cpu_kernels")
def test_a_table_made_again_at_a_freed_address_gets_huge_pages(monkeypatch):
    """The update asks for huge pages on the table it updates in place; a
    table made after an earlier one was freed, at the same address (as a
    restore or a second model in one process makes it), gets them too."""
    monkeypatch.delenv("SPARSEFLOW_HUGE_PAGES", raising=False)
    rows, dim, uniques = 1 << 19, 16, 8  # a 32 MiB table
    g = _owner_geometry(embedding.SGDOptimizerSpec(learning_rate=0.5), 1, rows, dim, uniques)
    received = jnp.arange(uniques, dtype=jnp.int32).reshape(1, 1, uniques)
    grads = jnp.ones((1, 1, uniques, dim), jnp.float32)
    update = jax.jit(
        lambda t: _cpu_kernels.apply_update(g.optimizer, received, grads, t, SGDSlots(), 0.5, 0, g)[
            0
        ],
        donate_argnums=0,
    )
    addresses, huge = [], []
    for _ in range(4):
        table = update(jnp.zeros((rows, dim), jnp.float32))
        table.block_until_ready()
        addresses.append(table.unsafe_buffer_pointer())
        # Only whole 2 MiB pages inside the buffer can be huge.
        huge.append(_huge_page_kib(-(-addresses[-1] // (2 << 20)) * (2 << 20)))
        np.testing.assert_array_equal(np.asarray(table[:uniques]), -0.5)
        del table
    if len(set(addresses)) == len(addresses):
        pytest.skip("no table was made at a freed table's address")
    assert None not in huge and min(huge) > 0, f"AnonHugePages (KiB) by table: {huge}"


# Besides `JTE_OPTIMIZERS` (F2A's capped, on whole update counts, which the
# kernel looks up) and row-wise Adam, F2A uncapped on counts it computes.
_STEP_RULES = {
    **JTE_OPTIMIZERS,
    **ROWWISE_ADAM_OPTIMIZERS,
    "f2a_uncapped": embedding.F2AOptimizerSpec(
        learning_rate=0.1, rho=0.7, initial_accumulator_value=0.3, initial_local_step_value=0.5
    ),
}


def _train(monkeypatch, kernels: bool, optimizer, devices: int, slots: int, steps: int):
    """The gathered tables and slots after `steps` updates of fresh
    variables, on the kernels or on the pure-JAX path; the batches repeat
    hot ids within and across samples and devices."""
    monkeypatch.setenv("SPARSEFLOW_CPU_KERNELS", "1" if kernels else "0")
    assert _cpu_kernels.enabled("cpu") == kernels
    specs, mesh = feature_specs("sum", optimizer, devices, slots), mesh_of(devices)
    variables = jax.block_until_ready(
        embedding.init_embedding_variables(jax.random.key(4), specs, mesh, num_sc_per_device=slots)
    )
    for step in range(steps):
        preprocessed = preprocess(make_batch(30 + step), specs, devices, slots)
        variables = jax.block_until_ready(
            embedding.apply_gradients(
                activation_grads(step, positive=True), preprocessed, variables, specs, mesh, step
            )
        )
    return gather_all(variables, specs, mesh, slots)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize(("devices", "slots"), [(1, 1), (2, 2)])
@pytest.mark.parametrize("optimizer", list(_STEP_RULES))
def test_step_rules_in_the_kernel_match_the_pure_jax_update(optimizer, devices, slots, monkeypatch):
    """Four steps (bias correction, momentum and update counts carry over)
    on the kernels and on the pure-JAX update, table and every slot.

    Both are float32 and differ only in rounding: the kernel sums a row's
    gradients in run order and XLA in its scatter's, the kernel fuses
    multiplies and adds (`_cpu_kernels`), and its roots and powers are the C
    library's. A few ulp a step, compounded over four steps (LaProp's
    g / sqrt(nu) carries a gradient's relative error into its slot): rtol
    1e-5. Gradients are >= 0, so that no row's sum cancels into a relative
    error of its own; atol admits weights an update brings near 0.
    """
    spec = _STEP_RULES[optimizer]
    assert _cpu_kernels.updates_in_kernel(spec)
    kernel, reference = (
        _train(monkeypatch, kernels, spec, devices, slots, steps=4) for kernels in (True, False)
    )
    for table in TABLES:
        np.testing.assert_allclose(kernel[0][table], reference[0][table], rtol=1e-5, atol=1e-6)
        for name, values in reference[1][table].items():
            np.testing.assert_allclose(
                kernel[1][table][name], values, rtol=1e-5, atol=1e-6, err_msg=name
            )
