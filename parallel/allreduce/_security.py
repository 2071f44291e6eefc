"""How the hosts of a group prove who they are: mutual TLS, a shared secret, or both.

`AllReduceSecurity` holds only paths and the run id, so that it pickles into
worker processes; each node reads the files where it runs (`load`). Without
one, a group runs insecure: any process that reaches a port can speak for a
rank, which is only acceptable on loopback (tests, one machine).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc

from parallel.allreduce._auth import MessageAuthenticator, read_secret
from parallel.allreduce._tls import TlsFiles


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerCredentials:
    """What a node loaded: TLS files and/or the message authenticator."""

    tls: TlsFiles | None
    authenticator: MessageAuthenticator | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllReduceSecurity:
    """The authentication of a group; picklable, the same on every host.

    Attributes:
      tls_dir: directory with `ca.crt`, `rank-<r>.crt` and `rank-<r>.key`
        (see `parallel.allreduce._tls`): mutual TLS, each rank tied to the
        identity `allreduce-rank-<r>` of its certificate. None: no TLS.
      secret_file: a file holding the run's shared secret (at least 16
        bytes): every message carries an HMAC over (run id, sync key, source
        rank, value), checked before the value is recorded. None: no HMAC.
      run_id: names the run; messages of another run id fail the HMAC check.
        `AllReduceConfig.for_worker` appends the worker's index.

    Raises:
      ValueError: neither `tls_dir` nor `secret_file` is given.
    """

    tls_dir: Path | None = None
    secret_file: Path | None = None
    run_id: str = ""

    def __post_init__(self):
        if self.tls_dir is None and self.secret_file is None:
            raise ValueError(
                "AllReduceSecurity needs tls_dir, secret_file or both; pass security=None "
                "for an insecure group (loopback only)."
            )
        for name in ("tls_dir", "secret_file"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
        if not isinstance(self.run_id, str):
            raise TypeError(f"run_id must be a str, got {type(self.run_id).__name__}.")

    def for_worker(self, worker_index: int) -> AllReduceSecurity:
        """The security of worker `worker_index`'s group: its own run id."""
        return dataclasses.replace(self, run_id=f"{self.run_id}/worker-{worker_index}")

    def load(self, rank: int) -> PeerCredentials:
        """Reads the files of rank `rank`.

        Raises:
          ValueError: a file is missing, unreadable, or the secret too short.
        """
        tls = None if self.tls_dir is None else TlsFiles.read(self.tls_dir, rank)
        authenticator = None
        if self.secret_file is not None:
            authenticator = MessageAuthenticator(read_secret(self.secret_file), self.run_id)
        return PeerCredentials(tls=tls, authenticator=authenticator)

    def server_credentials(self, rank: int) -> grpc.ServerCredentials | None:
        """What `bind_server(credentials=...)` needs for rank `rank`; None without TLS."""
        if self.tls_dir is None:
            return None
        return TlsFiles.read(self.tls_dir, rank).server_credentials()
