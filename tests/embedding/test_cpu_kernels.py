"""The CPU kernels: building them, and their work split into chunks."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import embedding
from embedding import _cpu_kernels


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
