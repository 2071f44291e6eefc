"""FDO stats job throughput: Beam's in-process and Dask runners against a plain Python loop.

Both compute the same stats over the same ArrayRecord files of the demo
config (`sparseflow/configs/demo.yaml`: 10 features, 8 tables, 8 devices x 2
partitions, global batch 512): read, parse and check the records, form the
global batches, lay every batch out with the online preprocessing, combine.
The loop reads the files once, in order, in one process; the Beam job
(`beam_jobs.run_fdo_job`, in process on the FnApiRunner, one worker) reads them in
ranges, once (the data has no bad records, so the numbering of the good
records that the checking pass assumes holds; see `beam_jobs._range_stats`),
and joins batches that straddle ranges. The same job also runs on a local Dask cluster
(`beam_jobs.dask_runner`) of each of `--dask-workers` worker processes (one
thread each, 127.0.0.1): the cluster is started, and its workers warmed up,
before the timed runs. Every result is checked to equal the loop's.

Datasets are written once per size into `--data-dir` and reused. Each
figure is the best of `--repeats` runs, after an untimed warm-up. Targets:
in process >= 0.6x the loop at 1e5 examples, Dask on 2 workers >= 0.5x the
loop at 1e6; cost linear in the examples (the largest size within 1.2x of the
smallest scaled up). `dask_scaling` is the 1-worker time over the largest
worker count's, at the largest size; `dask_examples_per_worker_s` the
1-worker rate there, from which `projected_hours_4e9_examples_64_workers`
assumes linear scaling (no shuffle or scheduler limits). The last line
printed is one JSON object.

The config's training order (the demo shuffles, over 4 epochs) is timed
too, at the smallest size: the job with `FdoJobConfig.training_order` set
forms the batches training draws (every record in its batch of every
epoch), against `plain_loop_training_order`, which reads the records once
and takes each epoch's batches forwards in training's order
(`pipelines.batch_plan`, the training input's plan); their stats must be
equal. `ratio_vs_plain_loop_training_order` is that loop's time over the
job's (`training_order_loop_s` / `training_order_beam_s`, over
`training_order_batches` batches of `training_order_examples` examples).

    python benchmarks/fdo_job.py [--sizes 100000 1000000] [--dask-workers 1 2]
                                 [--data-dir DIR] [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

from _step_times import best_of

import beam_jobs
import embedding
import pipelines
from beam_jobs._batch_stats import BatchStatsComputer
from beam_jobs._batches import check_records, concat_rows, slice_rows, take_rows
from beam_jobs.dask_cluster import dask_cluster
from sparseflow import load_config, shipped_config
from sparseflow._fdo_run import job_config

CONFIG = shipped_config("demo")
_CHUNK = 8192
_DASK_RUNNER = "beam_jobs.dask_runner.DaskRunner"
# A day of Criteo-1TB-sized logs, on a cluster of this many workers.
_PROJECTED_EXAMPLES = 4_000_000_000
_PROJECTED_WORKERS = 64


def dataset(config, directory: Path, examples: int) -> list[str]:
    """The ArrayRecord files of `examples` synthetic examples, written if missing."""
    path = directory / f"demo-{examples}"
    if not (path / "dataset.json").is_file():
        print(f"writing {examples:,} examples to {path} ...", flush=True)
        pipelines.write_synthetic_dataset(
            config.synthetic.dataset,
            path,
            num_examples=examples,
            seed=0,
            num_shards=8,
            formats=("arrayrecord",),
        )
    return pipelines.list_record_files(str(path / "arrayrecord"))


def _stats_fns(job: beam_jobs.FdoJobConfig):
    """The job's per-batch stats and their combine, for a loop to call."""
    compute = BatchStatsComputer(job.feature_specs, job.geometry)
    combine = beam_jobs.FdoStatsFn(
        geometry=job.geometry,
        config_hash=job.config_hash,
        top_k=job.top_k,
        layout=None if job.fdo_layout is None else job.fdo_layout.entries,
    )
    return compute, combine


def _checked_chunks(job: beam_jobs.FdoJobConfig, files: list[str]):
    """`(records, good rows, problems)` of the files' records, read in order in chunks."""
    records = pipelines.read_records(files)
    while chunk := [r for _, r in zip(range(_CHUNK), records)]:
        yield (len(chunk), *check_records(chunk, job.layout, job.vocabulary_sizes))


def plain_loop(job: beam_jobs.FdoJobConfig, files: list[str]) -> embedding.FdoStats:
    """The same stats in one process: records in order, batches cut as they fill."""
    compute, combine = _stats_fns(job)
    accumulator = combine.create_accumulator()
    size = job.geometry.global_batch_size
    pending, batch = [], 0
    for _, rows, _ in _checked_chunks(job, files):
        pending.append(rows)
        rows = concat_rows(pending)
        whole = rows.num_rows // size
        for b in range(whole):
            stats = compute(batch, slice_rows(rows, b * size, (b + 1) * size))
            accumulator = combine.add_input(accumulator, stats)
            batch += 1
        pending = [slice_rows(rows, whole * size, rows.num_rows)]
    return combine.extract_output(accumulator)


def plain_loop_training_order(job: beam_jobs.FdoJobConfig, files: list[str]) -> embedding.FdoStats:
    """Training's batches in one process: the records read once, then every
    epoch's batches taken in training's order (`pipelines.batch_plan`, the
    training input's plan), forwards: batch by batch, its records looked up.

    Raises:
      ValueError: a bad record (training's fill-ins are not modelled here).
    """
    order, size = job.training_order, job.geometry.global_batch_size
    compute, combine = _stats_fns(job)
    count, parts = 0, []
    for records, rows, problems in _checked_chunks(job, files):
        if problems:
            raise ValueError(f"Record {count + problems[0][0]} is bad: {problems[0][1]}")
        count += records
        parts.append(rows)
    rows = concat_rows(parts)
    batching = pipelines.BatchingConfig(
        global_batch_size=size, num_epochs=order.epochs, shuffle_seed=order.shuffle_seed
    )
    plan = pipelines.batch_plan(count, batching)
    accumulator = combine.create_accumulator()
    for batch in range(plan.num_batches):
        stats = compute(batch, take_rows(rows, plan.record_indices(batch)))
        accumulator = combine.add_input(accumulator, stats)
    batch_order = embedding.FdoBatchOrder(
        records=count, shuffle_seed=order.shuffle_seed, epochs=order.epochs
    )
    return dataclasses.replace(combine.extract_output(accumulator), batch_order=batch_order)


def _same_stats(result: beam_jobs.FdoJobResult, loop_stats: embedding.FdoStats, runner: str):
    if json.loads(result.stats.to_json()) != json.loads(loop_stats.to_json()):
        raise AssertionError(
            f"The Beam job ({runner}) and the plain loop computed different stats."
        )


def measure(job, files: list[str], examples: int, out_dir: str, repeats: int) -> dict:
    """The loop and the in-process runner at one size."""
    loop_stats, loop_s = best_of(repeats, plain_loop, job, files)
    result, beam_s = best_of(repeats, beam_jobs.run_fdo_job, job, files, out_dir)
    _same_stats(result, loop_stats, "in process")
    return {
        "examples": examples,
        "batches": result.stats.batches,
        "beam_s": round(beam_s, 2),
        "loop_s": round(loop_s, 2),
        "beam_examples_per_s": round(examples / beam_s),
        "loop_examples_per_s": round(examples / loop_s),
        "ratio_vs_plain_loop": round(loop_s / beam_s, 3),
        "loop_stats": loop_stats,
    }


def measure_training_order(job, files: list[str], out_dir: str, repeats: int) -> dict:
    """The training-order loop and job (`job.training_order` set) at one size."""
    loop_stats, loop_s = best_of(repeats, plain_loop_training_order, job, files)
    result, beam_s = best_of(repeats, beam_jobs.run_fdo_job, job, files, out_dir)
    _same_stats(result, loop_stats, "in process, training's order")
    return {
        "training_order_batches": result.stats.batches,
        "training_order_beam_s": round(beam_s, 2),
        "training_order_loop_s": round(loop_s, 2),
        "ratio_vs_plain_loop_training_order": round(loop_s / beam_s, 3),
    }


def measure_dask(
    job, files: dict[int, list[str]], workers: int, runs: list[dict], out_dir: str, repeats: int
) -> None:
    """Adds the runs' figures on a local cluster of `workers` processes."""
    with dask_cluster(workers=workers) as address:
        args = [f"--runner={_DASK_RUNNER}", f"--dask_client_address={address}"]
        smallest = files[runs[0]["examples"]]
        # Untimed: every worker imports TF and loads the kernels once.
        beam_jobs.run_fdo_job(job, smallest, os.path.join(out_dir, f"warm-up-{workers}"), args)
        for run in runs:
            out = os.path.join(out_dir, f"dask-{workers}-{run['examples']}")
            result, seconds = best_of(
                repeats, beam_jobs.run_fdo_job, job, files[run["examples"]], out, args
            )
            _same_stats(result, run["loop_stats"], f"Dask, {workers} workers")
            run[f"dask_{workers}_s"] = round(seconds, 2)
            run[f"ratio_vs_plain_loop_dask_{workers}"] = round(run["loop_s"] / seconds, 3)


def _dask_summary(large: dict, workers: list[int]) -> dict:
    if not workers:
        return {}
    most = max(workers)
    summary = {
        f"ratio_vs_plain_loop_dask_{w}": large[f"ratio_vs_plain_loop_dask_{w}"] for w in workers
    }
    if 1 in workers:
        per_worker = large["examples"] / large["dask_1_s"]
        hours = _PROJECTED_EXAMPLES / (_PROJECTED_WORKERS * per_worker) / 3600
        summary["dask_examples_per_worker_s"] = round(per_worker)
        summary[f"dask_scaling_1_to_{most}"] = round(large["dask_1_s"] / large[f"dask_{most}_s"], 3)
        summary["projected_hours_4e9_examples_64_workers"] = round(hours, 2)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "fdo_bench")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    parser.add_argument(
        "--dask-workers", type=int, nargs="*", default=[1, 2], help="local Dask cluster sizes"
    )
    args = parser.parse_args()
    config = load_config(args.config)
    # The loop forms file-order batches, so the job is timed in that form too;
    # the demo config shuffles, which makes `sparseflow fdo` follow training's
    # order (`shuffled`), timed at the smallest size against its own loop.
    shuffled = job_config(config)
    job = dataclasses.replace(shuffled, training_order=None)
    sizes = sorted(args.sizes)
    files = {examples: dataset(config, args.data_dir, examples) for examples in sizes}
    runs = []
    with tempfile.TemporaryDirectory() as out_dir:
        # Untimed: loads the compiled kernels and traces TF's parsing once.
        plain_loop(job, files[sizes[0]][:1])
        beam_jobs.run_fdo_job(job, files[sizes[0]][:1], os.path.join(out_dir, "warm-up"))
        for examples in sizes:
            out = os.path.join(out_dir, f"fdo-{examples}")
            runs.append(measure(job, files[examples], examples, out, args.repeats))
        out = os.path.join(out_dir, "training-order")
        training = measure_training_order(shuffled, files[sizes[0]], out, args.repeats)
        for workers in args.dask_workers:
            measure_dask(job, files, workers, runs, out_dir, args.repeats)
    for run in runs:
        del run["loop_stats"]
        print(json.dumps(run), flush=True)
    small, large = runs[0], runs[-1]
    scale = large["examples"] / small["examples"]
    print(
        json.dumps(
            {
                "benchmark": "fdo_job",
                "config": str(args.config.name),
                "runner": "FnApiRunner (in process, in_memory, 1 worker); "
                "Dask (local cluster, 1 thread per worker process)",
                "repeats": args.repeats,
                "runs": runs,
                "ratio_vs_plain_loop": min(r["ratio_vs_plain_loop"] for r in runs),
                "linearity_beam": round(large["beam_s"] / (scale * small["beam_s"]), 3),
                "linearity_loop": round(large["loop_s"] / (scale * small["loop_s"]), 3),
                "training_order_examples": small["examples"],
                **training,
                **_dask_summary(large, args.dask_workers),
            }
        )
    )


if __name__ == "__main__":
    main()
