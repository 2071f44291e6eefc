"""How our sparse step, memory, initialization and checkpoints grow with the tables.

For each optimizer (`--optimizers`, default row-wise Adagrad and Adam) and
each size (`--rows`, the rows of all 8 tables together, dim 16, stacked into
one as `benchmarks/lookup.py` stacks them), on one CPU device:

  * the step of `benchmarks/lookup.py` (lookup, backward, sparse update, one
    jitted program with the tables donated) on the same ids at every size:
    global batch 4096, Zipf(1.1) ids, 1..20 per sample, the popular ids
    scattered over each table (`_zipf_batches.make_batches(scattered=True)`:
    hashed ids lie anywhere, so a large table's rows are far apart in memory);
  * the tables' initialization (`init_s`), and the resident memory: the
    process's before the tables exist (`rss_before_init`, its libraries,
    compiled programs and laid-out batches), and its peak while the tables
    are created, while it trains and while it saves and restores;
  * a save and a restore through the trainer's own checkpoints
    (`sparseflow._checkpoint`, orbax), the restore into nothing but the
    checkpoint, checked by a checksum of the arrays' bits: `save_s` until
    the save returns, `sync_s` until the data is on disk (`os.sync`),
    `restore_s`;
  * the same on `--group` (default 2x4): 2 processes of 4 CPU devices each,
    one `jax.distributed` group over loopback (gloo collectives), the tables
    sharded over all 8 devices, each process laying out its own half of every
    batch; its figures (`group`) are per process, the worst of the two, and
    its step times process 0's;
  * the disk's sequential write speed, `dd` of 2 GiB with `conv=fdatasync`,
    once per run: `disk_write_mb_s`.

TorchRec's step (`lookup_torchrec_peer.py`, row-wise Adagrad only: FBGEMM has
no Adam on the CPU) runs at the same sizes; where ours and its fit in memory
together (`--memory-gib`) the two alternate in `--rounds` rounds, else each
runs its rounds alone, one after the other (`alternated: false`). As in
`lookup.py`, our row-wise step is compared with the faster of TorchRec's
row-wise step and 0.65x its SGD step (`torchrec_target_ms`): FBGEMM's CPU
row-wise backward takes a slow path on some CPUs.

Figures per optimizer and size `<opt>_<rows>`: `step_ms` (median, with its
IQR), `state_bytes` (tables and slots), `peak_over_arrays_<phase>`: the peak
resident memory over what the phase must hold, both above the process's own
baseline: `(peak - rss_before_init + batch_bytes) / (state_bytes +
batch_bytes)` (target: at most 1.3), `save_mb_s` and `durable_save_mb_s`
(the state over `save_s`, and over `save_s + sync_s`), `restore_mb_s`, and
`ratio_vs_torchrec` (TorchRec's step over ours: above 1 we are faster).
Summary keys: `step_growth_<opt>` (the largest size's step over the
smallest's; target at most 1.5), `durable_save_over_disk_<opt>` at the
largest size (target at least 0.5). A size whose state would not fit
`--memory-gib` is skipped and listed. The last line printed is one JSON object.

    python benchmarks/scale.py [--rows 1e6,1e7,1e8,2e8] [--optimizers rowwise_adagrad,adam]
        [--rounds 3] [--steps 10] [--no-peer] [--group 2x4|none] [--work-dir DIR]
    python benchmarks/scale.py --rows 1e5,1e6 --rounds 1 --steps 3 --no-peer   # a check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _torchrec_env
import _zipf_batches
import numpy as np
import portpicker
from _alternating import alternating
from _line_protocol import LineProcess, ProcessGroup
from _lookup_shape import OPTIMIZERS, OURS_ONLY_OPTIMIZERS, LookupShape
from lookup import ROWWISE_VS_SGD, _device_env, write_batches

BENCHMARKS = Path(__file__).resolve().parent
TABLES, DIM, BATCH = 8, 16, 4096
SLOT_FLOATS_PER_ROW = {"rowwise_adagrad": 1, "adam": 2 * DIM, "sgd": 0}
SETTLE_SECONDS = 0.5


def _rows(text: str) -> list[int]:
    return [int(float(part)) for part in text.split(",")]


def _group_shape(text: str) -> tuple[int, int] | None:
    if text == "none":
        return None
    processes, _, devices = text.partition("x")
    return int(processes), int(devices)


def state_bytes(optimizer: str, rows: int) -> int:
    """Tables and slots of `rows` rows (float32)."""
    return rows * (DIM + SLOT_FLOATS_PER_ROW[optimizer]) * 4


def disk_write_mb_s(folder: Path, gib: int = 2) -> float:
    """`dd`'s sequential write speed into `folder`, flushed to disk before it stops timing."""
    target = folder / "dd.bin"
    done = subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=64M", f"count={16 * gib}", "conv=fdatasync"],
        capture_output=True,
        text=True,
        check=True,
    )
    target.unlink()
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", done.stderr)
    return round(int(match.group(1)) / float(match.group(2)) / 1e6, 1)


def _ours(stack: contextlib.ExitStack, batches: Path, shape: LookupShape) -> LineProcess:
    argv = [sys.executable, str(BENCHMARKS / "_lookup_ours.py"), str(batches)]
    argv += ["--shape", shape.to_json(), "--devices", "1"]
    return stack.enter_context(LineProcess("ours", argv, env=_device_env(1), timeout_s=600))


def _group(
    stack: contextlib.ExitStack, batches: Path, shape: LookupShape, processes: int, devices: int
) -> ProcessGroup:
    """`processes` step processes of one `jax.distributed` group, `devices` each."""
    coordinator = f"127.0.0.1:{portpicker.pick_unused_port()}"
    members = []
    for index in range(processes):
        argv = [sys.executable, str(BENCHMARKS / "_lookup_ours.py"), str(batches)]
        argv += ["--shape", shape.to_json(), "--devices", str(processes * devices)]
        argv += ["--processes", str(processes), "--process-id", str(index)]
        argv += ["--coordinator", coordinator]
        name = f"ours process {index}"
        members.append(
            LineProcess(name, argv, env=_device_env(devices), timeout_s=600, greet=False)
        )
    return stack.enter_context(ProcessGroup(members))


def _peer(stack, batches: Path, shape: LookupShape, args) -> LineProcess:
    argv = [str(args.torchrec_python), str(BENCHMARKS / "lookup_torchrec_peer.py"), str(batches)]
    argv += ["--shape", shape.to_json()]
    return stack.enter_context(
        LineProcess("torchrec", argv, env=_torchrec_env.peer_env(args), timeout_s=600)
    )


def _timed_rounds(runners: dict[str, LineProcess], rounds: int, steps: int) -> dict:
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _, name in alternating(list(runners), rounds):
        time.sleep(SETTLE_SECONDS)
        times[name] += runners[name].call(f"time {steps}")["step_ms"]
    return times


def _ours_figures(setup: dict, trained: dict, checkpoint: dict, times: list[float]) -> dict:
    state, batch = setup["state_bytes"], setup["batch_bytes"]

    def over_arrays(peak: int) -> float:
        return round((peak - setup["rss_before_init"] + batch) / (state + batch), 3)

    return {
        "step_ms": round(statistics.median(times), 2),
        "step_ms_iqr": [round(float(q), 2) for q in np.percentile(times, [25, 75])],
        "init_s": setup["init_s"],
        "state_bytes": state,
        "batch_bytes": batch,
        "rss_before_init": setup["rss_before_init"],
        "peak_rss_train": trained["peak_rss"],
        "peak_over_arrays_init": over_arrays(setup["peak_rss_init"]),
        "peak_over_arrays_train": over_arrays(trained["peak_rss"]),
        "peak_over_arrays_save": over_arrays(checkpoint["peak_rss_save"]),
        "peak_over_arrays_restore": over_arrays(checkpoint["peak_rss_restore"]),
        **{k: checkpoint[k] for k in ("save_s", "sync_s", "restore_s", "checkpoint_bytes")},
        "save_mb_s": round(state / checkpoint["save_s"] / 1e6, 1),
        "durable_save_mb_s": round(state / (checkpoint["save_s"] + checkpoint["sync_s"]) / 1e6, 1),
        "restore_mb_s": round(state / checkpoint["restore_s"] / 1e6, 1),
    }


def _peer_sgd(peer: LineProcess, optimizer: str, args) -> dict:
    """For row-wise Adagrad, the peer's SGD step too (`torchrec_sgd_ms`), as `lookup.py`
    compares: FBGEMM's CPU row-wise backward takes a slow path on some CPUs."""
    if optimizer != "rowwise_adagrad":
        return {}
    peer.call("setup sgd")
    times = _timed_rounds({"torchrec": peer}, args.rounds, args.steps)["torchrec"]
    return {"torchrec_sgd_ms": round(statistics.median(times), 2)}


def measure_group(optimizer: str, rows: int, args, work: Path) -> dict:
    """Ours on `--group` (processes x devices): set up, timed, checkpointed; per
    process figures, the worst of the processes (step times are process 0's)."""
    processes, devices = args.group
    path = _write_batches(rows, args, work)
    shape = _shape(rows)
    with contextlib.ExitStack() as stack:
        group = _group(stack, path, shape, processes, devices)
        setups = group.call(f"setup {optimizer}")
        group.call("memory")
        times = []
        for _ in range(args.rounds):
            time.sleep(SETTLE_SECONDS)
            times += group.call(f"time {args.steps}")[0]["step_ms"]
        trained = group.call("memory")
        checkpoints = group.call(f"checkpoint {work / 'checkpoint'}")
    path.unlink()
    per_process = [
        _ours_figures(*replies, times) for replies in zip(setups, trained, checkpoints, strict=True)
    ]
    return {
        key: max(p[key] for p in per_process) if key != "step_ms_iqr" else per_process[0][key]
        for key in per_process[0]
    }


def _shape(rows: int) -> LookupShape:
    return LookupShape(tables=TABLES, vocabulary=rows // TABLES, dim=DIM, batch=BATCH)


def _write_batches(rows: int, args, work: Path) -> Path:
    """The run's id batches for `rows` rows, in `work`."""
    shape = _shape(rows)
    batches = _zipf_batches.make_batches(
        args.batches,
        args.seed,
        tables=TABLES,
        rows=BATCH,
        vocabulary=shape.vocabulary,
        zipf=shape.zipf,
        max_valency=shape.max_valency,
        scattered=True,
    )
    path = work / "batches.npz"
    write_batches(batches, path)
    return path


def measure_size(optimizer: str, rows: int, args, work: Path) -> dict:
    """One optimizer at one size: ours (and the peer) set up, timed, ours checkpointed."""
    shape = _shape(rows)
    path = _write_batches(rows, args, work)
    peer_runs = args.peer and optimizer in OPTIMIZERS
    together = state_bytes(optimizer, rows) * (1 + 1.5 * peer_runs) <= args.memory_gib * 2**30
    figures: dict = {"alternated": bool(peer_runs and together)}
    with contextlib.ExitStack() as stack:
        ours = _ours(stack, path, shape)
        setup = ours.call(f"setup {optimizer}")
        runners = {"ours": ours}
        if peer_runs and together:
            runners["torchrec"] = _peer(stack, path, shape, args)
            figures["torchrec_check"] = runners["torchrec"].call(f"setup {optimizer}")["check"]
        ours.call("memory")  # the training peak starts here
        times = _timed_rounds(runners, args.rounds, args.steps)
        trained = ours.call("memory")
        checkpoint = ours.call(f"checkpoint {work / 'checkpoint'}")
        figures |= _ours_figures(setup, trained, checkpoint, times["ours"])
        if peer_runs and together:
            figures |= _peer_sgd(runners["torchrec"], optimizer, args)
    if peer_runs and not together:
        with contextlib.ExitStack() as stack:
            peer = _peer(stack, path, shape, args)
            figures["torchrec_check"] = peer.call(f"setup {optimizer}")["check"]
            times |= _timed_rounds({"torchrec": peer}, args.rounds, args.steps)
            figures |= _peer_sgd(peer, optimizer, args)
    if "torchrec" in times:
        peer_ms = figures["torchrec_step_ms"] = round(statistics.median(times["torchrec"]), 2)
        if "torchrec_sgd_ms" in figures:
            peer_ms = min(peer_ms, round(ROWWISE_VS_SGD * figures["torchrec_sgd_ms"], 2))
            figures["torchrec_target_ms"] = peer_ms
        figures["ratio_vs_torchrec"] = round(peer_ms / figures["step_ms"], 3)
    path.unlink()
    return figures


def summary(results: dict[str, dict[int, dict]], disk: float) -> dict:
    out = {}
    for optimizer, by_size in results.items():
        if len(by_size) < 2:
            continue
        smallest, largest = by_size[min(by_size)], by_size[max(by_size)]
        out[f"step_growth_{optimizer}"] = round(largest["step_ms"] / smallest["step_ms"], 3)
        out[f"durable_save_over_disk_{optimizer}"] = round(largest["durable_save_mb_s"] / disk, 3)
        out[f"largest_rows_{optimizer}"] = max(by_size)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=_rows, default=_rows("1e6,1e7,1e8,2e8"))
    parser.add_argument("--optimizers", default="rowwise_adagrad,adam")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-gib", type=float, default=15.0)
    parser.add_argument("--no-peer", dest="peer", action="store_false")
    parser.add_argument(
        "--group",
        type=_group_shape,
        default=(2, 4),
        help="PxD: also on P processes of D devices each (jax.distributed); 'none' skips",
    )
    parser.add_argument("--work-dir", type=Path, default=None)
    _torchrec_env.add_arguments(parser)
    args = parser.parse_args()
    optimizers = args.optimizers.split(",")
    for optimizer in optimizers:
        if optimizer not in SLOT_FLOATS_PER_ROW or optimizer not in (
            *OPTIMIZERS,
            *OURS_ONLY_OPTIMIZERS,
        ):
            raise SystemExit(
                f"--optimizers: {optimizer!r} is not one of {sorted(SLOT_FLOATS_PER_ROW)}"
            )
    if args.peer:
        _torchrec_env.check_python(args)
    work = Path(tempfile.mkdtemp(prefix="scale-", dir=args.work_dir))
    try:
        disk = disk_write_mb_s(work)
        print(f"disk: {disk} MB/s sequential write (dd, fdatasync)", flush=True)
        results: dict[str, dict[int, dict]] = {}
        skipped = []
        for optimizer in optimizers:
            results[optimizer] = {}
            for rows in args.rows:
                if state_bytes(optimizer, rows) > args.memory_gib * 2**30:
                    skipped.append(f"{optimizer}_{rows}")
                    continue
                figures = measure_size(optimizer, rows, args, work)
                if args.group is not None:
                    figures["group"] = measure_group(optimizer, rows, args, work)
                results[optimizer][rows] = figures
                print(f"{optimizer} {rows:,} rows: {json.dumps(figures)}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    line = {"benchmark": "scale", "disk_write_mb_s": disk, "skipped": skipped}
    line |= summary(results, disk)
    line |= {f"{o}_{r}": f for o, by_size in results.items() for r, f in by_size.items()}
    print(json.dumps(line))


if __name__ == "__main__":
    main()
