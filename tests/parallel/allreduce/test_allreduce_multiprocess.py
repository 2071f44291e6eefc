"""Hosts as separate processes on 127.0.0.1: agreement, a killed host, a late host."""

import functools

import numpy as np
from allreduce_hosts import HostGroup, contributions

# Generous for a loaded 2-core machine; the faults tests wait for them on purpose.
LINE_TIMEOUT_S = 90
KILL_DEADLINE_S = 6.0
# The late host binds its port this long after the others started sending to it.
LATE_START_S = 3.0


def expected_or(seed, world, threads, num_keys):
    """OR per key over every thread of every host, from the raw contributions."""
    values = np.array(
        [contributions(seed, r, t, num_keys) for r in range(world) for t in range(threads)],
        dtype=object,
    )
    return [functools.reduce(lambda a, b: a | b, values[:, key]) for key in range(num_keys)]


def test_every_thread_of_every_host_sees_the_same_or():
    world, threads, keys, seed = 4, 2, 200, 11
    with HostGroup(
        world_size=world,
        threads=threads,
        num_keys=keys,
        seed=seed,
        deadline_s=60,
        timeout_s=LINE_TIMEOUT_S,
    ) as group:
        group.go(range(world))
        lines = {rank: group.thread_lines(rank) for rank in range(world)}
    expected = expected_or(seed, world, threads, keys)
    # The inputs are mixed enough for the check to mean something.
    assert 0 < sum(expected[::2]) < keys // 2
    assert len(set(expected[1::2])) > 10
    for rank in range(world):
        assert [line.get("results") for line in lines[rank]] == [expected] * threads, lines[rank]


def test_a_killed_host_fails_the_others_within_the_deadline():
    world, threads, keys, stop = 4, 2, 60, 25
    with HostGroup(
        world_size=world,
        threads=threads,
        num_keys=keys,
        seed=3,
        deadline_s=KILL_DEADLINE_S,
        timeout_s=LINE_TIMEOUT_S,
        extra_args={3: [f"--stop-after={stop}"]},
    ) as group:
        group.go(range(world))
        assert [line["stopped_at"] for line in group.thread_lines(3)] == [stop] * threads
        group.kill(3)
        by_rank = {rank: group.thread_lines(rank) for rank in range(3)}
    # Host 3 finished key stop-1 itself, but its value for that key may still
    # have been on the way to a peer when it was killed: that peer then stops
    # at stop-1, and a peer that got it waits at `stop` for host 3 and for
    # the peers stuck at stop-1.
    for thread in range(threads):
        lines = {rank: by_rank[rank][thread] for rank in by_rank}
        stuck_early = {rank for rank, line in lines.items() if line["key"] == stop - 1}
        for rank, line in lines.items():
            assert line["error"] == "AllReduceTimeoutError", line
            assert line["key"] in (stop - 1, stop), line
            expected = [3] if line["key"] == stop - 1 else sorted(stuck_early | {3})
            assert line["missing_ranks"] == expected, (rank, thread, line, stuck_early)
            assert f"sync key {line['key']} timed out" in line["message"]
            assert group.peers[3] in line["message"]
    for line in (line for lines in by_rank.values() for line in lines):
        # Bounded: the deadline, plus slack for a loaded machine, never a hang.
        assert KILL_DEADLINE_S <= line["elapsed_s"] < KILL_DEADLINE_S + 30


def test_a_host_that_starts_late_within_the_deadline_still_agrees():
    world, threads, keys, seed = 3, 2, 20, 5
    with HostGroup(
        world_size=world,
        threads=threads,
        num_keys=keys,
        seed=seed,
        deadline_s=60,
        timeout_s=LINE_TIMEOUT_S,
        extra_args={2: [f"--start-delay={LATE_START_S}", "--no-barrier"]},
    ) as group:
        group.go(range(2))
        lines = {rank: group.thread_lines(rank) for rank in range(world)}
    expected = expected_or(seed, world, threads, keys)
    for rank in range(world):
        assert [line.get("results") for line in lines[rank]] == [expected] * threads, lines[rank]
