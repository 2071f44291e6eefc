"""One host of a multi-process all-reduce test, and a launcher for groups of them.

As a script it is one host: it creates an `AllReduceNode`, prints
`{"ready": port}`, optionally waits for a line "go" on stdin (so that every
host starts its rounds at once), runs `--threads` local threads over the keys
and prints one JSON line per thread: its results, or the error that stopped
it. Keys are `0 .. num_keys-1`, even keys bool and odd keys uint64, as the
preprocessing uses `2*batch` and `2*batch+1`.

    python allreduce_hosts.py --rank 0 --peers 127.0.0.1:5000,127.0.0.1:5001
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np

from parallel.allreduce import AllReduceNode

HERE = os.path.dirname(os.path.abspath(__file__))


def contributions(seed: int, rank: int, thread: int, num_keys: int) -> list[bool | int]:
    """The values thread `thread` of host `rank` contributes, per key.

    Sparse on purpose, so that the ORs are neither all False nor all ones:
    a bool is True with probability 0.1; a uint64 has 0-2 random bits set.
    """
    rng = np.random.default_rng([seed, rank, thread])
    flags = rng.random(num_keys) < 0.1
    bits = rng.integers(0, 64, size=(num_keys, 2))
    keep = rng.random((num_keys, 2)) < 0.5
    values: list[bool | int] = []
    for key in range(num_keys):
        if key % 2 == 0:
            values.append(bool(flags[key]))
        else:
            values.append(sum(1 << int(b) for b, k in zip(bits[key], keep[key]) if k))
    return values


def free_ports(count: int) -> list[int]:
    """Ports that were free a moment ago on 127.0.0.1."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class HostGroup:
    """Host processes on 127.0.0.1 running this script; killed on exit.

    Every read waits at most `timeout_s`: a hung host fails the test instead
    of hanging it.

    Args:
      world_size: N.
      threads: K per host.
      num_keys: keys per thread.
      seed: seed of the contributions.
      deadline_s: the nodes' deadline.
      timeout_s: the longest wait for any one line of a host.
      extra_args: per rank, more command-line arguments (e.g. a start delay).
    """

    def __init__(
        self,
        *,
        world_size: int,
        threads: int,
        num_keys: int,
        seed: int,
        deadline_s: float,
        timeout_s: float,
        extra_args: dict[int, list[str]] | None = None,
    ):
        self.peers = [f"127.0.0.1:{port}" for port in free_ports(world_size)]
        self.threads = threads
        self.timeout_s = timeout_s
        extra_args = extra_args or {}
        self.processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    os.path.join(HERE, "allreduce_hosts.py"),
                    f"--rank={rank}",
                    f"--peers={','.join(self.peers)}",
                    f"--threads={threads}",
                    f"--keys={num_keys}",
                    f"--seed={seed}",
                    f"--deadline={deadline_s}",
                    *extra_args.get(rank, []),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(world_size)
        ]
        self._lines = [queue.Queue() for _ in self.processes]
        for process, lines in zip(self.processes, self._lines):
            threading.Thread(target=_forward_lines, args=(process, lines), daemon=True).start()

    def read(self, rank: int) -> dict:
        """The next JSON line of host `rank`."""
        try:
            line = self._lines[rank].get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"host {rank} printed nothing for {self.timeout_s} s.") from None
        if line is None:
            code = self.processes[rank].wait(timeout=self.timeout_s)
            raise RuntimeError(f"host {rank} exited with code {code} before printing a line.")
        return json.loads(line)

    def go(self, ranks) -> None:
        """Waits until `ranks` are ready, then lets them start together."""
        for rank in ranks:
            ready = self.read(rank)
            if "ready" not in ready:
                raise RuntimeError(f"host {rank} printed {ready} instead of ready.")
        for rank in ranks:
            self.processes[rank].stdin.write("go\n")
            self.processes[rank].stdin.flush()

    def thread_lines(self, rank: int) -> list[dict]:
        """The K per-thread lines of host `rank`, by thread."""
        lines = []
        while len(lines) < self.threads:
            line = self.read(rank)
            if "thread" in line:
                lines.append(line)
        return sorted(lines, key=lambda line: line["thread"])

    def kill(self, rank: int) -> None:
        self.processes[rank].send_signal(signal.SIGKILL)
        self.processes[rank].wait(timeout=self.timeout_s)

    def __enter__(self) -> HostGroup:
        return self

    def __exit__(self, *exc_info) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=self.timeout_s)
            process.stdin.close()


def _forward_lines(process: subprocess.Popen, lines: queue.Queue) -> None:
    for line in process.stdout:
        lines.put(line)
    lines.put(None)


def _run_thread(node, thread: int, values, stop_after: int | None, out: list) -> None:
    results = []
    start = time.monotonic()
    try:
        for key, value in enumerate(values):
            if stop_after is not None and key == stop_after:
                out.append({"thread": thread, "stopped_at": key})
                return
            results.append(node.all_reduce(key, value))
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
        out.append(
            {
                "thread": thread,
                "error": type(e).__name__,
                "message": str(e),
                "key": len(results),
                "missing_ranks": list(getattr(e, "missing_ranks", [])),
                "elapsed_s": getattr(e, "elapsed_s", time.monotonic() - start),
            }
        )
        return
    out.append({"thread": thread, "results": results})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--peers", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keys", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=30.0)
    parser.add_argument("--start-delay", type=float, default=0.0, help="seconds before binding")
    parser.add_argument("--no-barrier", action="store_true", help="start without waiting for go")
    parser.add_argument("--stop-after", type=int, default=None, help="stop before this key")
    args = parser.parse_args()

    time.sleep(args.start_delay)
    node = AllReduceNode(
        args.rank,
        args.peers.split(","),
        local_contributors=args.threads,
        deadline_s=args.deadline,
    )
    print(json.dumps({"ready": node.port}), flush=True)
    if not args.no_barrier:
        sys.stdin.readline()
    out: list[dict] = []
    workers = [
        threading.Thread(
            target=_run_thread,
            args=(
                node,
                t,
                contributions(args.seed, args.rank, t, args.keys),
                args.stop_after,
                out,
            ),
        )
        for t in range(args.threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for line in out:
        print(json.dumps(line), flush=True)
    if args.stop_after is not None:
        time.sleep(3600)  # stays up, silent, until the test kills it
    node.close()


if __name__ == "__main__":
    main()
