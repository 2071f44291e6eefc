"""Two hosts as two local processes: Grain workers agree on minibatching across
hosts, and a host that stops early does not hang the other (pipelines/_grain.py)."""

import json
import os
import subprocess
import sys

import host_process
import numpy as np
import pipeline_cases as cases

import pipelines
from embedding import RaggedIds
from pipelines._parse import serialize_examples

TIMEOUT_S = 240
HOST_ROWS = host_process.BATCH // 2
CROWDED = 1


def _records(num_batches: int, crowded: tuple[int, int] | None = None) -> list[bytes]:
    """Records whose ids stay within the limits, except host `crowded[1]`'s rows
    of batch `crowded[0]`: there feature `a` puts 12 distinct ids into partition
    0 of each partition slot (limit 4), which forces minibatching."""
    count = num_batches * host_process.BATCH
    rows = np.arange(count) % HOST_ROWS
    a_ids = [[row] for row in rows]
    if crowded is not None:
        batch, host = crowded
        start = batch * host_process.BATCH + host * HOST_ROWS
        for index in range(start, start + HOST_ROWS):
            a_ids[index] = [4 * (3 * (rows[index] % 4) + j) for j in range(3)]
    ones = np.ones(count, np.int64)
    parsed = pipelines.ParsedBatch(
        ids={
            "a": _ragged(np.concatenate(a_ids), [len(ids) for ids in a_ids]),
            "b": _ragged(rows, ones),
            "c": _ragged(rows + 8, ones),
        },
        weights={"b": _ragged(np.full(count, 0.5, np.float32), ones)},
        dense=np.arange(count * 3, dtype=np.float32).reshape(count, 3),
        labels=(rows % 2).astype(np.int32),
    )
    return serialize_examples(parsed)


def _ragged(values, lengths) -> RaggedIds:
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return RaggedIds(np.asarray(values), splits)


def _run_hosts(data: list, workers: int, deadline_s: float, tmp_path) -> list[dict]:
    """Runs host 0 and host 1 (reading `data[0]`, `data[1]`); returns their outputs."""
    groups = max(workers, 1)
    base = cases.free_port_block(2 * groups)
    processes, outs = [], []
    for rank in range(2):
        out = tmp_path / f"host{rank}.json"
        args = {
            "data": data[rank],
            "process_index": rank,
            "ports": [base, base + groups],
            "workers": workers,
            "deadline_s": deadline_s,
            "out": str(out),
        }
        command = [sys.executable, host_process.__file__, json.dumps(args)]
        processes.append(subprocess.Popen(command, cwd=os.path.dirname(host_process.__file__)))
        outs.append(out)
    try:
        codes = [process.wait(timeout=TIMEOUT_S) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    assert codes == [0, 0]
    return [json.loads(out.read_text()) for out in outs]


def test_workers_of_both_hosts_agree_when_only_one_host_needs_minibatching(tmp_path):
    files = cases.write_records(str(tmp_path), _records(4, crowded=(CROWDED, 0)))
    hosts = _run_hosts([files["arrayrecord"]] * 2, 2, 30.0, tmp_path)
    for rank, host in enumerate(hosts):
        assert host["error"] is None
        # Record i has dense values [3i, 3i + 1, 3i + 2]: host p's rows of
        # batch b are records b * 16 + p * 8 + r.
        first_records = [b * host_process.BATCH + rank * HOST_ROWS for b in range(4)]
        assert host["first_dense"] == [3.0 * record for record in first_records]
    host0, host1 = hosts
    assert host0["num_minibatches"] == host1["num_minibatches"]
    assert host0["num_minibatches"][CROWDED][0] > 1
    others = [counts for number, counts in enumerate(host0["num_minibatches"]) if number != CROWDED]
    assert others == [[1]] * 3


def test_a_host_that_ends_early_stops_the_other_with_a_clear_error(tmp_path):
    long = cases.write_records(str(tmp_path / "long"), _records(4))
    short = cases.write_records(str(tmp_path / "short"), _records(2))
    host0, host1 = _run_hosts([long["arrayrecord"], short["arrayrecord"]], 0, 3.0, tmp_path)
    assert host1["num_minibatches"] == [[1], [1]] and host1["error"] is None
    assert host0["num_minibatches"] == [[1], [1]]
    assert "batch 2 (host 0 of 2): the hosts could not agree" in host0["error"]
    assert "same dataset size" in host0["error"]
