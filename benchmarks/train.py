"""Training throughput on the demo config: SC/TC pipelined vs sequential, and the whole demo.

With `--pipeshard STAGES:MICROBATCHES:SCHEDULE` (e.g. `2:4:1f1b`) a third
mode joins the alternation: pipelined training with the dense tower as a
pipeshard pipeline (`model.pipeshard`), reported as `pipeshard` with its
ratio to the pipelined mode. On CPU its stages share the same cores, so it
measures what the host-driven pipeline costs, not a speed-up.

Both modes train the same steps on the same data in one run, `--repeats`
times each, in the order sequential, pipelined, pipelined, sequential, ...:
the load of a shared machine drifts within a run, and alternating the modes
spreads the drift over both. Steady-state figures are the median of the
per-call times of all runs of a mode, after each run's first calls (which
compile); `ratio_vs_sequential_by_repeat` gives each repeat's own ratio. A
pipelined run makes n + 2 calls for n batches: `steps_per_s` is the steady
state of a long run, `steps_per_s_over_run` charges this run's n steps with
the two boundary calls too. On 8 virtual CPU devices sharing 2 cores the
sparse and dense stages cannot run side by side, so pipelining cannot gain
here; the figure to watch is that it costs little.

    python benchmarks/train.py [--steps 120] [--repeats 2] [--skip-demo] [--pipeshard 2:4:1f1b]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from _alternating import add_repeats_argument, alternating  # noqa: E402

import sparseflow  # noqa: E402
from sparseflow import _demo, _train  # noqa: E402
from sparseflow._tower_config import PipeshardConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WARMUP_CALLS = 5


def _steady(results: list[_train.TrainResult], pipelined: bool) -> dict:
    median = _median_call(results)
    n = results[0].steps
    calls_per_step = (n + 2) / n if pipelined else 1.0
    return {
        "steps_per_s": round(1.0 / median, 2),
        "steps_per_s_over_run": round(1.0 / (median * calls_per_step), 2),
        "examples_per_s": round(512 / median),
        "median_call_ms": round(median * 1e3, 1),
        "wall_s": round(statistics.mean(result.seconds for result in results), 1),
        "final_loss": round(statistics.mean(results[-1].losses[-20:]), 4),
    }


def _median_call(results: list[_train.TrainResult]) -> float:
    return statistics.median(
        call for result in results for call in result.call_seconds[WARMUP_CALLS:]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    add_repeats_argument(parser)
    parser.add_argument("--skip-demo", action="store_true")
    parser.add_argument(
        "--pipeshard",
        type=_pipeshard,
        help="also train with model.pipeshard STAGES:MICROBATCHES:SCHEDULE",
    )
    args = parser.parse_args()
    # The demo's data where `make demo` writes it: runs/demo under the checkout.
    config = sparseflow.load_config(sparseflow.shipped_config("demo"), relative_to=REPO)
    _demo.ensure_data(config)
    data = str(config.dataset.dir / "arrayrecord")
    fdo_dir, _ = _demo.run_fdo(
        config, data, _demo.claim_run_dir(config)
    )  # the limits the demo trains with
    figures = {
        "benchmark": "train",
        "config": "sparseflow/configs/demo.yaml",
        "steps": args.steps,
        "repeats": args.repeats,
    }
    modes = {"sequential": config, "pipelined": config}
    if args.pipeshard is not None:
        model = dataclasses.replace(config.model, pipeshard=args.pipeshard)
        modes["pipeshard"] = dataclasses.replace(config, model=model)
        figures["pipeshard_config"] = dataclasses.asdict(args.pipeshard) | {
            "schedule": args.pipeshard.schedule.value
        }
    runs: dict[str, list[_train.TrainResult]] = {mode: [] for mode in modes}
    for _, mode in alternating(tuple(modes), args.repeats):
        runs[mode].append(
            _train.train(
                modes[mode],
                _train.TrainOptions(
                    data=data,
                    steps=args.steps,
                    pipelined=mode != "sequential",
                    fdo_dir=fdo_dir,
                    progress=False,
                ),
            )
        )
    for mode in modes:
        figures[mode] = _steady(runs[mode], pipelined=mode != "sequential")
    if args.pipeshard is not None:
        figures["pipeshard_ratio_vs_pipelined"] = round(
            figures["pipeshard"]["steps_per_s"] / figures["pipelined"]["steps_per_s"], 3
        )
    sequential, pipelined = figures["sequential"], figures["pipelined"]
    figures["ratio_vs_sequential"] = round(pipelined["steps_per_s"] / sequential["steps_per_s"], 3)
    figures["ratio_vs_sequential_over_run"] = round(
        pipelined["steps_per_s_over_run"] / sequential["steps_per_s_over_run"], 3
    )
    figures["ratio_vs_sequential_by_repeat"] = [
        round(_median_call([sequential_run]) / _median_call([pipelined_run]), 3)
        for sequential_run, pipelined_run in zip(runs["sequential"], runs["pipelined"], strict=True)
    ]
    if not args.skip_demo:
        began = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "sparseflow", "demo", "--no-progress"],
            check=True,
            cwd=REPO,
            capture_output=True,
        )
        figures["demo_s"] = round(time.perf_counter() - began, 1)
    figures["cpu_count"] = os.cpu_count()
    figures["load_average_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures))


def _pipeshard(text: str) -> PipeshardConfig:
    """`STAGES:MICROBATCHES:SCHEDULE` as a `model.pipeshard` section."""
    try:
        stages, microbatches, schedule = text.split(":")
        return PipeshardConfig(
            stages=int(stages), microbatches=int(microbatches), schedule=schedule
        )
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"expected STAGES:MICROBATCHES:SCHEDULE such as 2:4:1f1b, got {text!r} ({e})"
        ) from e


if __name__ == "__main__":
    main()
