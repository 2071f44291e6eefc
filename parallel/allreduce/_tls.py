"""Mutual TLS between the hosts of a group, each rank tied to its certificate.

A TLS directory holds the group's CA certificate and, for each rank that
runs on the host, its certificate and key:

    ca.crt                  the CA that signed every rank's certificate
    rank-<r>.crt            rank r's certificate (PEM, chain allowed)
    rank-<r>.key            rank r's private key (PEM)

Rank r's certificate names the identity `allreduce-rank-<r>` (as a DNS
subject alternative name, or as the common name when it has none). A server
requires a client certificate from the CA and accepts values only for the
rank its certificate names; a client checks that the server it reached holds
the certificate of the rank it meant to reach, not that of the address.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import grpc

CA_FILE = "ca.crt"
_IDENTITY = re.compile(rb"allreduce-rank-(\d+)")


def rank_identity(rank: int) -> str:
    """The certificate identity of `rank`: `allreduce-rank-<rank>`."""
    return f"allreduce-rank-{rank}"


def rank_of_identities(identities: list[bytes] | None) -> int | None:
    """The single rank a peer's certificate identities name, else None."""
    ranks = {int(m.group(1)) for i in identities or () if (m := _IDENTITY.fullmatch(i))}
    return ranks.pop() if len(ranks) == 1 else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TlsFiles:
    """The PEM bytes one rank needs: the CA, its certificate and its key."""

    ca: bytes
    certificate: bytes
    key: bytes

    @classmethod
    def read(cls, tls_dir: Path, rank: int) -> TlsFiles:
        """Reads rank `rank`'s files from `tls_dir` (layout in the module docstring).

        Raises:
          ValueError: a file is missing or unreadable.
        """
        names = (CA_FILE, f"rank-{rank}.crt", f"rank-{rank}.key")
        contents = []
        for name in names:
            path = Path(tls_dir) / name
            try:
                contents.append(path.read_bytes())
            except OSError as e:
                raise ValueError(
                    f"Cannot read {str(path)!r} for the all-reduce's TLS ({e}); the TLS "
                    f"directory must hold {', '.join(names)}, the certificate naming "
                    f"{rank_identity(rank)!r}."
                ) from e
        return cls(ca=contents[0], certificate=contents[1], key=contents[2])

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials of a server that requires a client certificate from the CA."""
        return grpc.ssl_server_credentials(
            [(self.key, self.certificate)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of a client presenting this rank's certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.certificate
        )


def channel_options(peer_rank: int) -> list[tuple[str, str]]:
    """Makes a channel check that the server holds `peer_rank`'s certificate."""
    return [("grpc.ssl_target_name_override", rank_identity(peer_rank))]
