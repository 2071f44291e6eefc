"""`sparseflow predict`'s examples/s against training's, on the demo config.

Writes the demo config's synthetic data (`--examples`), trains `--steps`
steps on it (pipelined, as the demo does; minibatching off, as without FDO
stats its buffers are sized for 64 minibatches) into a checkpoint, then
scores the data with `sparseflow predict`. Training's figure is its steady
state: the global batch over the median call after the first calls (which
compile). Prediction's is its steady state too: the records after the first
batch (which compiles the forward) over the time after it
(`Predictions.examples_per_s`), at the config's batch and at `--predict-batch`
records per forward (default twice the config's, `sparseflow predict
--batch-size`), the two alternated `--predict-runs` times (medians). The last
line is one JSON object with the figures, `ratio_predict_vs_train` (at
`--predict-batch`) and `ratio_predict_vs_train_config_batch`.

Then the checkpoint is exported (`sparseflow export`) and a serving process
started fresh `--serving-runs` times (`benchmarks/_serving_start.py`: numpy,
jax and `sparseflow_serving` only), each timed from its launch to its exit
(`serving_process_s`) and, inside it, to the end of its first score of a
batch of 256 (`serving_to_first_score_s`: imports, loading the folder,
compiling and running the forward); medians over the runs, with the
import, load and first-score parts, a second score's time (compiled
already), and the training modules it imported
(`serving_training_stack_imported`, empty when it imports none).

    python benchmarks/predict.py [--examples 20480] [--steps 40] [--predict-batch N]
        [--predict-runs 3] [--serving-runs 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pipelines  # noqa: E402
import sparseflow  # noqa: E402
from sparseflow import _export, _train  # noqa: E402

WARMUP_CALLS = 5
SERVING_START = Path(__file__).with_name("_serving_start.py")
# The seconds `_serving_start.py` reports (and the launch-to-exit time), as medians.
SERVING_FIGURES = ("process_s", "to_first_score_s", "import_s", "load_s", "first_score_s",
                   "second_score_s")  # fmt: skip


def _config(tmp: Path) -> sparseflow.RunConfig:
    config = sparseflow.load_config(sparseflow.shipped_config("demo"), relative_to=tmp)
    preprocessing = dataclasses.replace(config.preprocessing, enable_minibatching=False)
    return dataclasses.replace(config, preprocessing=preprocessing)


def _data(config, out: Path, examples: int) -> str:
    pipelines.write_synthetic_dataset(
        config.synthetic.dataset, out, num_examples=examples, seed=config.seed, num_shards=2,
        formats=("arrayrecord",),
    )  # fmt: skip
    return str(out / "arrayrecord")


def serving_starts(folder: Path, runs: int) -> dict:
    """Medians over `runs` fresh serving processes of `folder` (see the module doc)."""
    starts = []
    for _ in range(runs):
        launched = time.perf_counter()
        done = subprocess.run(
            [sys.executable, str(SERVING_START), str(folder)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        start = json.loads(done.stdout.strip().splitlines()[-1])
        starts.append(start | {"process_s": time.perf_counter() - launched})
    figures = {
        f"serving_{key}": round(statistics.median(start[key] for start in starts), 3)
        for key in SERVING_FIGURES
    }
    figures["serving_training_stack_imported"] = sorted(
        {name for start in starts for name in start["training_stack_imported"]}
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20480)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--predict-batch", type=int, help="default: twice the config's batch")
    parser.add_argument("--predict-runs", type=int, default=3)
    parser.add_argument("--serving-runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sparseflow-predict-bench-") as folder:
        tmp = Path(folder)
        config = _config(tmp)
        data = _data(config, tmp / "data", args.examples)
        checkpoints = tmp / "checkpoints"
        result = _train.train(
            config,
            _train.TrainOptions(
                data=data, steps=args.steps, checkpoint_dir=checkpoints, progress=False
            ),
        )
        train_examples_per_s = config.global_batch_size / statistics.median(
            result.call_seconds[WARMUP_CALLS:]
        )
        larger = args.predict_batch or 2 * config.global_batch_size
        rates = {config.global_batch_size: [], larger: []}
        for _ in range(args.predict_runs):
            for size, runs in rates.items():
                options = sparseflow.PredictOptions(
                    checkpoint_dir=checkpoints, data=data, batch_size=size, progress=False
                )
                runs.append(sparseflow.predict(config, options).examples_per_s)
        predict_examples_per_s = statistics.median(rates[larger])
        config_batch_examples_per_s = statistics.median(rates[config.global_batch_size])
        _export.export_model(config, checkpoints, tmp / "export")
        serving = serving_starts(tmp / "export", args.serving_runs)
    print(
        json.dumps(
            {
                "benchmark": "predict",
                "config": "sparseflow/configs/demo.yaml (minibatching off)",
                "examples": args.examples,
                "train_steps": args.steps,
                "train_examples_per_s": round(train_examples_per_s),
                "predict_batch": larger,
                "predict_examples_per_s": round(predict_examples_per_s),
                "predict_examples_per_s_range": [
                    round(min(rates[larger])),
                    round(max(rates[larger])),
                ],
                "predict_examples_per_s_config_batch": round(config_batch_examples_per_s),
                "ratio_predict_vs_train": round(predict_examples_per_s / train_examples_per_s, 2),
                "ratio_predict_vs_train_config_batch": round(
                    config_batch_examples_per_s / train_examples_per_s, 2
                ),
                **serving,
            }
        )
    )


if __name__ == "__main__":
    main()
