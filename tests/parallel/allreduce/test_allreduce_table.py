"""The per-key reduction state, without networking."""

import functools
import random
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel.allreduce import AllReduceClosedError, AllReducePeerError, AllReduceTimeoutError
from parallel.allreduce._codec import Contribution
from parallel.allreduce._table import PeerOutcome, ReductionTable
from parallel.allreduce._values import ValueKind

PEERS = ("h0:1", "h1:1", "h2:1", "h3:1")


def make_table(
    rank=0, peers=PEERS, k=2, deadline_s=30.0, window=16, pending_limit=1024, key_window=2**16
):
    return ReductionTable(
        rank=rank,
        peers=peers,
        local_contributors=k,
        deadline_s=deadline_s,
        finished_window=window,
        pending_limit=pending_limit,
        key_window=key_window,
    )


def peer(key, src, value, kind=ValueKind.UINT64):
    return Contribution(sync_key=key, src_rank=src, kind=kind, value=value)


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 5),
    k=st.integers(1, 4),
    data=st.data(),
)
def test_result_is_the_or_in_any_arrival_order(world, k, data):
    peers = tuple(f"h{r}:1" for r in range(world))
    table = make_table(rank=0, peers=peers, k=k)
    local = data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=k, max_size=k))
    remote = data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=world - 1, max_size=world - 1))
    events = [("local", v) for v in local] + [("peer", (r + 1, v)) for r, v in enumerate(remote)]
    events = data.draw(st.permutations(events))
    sent = []
    for what, payload in events:
        if what == "local":
            sent.append(table.add_local(9, ValueKind.UINT64, payload))
        else:
            assert table.add_peer(peer(9, *payload)) is PeerOutcome.ACCEPTED
    expected = int(np.bitwise_or.reduce(np.array(local + remote, dtype=np.uint64)))
    # Only the K-th local contribution hands the host's value to the sender.
    assert sent[:-1] == [None] * (k - 1)
    assert sent[-1] == int(np.bitwise_or.reduce(np.array(local, dtype=np.uint64)))
    assert table.wait(9) == (ValueKind.UINT64, expected)
    assert table.counts()["completed"] == 1 and table.counts()["pending"] == 0


def test_k_threads_block_until_the_last_contribution():
    table = make_table(peers=("h0:1",), k=4)
    values = [True, False, False, False]
    results = {}

    def contribute(t):
        table.add_local(3, ValueKind.BOOL, int(values[t]))
        results[t] = table.wait(3)

    threads = [threading.Thread(target=contribute, args=(t,)) for t in range(4)]
    random.Random(0).shuffle(threads)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == {t: (ValueKind.BOOL, 1) for t in range(4)}


def test_duplicates_and_late_messages_are_ignored_and_counted():
    table = make_table(peers=PEERS[:2], k=1)
    assert table.add_peer(peer(5, 1, 0b01)) is PeerOutcome.ACCEPTED
    assert table.add_peer(peer(5, 1, 0b10)) is PeerOutcome.DUPLICATE
    table.add_local(5, ValueKind.UINT64, 0b100)
    assert table.add_peer(peer(5, 1, 0b1000)) is PeerOutcome.LATE
    assert table.wait(5) == (ValueKind.UINT64, 0b101)
    counts = table.counts()
    assert (counts["duplicates_ignored"], counts["late_ignored"]) == (1, 1)


def test_finished_keys_are_remembered_in_a_bounded_window():
    table = make_table(peers=PEERS[:2], k=1, window=3)
    for key in range(10):
        table.add_peer(peer(key, 1, 1))
        table.add_local(key, ValueKind.UINT64, 0)
    assert len(table._finished) == 3
    assert table.add_peer(peer(9, 1, 1)) is PeerOutcome.LATE
    assert table.add_peer(peer(7, 1, 1)) is PeerOutcome.LATE
    # Key 0 fell out of the window: its message starts a new round.
    assert table.add_peer(peer(0, 1, 1)) is PeerOutcome.ACCEPTED


def test_more_than_k_local_contributions_is_an_error():
    table = make_table(peers=("h0:1",), k=1)
    table.add_local(1, ValueKind.BOOL, 1)
    with pytest.raises(ValueError, match="already had its 1 local contributions"):
        table.add_local(1, ValueKind.BOOL, 0)


def test_local_kind_mismatch():
    table = make_table(k=2)
    table.add_local(1, ValueKind.BOOL, 1)
    with pytest.raises(TypeError, match="sync key 1 holds bool values; got a uint64"):
        table.add_local(1, ValueKind.UINT64, 4)


def test_peer_kind_mismatch_fails_the_key():
    table = make_table(k=1)
    table.add_local(4, ValueKind.BOOL, 1)
    with pytest.raises(ValueError, match="rank 2 sent a uint64 value for sync key 4"):
        table.add_peer(peer(4, 2, 7))
    with pytest.raises(AllReducePeerError, match="rank 2 sent a uint64") as info:
        table.wait(4)
    assert (info.value.peer_rank, info.value.sync_key) == (2, 4)


def test_timeout_names_the_missing_ranks_on_every_waiter():
    table = make_table(rank=1, k=2, deadline_s=0.3)
    table.add_peer(peer(8, 2, 1))
    errors = []

    def wait():
        # A thread that comes after the first timeout gets the same error at once.
        with pytest.raises(AllReduceTimeoutError) as info:
            table.add_local(8, ValueKind.UINT64, 1)
            table.wait(8)
        errors.append(info.value)

    threads = [threading.Thread(target=wait) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(errors) == 2 and errors[0] is not errors[1]
    for error in errors:
        assert error.missing_ranks == (0, 3)
        assert "peer rank(s) 0 (h0:1), 3 (h3:1)" in str(error)
        assert "sync key 8" in str(error) and error.elapsed_s >= 0.3
    # A key that timed out stays failed; its late messages are ignored.
    with pytest.raises(AllReduceTimeoutError):
        table.add_local(8, ValueKind.UINT64, 1)
    assert table.add_peer(peer(8, 0, 1)) is PeerOutcome.LATE


def test_timeout_reports_missing_local_contributions():
    table = make_table(peers=("h0:1",), k=3, deadline_s=0.1)
    table.add_local(2, ValueKind.BOOL, 0)
    with pytest.raises(AllReduceTimeoutError, match="2 of 3 local contribution") as info:
        table.wait(2)
    assert info.value.missing_ranks == () and info.value.missing_local == 2


def test_close_fails_waiters_and_later_calls():
    table = make_table(k=1)
    table.add_local(1, ValueKind.BOOL, 1)
    errors = []
    waiter = threading.Thread(
        target=functools.partial(_capture, errors, table.wait, 1), name="waiter"
    )
    waiter.start()
    table.close()
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert isinstance(errors[0], AllReduceClosedError) and "was closed" in str(errors[0])
    with pytest.raises(AllReduceClosedError):
        table.add_local(2, ValueKind.BOOL, 1)
    with pytest.raises(AllReduceClosedError):
        table.add_peer(peer(3, 1, 1))


def test_fail_reports_whether_the_key_was_pending():
    table = make_table(k=1)
    table.add_local(1, ValueKind.BOOL, 1)

    def error():
        return AllReducePeerError("peer said no", sync_key=1, rank=0, peer_rank=3)

    assert table.fail(1, error)
    assert not table.fail(1, error)
    with pytest.raises(AllReducePeerError, match="peer said no"):
        table.wait(1)


def _capture(errors, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        errors.append(e)


def test_a_peer_key_far_from_the_local_rounds_is_rejected():
    table = make_table(k=1, key_window=100)
    table.add_local(1000, ValueKind.UINT64, 1)
    assert table.add_peer(peer(1100, 1, 1)) is PeerOutcome.ACCEPTED
    assert table.add_peer(peer(900, 1, 1)) is PeerOutcome.ACCEPTED
    with pytest.raises(ValueError, match="more than 100 keys away from the latest key"):
        table.add_peer(peer(1101, 1, 1))
    assert table.counts()["pending"] == 3


def test_keys_only_peers_started_are_bounded_and_expire():
    table = make_table(k=1, deadline_s=0.2, pending_limit=2)
    table.add_peer(peer(1, 1, 1))
    table.add_peer(peer(2, 1, 1))
    with pytest.raises(ValueError, match="already holds 2 keys that only peers have started"):
        table.add_peer(peer(3, 1, 1))
    table.add_local(2, ValueKind.UINT64, 1)  # a local round holds on to key 2
    time.sleep(0.3)
    assert table.add_peer(peer(3, 1, 1)) is PeerOutcome.ACCEPTED
    counts = table.counts()
    assert (counts["expired"], counts["pending"]) == (1, 2)  # key 1 went, key 2 stayed
