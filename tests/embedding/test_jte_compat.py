"""A jax-tpu-embedding script runs on `embedding.jte_compat` with its imports changed only.

The script (specs, `prepare_feature_specs_for_training` used for its side
effect, preprocessing, table stacking, lookup, gradient, update, unstacking)
runs once against jax-tpu-embedding 0.1.0 and once against the aliases.
Everything up to the lookup is compared with the reference itself. The
reference's lookup has no CPU kernel (its custom call `SparseDenseMatmulOp`
exists for TPU only), so the lookup, the gradient and the update are
compared with the float64 numpy references of lookup_reference.py instead.
"""

import textwrap

import jax
import lookup_reference as ref
import numpy as np
import pytest
from jte_layout import assert_same_layout

import embedding
from embedding import jte_compat

pytest.importorskip("jax_tpu_embedding.sparsecore.lib.nn.embedding")

REFERENCE_IMPORTS = """
from jax_tpu_embedding.sparsecore.lib.nn import embedding
from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec
from jax_tpu_embedding.sparsecore.lib.nn import table_stacking
"""
OUR_IMPORTS = """
from embedding import jte_compat as embedding
from embedding import jte_compat as embedding_spec
from embedding import jte_compat as table_stacking
"""
SCRIPT = """
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()), ("x",))
global_device_count = mesh.size
num_sc_per_device = 2
num_shards = global_device_count * num_sc_per_device

table_specs = {
    name: embedding_spec.TableSpec(
        name=name,
        vocabulary_size=vocab,
        embedding_dim=dim,
        initializer=jax.nn.initializers.zeros,
        optimizer=embedding_spec.SGDOptimizerSpec(learning_rate=LEARNING_RATE),
        combiner=COMBINER,
        max_ids_per_partition=64,
        max_unique_ids_per_partition=64,
    )
    for name, (vocab, dim) in TABLES.items()
}
feature_specs = {
    name: embedding_spec.FeatureSpec(
        name=name,
        table_spec=table_specs[table],
        input_shape=[BATCH, 4],
        output_shape=[BATCH, TABLES[table][1]],
    )
    for name, table in FEATURE_TABLES.items()
}
embedding.prepare_feature_specs_for_training(
    feature_specs, global_device_count=global_device_count, num_sc_per_device=num_sc_per_device
)
results["stacking"] = {
    name: (
        feature.table_spec.stacked_table_spec.stack_name,
        feature.table_spec.stacked_table_spec.stack_vocab_size,
        feature.table_spec.stacked_table_spec.stack_embedding_dim,
        int(feature.table_spec.stacked_table_spec.total_sample_count),
        feature.table_spec.setting_in_stack.padded_vocab_size,
        feature.table_spec.setting_in_stack.row_offset_in_shard,
        feature.table_spec.setting_in_stack.shard_rotation,
        feature.id_transformation.row_offset,
    )
    for name, feature in feature_specs.items()
}

preprocessed, stats = embedding.preprocess_sparse_dense_matmul_input(
    IDS,
    WEIGHTS,
    feature_specs,
    local_device_count=mesh.local_mesh.size,
    global_device_count=global_device_count,
    num_sc_per_device=num_sc_per_device,
    sharding_strategy="MOD",
)
results["preprocessed"] = preprocessed.sparse_dense_matmul_input._asdict()
results["max_ids_per_partition"] = dict(stats.max_ids_per_partition)
results["coo_buffer_size"] = embedding.compute_coo_buffer_size_per_device(
    feature_specs, global_device_count, num_sc_per_device
)

stacked = table_stacking.stack_and_shard_tables(table_specs, INITIAL_TABLES, num_shards)
results["stacked"] = {name: np.asarray(table) for name, table in stacked.items()}
sharding = NamedSharding(mesh, P("x"))
embedding_variables = {
    name: embedding.EmbeddingVariables(
        table=jax.device_put(np.asarray(table).reshape(-1, table.shape[-1]), sharding), slot=()
    )
    for name, table in stacked.items()
}

sparse_matmul = jax.jit(
    functools.partial(
        embedding.tpu_sparse_dense_matmul,
        global_device_count=global_device_count,
        feature_specs=feature_specs,
        sharding_strategy="MOD",
        num_sc_per_device=num_sc_per_device,
    )
)
activations = sparse_matmul(preprocessed, embedding_variables)
results["activations"] = jax.tree.map(np.asarray, activations)

grad_update = jax.jit(
    functools.partial(
        embedding.tpu_sparse_dense_matmul_grad,
        feature_specs=feature_specs,
        global_device_count=global_device_count,
        sharding_strategy="MOD",
        num_sc_per_device=num_sc_per_device,
    )
)
embedding_variables = grad_update(ACTIVATION_GRADIENTS, preprocessed, embedding_variables)
results["updated"] = table_stacking.unshard_and_unstack_tables(
    table_specs, {name: v.table for name, v in embedding_variables.items()}, num_shards
)
"""
LEARNING_RATE = 0.1


def _int32_rows(rows: np.ndarray) -> np.ndarray:
    out = np.empty(len(rows), dtype=object)
    out[:] = [row.astype(np.int32) for row in rows]
    return out


def _inputs(combiner: str) -> dict:
    batch = ref.make_batch(seed=3)
    ids, weights = batch.as_input()
    # jax-tpu-embedding 0.1.0 reads the rows of an object array as int32.
    ids = {name: _int32_rows(rows) for name, rows in ids.items()}
    rng = np.random.default_rng(4)
    tables = {name: rng.normal(size=shape).astype(np.float32) for name, shape in ref.TABLES.items()}
    grads = {
        name: rng.normal(size=(ref.BATCH, ref.TABLES[table][1])).astype(np.float32)
        for name, table in ref.FEATURE_TABLES.items()
    }
    return {
        "batch": batch,
        "namespace": dict(
            TABLES=ref.TABLES,
            FEATURE_TABLES=ref.FEATURE_TABLES,
            BATCH=ref.BATCH,
            COMBINER=combiner,
            LEARNING_RATE=LEARNING_RATE,
            IDS=ids,
            WEIGHTS=weights,
            INITIAL_TABLES=tables,
            ACTIVATION_GRADIENTS=grads,
        ),
    }


def _run(imports: str, namespace: dict) -> tuple[dict, Exception | None]:
    results: dict = {}
    try:
        exec(textwrap.dedent(imports) + SCRIPT, dict(namespace, results=results))  # noqa: S102
    except Exception as error:  # noqa: BLE001 - the reference's missing kernel, checked below
        return results, error
    return results, None


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_a_reference_script_runs_on_the_aliases_with_its_imports_changed(combiner):
    case = _inputs(combiner)
    theirs, their_error = _run(REFERENCE_IMPORTS, case["namespace"])
    ours, our_error = _run(OUR_IMPORTS, case["namespace"])
    assert our_error is None, repr(our_error)
    # The reference stops at its lookup: no CPU implementation.
    assert their_error is not None and "SparseDenseMatmulOp" in str(their_error)
    assert "activations" not in theirs

    assert ours["stacking"] == theirs["stacking"]
    assert_same_layout(ours["preprocessed"], theirs["preprocessed"], devices=8, slots=2)
    for stack, counts in theirs["max_ids_per_partition"].items():
        np.testing.assert_array_equal(ours["max_ids_per_partition"][stack], counts)
    assert ours["coo_buffer_size"] == {k: int(v) for k, v in theirs["coo_buffer_size"].items()}
    assert sorted(ours["stacked"]) == sorted(theirs["stacked"])
    for stack, table in theirs["stacked"].items():
        np.testing.assert_array_equal(ours["stacked"][stack], table, err_msg=stack)

    batch, namespace = case["batch"], case["namespace"]
    tables = {
        name: values.astype(np.float64) for name, values in namespace["INITIAL_TABLES"].items()
    }
    expected = ref.activations(tables, batch, combiner)
    for feature, values in expected.items():
        np.testing.assert_allclose(ours["activations"][feature], values, rtol=1e-5, atol=1e-5)
    grads = ref.row_gradients(batch, combiner, namespace["ACTIVATION_GRADIENTS"])
    sgd = embedding.SGDOptimizerSpec(learning_rate=LEARNING_RATE)
    ref.apply_update(dict.fromkeys(ref.TABLES, sgd), tables, {t: {} for t in tables}, grads, 0)
    for table, values in tables.items():
        np.testing.assert_allclose(ours["updated"][table], values, rtol=1e-5, atol=1e-5)
    assert any(
        not np.allclose(values, namespace["INITIAL_TABLES"][table])
        for table, values in ours["updated"].items()
    )


def _specs():
    table = jte_compat.TableSpec(
        name="t",
        vocabulary_size=64,
        embedding_dim=8,
        initializer=jax.nn.initializers.zeros,
        optimizer=jte_compat.AdagradOptimizerSpec(learning_rate=0.1),
        combiner="sum",
    )
    return {
        "f": jte_compat.FeatureSpec(
            name="f", table_spec=table, input_shape=[16, 1], output_shape=[16, 8]
        )
    }


def test_preparing_stores_the_prepared_specs_in_the_callers_dict_and_returns_them():
    specs = _specs()
    unprepared = specs["f"]
    returned = jte_compat.prepare_feature_specs_for_training(specs, 8, 2)
    assert not unprepared.table_spec.is_stacked()
    assert specs["f"].table_spec.is_stacked() and returned["f"] is specs["f"]
    assert specs == embedding.prepare_feature_specs_for_training({"f": unprepared}, 8, 2)


def test_calls_the_aliases_cannot_honour_are_refused_by_name():
    specs = _specs()
    with pytest.raises(ValueError, match="pass num_sc_per_device"):
        jte_compat.prepare_feature_specs_for_training(specs, 8)
    with pytest.raises(ValueError, match="only MOD"):
        jte_compat.preprocess_sparse_dense_matmul_input(
            {"f": np.zeros((16, 1), np.int32)},
            None,
            specs,
            8,
            8,
            num_sc_per_device=2,
            sharding_strategy="DIV",
        )
    with pytest.raises(ValueError, match="perform_unstacking=False"):
        jte_compat.tpu_sparse_dense_matmul(
            None, {}, specs, global_device_count=8, perform_unstacking=False
        )


def test_adagrad_slots_travel_as_the_references_slot_tuple():
    specs = _specs()
    mesh = ref.mesh_of(8)
    ids = np.arange(16, dtype=np.int32).reshape(16, 1) * 3
    preprocessed, _ = jte_compat.preprocess_sparse_dense_matmul_input(
        {"f": ids}, None, specs, 8, 8, num_sc_per_device=2
    )
    ours = embedding.init_embedding_variables(jax.random.key(0), specs, mesh, num_sc_per_device=2)
    given = {
        name: jte_compat.EmbeddingVariables(table=v.table, slot=(v.slots.accumulator,))
        for name, v in ours.items()
    }
    grads = {"f": np.ones((16, 8), np.float32)}
    updated = jte_compat.tpu_sparse_dense_matmul_grad(grads, preprocessed, given, specs)
    expected = embedding.apply_gradients(
        grads,
        preprocessed,
        embedding.init_embedding_variables(jax.random.key(0), specs, mesh, num_sc_per_device=2),
        specs,
        mesh,
        0,
    )
    assert isinstance(updated["t"], jte_compat.EmbeddingVariables)
    np.testing.assert_array_equal(updated["t"].table, expected["t"].table)
    np.testing.assert_array_equal(updated["t"].slot.accumulator, expected["t"].slots.accumulator)


def test_fdo_stats_of_the_client_update_the_callers_specs(tmp_path):
    specs = _specs()
    geometry = embedding.FdoGeometry(global_batch_size=16, devices=8, partitions_per_device=2)
    client = jte_compat.FDOClient(tmp_path, config_hash="h", geometry=geometry)
    ids = np.zeros((16, 1), np.int32)  # every sample looks up id 0: one busy partition
    _, stats = jte_compat.preprocess_sparse_dense_matmul_input(
        {"f": ids}, None, specs, 8, 8, num_sc_per_device=2
    )
    client.record(stats)
    client.publish()
    loaded = client.load()
    with pytest.raises(ValueError, match="measured with 2 partitions per device"):
        jte_compat.update_preprocessing_parameters(dict(specs), loaded, 4)
    returned = jte_compat.update_preprocessing_parameters(specs, loaded, 2)
    assert returned["f"] is specs["f"]
    assert specs == embedding.apply_fdo(_specs(), loaded)
    assert specs["f"].table_spec.stacked_table_spec.max_ids_per_partition < 256
