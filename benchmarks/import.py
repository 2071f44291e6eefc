"""Import throughput: the Beam import job against a plain single-process loop.

Both turn the same synthetic Criteo-format TSV file (`--lines` lines: a
label, 13 integer columns and 26 hexadecimal categorical ones, about a fifth
of the fields empty, one line in a thousand malformed) into the same
`--shards` ArrayRecord files of `tf.train.Example`s: the loop counts the
lines, then reads them once, in order, parses them with the job's own
parser (`beam_jobs._lines.LineParser`) and writes shard after shard; the
Beam job (`beam_jobs.run_import_job`) runs in process on the FnApiRunner
(one worker), and on a local Dask cluster of 2 worker processes (started,
and warmed up, before the timed run). Every run's records are checked to be
the loop's, byte for byte (a digest of the records in order).

The input file is written once per size into `--data-dir` and reused. Each
figure is the best of `--repeats` runs. The last line printed is one JSON
object with `ratio_vs_plain_loop` (loop time over in-process job time) and
`ratio_vs_plain_loop_dask_2`.

    python benchmarks/import.py [--lines 1000000] [--shards 8] [--data-dir DIR]
                                [--repeats 2] [--dask-workers 2]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import tempfile
from pathlib import Path

import _criteo_logs
from _step_times import best_of

import beam_jobs
import pipelines
from beam_jobs._lines import BadLine, LineParser
from beam_jobs.dask_cluster import dask_cluster

_DASK_RUNNER = "beam_jobs.dask_runner.DaskRunner"
_EMPTY = 0.2
_PROFILE = _criteo_logs.LogProfile(
    cardinalities=(100_000,) * _criteo_logs.CAT_COLUMNS,
    zipf=1.2,
    int_empty=(_EMPTY,) * _criteo_logs.INT_COLUMNS,
    cat_empty=(_EMPTY,) * _criteo_logs.CAT_COLUMNS,
    positives=0.5,
    bad_every=1000,
)


def criteo_file(directory: Path, lines: int) -> str:
    """A synthetic Criteo-format file of `lines` lines, written if missing."""
    return str(_criteo_logs.cached_log(directory / f"criteo-{lines}.tsv", lines, _PROFILE))


def plain_loop(path: str, paths: list[str]) -> int:
    """Writes the records of `path` to `paths` (contiguous shards) in one process; good lines."""
    parser = LineParser(beam_jobs.criteo_spec(), "\t")
    with open(path, "rb") as file:
        total = sum(block.count(b"\n") for block in iter(lambda: file.read(2**20), b""))
    bounds = [s * total // len(paths) for s in range(len(paths) + 1)]
    written = 0
    with open(path, "rb") as file:
        for s, shard_path in enumerate(paths):
            with pipelines.RecordFileWriter(shard_path) as writer:
                for line in itertools.islice(file, bounds[s + 1] - bounds[s]):
                    try:
                        values = parser.values(parser.fields(line))
                    except BadLine:
                        continue
                    writer.write(parser.example(values))
            written += writer.count
    return written


def digest(paths: list[str]) -> str:
    h = hashlib.sha256()
    for record in pipelines.read_records(paths):
        h.update(len(record).to_bytes(8, "little"))
        h.update(record)
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=lambda s: int(float(s)), default=1_000_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument(
        "--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "import_bench"
    )
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    parser.add_argument("--dask-workers", type=int, default=2, help="local Dask cluster size")
    args = parser.parse_args()
    source = criteo_file(args.data_dir, args.lines)
    config = beam_jobs.ImportConfig(spec=beam_jobs.criteo_spec(), shards=args.shards)
    result: dict = {"benchmark": "import", "lines": args.lines, "shards": args.shards}
    with tempfile.TemporaryDirectory() as out:

        def run_job(name: str, pipeline_args=()):
            directory = os.path.join(out, name)
            return beam_jobs.run_import_job([source], config, directory, pipeline_args)

        loop_paths = config.shard_paths(os.path.join(out, "loop"))
        os.makedirs(os.path.dirname(loop_paths[0]))
        records, loop_s = best_of(args.repeats, plain_loop, source, loop_paths)
        expected = digest(loop_paths)
        run_job("warm-up")  # untimed: Beam's and TF's first-use costs
        job, beam_s = best_of(args.repeats, run_job, "in-process")
        if job.summary["records"] != records or digest(job.files) != expected:
            raise AssertionError(
                "The in-process import and the plain loop wrote different records."
            )
        workers = args.dask_workers
        with dask_cluster(workers=workers) as address:
            dask_args = [f"--runner={_DASK_RUNNER}", f"--dask_client_address={address}"]
            run_job("dask-warm-up", dask_args)  # untimed: every worker imports TF once
            on_dask, dask_s = best_of(args.repeats, run_job, f"dask-{workers}", dask_args)
        if digest(on_dask.files) != expected:
            raise AssertionError("The import on Dask and the plain loop wrote different records.")
    result.update(
        {
            "records": records,
            "dead_letters": args.lines - records,
            "loop_s": round(loop_s, 2),
            "beam_s": round(beam_s, 2),
            f"dask_{workers}_s": round(dask_s, 2),
            "loop_records_per_s": round(records / loop_s),
            "beam_records_per_s": round(records / beam_s),
            f"dask_{workers}_records_per_s": round(records / dask_s),
            "runner": "FnApiRunner (in process, 1 worker); Dask: local cluster, 1 thread each",
            "ratio_vs_plain_loop": round(loop_s / beam_s, 3),
            f"ratio_vs_plain_loop_dask_{workers}": round(loop_s / dask_s, 3),
        }
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
