"""A serving process's start, for `benchmarks/predict.py`: run it fresh.

Times, from this process's start (before numpy or jax is imported): the
imports (numpy, jax, `sparseflow_serving`), `load_exported(FOLDER)`, the
first `score` of a batch of `--batch` examples (which compiles the exported
forward) and a second one of other ids. Ids are drawn uniformly from each
feature's table, one per example; dense inputs from a standard normal.
Prints one JSON line: the seconds, the batch, and which of the training
stack's modules got imported (none should).

    python benchmarks/_serving_start.py EXPORT_FOLDER [--batch 256]
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before numpy or jax is imported

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402, F401 - timed with the imports a serving process makes
import numpy as np  # noqa: E402

import sparseflow_serving  # noqa: E402

IMPORTED = time.perf_counter()
TRAINING_STACK = ("sparseflow", "embedding", "pipelines", "grain", "apache_beam", "tensorflow",
                  "orbax")  # fmt: skip


def _batch(model, batch: int, rng: np.random.Generator) -> tuple[dict, np.ndarray]:
    ids = {}
    for feature in model.manifest["features"]:
        rows = model.tables[feature["table"]].shape[0]
        ids[feature["name"]] = rng.integers(0, rows, size=(batch, 1)).tolist()
    dense = rng.standard_normal((batch, model.manifest["dense"]["num_dense_features"]))
    return ids, dense.astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    model = sparseflow_serving.load_exported(args.folder)
    loaded = time.perf_counter()
    first = model.score(*_batch(model, args.batch, rng))
    scored = time.perf_counter()
    second = model.score(*_batch(model, args.batch, rng))
    again = time.perf_counter()
    if not (np.isfinite(first).all() and np.isfinite(second).all()):
        raise SystemExit("the exported model scored non-finite logits")
    print(
        json.dumps(
            {
                "batch": args.batch,
                "import_s": IMPORTED - STARTED,
                "load_s": loaded - IMPORTED,
                "first_score_s": scored - loaded,
                "to_first_score_s": scored - STARTED,
                "second_score_s": again - scored,
                "training_stack_imported": sorted(
                    name for name in TRAINING_STACK if name in sys.modules
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
