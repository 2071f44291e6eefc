"""Mutual TLS: only holders of a rank's certificate speak for that rank."""

import certificates
import groups
import grpc
import pytest

from parallel.allreduce import AllReduceNode, AllReduceSecurity, bind_server
from parallel.allreduce import allreduce_pb2 as pb
from parallel.allreduce._rpc import AllReduceStub
from parallel.allreduce._tls import TlsFiles, channel_options, rank_of_identities

RPC_TIMEOUT_S = 5


def contribute_as(node, tls_dir, cert_rank, **fields):
    """A unary `ContributeData` to `node` with rank `cert_rank`'s certificate; its status."""
    files = TlsFiles.read(tls_dir, cert_rank)
    options = channel_options(node.rank)
    address = f"127.0.0.1:{node.port}"
    with grpc.secure_channel(address, files.channel_credentials(), options=options) as channel:
        try:
            AllReduceStub(channel).ContributeData(pb.AllReduceData(**fields), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_tls_group_reduces(make_group, tls_dir):
    nodes = make_group(3, security=AllReduceSecurity(tls_dir=tls_dir))
    assert groups.all_reduce_together(nodes, 7, [0x1, 0x2, 0x4]) == [0x7] * 3
    assert groups.all_reduce_together(nodes, 8, [False, True, False]) == [True] * 3


def test_a_certificate_speaks_only_for_its_rank(make_group, tls_dir):
    nodes = make_group(3, security=AllReduceSecurity(tls_dir=tls_dir))
    code = contribute_as(nodes[0], tls_dir, 2, sync_key=42, src_rank=1, uint64_val=0xFFFF)
    assert code is grpc.StatusCode.UNAUTHENTICATED
    assert groups.all_reduce_together(nodes, 42, [0x1, 0x2, 0x4]) == [0x7] * 3
    assert nodes[0].stats().auth_failed == 1


def test_a_client_without_a_certificate_is_refused(make_group, tls_dir):
    node = make_group(2, security=AllReduceSecurity(tls_dir=tls_dir))[0]
    ca = (tls_dir / "ca.crt").read_bytes()
    credentials = grpc.ssl_channel_credentials(root_certificates=ca)
    address = f"127.0.0.1:{node.port}"
    with grpc.secure_channel(address, credentials, options=channel_options(0)) as channel:
        with pytest.raises(grpc.RpcError) as info:
            AllReduceStub(channel).ContributeData(
                pb.AllReduceData(sync_key=1, src_rank=1, bool_val=True), timeout=RPC_TIMEOUT_S
            )
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert node.stats().pending == 0


def test_a_certificate_of_another_ca_is_refused(make_group, tls_dir, tmp_path):
    node = make_group(2, security=AllReduceSecurity(tls_dir=tls_dir))[0]
    other = certificates.write_tls_dir(tmp_path / "other", 2)
    (other / "ca.crt").write_bytes((tls_dir / "ca.crt").read_bytes())  # trusts our server
    code = contribute_as(node, other, 1, sync_key=1, src_rank=1, bool_val=True)
    assert code is grpc.StatusCode.UNAVAILABLE
    assert node.stats().pending == 0


def test_a_server_must_hold_the_certificate_of_its_rank(make_group, tls_dir, tmp_path):
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    for name in ("ca.crt", "rank-1.crt", "rank-1.key"):
        (swapped / name).write_bytes((tls_dir / name).read_bytes())
    for suffix in ("crt", "key"):  # rank 0 serves with rank 1's certificate
        (swapped / f"rank-0.{suffix}").write_bytes((tls_dir / f"rank-1.{suffix}").read_bytes())
    impostor = make_group(2, security=AllReduceSecurity(tls_dir=swapped))[0]
    code = contribute_as(impostor, tls_dir, 1, sync_key=1, src_rank=1, bool_val=True)
    assert code is grpc.StatusCode.UNAVAILABLE
    assert impostor.stats().pending == 0


@pytest.mark.parametrize(
    "identities, rank",
    [
        ([b"allreduce-rank-3"], 3),
        ([b"allreduce-rank-3", b"host.example"], 3),
        ([b"allreduce-rank-1", b"allreduce-rank-2"], None),
        ([b"allreduce-rank-x"], None),
        (None, None),
    ],
)
def test_rank_of_identities(identities, rank):
    assert rank_of_identities(identities) == rank


def test_a_missing_tls_file_is_a_clear_error(tls_dir):
    (tls_dir / "rank-0.key").unlink()
    with pytest.raises(ValueError, match="rank-0.key"):
        AllReduceNode(
            0, ["127.0.0.1:0", "127.0.0.1:1"], port=0, security=AllReduceSecurity(tls_dir=tls_dir)
        )


def test_a_server_bound_without_tls_is_refused_for_a_tls_node(tls_dir):
    server = bind_server(0, host="127.0.0.1")
    with pytest.raises(ValueError, match="bound without TLS credentials"):
        AllReduceNode(
            0, ["127.0.0.1:0", "127.0.0.1:1"], server, security=AllReduceSecurity(tls_dir=tls_dir)
        )


def test_a_certificate_naming_no_rank_is_refused(make_group, tmp_path):
    names = ["allreduce-rank-0", "allreduce-rank-1", "host-x"]  # one CA signs all three
    tls_dir = certificates.write_tls_dir(tmp_path / "tls", 3, names=names)
    node = make_group(2, security=AllReduceSecurity(tls_dir=tls_dir))[0]
    code = contribute_as(node, tls_dir, 2, sync_key=1, src_rank=1, bool_val=True)
    assert code is grpc.StatusCode.UNAUTHENTICATED
    assert node.stats().pending == 0
