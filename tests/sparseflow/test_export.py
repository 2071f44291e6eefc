"""`sparseflow export`: the folder's program, loaded without the training stack, and its
SavedModel score as `sparseflow predict` does."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from predict_cases import write_records
from train_cases import REPO, cli

import pipelines
import sparseflow_serving
from sparseflow import _export, _predict

# Run in a fresh interpreter: loads the export, scores the inputs saved by the
# test, and names the heavy modules that got imported.
_LOADER_SCRIPT = """
import json, sys
import numpy as np
import sparseflow_serving

folder, inputs, out = sys.argv[1:]
saved = np.load(inputs)
model = sparseflow_serving.load_exported(folder)
ids, weights = {}, {}
for feature in model.manifest["features"]:
    name = feature["name"]
    splits = saved[name + ".splits"]
    values = saved[name + ".ids"]
    ids[name] = [values[a:b] for a, b in zip(splits[:-1], splits[1:])]
    if name + ".weights" in saved:
        w = saved[name + ".weights"]
        weights[name] = [w[a:b] for a, b in zip(splits[:-1], splits[1:])]
np.save(out, model.score(ids, saved["dense"], weights))
heavy = ["grain", "apache_beam", "tensorflow", "orbax", "sparseflow", "sparseflow._train"]
print(json.dumps(sorted(name for name in heavy if name in sys.modules)))
"""


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    config, _, checkpoints = trained
    out = tmp_path_factory.mktemp("export") / "model"
    return _export.export_model(config, checkpoints, out)


@pytest.fixture(scope="module")
def predicted(trained, records, tmp_path_factory):
    config, _, checkpoints = trained
    data = write_records(tmp_path_factory.mktemp("scored") / "part-0.array_record", records)
    return _predict.predict(
        config, _predict.PredictOptions(checkpoint_dir=checkpoints, data=data, progress=False)
    )


def test_the_manifest_holds_every_table_whole_and_every_feature(trained, exported):
    config, _, _ = trained
    manifest = json.loads((exported.path / "manifest.json").read_text())
    assert manifest["step"] == exported.step
    assert {name: tuple(entry["shape"]) for name, entry in manifest["tables"].items()} == {
        table.name: (table.vocabulary_size, table.embedding_dim) for table in config.tables.values()
    }
    for entry in manifest["tables"].values():
        assert np.load(exported.path / entry["file"]).shape == tuple(entry["shape"])
    features = {f["name"]: f for f in manifest["features"]}
    assert set(features) == set(config.feature_specs)
    assert features["clicked_items"]["table"] == "items"
    assert features["clicked_items"]["combiner"] == "mean"
    assert features["query_tokens"]["weights_key"] is not None


def test_the_program_scores_as_predict_without_the_training_stack(
    trained, records, exported, predicted, tmp_path
):
    config, _, _ = trained
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, **_arrays(records, config.layout))
    scores = tmp_path / "scores.npy"
    done = subprocess.run(
        [sys.executable, "-c", _LOADER_SCRIPT, str(exported.path), str(inputs), str(scores)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
    np.testing.assert_allclose(np.load(scores), predicted.scores, rtol=0, atol=1e-6)


def test_the_saved_model_scores_as_predict(trained, records, exported, predicted):
    config, _, _ = trained
    parsed = pipelines.parse_examples(records, config.layout)
    inputs = {"dense": tf.constant(parsed.dense)}
    for name, ragged in parsed.ids.items():
        weights = parsed.weights.get(name)
        gains = np.ones_like(ragged.values, np.float32) if weights is None else weights.values
        inputs[f"{name}_ids"] = tf.RaggedTensor.from_row_splits(
            ragged.values.astype(np.int32), ragged.row_splits
        ).to_tensor(0)
        inputs[f"{name}_weights"] = tf.RaggedTensor.from_row_splits(
            gains.astype(np.float32), ragged.row_splits
        ).to_tensor(0.0)
    loaded = tf.saved_model.load(str(exported.path / "saved_model"))
    logits = loaded.signatures["serving_default"](**inputs)["logits"].numpy()
    np.testing.assert_allclose(logits, predicted.scores, rtol=0, atol=1e-5)


def test_the_loader_refuses_ids_outside_a_table(exported):
    model = sparseflow_serving.load_exported(exported.path)
    ids = {f["name"]: [[0]] for f in model.manifest["features"]}
    ids["user_id"] = [[10**9]]
    with pytest.raises(ValueError, match="'user_id', example 0: ids \\[1000000000\\]"):
        model.score(ids, np.zeros((1, 13)))


def test_the_command_refuses_a_folder_that_is_not_empty(small_run, trained, tmp_path):
    _, path, _, _ = small_run
    (tmp_path / "kept").write_text("")
    done = cli(
        "export", "--config", str(path), "--checkpoint-dir", str(trained[2]),
        "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 2
    assert "is not empty" in done.stderr


def _arrays(records: list[bytes], layout) -> dict[str, np.ndarray]:
    """The parsed records as flat arrays: per feature its ids, row splits and weights."""
    parsed = pipelines.parse_examples(records, layout)
    arrays = {"dense": parsed.dense}
    for name, ragged in parsed.ids.items():
        arrays[f"{name}.ids"] = ragged.values
        arrays[f"{name}.splits"] = ragged.row_splits
        if name in parsed.weights:
            arrays[f"{name}.weights"] = parsed.weights[name].values
    return arrays
