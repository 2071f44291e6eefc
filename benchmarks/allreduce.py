"""Cross-host all-reduce: round latency and a soak, against jax-tpu-embedding's.

Every host is a separate process on 127.0.0.1 (this script re-run with
`--child`); the parent picks the ports, waits until every host is up, starts
them together and collects one JSON line from each.

  * latency: one agreement round (bool and uint64 keys alternating, one
    contributor per host) repeated `--rounds` times for 2, 4 and 8 hosts;
    p50/p99 over every host's per-round times, and the CPU time one host
    spends per round (on one machine the hosts share its cores, so once
    hosts x CPU per round exceeds the cores, the round waits for CPU);
  * soak: 4 hosts x 4 threads over `--soak-keys` keys; rounds/s, and every
    thread's result checked against the OR of all inputs computed here
    (lost = keys a thread never got, mismatched = keys with a wrong result);
  * security: 4-host latency insecure, with the HMAC of a shared secret and
    with mutual TLS (`hmac_overhead_ratio`, `tls_overhead_ratio`: p50 over
    the insecure p50), then `--hostile-rounds` rounds of 4 hosts with HMAC
    and with TLS while a stranger (`_hostile.py`) holds 64 idle streams to
    host 0 and floods every host with forged values: lost and wrong rounds,
    p50/p99, the hosts' RSS growth and what their nodes dropped.

The peer, jax-tpu-embedding (optional extra `bench`), exposes its gRPC
all-reduce only inside its preprocessing, so one of its rounds is one
`preprocess_sparse_dense_matmul_input(..., enable_minibatching=True)` call on
a tiny batch (one flag round; a second round, the split, when a host's batch
breaks the limits); `jax_tpu_embedding_preprocess_only_p50_ms` is the same
call without the agreement. Its soak (4 hosts, its own internal contributor
threads) makes a random host break the limits in about 5% of the batches and
checks that all hosts agree on the number of minibatches; it runs at most
2,000 batches, because the peer leaks one OS thread per call and its hosts
crash after about 7,000 (`*_max_os_threads_per_host` shows it). Its sends do
not wait for a peer that is not up yet (the process crashes), so every host
starts its rounds only once all servers are up.

The last line printed is one JSON object.

    python benchmarks/allreduce.py [--rounds 400] [--soak-keys 10000] [--hostile-rounds 1000]
    python benchmarks/allreduce.py --security-only --rounds 50 --hostile-rounds 50  # a quick check
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _hostile import Stranger, write_secret, write_tls_dir

from parallel.allreduce import AllReduceNode, AllReduceSecurity

LATENCY_HOSTS = (2, 4, 8)
SOAK_HOSTS, SOAK_THREADS = 4, 4
WARMUP_ROUNDS = 30
DEADLINE_S = 120.0
LINE_TIMEOUT_S = 900.0
PEER_BATCH = 64
PEER_SC_PER_DEVICE = 2
PEER_LIMIT = 16
PEER_BREACH_PROBABILITY = 0.05
# The peer leaks one thread per preprocessing call with minibatching on
# (measured here: +1 OS thread per call, also on one host); at about 7,000
# calls per host the shared machine refuses new threads and the hosts crash,
# so its soak stops earlier.
PEER_SOAK_MAX_BATCHES = 2_000
SECURITY_HOSTS = 4
SECURITY_MODES = ("insecure", "hmac", "tls")
# The stranger stops by itself after this long, should the hosts hang.
HOSTILE_MAX_S = 600.0


def values(seed: int, rank: int, thread: int, num_keys: int) -> list[bool | int]:
    """Sparse inputs: even keys bool (True w.p. 0.1), odd keys one random bit or 0."""
    rng = np.random.default_rng([seed, rank, thread])
    flags = rng.random(num_keys) < 0.1
    bits = rng.integers(0, 64, num_keys)
    keep = rng.random(num_keys) < 0.3
    return [
        bool(flags[k]) if k % 2 == 0 else (1 << int(bits[k])) * int(keep[k])
        for k in range(num_keys)
    ]


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


# ---------------------------------------------------------------- children


def child_security(args: argparse.Namespace) -> AllReduceSecurity | None:
    directory = Path(args.security_dir or ".")
    if args.security == "hmac":
        return AllReduceSecurity(secret_file=directory / "secret", run_id="benchmark")
    if args.security == "tls":
        return AllReduceSecurity(tls_dir=directory / "tls", run_id="benchmark")
    return None


def child_ours(args: argparse.Namespace) -> dict:
    peers = args.peers.split(",")
    node = AllReduceNode(
        args.rank,
        peers,
        local_contributors=args.threads,
        deadline_s=DEADLINE_S,
        security=child_security(args),
    )
    ready_and_wait()
    rss = rss_mb()
    inputs = [values(args.seed, args.rank, t, args.keys) for t in range(args.threads)]
    out: list[dict] = [{} for _ in range(args.threads)]
    start, cpu = time.perf_counter(), time.process_time()
    workers = [
        threading.Thread(target=_ours_thread, args=(node, inputs[t], out[t]))
        for t in range(args.threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    os_threads = os_thread_count()
    rss_growth = rss_mb() - rss
    stats = dataclasses.asdict(node.stats())
    node.close()
    return {
        "elapsed_s": elapsed,
        "cpu_s": cpu,
        "os_threads": os_threads,
        "rss_growth_mb": rss_growth,
        "stats": stats,
        "threads": out,
    }


def _ours_thread(node: AllReduceNode, inputs: list, out: dict) -> None:
    results, times = [], []
    try:
        for key, value in enumerate(inputs):
            start = time.perf_counter()
            results.append(node.all_reduce(key, value))
            times.append(time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 - reported as lost keys
        out["error"] = f"{type(e).__name__}: {e}"
    out.update(results=results, times=times)


def child_peer(args: argparse.Namespace) -> dict:
    import jax  # the optional peer; imported only in its own host processes
    from jax_tpu_embedding.sparsecore.lib.nn import embedding as jte
    from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec as jte_spec

    world, rank = len(args.peers.split(",")), args.rank
    addresses = args.peers.split(",")
    port = int(addresses[rank].rpartition(":")[2])
    others = [a for r, a in enumerate(addresses) if r != rank]
    interface = jte.get_all_reduce_interface(others, port, rank, world)
    specs = {}
    for t in range(args.threads):
        table = jte_spec.TableSpec(
            vocabulary_size=4096,
            embedding_dim=8,
            initializer=jax.nn.initializers.zeros,
            optimizer=jte_spec.SGDOptimizerSpec(),
            combiner="sum",
            name=f"t{t}",
            max_ids_per_partition=PEER_LIMIT,
            max_unique_ids_per_partition=PEER_LIMIT,
        )
        specs[f"f{t}"] = jte_spec.FeatureSpec(
            name=f"f{t}",
            table_spec=table,
            input_shape=[PEER_BATCH, 1],
            output_shape=[PEER_BATCH, 8],
        )
    jte.prepare_feature_specs_for_training(specs, world, PEER_SC_PER_DEVICE)
    partitions = world * PEER_SC_PER_DEVICE
    spread = np.arange(PEER_BATCH, dtype=np.int32).reshape(-1, 1) % partitions
    # Every id in partition 0: 64 ids against a limit of 16.
    skewed = np.arange(PEER_BATCH, dtype=np.int32).reshape(-1, 1) * partitions * 7
    rng = np.random.default_rng([args.seed, rank])
    breach = rng.random(args.keys) < (PEER_BREACH_PROBABILITY if args.mode == "soak" else 0)

    def call(batch: int, minibatching: bool):
        ids = skewed if breach[batch] else spread
        features = {name: ids for name in specs}
        out, _ = jte.preprocess_sparse_dense_matmul_input(
            features,
            None,
            specs,
            1,
            world,
            num_sc_per_device=PEER_SC_PER_DEVICE,
            batch_number=batch,
            # The peer aborts the process on a partition still over the limit
            # after its split; only the agreement is measured here.
            allow_id_dropping=True,
            enable_minibatching=minibatching,
            all_reduce_interface=interface if minibatching else None,
        )
        return int(np.max(out.num_minibatches))

    ready_and_wait()
    times, minibatches = [], []
    start, cpu = time.perf_counter(), time.process_time()
    for batch in range(args.keys):
        t0 = time.perf_counter()
        minibatches.append(call(batch, True))
        times.append(time.perf_counter() - t0)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    os_threads = os_thread_count()
    baseline = []
    for batch in range(min(args.keys, 200)):
        t0 = time.perf_counter()
        call(batch, False)
        baseline.append(time.perf_counter() - t0)
    return {
        "elapsed_s": elapsed,
        "cpu_s": cpu,
        "os_threads": os_threads,
        "times": times,
        "baseline_times": baseline,
        "minibatches": minibatches,
        "breach": breach.tolist(),
    }


def os_thread_count() -> int:
    """Threads of this process, as the OS counts them."""
    return len(os.listdir("/proc/self/task"))


def rss_mb() -> float:
    """The resident memory of this process, in MiB."""
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kib / 1024


def ready_and_wait() -> None:
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()


# ------------------------------------------------------------------ parent


def run_group(
    kind: str,
    world: int,
    threads: int,
    keys: int,
    mode: str,
    seed: int,
    *,
    security: str = "insecure",
    security_dir: Path | None = None,
    stranger: dict | None = None,
) -> list[dict]:
    """Starts `world` hosts of `kind`, starts them together, returns their outputs.

    With `stranger` (a dict), a `Stranger` floods the hosts from the start
    of the rounds until they end; `stranger["forged"]` is set to what it sent.
    """
    ports = free_ports(world)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    logs = [tempfile.TemporaryFile("w+") for _ in range(world)]
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                f"--child={kind}",
                f"--rank={rank}",
                f"--peers={peers}",
                f"--threads={threads}",
                f"--keys={keys}",
                f"--mode={mode}",
                f"--seed={seed}",
                f"--security={security}",
                f"--security-dir={security_dir or ''}",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        for rank, log in enumerate(logs)
    ]
    lines = [queue.Queue() for _ in processes]
    for process, q in zip(processes, lines):
        threading.Thread(target=_forward, args=(process, q), daemon=True).start()
    flood = None
    try:
        for rank in range(world):
            _expect(lines[rank], rank, "ready")
        if stranger is not None:
            flood = Stranger(ports, keys, seed, HOSTILE_MAX_S)
            flood.start()
        for process in processes:
            process.stdin.write("go\n")
            process.stdin.flush()
        return [_expect(lines[rank], rank, "elapsed_s") for rank in range(world)]
    except (RuntimeError, queue.Empty) as e:
        time.sleep(2)  # lets the other hosts react to the failure before the report
        raise RuntimeError(f"{kind} hosts failed ({e}): {_report(processes, logs)}") from e
    finally:
        if flood is not None:
            stranger["forged"] = flood.stop()
        for process, log in zip(processes, logs):
            if process.poll() is None:
                process.kill()
            process.wait(timeout=60)
            log.close()


def _report(processes: list[subprocess.Popen], logs: list) -> str:
    """Each host's exit code and the last error line of its stderr."""
    parts = []
    for rank, (process, log) in enumerate(zip(processes, logs)):
        log.seek(0)
        errors = [line for line in log.read().splitlines() if line[:1] in "EF" or "Error" in line]
        last = errors[-1][-300:] if errors else "no error line"
        parts.append(f"host {rank}: exit {process.poll()}, {last}")
    return "; ".join(parts)


def _forward(process: subprocess.Popen, lines: queue.Queue) -> None:
    for line in process.stdout:
        lines.put(line)
    lines.put(None)


def _expect(lines: queue.Queue, rank: int, field: str) -> dict:
    line = lines.get(timeout=LINE_TIMEOUT_S)
    if line is None:
        raise RuntimeError(f"host {rank} exited before printing {field!r}")
    record = json.loads(line)
    if field not in record:
        raise RuntimeError(f"host {rank} printed {record} instead of {field!r}")
    return record


def percentiles_ms(times: list[float]) -> dict:
    ms = np.asarray(times) * 1e3
    p50, p99 = np.percentile(ms, [50, 99])
    return {"p50_ms": round(float(p50), 3), "p99_ms": round(float(p99), 3)}


def cpu_ms_per_round(outputs: list[dict], rounds: int) -> float:
    """Mean CPU time of one host per round (all its threads, gRPC's included)."""
    return round(statistics.mean(out["cpu_s"] for out in outputs) / rounds * 1e3, 3)


def latency_ours(world: int, rounds: int, seed: int) -> dict:
    outputs = run_group("ours", world, 1, WARMUP_ROUNDS + rounds, "latency", seed)
    times = [t for out in outputs for t in out["threads"][0]["times"][WARMUP_ROUNDS:]]
    cpu = cpu_ms_per_round(outputs, WARMUP_ROUNDS + rounds)
    return {**percentiles_ms(times), "cpu_ms_per_round_per_host": cpu}


def latency_peer(world: int, rounds: int, seed: int) -> tuple[dict, float]:
    outputs = run_group("peer", world, 1, WARMUP_ROUNDS + rounds, "latency", seed)
    times = [t for out in outputs for t in out["times"][WARMUP_ROUNDS:]]
    baseline = [t for out in outputs for t in out["baseline_times"][WARMUP_ROUNDS:]]
    cpu = cpu_ms_per_round(outputs, WARMUP_ROUNDS + rounds)
    figures = {**percentiles_ms(times), "cpu_ms_per_round_per_host": cpu}
    return figures, statistics.median(baseline) * 1e3


def security_latency(modes: tuple[str, ...], rounds: int, seed: int, directory: Path) -> dict:
    """4-host p50/p99 per security mode, and each mode's p50 over the insecure one."""
    result = {}
    for mode in modes:
        outputs = run_group(
            "ours",
            SECURITY_HOSTS,
            1,
            WARMUP_ROUNDS + rounds,
            "latency",
            seed,
            security=mode,
            security_dir=directory,
        )
        times = [t for out in outputs for t in out["threads"][0]["times"][WARMUP_ROUNDS:]]
        for name, value in percentiles_ms(times).items():
            result[f"{SECURITY_HOSTS}_hosts_{mode}_{name}"] = value
    insecure = result[f"{SECURITY_HOSTS}_hosts_insecure_p50_ms"]
    for mode in modes[1:]:
        ratio = result[f"{SECURITY_HOSTS}_hosts_{mode}_p50_ms"] / insecure
        result[f"{mode}_overhead_ratio"] = round(ratio, 3)
    return result


def hostile(mode: str, rounds: int, seed: int, directory: Path) -> dict:
    """`rounds` rounds of 4 hosts secured by `mode` while a stranger floods them."""
    keys = WARMUP_ROUNDS + rounds
    stranger: dict = {}
    outputs = run_group(
        "ours",
        SECURITY_HOSTS,
        1,
        keys,
        "latency",
        seed,
        security=mode,
        security_dir=directory,
        stranger=stranger,
    )
    inputs = [values(seed, rank, 0, keys) for rank in range(SECURITY_HOSTS)]
    expected = [functools.reduce(lambda a, b: a | b, column) for column in zip(*inputs)]
    threads = [out["threads"][0] for out in outputs]
    lost = sum(keys - len(thread["results"]) for thread in threads)
    wrong = sum(a != b for t in threads for a, b in zip(t["results"], expected))
    times = [t for thread in threads for t in thread["times"][WARMUP_ROUNDS:]]
    prefix = f"hostile_{mode}"
    return {
        **{f"{prefix}_{name}": value for name, value in percentiles_ms(times).items()},
        f"{prefix}_lost_rounds": lost,
        f"{prefix}_wrong_rounds": wrong,
        f"{prefix}_forged_messages": stranger.get("forged", 0),
        f"{prefix}_max_rss_growth_mb": round(max(o["rss_growth_mb"] for o in outputs), 1),
        f"{prefix}_auth_failed": sum(o["stats"]["auth_failed"] for o in outputs),
        f"{prefix}_streams_ended": sum(o["stats"]["streams_ended"] for o in outputs),
        **({f"{prefix}_errors": [t["error"] for t in threads if "error" in t][:3]}
           if any("error" in t for t in threads) else {}),
    }  # fmt: skip


def security_figures(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        write_secret(directory)
        tls = write_tls_dir(directory / "tls", SECURITY_HOSTS) is not None
        modes = SECURITY_MODES if tls else ("insecure", "hmac")
        result = {} if tls else {"tls": "skipped: the cryptography package is not installed"}
        result.update(security_latency(modes, args.rounds, args.seed, directory))
        for mode in modes[1:]:
            result.update(hostile(mode, args.hostile_rounds, args.seed, directory))
    result["hostile_rounds"] = args.hostile_rounds
    return result


def soak_ours(keys: int, seed: int) -> dict:
    outputs = run_group("ours", SOAK_HOSTS, SOAK_THREADS, keys, "soak", seed)
    inputs = [values(seed, r, t, keys) for r in range(SOAK_HOSTS) for t in range(SOAK_THREADS)]
    expected = [functools.reduce(lambda a, b: a | b, column) for column in zip(*inputs)]
    lost = mismatched = 0
    errors = []
    for out in outputs:
        for thread in out["threads"]:
            results = thread["results"]
            lost += keys - len(results)
            mismatched += sum(a != b for a, b in zip(results, expected))
            if "error" in thread:
                errors.append(thread["error"])
    elapsed = max(out["elapsed_s"] for out in outputs)
    return {
        "soak_rounds_per_s": round(keys / elapsed, 1),
        "soak_lost_keys": lost,
        "soak_mismatched_keys": mismatched,
        "soak_max_os_threads_per_host": max(out["os_threads"] for out in outputs),
        **({"soak_errors": errors[:3]} if errors else {}),
    }


def soak_peer(keys: int, seed: int) -> dict:
    keys = min(keys, PEER_SOAK_MAX_BATCHES)
    outputs = run_group("peer", SOAK_HOSTS, SOAK_THREADS, keys, "soak", seed)
    any_breach = np.any([out["breach"] for out in outputs], axis=0)
    counts = np.array([out["minibatches"] for out in outputs])
    disagree = int(np.sum(np.any(counts != counts[0], axis=0)))
    wrong = int(np.sum((counts[0] > 1) != any_breach))
    elapsed = max(out["elapsed_s"] for out in outputs)
    return {
        "jax_tpu_embedding_soak_rounds_per_s": round(keys / elapsed, 1),
        "jax_tpu_embedding_soak_batches": keys,
        "jax_tpu_embedding_soak_max_os_threads_per_host": max(o["os_threads"] for o in outputs),
        "jax_tpu_embedding_soak_batches_with_breach": int(any_breach.sum()),
        "jax_tpu_embedding_soak_disagreeing_batches": disagree,
        "jax_tpu_embedding_soak_wrong_minibatching": wrong,
    }


def peer_figures(args: argparse.Namespace) -> dict:
    """The peer's latency and soak figures; a run that crashes is reported, not raised."""
    result = {}
    for world in LATENCY_HOSTS:
        try:
            figures, baseline = latency_peer(world, args.rounds, args.seed)
        except RuntimeError as e:
            result[f"jax_tpu_embedding_{world}_hosts_failed"] = str(e)
            continue
        for name, value in figures.items():
            result[f"jax_tpu_embedding_{world}_hosts_{name}"] = value
        result[f"jax_tpu_embedding_{world}_hosts_preprocess_only_p50_ms"] = round(baseline, 3)
    try:
        result.update(soak_peer(args.soak_keys, args.seed))
    except RuntimeError as e:
        result["jax_tpu_embedding_soak_failed"] = str(e)
    return result


def peer_available() -> str | None:
    """None if jax-tpu-embedding imports, else why not."""
    try:
        from jax_tpu_embedding.sparsecore.lib.nn import embedding  # noqa: F401
    except ImportError as e:
        return f"not installed (make bench-env): {e}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--soak-keys", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hostile-rounds", type=int, default=1_000)
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument(
        "--security-only", action="store_true", help="only the security and hostile-peer runs"
    )
    parser.add_argument("--child", choices=["ours", "peer"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--peers", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--keys", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["latency", "soak"], help=argparse.SUPPRESS)
    parser.add_argument("--security", choices=SECURITY_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--security-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child = child_ours if args.child == "ours" else child_peer
        print(json.dumps(child(args)), flush=True)
        return

    result = {
        "benchmark": "allreduce",
        "note": "loopback, hosts as processes on one shared, loaded 2-core machine",
        "rounds": args.rounds,
    }
    if args.security_only:
        result.update(security_figures(args))
        result.update(security_targets(result))
        print(json.dumps(result))
        return
    for world in LATENCY_HOSTS:
        for name, value in latency_ours(world, args.rounds, args.seed).items():
            result[f"{world}_hosts_{name}"] = value
    result.update(soak_ours(args.soak_keys, args.seed))
    result["soak_hosts"], result["soak_threads"], result["soak_keys"] = (
        SOAK_HOSTS,
        SOAK_THREADS,
        args.soak_keys,
    )
    why_not = "skipped (--skip-peer)" if args.skip_peer else peer_available()
    if why_not:
        result["jax_tpu_embedding"] = why_not
    else:
        result.update(peer_figures(args))
    if "jax_tpu_embedding_soak_rounds_per_s" in result:
        result["ratio_vs_jax_tpu_embedding"] = round(
            result["soak_rounds_per_s"] / result["jax_tpu_embedding_soak_rounds_per_s"], 3
        )
    result["target_4_hosts_p50_lt_2ms"] = result["4_hosts_p50_ms"] < 2
    result["target_4_hosts_p99_lt_10ms"] = result["4_hosts_p99_ms"] < 10
    result.update(security_figures(args))
    result.update(security_targets(result))
    print(json.dumps(result))


def security_targets(result: dict) -> dict:
    """Every hostile round correct; 4-host p50 with HMAC < 2 ms, with TLS < 3 ms."""
    targets = {}
    for mode, limit_ms in (("hmac", 2), ("tls", 3)):
        if f"hostile_{mode}_lost_rounds" in result:
            lost = result[f"hostile_{mode}_lost_rounds"] + result[f"hostile_{mode}_wrong_rounds"]
            targets[f"target_hostile_{mode}_every_round_correct"] = lost == 0
        if f"4_hosts_{mode}_p50_ms" in result:
            p50 = result[f"4_hosts_{mode}_p50_ms"]
            targets[f"target_4_hosts_{mode}_p50_lt_{limit_ms}ms"] = p50 < limit_ms
    return targets


if __name__ == "__main__":
    main()
