"""The hostile peer of `benchmarks/allreduce.py`, and the keys the hosts use against it.

A `Stranger` knows every host's port (127.0.0.1 only) but neither the run's
secret nor a certificate. While the hosts run their rounds it holds
`IDLE_STREAMS` idle streams to host 0, and floods every host with values
forged for the keys being reduced, each claiming to come from another rank,
at `FORGED_PER_S` messages per second per host. It stops when told to, or
after `max_s` seconds by itself.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from parallel.allreduce import allreduce_pb2 as pb
from parallel.allreduce._rpc import AllReduceStub

IDLE_STREAMS = 64
FORGED_PER_S = 500
_BATCH = 25  # forged messages sent back to back, then a pause
_RETRY_S = 0.05


def write_secret(directory: Path) -> Path:
    path = directory / "secret"
    path.write_bytes(os.urandom(32).hex().encode())
    return path


def write_tls_dir(directory: Path, ranks: int) -> Path | None:
    """A throwaway CA and one certificate per rank; None without `cryptography`."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    day = datetime.timedelta(days=1)

    def certificate(name, key, issuer, issuer_key, *, ca):
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer or subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - day)
            .not_valid_after(now + day)
        )
        if ca:
            builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        else:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName(name)]), False
            )
        return builder.sign(issuer_key or key, hashes.SHA256())

    pem = serialization.Encoding.PEM
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate("benchmark CA", ca_key, None, None, ca=True)
    (directory / "ca.crt").write_bytes(ca.public_bytes(pem))
    for rank in range(ranks):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = certificate(f"allreduce-rank-{rank}", key, ca.subject, ca_key, ca=False)
        (directory / f"rank-{rank}.crt").write_bytes(cert.public_bytes(pem))
        (directory / f"rank-{rank}.key").write_bytes(
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
    return directory


class Stranger:
    """Floods the hosts at `ports` (rank order) until `stop`, at most `max_s` seconds.

    Args:
      ports: every host's port on 127.0.0.1.
      keys: the keys the hosts reduce (forged values target them).
      seed: seeds the forged keys and values.
      max_s: the flood ends by itself after this long.
    """

    def __init__(self, ports: list[int], keys: int, seed: int, max_s: float):
        self._ports = ports
        self._keys = keys
        self._seed = seed
        self._end = time.monotonic() + max_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sent = 0
        self._threads = [
            threading.Thread(target=self._hold_idle_streams, daemon=True),
            *(
                threading.Thread(target=self._forge, args=(rank,), daemon=True)
                for rank in range(len(ports))
            ),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> int:
        """Ends the flood; the forged messages sent."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        return self._sent

    def _running(self) -> bool:
        return not self._stop.is_set() and time.monotonic() < self._end

    def _hold_idle_streams(self) -> None:
        address = f"127.0.0.1:{self._ports[0]}"
        channels, calls, requests = [], [], []
        try:
            for _ in range(IDLE_STREAMS):
                channel = grpc.insecure_channel(
                    address, options=[("grpc.use_local_subchannel_pool", 1)]
                )
                silent = queue.SimpleQueue()
                channels.append(channel)
                requests.append(silent)
                calls.append(AllReduceStub(channel).ContributeStream(iter(silent.get, None)))
            while self._running():
                self._stop.wait(0.1)
        finally:
            for silent in requests:
                silent.put(None)
            for call in calls:
                call.cancel()
            for channel in channels:
                channel.close()

    def _forge(self, rank: int) -> None:
        world = len(self._ports)
        rng = np.random.default_rng([self._seed, rank, 7])
        with grpc.insecure_channel(f"127.0.0.1:{self._ports[rank]}") as channel:
            stub = AllReduceStub(channel)
            while self._running():
                try:
                    for _ in stub.ContributeStream(self._forged(rng, (rank + 1) % world)):
                        pass
                except grpc.RpcError:
                    self._stop.wait(_RETRY_S)  # refused (TLS) or pushed out: try again

    def _forged(self, rng: np.random.Generator, claimed_rank: int):
        while self._running():
            for _ in range(_BATCH):
                key = int(rng.integers(0, self._keys))
                value = {"bool_val": True} if key % 2 == 0 else {"uint64_val": 2**64 - 1}
                yield pb.AllReduceData(
                    sync_key=key, src_rank=claimed_rank, mac=rng.bytes(32), **value
                )
            with self._lock:
                self._sent += _BATCH
            time.sleep(_BATCH / FORGED_PER_S)
