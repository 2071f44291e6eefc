"""Message authentication with a shared secret per run (HMAC-SHA256).

For clusters without a PKI: every host of a group reads the same secret file,
and every `AllReduceData` carries an HMAC over (run id, sync key, source rank,
value kind, value). A receiver checks it before the value is recorded, so a
process that can reach the port but does not know the secret cannot speak
for a rank. The run id keeps a message of one run (or of one worker's group)
from being accepted by another that shares the secret; a replayed message of
the same group carries the genuine value, which the OR ignores as a repeat.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from pathlib import Path

from parallel.allreduce._codec import Contribution
from parallel.allreduce._values import ValueKind

MIN_SECRET_BYTES = 16
# Versioned, so that a later layout of the signed bytes can never verify
# against this one.
_DOMAIN = b"sparseflow.allreduce.v1\0"
_KIND_BYTE = {ValueKind.BOOL: b"b", ValueKind.UINT64: b"u"}


def read_secret(path: Path) -> bytes:
    """The secret in `path`, without trailing whitespace (an `echo`'s newline).

    Raises:
      ValueError: the file cannot be read, or holds fewer than 16 bytes.
    """
    try:
        secret = Path(path).read_bytes().rstrip()
    except OSError as e:
        raise ValueError(
            f"Cannot read the all-reduce secret file {str(path)!r} ({e}); create it on every "
            "host, e.g. `head -c 32 /dev/urandom | base64 > FILE`."
        ) from e
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"The all-reduce secret in {str(path)!r} has {len(secret)} bytes; use at least "
            f"{MIN_SECRET_BYTES}, e.g. `head -c 32 /dev/urandom | base64 > FILE`."
        )
    return secret


class MessageAuthenticator:
    """Signs and checks contributions with one secret and run id.

    Args:
      secret: the run's shared secret, the same on every host.
      run_id: names the run (and the worker's group); the same on every host.
    """

    def __init__(self, secret: bytes, run_id: str):
        self._secret = secret
        self._prefix = _DOMAIN + struct.pack(">I", len(run_id.encode())) + run_id.encode()

    def sign(self, contribution: Contribution) -> bytes:
        """The HMAC of `contribution`, 32 bytes."""
        return hmac.digest(self._secret, self._signed_bytes(contribution), hashlib.sha256)

    def verify(self, contribution: Contribution, mac: bytes) -> bool:
        """Whether `mac` is the HMAC of `contribution`; compared in constant time."""
        return hmac.compare_digest(self.sign(contribution), mac)

    def _signed_bytes(self, contribution: Contribution) -> bytes:
        return self._prefix + struct.pack(
            ">QIcQ",
            contribution.sync_key,
            contribution.src_rank,
            _KIND_BYTE[contribution.kind],
            contribution.value,
        )
