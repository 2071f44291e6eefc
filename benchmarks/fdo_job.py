"""FDO stats job throughput: Beam's in-process runner against a plain Python loop.

Both compute the same stats over the same ArrayRecord files of the demo
config (`sparseflow/configs/demo.yaml`: 10 features, 8 tables, 8 devices x 2
partitions, global batch 512): read, parse and check the records, form the
global batches, lay every batch out with the online preprocessing, combine.
The loop reads the files once, in order, in one process; the Beam job
(`beam_jobs.run_fdo_job`, in process on the FnApiRunner, one worker) reads them in
ranges, twice (a counting pass numbers the good records), and joins batches
that straddle ranges. The two results are checked to be equal.

Datasets are written once per size into `--data-dir` and reused. Each
figure is the best of `--repeats` runs, after an untimed warm-up. Targets:
Beam >= 0.5x the loop; cost linear in the examples (the largest size within
1.2x of the smallest scaled up). The last line printed is one JSON object.

    python benchmarks/fdo_job.py [--sizes 100000 1000000] [--data-dir DIR] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import beam_jobs
import embedding
import pipelines
from beam_jobs._batch_stats import BatchStatsComputer
from beam_jobs._batches import check_records, concat_rows, slice_rows
from sparseflow import load_config, shipped_config
from sparseflow._fdo_command import job_config

CONFIG = shipped_config("demo")
_CHUNK = 8192


def dataset(config, directory: Path, examples: int) -> list[str]:
    """The ArrayRecord files of `examples` synthetic examples, written if missing."""
    path = directory / f"demo-{examples}"
    if not (path / "dataset.json").is_file():
        print(f"writing {examples:,} examples to {path} ...", flush=True)
        pipelines.write_synthetic_dataset(
            config.synthetic,
            path,
            num_examples=examples,
            seed=0,
            num_shards=8,
            formats=("arrayrecord",),
        )
    return pipelines.list_record_files(str(path / "arrayrecord"))


def plain_loop(job: beam_jobs.FdoJobConfig, files: list[str]) -> embedding.FdoStats:
    """The same stats in one process: records in order, batches cut as they fill."""
    compute = BatchStatsComputer(job.feature_specs, job.geometry)
    combine = beam_jobs.FdoStatsFn(
        geometry=job.geometry, config_hash=job.config_hash, top_k=job.top_k
    )
    accumulator = combine.create_accumulator()
    size = job.geometry.global_batch_size
    pending, batch = [], 0
    records = pipelines.read_records(files)
    while chunk := [r for _, r in zip(range(_CHUNK), records)]:
        rows, _ = check_records(chunk, job.layout, job.vocabulary_sizes)
        pending.append(rows)
        rows = concat_rows(pending)
        whole = rows.num_rows // size
        for b in range(whole):
            stats = compute(batch, slice_rows(rows, b * size, (b + 1) * size))
            accumulator = combine.add_input(accumulator, stats)
            batch += 1
        pending = [slice_rows(rows, whole * size, rows.num_rows)]
    return combine.extract_output(accumulator)


def _best_of(repeats: int, fn, *args):
    """(result, the shortest of `repeats` wall times): others' load only adds time."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn(*args)
        times.append(time.perf_counter() - start)
    return result, min(times)


def measure(job, files: list[str], examples: int, out_dir: str, repeats: int) -> dict:
    loop_stats, loop_s = _best_of(repeats, plain_loop, job, files)
    result, beam_s = _best_of(repeats, beam_jobs.run_fdo_job, job, files, out_dir)
    if json.loads(result.stats.to_json()) != json.loads(loop_stats.to_json()):
        raise AssertionError("The Beam job and the plain loop computed different stats.")
    figures = {
        "examples": examples,
        "batches": result.stats.batches,
        "beam_s": round(beam_s, 2),
        "loop_s": round(loop_s, 2),
        "beam_examples_per_s": round(examples / beam_s),
        "loop_examples_per_s": round(examples / loop_s),
        "ratio_vs_plain_loop": round(loop_s / beam_s, 3),
    }
    print(json.dumps(figures), flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "fdo_bench")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    args = parser.parse_args()
    config = load_config(args.config)
    job = job_config(config)
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
    small, large = runs[0], runs[-1]
    scale = large["examples"] / small["examples"]
    print(
        json.dumps(
            {
                "benchmark": "fdo_job",
                "config": str(args.config.name),
                "runner": "FnApiRunner (in process, in_memory, 1 worker)",
                "repeats": args.repeats,
                "runs": runs,
                "ratio_vs_plain_loop": min(r["ratio_vs_plain_loop"] for r in runs),
                "linearity_beam": round(large["beam_s"] / (scale * small["beam_s"]), 3),
                "linearity_loop": round(large["loop_s"] / (scale * small["loop_s"]), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
