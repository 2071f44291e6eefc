"""The shared-secret HMAC: a stranger without the secret cannot speak for a rank."""

import dataclasses

import groups
import grpc
import pytest

from parallel.allreduce import AllReduceNode, AllReduceSecurity
from parallel.allreduce import allreduce_pb2 as pb
from parallel.allreduce._auth import MessageAuthenticator, read_secret
from parallel.allreduce._codec import Contribution
from parallel.allreduce._rpc import AllReduceStub
from parallel.allreduce._values import ValueKind

RPC_TIMEOUT_S = 20
SECRET = b"0123456789abcdef-the-run-secret"
CONTRIBUTION = Contribution(sync_key=42, src_rank=1, kind=ValueKind.UINT64, value=0x2)


def stranger_sends(node, **fields):
    """One unary `ContributeData` to `node`; the status code it got."""
    with grpc.insecure_channel(f"127.0.0.1:{node.port}") as channel:
        try:
            AllReduceStub(channel).ContributeData(pb.AllReduceData(**fields), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    "value",
    [{"uint64_val": 0xFFFF}, {"bool_val": True}],
    ids=["same kind", "other kind"],
)
def test_a_stranger_before_the_real_rank_changes_nothing(make_group, secret_file, value):
    nodes = make_group(2, security=AllReduceSecurity(secret_file=secret_file, run_id="run-a"))
    code = stranger_sends(nodes[0], sync_key=42, src_rank=1, **value)
    assert code is grpc.StatusCode.UNAUTHENTICATED
    assert groups.all_reduce_together(nodes, 42, [0x1, 0x2]) == [0x3, 0x3]
    stats = nodes[0].stats()
    assert (stats.auth_failed, stats.completed, stats.failed) == (1, 1, 0)


def test_a_message_signed_with_another_secret_is_dropped(make_group, secret_file):
    nodes = make_group(2, security=AllReduceSecurity(secret_file=secret_file, run_id="run-a"))
    forged = MessageAuthenticator(b"another-secret-0123456789", "run-a").sign(CONTRIBUTION)
    code = stranger_sends(nodes[0], sync_key=42, src_rank=1, uint64_val=0xFFFF, mac=forged)
    assert code is grpc.StatusCode.UNAUTHENTICATED
    assert groups.all_reduce_together(nodes, 42, [0x1, 0x2]) == [0x3, 0x3]


def test_a_message_of_another_run_is_dropped(make_group, secret_file, caplog):
    nodes = make_group(2, security=AllReduceSecurity(secret_file=secret_file, run_id="run-a"))
    signed = MessageAuthenticator(read_secret(secret_file), "run-b").sign(CONTRIBUTION)
    code = stranger_sends(nodes[0], sync_key=42, src_rank=1, uint64_val=0x2, mac=signed)
    assert code is grpc.StatusCode.UNAUTHENTICATED
    assert "its HMAC does not match" in caplog.text
    assert nodes[0].stats().auth_failed == 1 and nodes[0].stats().pending == 0


@pytest.mark.parametrize(
    "change",
    [
        {"sync_key": 43},
        {"src_rank": 2},
        {"value": 0x3},
        {"kind": ValueKind.BOOL, "value": 0},
    ],
)
def test_the_hmac_covers_every_field(change):
    authenticator = MessageAuthenticator(SECRET, "run-a")
    mac = authenticator.sign(CONTRIBUTION)
    assert authenticator.verify(CONTRIBUTION, mac)
    assert not authenticator.verify(dataclasses.replace(CONTRIBUTION, **change), mac)
    assert not MessageAuthenticator(SECRET, "run-b").verify(CONTRIBUTION, mac)


def test_worker_groups_have_their_own_run_ids(secret_file):
    security = AllReduceSecurity(secret_file=secret_file, run_id="run-a")
    assert [security.for_worker(w).run_id for w in (0, 1)] == ["run-a/worker-0", "run-a/worker-1"]


@pytest.mark.parametrize(
    "content, match", [(b"short\n", "has 5 bytes; use at least 16"), (None, "Cannot read")]
)
def test_a_bad_secret_file_is_a_clear_error(tmp_path, content, match):
    path = tmp_path / "secret"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        AllReduceNode(
            0, ["127.0.0.1:0", "127.0.0.1:1"], port=0, security=AllReduceSecurity(secret_file=path)
        )


def test_security_needs_a_tls_dir_or_a_secret():
    with pytest.raises(ValueError, match="needs tls_dir, secret_file or both"):
        AllReduceSecurity(run_id="run-a")
