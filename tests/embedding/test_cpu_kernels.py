"""The CPU kernels: building them, and their work split into chunks."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import embedding
from embedding import _cpu_kernels
from embedding._optimizers import RowWiseAdagradSlots, SGDSlots
from embedding._stack_geometry import StackGeometry


def test_a_failed_build_names_the_compiler_output(tmp_path, monkeypatch):
    source = tmp_path / "_cpu_kernels.cc"
    source.write_text("this is not C++\n")
    monkeypatch.setattr(_cpu_kernels, "_SOURCE", source)
    monkeypatch.setattr(_cpu_kernels, "_build_folders", lambda: [tmp_path / "out"])
    with pytest.raises(RuntimeError, match="(?s)building the CPU kernels failed:.*error: expected"):
        _cpu_kernels.build()
    assert not list((tmp_path / "out").glob("*.so"))


def test_no_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(_cpu_kernels, "_build_folders", lambda: [tmp_path])
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler .*no-such-compiler"):
        _cpu_kernels.build()


def test_a_rebuild_replaces_only_its_own_older_libraries(tmp_path, monkeypatch):
    monkeypatch.setattr(_cpu_kernels, "_build_folders", lambda: [tmp_path])
    older = tmp_path / "_cpu_kernels-0000000000000000.so"
    older.write_bytes(b"an earlier build")
    unrelated = tmp_path / "other.so"
    unrelated.write_bytes(b"not ours")
    built = _cpu_kernels.build()
    assert built.parent == tmp_path and built.exists()
    assert not older.exists() and unrelated.exists()


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


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize(
    "optimizer",
    [
        embedding.SGDOptimizerSpec(learning_rate=0.1),
        embedding.RowWiseAdagradOptimizerSpec(learning_rate=0.1, initial_accumulator_value=0.5),
    ],
)
def test_chunked_kernels_match_float64(optimizer, devices, monkeypatch):
    """A step of `0.5 * sum(activations^2)` on a batch large enough for the
    kernels to split the pooling, its transpose, the gather and the update."""
    monkeypatch.setenv("SPARSEFLOW_CPU_KERNELS", "1")
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

    activations, variables = step(variables)
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
def test_update_merges_runs_in_run_order(rows, uniques, runs, dim, optimizer, monkeypatch):
    """The owner's merge of several ascending runs (some empty, rows repeated
    across runs; in a shard of 9000 rows, over several of the merge's windows
    of 4096 rows, with the rows on both sides of each window's edge) sums
    each row's gradients once, against float64, for a width known at compile
    time (16) and one not (4), and leaves untouched rows and slots bit for
    bit."""
    monkeypatch.setenv("SPARSEFLOW_CPU_KERNELS", "1")
    assert _cpu_kernels.enabled("cpu")  # builds and registers them
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
def test_pool_and_its_transpose_against_float64(entries, dim, monkeypatch):
    """Pooling by sample and its transpose by row (the rows, and the row
    gradients, in one piece per device, as an all-to-all takes and leaves
    them), on entries with holes
    (-1 rows, also between two entries of one row; padded samples), rows no
    entry names (their gradient is exactly zero), at 40k entries per slot work
    cut into chunks, and rows of a width known at compile time (8) or not (12)."""
    monkeypatch.setenv("SPARSEFLOW_CPU_KERNELS", "1")
    assert _cpu_kernels.enabled("cpu")
    slots, devices, num_samples = 2, 2, 300
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
def test_a_table_made_again_at_a_freed_address_gets_huge_pages(monkeypatch):
    """The update asks for huge pages on the table it updates in place; a
    table made after an earlier one was freed, at the same address (as a
    restore or a second model in one process makes it), gets them too."""
    monkeypatch.setenv("SPARSEFLOW_CPU_KERNELS", "1")
    monkeypatch.delenv("SPARSEFLOW_HUGE_PAGES", raising=False)
    assert _cpu_kernels.enabled("cpu")
    rows, dim, uniques = 1 << 19, 16, 8  # a 32 MiB table
    g = _owner_geometry(embedding.SGDOptimizerSpec(learning_rate=0.5), 1, rows, dim, uniques)
    received = jnp.arange(uniques, dtype=jnp.int32).reshape(1, 1, uniques)
    grads = jnp.ones((1, 1, uniques, dim), jnp.float32)
    update = jax.jit(
        lambda t: _cpu_kernels.apply_update(g.optimizer, received, grads, t, SGDSlots(), 0.5, g)[0],
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
