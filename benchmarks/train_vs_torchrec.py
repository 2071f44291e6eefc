"""Whole DLRM training runs on Criteo-format logs, ours against TorchRec 1.8's: examples per second.

The data: a synthetic Criteo-format log (`_criteo_logs.KAGGLE`: `--lines`
lines of a label, 13 heavy-tailed counts and 26 categorical columns of 8
hexadecimal digits with the Kaggle challenge's cardinalities, ids drawn
Zipf(1.1)-like over each column, about the Kaggle set's share of empty fields
per column, 25% positives whose logits the ids partly explain), written once
into `--data-dir` and reused, as everything below that is not timed.

  * Ours, as a user runs it: `sparseflow import --format criteo` into
    ArrayRecord, then training with the shipped `criteo` config changed only
    where the benchmark needs it: `global_batch_size` 4096, `mesh.devices` 1
    (and 8; `partitions_per_device` stays 2), the data and enough
    `training.epochs` for `--steps` batches. The config's DLRM has no
    per-feature projection (`model.feature_projection: false`), as TorchRec's
    has none. The limits come from `sparseflow
    fdo` run once per mesh and passed as `--fdo`; `allow_id_dropping` stays
    false. The derived configs are YAML files in the cache folder. Each run is
    a fresh process (`_train_vs_torchrec_ours.py`; the device count is fixed
    per process by XLA_FLAGS) that calls `sparseflow._train.train`: batches
    stream from the files through Grain and our preprocessing, pipelined,
    shuffled, in the trainer's own loop.
  * TorchRec: `torchrec.models.dlrm.DLRM`, the same 26 tables (100,000 x 16,
    sum pooling), dense arch [64, 16], over arch [64, 32, 1], under
    `DistributedModelParallel` on one CPU rank, FBGEMM's row-wise Adagrad
    fused into the backward (lr 0.05, eps 1e-8, accumulators 0.1), Adam 0.001
    on the dense part, 2 threads (`train_torchrec_peer.py`, in
    `.venv-torchrec`, a fresh process per run, with huge pages unless
    `--no-peer-huge-pages`). Its batches are built in memory before timing
    from our imported records, parsed by our parser (`pipelines.parse_examples`
    with the config's record layout: the same FarmHash ids modulo 100,000,
    log1p counts and labels), in file order, cycled: its cheapest input.

Each round runs TorchRec, ours on 1 device, ours on 1 device with the same
DLRM as a user's Flax NNX model on the `embedding.nnx` layer (`model.module:
sparseflow.towers:Dlrm`, its `args` the config's tower keys, the module
`model.tower` runs too; the tower run's FDO stats) and ours on 8 devices
(`--no-8dev` skips it), every other round in reverse order. A step of ours is a call of
the trainer's loop plus the loop's wait for that call's batch
(`TrainResult.input_wait_seconds`; the wait falls outside the call); a step
of TorchRec is zero_grad, forward, loss, backward and the optimizer step. Per
run: the steady state is the median step after the first `--warmup-calls`
(30) calls (ours: up to the last call that carries a batch; a pipelined run
ends with two that drain it); the whole run is the examples trained over the
seconds from the process's start (before jax or torch is imported) to the end
of its last step, compilation, set-up and input included;
`time_to_first_step_s` is from that start to the end of the first step. Ours
also reports where a step goes: `input_wait_ms`, `device_step_ms` (the call)
and `host_preprocess_ms` (the trainer's host iterator timed alone, batch by
batch, after training, in the same process). Each side's loss over its last
20 steps must be below its first 20's (`learns`). Figures are medians over
rounds, with the min/max over rounds (`*_range`) and every round's ratio
(`*_by_round`). Then our 1-device runner starts twice with an empty and then
a warm compilation cache folder (`SPARSEFLOW_COMPILATION_CACHE`; the rounds
run without it): `first_run_first_step_s`, `second_run_first_step_s`; and
the 8-device runner the same (`_8dev`).

`ratio_vs_torchrec_e2e` is our 1-device steady-state examples/s over
TorchRec's (above 1 we are faster), `_8dev` the same for 8 devices,
`_whole_run` on whole-run examples/s, `ours_8dev_over_1dev` ours on 8 devices
over ours on 1, `ratio_nnx_vs_functional` the NNX run over ours on 1 device:
each the median of the rounds' ratios. Every run's own output
is kept in `--data-dir`/last-run. The last line printed is one JSON object.

    python benchmarks/train_vs_torchrec.py [--lines 300000] [--steps 130] [--rounds 3]
        [--no-8dev] [--data-dir DIR]
    python benchmarks/train_vs_torchrec.py --lines 40000 --steps 40 --rounds 1   # a check
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import _criteo_logs
import _torchrec_env
import numpy as np
import yaml
from _alternating import alternating
from _line_protocol import ChildError, LineProcess

import pipelines
import sparseflow

BENCHMARKS = Path(__file__).resolve().parent
OURS_RUNNER = BENCHMARKS / "_train_vs_torchrec_ours.py"
PEER = BENCHMARKS / "train_torchrec_peer.py"
BATCH = 4096
LOSS_WINDOW = 20
CACHE_RUN_STEPS = 5
COMPILATION_CACHE = "SPARSEFLOW_COMPILATION_CACHE"
DEVICES = {"ours": 1, "ours_nnx": 1, "ours_8dev": 8}
# The shipped DLRM named as a user's NNX model (`model.module`) in place of
# the config's `model.tower`: the same module, given the other way.
NNX_DLRM = "sparseflow.towers:Dlrm"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=lambda s: int(float(s)), default=300_000)
    parser.add_argument("--steps", type=int, default=130, help="steps per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-calls", type=int, default=30, help="calls left out of the median")
    parser.add_argument("--no-8dev", dest="eight_devices", action="store_false")
    parser.add_argument(
        "--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "train_vs_torchrec"
    )
    parser.add_argument("--seed", type=int, default=0, help="of the synthetic log")
    parser.add_argument("--shards", type=int, default=4, help="files of the imported records")
    parser.add_argument(
        "--preprocess-batches", type=int, default=20, help="batches timed for host_preprocess_ms"
    )
    _torchrec_env.add_arguments(parser)
    args = parser.parse_args()
    if args.steps <= args.warmup_calls or args.rounds < 1:
        parser.error("--steps must exceed --warmup-calls, and --rounds be at least 1")
    return args


def _run(argv: list[str], env: dict[str, str] | None = None, *, echo: bool = True) -> str:
    """Runs `argv`; returns its stdout, which goes to our stderr if `echo` (our
    stdout is for our own lines)."""
    completed = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True)
    if echo:
        sys.stderr.write(completed.stdout)
    if completed.returncode:
        raise SystemExit(f"`{' '.join(argv)}` failed with status {completed.returncode}")
    return completed.stdout


def _cached_dir(path: Path, build: Callable[[Path], None]) -> Path:
    """`path`, built by `build(partial)` into a sibling folder renamed to it when done."""
    if not path.is_dir():
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        build(partial)
        os.replace(partial, path)
    return path


def sparseflow_command(*arguments: object) -> list[str]:
    return [sys.executable, "-m", "sparseflow", *map(str, arguments)]


def import_records(args: argparse.Namespace, log: Path) -> Path:
    """The log as ArrayRecord files, by `sparseflow import` (once)."""
    out = args.data_dir / f"{log.stem}-records-{args.shards}"
    command = sparseflow_command("import", "--format", "criteo", "--input", log)
    command += ["--shards", str(args.shards), "--no-progress"]
    return _cached_dir(out, lambda partial: _run([*command, "--out", str(partial)]))


def derived_config(
    args: argparse.Namespace, records: Path, devices: int, epochs: int, *, nnx: bool = False
) -> Path:
    """The shipped `criteo` config as the benchmark runs it, written as YAML; with
    `nnx`, its tower as the NNX module `NNX_DLRM` (`model.module`)."""
    with open(sparseflow.shipped_config("criteo")) as file:
        raw = yaml.safe_load(file)
    if nnx:
        model = raw["model"]
        tower = {key: model.pop(key) for key in ("bottom_mlp", "top_mlp", "feature_projection")}
        raw["model"] = {"module": NNX_DLRM, "args": tower, **model}
    raw["name"] = f"criteo-benchmark-{devices}dev" + ("-nnx" if nnx else "")
    raw["global_batch_size"] = BATCH
    raw["mesh"]["devices"] = devices
    raw["dataset"] = {"dir": str(args.data_dir), "train": str(records)}
    raw["training"].update(steps=args.steps, epochs=epochs)
    path = args.data_dir / f"{records.name}-{devices}dev-{epochs}epochs{'-nnx' if nnx else ''}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def fdo_stats(config: Path) -> Path:
    """`sparseflow fdo` over the config's data (once per config and batch layout)."""
    layout = sparseflow.load_config(config).fdo_layout.key[:12]
    return _cached_dir(
        config.with_name(f"{config.stem}-fdo-{layout}"),
        lambda partial: _run(sparseflow_command("fdo", "--config", config, "--out", partial)),
    )


def torchrec_batches(args: argparse.Namespace, config: Path, records: Path, count: int) -> Path:
    """`count` batches of the records in file order, parsed by our parser, for the peer."""
    path = args.data_dir / f"{records.name}-torchrec-{count}.npz"
    if path.is_file():
        return path
    layout = sparseflow.load_config(config).layout
    stream = pipelines.read_records(pipelines.list_record_files(str(records)))
    arrays = {"keys": np.array(list(layout.sparse))}
    for b in range(count):
        parsed = pipelines.parse_examples(list(itertools.islice(stream, BATCH)), layout)
        ids = [parsed.ids[name] for name in layout.sparse]
        arrays[f"values_{b}"] = np.concatenate([r.values for r in ids]).astype(np.int64)
        arrays[f"lengths_{b}"] = np.concatenate([np.diff(r.row_splits) for r in ids]).astype(
            np.int32
        )
        arrays[f"dense_{b}"] = parsed.dense.astype(np.float32)
        arrays[f"labels_{b}"] = parsed.labels.astype(np.float32)
    partial = path.with_name(path.stem + ".partial.npz")
    np.savez(partial, **arrays)
    os.replace(partial, path)
    return path


def _device_env(devices: int, compilation_cache: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != COMPILATION_CACHE}
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    if compilation_cache is not None:
        env[COMPILATION_CACHE] = str(compilation_cache)
    return env


def run_ours(
    config: Path, fdo: Path, devices: int, steps: int, *, preprocess: int = 0, cache=None
) -> dict:
    argv = [sys.executable, str(OURS_RUNNER), str(config), "--fdo", str(fdo)]
    argv += ["--steps", str(steps), "--preprocess-batches", str(preprocess)]
    argv += [] if cache is None else ["--compilation-cache"]
    output = _run(argv, _device_env(devices, cache), echo=False)
    return json.loads(output.strip().splitlines()[-1])


def run_torchrec(args: argparse.Namespace, batches: Path, vocabulary: int) -> dict:
    argv = [str(args.torchrec_python), str(PEER), str(batches), "--vocabulary", str(vocabulary)]
    with LineProcess("torchrec", argv, env=_torchrec_env.peer_env(args)) as peer:
        return {**peer.call(f"train {args.steps}"), "greeting": peer.greeting}


def _median(values) -> float:
    return float(statistics.median(values))


def ours_figures(run: dict, warmup: int) -> dict:
    """One run of ours: steady step, where it goes, whole run, learning.

    The steady calls are those after `warmup` that carry a batch (a pipelined
    run ends with two calls that only drain the pipeline).
    """
    calls = np.asarray(run["call_seconds"])
    # `_train._loop` takes a call's batch before it starts timing the call.
    waits = np.asarray(run["input_wait_seconds"])
    steady = slice(warmup, run["steps"])
    steps = calls + waits
    figures = {
        "input_wait_ms": _median(waits[steady]) * 1e3,
        "device_step_ms": _median(calls[steady]) * 1e3,
    }
    if "host_preprocess_ms" in run:  # the first batch waits for the iterator to start
        figures["host_preprocess_ms"] = _median(run["host_preprocess_ms"][1:])
    return figures | _run_figures(run, _median(steps[steady]) * 1e3, run["steps"])


def torchrec_figures(run: dict, warmup: int, steps: int) -> dict:
    return _run_figures(run, _median(run["step_ms"][warmup:]), steps)


def _run_figures(run: dict, ms_per_step: float, steps: int) -> dict:
    """Steady state, whole run and learning of a run of `steps` steps."""
    first, last = np.mean(run["losses"][:LOSS_WINDOW]), np.mean(run["losses"][-LOSS_WINDOW:])
    return {
        "ms_per_step": ms_per_step,
        "examples_per_s": BATCH / ms_per_step * 1e3,
        "whole_run_examples_per_s": steps * BATCH / run["run_s"],
        "time_to_first_step_s": run["time_to_first_step_s"],
        "loss_first_20": float(first),
        "loss_last_20": float(last),
        "learns": bool(last < first),
    }


# Decimals of each figure (0: an integer); the timings also get their range over rounds.
_DIGITS = {"loss_first_20": 4, "loss_last_20": 4, "examples_per_s": 0}
_DIGITS |= {"whole_run_examples_per_s": 0, "time_to_first_step_s": 2}
_TIMINGS = {"ms_per_step", "examples_per_s", "whole_run_examples_per_s", "time_to_first_step_s"}
_TIMINGS |= {"input_wait_ms", "device_step_ms", "host_preprocess_ms"}


def _rounded(key: str, value: float) -> float | int:
    digits = _DIGITS.get(key, 2)
    return round(value, digits) if digits else round(value)


def side_summary(rounds: list[dict]) -> dict:
    """Medians over rounds, the timings' min and max; `learns` in every round."""
    out = {}
    for key, value in rounds[0].items():
        values = [r[key] for r in rounds]
        if isinstance(value, bool):
            out[key] = all(values)
            continue
        out[key] = _rounded(key, _median(values))
        if key in _TIMINGS:
            out[f"{key}_range"] = [_rounded(key, min(values)), _rounded(key, max(values))]
    return out


def ratios(per_round: dict[str, list[dict]]) -> dict:
    """Ours over TorchRec (and 8 devices over 1) on steady and whole-run examples/s."""
    pairs = {
        "ratio_vs_torchrec_e2e": ("ours", "torchrec", "examples_per_s"),
        "ratio_vs_torchrec_e2e_8dev": ("ours_8dev", "torchrec", "examples_per_s"),
        "ratio_vs_torchrec_e2e_whole_run": ("ours", "torchrec", "whole_run_examples_per_s"),
        "ratio_vs_torchrec_e2e_whole_run_8dev": (
            "ours_8dev",
            "torchrec",
            "whole_run_examples_per_s",
        ),
        "ours_8dev_over_1dev": ("ours_8dev", "ours", "examples_per_s"),
        "ratio_nnx_vs_functional": ("ours_nnx", "ours", "examples_per_s"),
    }
    out = {}
    for key, (ours, peer, figure) in pairs.items():
        if ours in per_round and peer in per_round:
            by_round = [
                a[figure] / b[figure] for a, b in zip(per_round[ours], per_round[peer], strict=True)
            ]
            out[key] = round(_median(by_round), 3)
            out[f"{key}_by_round"] = [round(r, 3) for r in by_round]
    return out


def _progress(name: str, figures: dict) -> None:
    print(
        f"{name}: {figures['ms_per_step']:.1f} ms per step, "
        f"{figures['whole_run_examples_per_s']:,.0f} examples/s over the whole run, loss "
        f"{figures['loss_first_20']:.4f} -> {figures['loss_last_20']:.4f}",
        flush=True,
    )


def compilation_cache_runs(args, setup: Setup) -> dict:
    """Time to the first step of our runner with an empty, then a warm, cache folder: on
    1 device, and (`_8dev`) on the 8-device mesh where it runs."""
    figures = {}
    for name, devices in setup.devices.items():
        if name == "ours_nnx":
            continue
        folder = args.data_dir / f"compilation-cache-{devices}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        first = run_ours(
            setup.configs[name], setup.fdo[name], devices, CACHE_RUN_STEPS, cache=folder
        )
        files = sum(len(names) for _, _, names in os.walk(folder))
        second = run_ours(
            setup.configs[name], setup.fdo[name], devices, CACHE_RUN_STEPS, cache=folder
        )
        suffix = "" if devices == 1 else f"_{devices}dev"
        figures |= {
            f"first_run_first_step_s{suffix}": round(first["time_to_first_step_s"], 2),
            f"second_run_first_step_s{suffix}": round(second["time_to_first_step_s"], 2),
            f"compilation_cache_used{suffix}": second["compilation_cache"] is not None,
            f"compilation_cache_files{suffix}": files,
        }
    return figures


class Setup:
    """What the runs need, made once and cached in `--data-dir` (nothing of it timed)."""

    def __init__(self, args: argparse.Namespace) -> None:
        log = _criteo_logs.cached_log(
            args.data_dir / f"criteo-kaggle-{args.lines}-seed{args.seed}.tsv",
            args.lines,
            _criteo_logs.KAGGLE,
            seed=args.seed,
        )
        records = import_records(args, log)
        self.records = pipelines.num_records(str(records))
        per_epoch = self.records // BATCH
        if per_epoch < 1:
            raise SystemExit(f"{self.records} records make no batch of {BATCH}; raise --lines")
        self.epochs = math.ceil(args.steps / per_epoch)
        self.devices = {name: d for name, d in DEVICES.items() if d == 1 or args.eight_devices}
        self.configs = {
            name: derived_config(args, records, d, self.epochs, nnx=name == "ours_nnx")
            for name, d in self.devices.items()
        }
        # The NNX run has the functional run's tables, batches and mesh: its stats.
        self.fdo = {
            name: fdo_stats(self.configs["ours" if name == "ours_nnx" else name])
            for name in self.configs
        }
        self.config = sparseflow.load_config(self.configs["ours"])
        self.vocabulary = next(iter(self.config.tables.values())).vocabulary_size
        count = min(args.steps, per_epoch)
        self.batches = torchrec_batches(args, self.configs["ours"], records, count)

    @property
    def feature_projection(self) -> bool:
        return self.config.model.feature_projection


def run_rounds(args: argparse.Namespace, setup: Setup) -> tuple[dict, dict, dict]:
    """`(figures by side and round, notes by side, the peer's greeting)`; every run's
    own output is kept in `--data-dir`/last-run."""
    runs: dict[str, list[dict]] = {name: [] for name in ("torchrec", *setup.devices)}
    notes: dict[str, dict] = {}
    raw = args.data_dir / "last-run"
    shutil.rmtree(raw, ignore_errors=True)
    raw.mkdir()
    for repeat, name in alternating(tuple(runs), args.rounds):
        if name == "torchrec":
            run = run_torchrec(args, setup.batches, setup.vocabulary)
            runs[name].append(torchrec_figures(run, args.warmup_calls, args.steps))
            greeting = run["greeting"]
        else:
            run = run_ours(
                setup.configs[name],
                setup.fdo[name],
                setup.devices[name],
                args.steps,
                preprocess=args.preprocess_batches,
            )
            runs[name].append(ours_figures(run, args.warmup_calls))
            limits = sorted(run["limits"].values())
            notes[name] = {
                "feature_projection": run["feature_projection"],
                "max_ids_per_partition": [limits[0], limits[-1]],
            }
        (raw / f"{name}-{repeat}.json").write_text(json.dumps(run))
        _progress(name, runs[name][-1])
    return runs, notes, greeting


def main() -> None:
    args = parse_args()
    _torchrec_env.check_python(args)
    args.data_dir = args.data_dir.resolve()
    setup = Setup(args)
    print(f"model.feature_projection: {setup.feature_projection}", flush=True)
    runs, notes, greeting = run_rounds(args, setup)
    figures = {
        "benchmark": "train_vs_torchrec",
        "lines": args.lines,
        "records": setup.records,
        "global_batch_size": BATCH,
        "steps": args.steps,
        "epochs": setup.epochs,
        "rounds": args.rounds,
        "warmup_calls": args.warmup_calls,
        "partitions_per_device": setup.config.mesh.partitions_per_device,
        "feature_projection": setup.feature_projection,
        "torchrec_version": greeting["torchrec"],
        "torchrec_threads": greeting["threads"],
        "torchrec_huge_pages": args.peer_huge_pages,
        "torchrec_batches": greeting["batches"],
        "torchrec_accumulator_shapes": greeting["accumulator_shapes"],
    }
    for name, rounds in runs.items():
        figures[name] = side_summary(rounds) | notes.get(name, {})
    figures |= ratios(runs)
    figures |= compilation_cache_runs(args, setup)
    figures["cpu_count"] = os.cpu_count()
    figures["load_average_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures))
    failed = [name for name in runs if not figures[name]["learns"]]
    if failed:
        raise SystemExit(f"no lower loss over the last {LOSS_WINDOW} steps: {', '.join(failed)}")


if __name__ == "__main__":
    try:
        main()
    except ChildError as e:
        raise SystemExit(f"train_vs_torchrec: {e}") from e
