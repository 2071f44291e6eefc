"""`sparseflow predict`'s examples/s against training's, on the demo config.

Writes the demo config's synthetic data (`--examples`), trains `--steps`
steps on it (pipelined, as the demo does; minibatching off, as without FDO
stats its buffers are sized for 64 minibatches) into a checkpoint, then
scores the data with `sparseflow predict`. Training's figure is its steady
state: the global batch over the median call after the first calls (which
compile). Prediction's is its steady state too: the records after the first
batch (which compiles the forward) over the time after it
(`Predictions.examples_per_s`). The last line is one JSON object with both
figures and `ratio_predict_vs_train`.

    python benchmarks/predict.py [--examples 20480] [--steps 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pipelines  # noqa: E402
import sparseflow  # noqa: E402
from sparseflow import _train  # noqa: E402

WARMUP_CALLS = 5


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20480)
    parser.add_argument("--steps", type=int, default=40)
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
        predictions = sparseflow.predict(
            config,
            sparseflow.PredictOptions(checkpoint_dir=checkpoints, data=data, progress=False),
        )
    print(
        json.dumps(
            {
                "benchmark": "predict",
                "config": "sparseflow/configs/demo.yaml (minibatching off)",
                "examples": args.examples,
                "train_steps": args.steps,
                "train_examples_per_s": round(train_examples_per_s),
                "predict_examples_per_s": round(predictions.examples_per_s),
                "ratio_predict_vs_train": round(
                    predictions.examples_per_s / train_examples_per_s, 2
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
