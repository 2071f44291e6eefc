"""One of our training runs for `benchmarks/train_vs_torchrec.py`, in a fresh process.

Loads a config as `sparseflow train --config` does, trains through
`sparseflow._train.train` (progress off, no checkpoints, the FDO stats of
`--fdo`) and prints one JSON line: per-call seconds, per-call input waits,
losses, and the seconds from this
process's start (before jax is imported) to the end of the first step and to
the end of the run. With `--preprocess-batches N` it then times the
trainer's own host input iterator alone, N batches without training
(`host_preprocess_ms`, one time per batch). The driver sets the device count
(XLA_FLAGS) before this process starts.

JAX's persistent compilation cache stays off unless `--compilation-cache`
turns it on as `sparseflow train` does (`sparseflow._compilation_cache`,
its folder `$SPARSEFLOW_COMPILATION_CACHE`), so that every run compiles.

    python benchmarks/_train_vs_torchrec_ours.py CONFIG.yaml --fdo DIR --steps 130 \\
        [--preprocess-batches 20] [--compilation-cache]
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before jax is imported

import gc  # noqa: E402

gc.disable()  # as the `sparseflow` script does before its imports (`sparseflow._script`)

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from sparseflow import _compilation_cache, _process, _train  # noqa: E402
from sparseflow._cli import load_cli_config  # noqa: E402


def host_preprocess_ms(config, options: _train.TrainOptions, batches: int) -> list[float]:
    """Milliseconds per batch of the trainer's host iterator (parse and layout, no
    device transfer, no step), under the limits the run started with."""
    mesh = _train.make_mesh(config.mesh.devices)
    specs = _train._feature_specs(config, options, mesh)
    times = []
    with _train._iterator(config, options, specs, mesh, options.data, training=True) as iterator:
        host = iterator.host
        for _ in range(min(batches, host.num_batches)):
            began = time.perf_counter()
            next(host)
            times.append((time.perf_counter() - began) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--fdo", type=Path, help="FDO stats to set the limits from")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--preprocess-batches", type=int, default=0)
    parser.add_argument("--compilation-cache", action="store_true")
    args = parser.parse_args()
    _process.freeze_live_objects()  # as `sparseflow train` does once it is imported
    gc.enable()
    cache = None  # the cache's folder while it is on
    if args.compilation_cache:
        cache = _compilation_cache.enable()
    else:
        _compilation_cache.disable()
    config = load_cli_config(args.config)
    options = _train.TrainOptions(
        data=list(config.dataset.train_data),
        steps=args.steps,
        fdo_dir=args.fdo,
        progress=False,
    )
    entered = time.perf_counter()
    result = _train.train(config, options)
    returned = time.perf_counter()
    params = result.train_state.params
    figures = {
        "devices": jax.device_count(),
        "steps": result.steps,
        "call_seconds": result.call_seconds,
        "losses": result.losses,
        "time_to_first_step_s": entered - STARTED + result.time_to_first_step,
        "run_s": returned - STARTED,
        "train_s": returned - entered,
        "loop_s": result.seconds,
        # The tower's nnx.State: its nnx.Params under `params`.
        "feature_projection": "project" in params["params"],
        "compilation_cache": None if cache is None else str(cache),
        "limits": {name: limits.max_ids_per_partition for name, limits in result.limits.items()},
        "input_wait_seconds": result.input_wait_seconds,
    }
    if args.preprocess_batches:
        figures["host_preprocess_ms"] = host_preprocess_ms(config, options, args.preprocess_batches)
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
