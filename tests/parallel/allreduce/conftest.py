"""Fixtures of the all-reduce tests: secrets, TLS directories, in-process groups."""

import certificates
import pytest

from parallel.allreduce import AllReduceNode, bind_server


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text("a-secret-of-the-test-run-0123456789\n")
    return path


@pytest.fixture
def tls_dir(tmp_path):
    return certificates.write_tls_dir(tmp_path / "tls", 3)


@pytest.fixture
def make_group():
    """Creates groups of nodes on 127.0.0.1; every node is closed at teardown.

    Call as `make_group(world, security=..., deadline_s=...)`; returns the nodes.
    """
    nodes = []

    def make(world, *, security=None, deadline_s=20.0, **options):
        servers = [
            bind_server(
                0,
                host="127.0.0.1",
                credentials=None if security is None else security.server_credentials(rank),
            )
            for rank in range(world)
        ]
        peers = [f"127.0.0.1:{server.port}" for server in servers]
        for rank in range(world):
            nodes.append(
                AllReduceNode(
                    rank,
                    peers,
                    servers[rank],
                    security=security,
                    deadline_s=deadline_s,
                    **options,
                )
            )
        return nodes[-world:]

    yield make
    for node in nodes:
        node.close(grace_s=0)
