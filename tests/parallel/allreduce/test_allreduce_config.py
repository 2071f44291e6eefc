"""Peer lists, the per-worker port convention and value checks."""

import pickle

import pytest

from parallel.allreduce import AllReduceConfig, agreement_port
from parallel.allreduce._config import split_address
from parallel.allreduce._values import ValueKind, as_bool, as_uint64, check_sync_key, infer


@pytest.mark.parametrize(
    "address, expected",
    [
        ("127.0.0.1:8470", ("127.0.0.1", 8470)),
        ("host-3.cluster:0", ("host-3.cluster", 0)),
        ("[::1]:65535", ("[::1]", 65535)),
    ],
)
def test_split_address(address, expected):
    assert split_address(address) == expected


@pytest.mark.parametrize("address", ["127.0.0.1", ":80", "host:", "host:http", "host:65536"])
def test_split_address_rejects(address):
    with pytest.raises(ValueError, match="host:port|65535"):
        split_address(address)


@pytest.mark.parametrize("base, worker, expected", [(9000, 0, 9000), (9000, 3, 9003)])
def test_agreement_port(base, worker, expected):
    assert agreement_port(base, worker) == expected


@pytest.mark.parametrize("base, worker", [(-1, 0), (9000, -1), (65535, 1)])
def test_agreement_port_rejects(base, worker):
    with pytest.raises(ValueError, match="base_port|65535"):
        agreement_port(base, worker)


def test_for_worker_shifts_every_port():
    config = AllReduceConfig(rank=1, peers=("a:9000", "b:9000", "[::1]:9100"), deadline_s=3)
    group = config.for_worker(2)
    assert group.peers == ("a:9002", "b:9002", "[::1]:9102")
    assert group.listen_port == 9002
    assert (group.rank, group.deadline_s) == (1, 3)
    assert AllReduceConfig(rank=0, peers=("a:9000",), port=7000).for_worker(1).port == 7001


def test_config_pickles():
    config = AllReduceConfig(rank=0, peers=["a:1", "b:2"], local_contributors=3)
    assert pickle.loads(pickle.dumps(config)) == config
    assert config.peers == ("a:1", "b:2") and config.world_size == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=0, peers=()), "non-empty"),
        (dict(rank=0, peers="a:1"), "non-empty"),
        (dict(rank=2, peers=("a:1", "b:2")), "rank 2 is outside"),
        (dict(rank=0, peers=("a:1", "a:1")), "same address"),
        (dict(rank=0, peers=("a:1",), port=70000), "port must be"),
        (dict(rank=0, peers=("a:1",), local_contributors=0), "local_contributors"),
        (dict(rank=0, peers=("a:1",), deadline_s=0), "deadline_s"),
        (dict(rank=0, peers=("a:1",), finished_window=0), "finished_window"),
    ],
)
def test_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AllReduceConfig(**kwargs)


def test_port_zero_may_repeat():
    assert AllReduceConfig(rank=0, peers=("127.0.0.1:0", "127.0.0.1:0")).listen_port == 0


@pytest.mark.parametrize(
    "value, kind, held",
    [(True, ValueKind.BOOL, 1), (False, ValueKind.BOOL, 0), (0, ValueKind.UINT64, 0)],
)
def test_infer(value, kind, held):
    assert infer(value) == (kind, held)


def test_numpy_values():
    np = pytest.importorskip("numpy")
    assert infer(np.bool_(True)) == (ValueKind.BOOL, 1)
    assert infer(np.uint64(2**64 - 1)) == (ValueKind.UINT64, 2**64 - 1)


@pytest.mark.parametrize(
    "check, value, error",
    [
        (as_bool, 1, TypeError),
        (as_uint64, True, TypeError),
        (as_uint64, 1.0, TypeError),
        (as_uint64, -1, ValueError),
        (as_uint64, 2**64, ValueError),
        (check_sync_key, -1, ValueError),
        (check_sync_key, "3", TypeError),
        (check_sync_key, True, TypeError),
    ],
)
def test_value_checks_reject(check, value, error):
    with pytest.raises(error, match=repr(value)[:3]):
        check(value)
