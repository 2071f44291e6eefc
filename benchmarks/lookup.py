"""One sparse training step, ours against TorchRec's, on identical id batches.

Shape (`--small` shrinks it for a quick check): 8 tables of 1M rows x dim 16,
one feature each, global batch 4096, Zipf(1.1) ids, 1..20 ids per sample, sum
combiner, loss `0.5 * sum(activations^2)`. For SGD, Adagrad (one accumulator
per element) and row-wise Adagrad (one per row, FBGEMM's
`EXACT_ROWWISE_ADAGRAD`), a step is the lookup, the backward and the sparse
update, waited for:

  * ours on 1 CPU device and on 8 virtual CPU devices, each in its own child
    process (`_lookup_ours.py`; a process's device count is fixed when jax
    starts): the 8 tables stacked into one (`embedding.stack_tables`; TorchRec
    likewise runs them through one table-batched kernel) and MOD-sharded,
    limits from a stats pass over the same batches (nothing dropped), one
    jitted program with the variables donated. `--no-stacking` keeps them 8
    physical tables.
    The host preprocessing of every batch is timed at every setup
    (`preprocess_ms`); it is not part of the step.
  * TorchRec 1.8's EmbeddingBagCollection with the optimizer fused into
    FBGEMM's table-batched backward, world 1 (`lookup_torchrec_peer.py`, run
    with `.venv-torchrec`, which `make bench-torchrec` creates). Before it
    times anything the peer checks one step of each optimizer against float64
    numpy; a peer that fails its check stops the benchmark. It runs with
    `THP_MEM_ALLOC_ENABLE=1`, so that its tables, like ours, sit on
    transparent huge pages (`--no-peer-huge-pages` leaves them on 4 KiB
    pages).

The three processes read the same batches from one `.npz` file. For each
optimizer, after each has set it up, they run `--steps` steps per turn, in
`--rounds` rounds that alternate their order (ours, ours 8 devices, torchrec,
torchrec, ours 8 devices, ours, ...), so the drift of a shared machine's load
spreads over all three. Figures: the median step over all rounds (`*_ms`),
its interquartile range (`*_ms_iqr`), and the ratio of each round
(`*_by_round`).

`ratio_vs_torchrec_<optimizer>` is TorchRec's step time over ours, that is our
throughput over TorchRec's (above 1 we are faster); the `_8dev` keys are the
same for ours on 8 devices. Row-wise Adagrad is compared with the faster of
TorchRec's row-wise step and 0.65x its SGD step
(`torchrec_rowwise_adagrad_target_ms`): FBGEMM's CPU row-wise backward takes a
slow path on some CPUs, and where its fast path runs it takes 0.57-0.67x of
its SGD step. jax-tpu-embedding's LaProp, Adagrad with momentum and F2A,
which TorchRec lacks, run on our side only (`--optimizers sgd,laprop,...`);
`ours_<optimizer>_over_sgd` is each of our steps over our SGD step. The last
line printed is one JSON object.

    python benchmarks/lookup.py [--rounds 5] [--steps 10] [--batches 4]
    python benchmarks/lookup.py --small    # seconds, for checking it runs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _torchrec_env
import _zipf_batches
import numpy as np
from _alternating import alternating
from _line_protocol import ChildError, LineProcess
from _lookup_shape import FULL, OPTIMIZERS, OURS_ONLY_OPTIMIZERS, SMALL, LookupShape

import embedding

BENCHMARKS = Path(__file__).resolve().parent
ROWWISE_VS_SGD = 0.65
RUNNERS = ("ours", "ours_8dev", "torchrec")
DEVICES = {"ours": 1, "ours_8dev": 8}
SUFFIX = {"ours": "", "ours_8dev": "_8dev"}


def write_batches(batches: list[dict[str, embedding.RaggedIds]], path: Path) -> None:
    """`values_<b>_<t>` and `offsets_<b>_<t>` of every batch `b` and table `t`."""
    arrays = {}
    for b, batch in enumerate(batches):
        for t in range(len(batch)):
            arrays[f"values_{b}_{t}"] = batch[f"f{t}"].values
            arrays[f"offsets_{b}_{t}"] = batch[f"f{t}"].row_splits
    np.savez(path, **arrays)


def _device_env(devices: int) -> dict[str, str]:
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
    )
    return dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}")


def start_runners(
    stack: contextlib.ExitStack, batches: Path, shape: LookupShape, args: argparse.Namespace
) -> dict[str, LineProcess]:
    runners = {}
    for name, devices in DEVICES.items():
        argv = [sys.executable, str(BENCHMARKS / "_lookup_ours.py"), str(batches)]
        argv += ["--shape", shape.to_json(), "--devices", str(devices)]
        argv += ["--partitions-per-device", str(args.partitions_per_device)]
        argv += [] if args.stacked else ["--no-stacking"]
        runners[name] = stack.enter_context(LineProcess(name, argv, env=_device_env(devices)))
    argv = [str(args.torchrec_python), str(BENCHMARKS / "lookup_torchrec_peer.py"), str(batches)]
    runners["torchrec"] = stack.enter_context(
        LineProcess(
            "torchrec", argv + ["--shape", shape.to_json()], env=_torchrec_env.peer_env(args)
        )
    )
    return runners


SETTLE_SECONDS = 0.5


def measure(
    optimizer: str, runners: dict[str, LineProcess], rounds: int, steps: int
) -> tuple[dict[str, dict], dict[str, list[list[float]]]]:
    """Sets `optimizer` up everywhere, then times it in alternating rounds.

    Returns:
      `(setup replies, step times)` by runner; a runner that could not set the
      optimizer up has an `ok: false` reply and no times.

    Raises:
      SystemExit: the peer's step disagreed with numpy.
    """
    setups = {name: runner.request(f"setup {optimizer}") for name, runner in runners.items()}
    peer = setups["torchrec"]
    if not peer["ok"] and peer["error"].startswith("CheckFailed"):
        raise SystemExit(f"TorchRec's {optimizer} step is not the reference step: {peer['error']}")
    ready = [name for name in RUNNERS if setups[name]["ok"]]
    times: dict[str, list[list[float]]] = {name: [] for name in ready}
    for _, name in alternating(ready, rounds):
        # Thread pools spin for a while after their last task (OpenMP's and
        # XLA's); a pause keeps one runner's spinning out of the next's times.
        time.sleep(SETTLE_SECONDS)
        times[name].append(runners[name].call(f"time {steps}")["step_ms"])
    return setups, times


def _ms(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def _iqr(values: list[float]) -> list[float]:
    return [round(float(q), 2) for q in np.percentile(values, [25, 75])]


def step_figures(optimizer: str, times: dict[str, list[list[float]]]) -> dict:
    """`<runner>_<optimizer>_ms[_8dev]`, its IQR and its round medians."""
    figures = {}
    for name, rounds in times.items():
        runner, suffix = ("torchrec", "") if name == "torchrec" else ("ours", SUFFIX[name])
        key = f"{runner}_{optimizer}_ms"
        every = [t for r in rounds for t in r]
        figures[key + suffix] = _ms(every)
        figures[f"{key}_iqr{suffix}"] = _iqr(every)
        figures[f"{key}_by_round{suffix}"] = [_ms(r) for r in rounds]
    return figures


def ratio_figures(optimizer: str, figures: dict) -> dict:
    """`ratio_vs_torchrec_<optimizer>[_8dev]` (and by round) where both sides ran."""
    peer = figures.get(f"torchrec_{optimizer}_ms")
    peer_rounds = figures.get(f"torchrec_{optimizer}_ms_by_round", [])
    out = {}
    if optimizer == "rowwise_adagrad" and "torchrec_sgd_ms" in figures:
        sgd_share = round(ROWWISE_VS_SGD * figures["torchrec_sgd_ms"], 2)
        peer = sgd_share if peer is None else min(peer, sgd_share)
        peer_rounds = [min(r, sgd_share) for r in peer_rounds]
        out["torchrec_rowwise_adagrad_target_ms"] = peer
    if peer is None:
        return out
    for suffix in SUFFIX.values():
        ours = figures.get(f"ours_{optimizer}_ms{suffix}")
        if ours is None:
            continue
        ours_rounds = figures[f"ours_{optimizer}_ms_by_round{suffix}"]
        if len(peer_rounds) != len(ours_rounds):  # the peer's row-wise step did not run
            peer_rounds = [peer] * len(ours_rounds)
        key = f"ratio_vs_torchrec_{optimizer}"
        out[key + suffix] = round(peer / ours, 3)
        out[f"{key}_by_round{suffix}"] = [
            round(p / o, 3) for p, o in zip(peer_rounds, ours_rounds, strict=True)
        ]
    return out


def setup_figures(setups: dict[str, dict[str, dict]]) -> dict:
    """Preprocessing times, the peer's check and what could not run, from the
    setup replies by optimizer and runner."""
    figures = {}
    for name, suffix in SUFFIX.items():
        times = [
            t for by_runner in setups.values() for t in by_runner[name].get("preprocess_ms", [])
        ]
        if times:
            figures[f"preprocess_ms{suffix}"] = _ms(times)
            figures[f"preprocess_ms_iqr{suffix}"] = _iqr(times)
    figures["torchrec_check_max_relative_error"] = {
        optimizer: by_runner["torchrec"]["check"]["max_relative_error"]
        for optimizer, by_runner in setups.items()
        if by_runner["torchrec"]["ok"]
    }
    figures["unavailable"] = {
        f"{name}_{optimizer}": reply["error"]
        for optimizer, by_runner in setups.items()
        for name, reply in by_runner.items()
        if not reply["ok"]
    }
    return figures


def over_sgd_figures(figures: dict) -> dict:
    """`ours_<optimizer>_over_sgd[_8dev]`: each of our steps over our SGD step
    (the target for Adagrad and the optimizers TorchRec lacks: at most 1.5)."""
    out = {}
    for suffix in SUFFIX.values():
        sgd = figures.get(f"ours_sgd_ms{suffix}")
        for optimizer in (*OPTIMIZERS, *OURS_ONLY_OPTIMIZERS):
            ours = figures.get(f"ours_{optimizer}_ms{suffix}")
            if optimizer != "sgd" and ours is not None and sgd is not None:
                out[f"ours_{optimizer}_over_sgd{suffix}"] = round(ours / sgd, 3)
    return out


def make_batches(
    shape: LookupShape, args: argparse.Namespace
) -> list[dict[str, embedding.RaggedIds]]:
    return _zipf_batches.make_batches(
        args.batches,
        args.seed,
        tables=shape.tables,
        rows=shape.batch,
        vocabulary=shape.vocabulary,
        zipf=shape.zipf,
        max_valency=shape.max_valency,
    )


def batch_figures(shape: LookupShape, batches: list[dict[str, embedding.RaggedIds]]) -> dict:
    ids = [sum(r.values.size for r in b.values()) for b in batches]
    unique = [sum(np.unique(r.values).size for r in b.values()) for b in batches]
    return dict(
        benchmark="lookup",
        **{k: getattr(shape, k) for k in ("tables", "vocabulary", "dim", "batch", "zipf")},
        ids_per_step=int(np.mean(ids)),
        unique_ids_per_step=int(np.mean(unique)),
    )


def greeting_figures(runners: dict[str, LineProcess]) -> dict:
    peer = runners["torchrec"].greeting
    figures = {"torchrec_version": peer["torchrec"], "torchrec_threads": peer["threads"]}
    for name, suffix in SUFFIX.items():
        figures[f"limits{suffix}"] = runners[name].greeting["limits"]
    return figures


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a small shape, to check it runs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per runner per round")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--partitions-per-device", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated")
    parser.add_argument(
        "--no-stacking",
        dest="stacked",
        action="store_false",
        help="our 8 tables as 8 physical tables instead of one stack",
    )
    _torchrec_env.add_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    _torchrec_env.check_python(args)
    shape = SMALL if args.small else FULL
    batches = make_batches(shape, args)
    figures = batch_figures(shape, batches)
    figures.update(rounds=args.rounds, steps_per_round=args.steps)
    figures.update(partitions_per_device=args.partitions_per_device)
    figures.update(torchrec_huge_pages=args.peer_huge_pages, ours_stacked=args.stacked)
    setups = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        path = Path(tmp) / "batches.npz"
        write_batches(batches, path)
        runners = start_runners(stack, path, shape, args)
        figures.update(greeting_figures(runners))
        for optimizer in args.optimizers.split(","):
            setups[optimizer], times = measure(optimizer, runners, args.rounds, args.steps)
            figures.update(step_figures(optimizer, times))
            figures.update(ratio_figures(optimizer, figures))
    figures.update(over_sgd_figures(figures))
    figures.update(setup_figures(setups))
    print(json.dumps(figures))


if __name__ == "__main__":
    try:
        main()
    except ChildError as e:
        raise SystemExit(f"lookup benchmark: {e}") from e
