"""Throwaway certificate authorities and rank certificates for TLS tests.

Made with the `cryptography` package when it is installed, else with the
`openssl` command line tool.
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
from pathlib import Path

try:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
except ImportError:
    x509 = None

_VALID = datetime.timedelta(days=1)


def write_tls_dir(directory: Path, ranks: int, *, names=None) -> Path:
    """A TLS directory (`ca.crt`, `rank-<r>.crt`, `rank-<r>.key`) for `ranks` ranks.

    Args:
      names: the certificate identity of each rank (default `allreduce-rank-<r>`).
    """
    directory.mkdir(parents=True, exist_ok=True)
    names = names or [f"allreduce-rank-{r}" for r in range(ranks)]
    make = _with_cryptography if x509 is not None else _with_openssl
    make(directory, names)
    return directory


def _with_cryptography(directory: Path, names: list[str]) -> None:
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test all-reduce CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _VALID)
        .not_valid_after(now + _VALID)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for rank, name in enumerate(names):
        key = ec.generate_private_key(ec.SECP256R1())
        certificate = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _VALID)
            .not_valid_after(now + _VALID)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        (directory / f"rank-{rank}.crt").write_bytes(
            certificate.public_bytes(serialization.Encoding.PEM)
        )
        (directory / f"rank-{rank}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )


def _with_openssl(directory: Path, names: list[str]) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("TLS tests need the cryptography package or the openssl tool.")

    def run(*args):
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)

    ca_key, ca = directory / "ca.key", directory / "ca.crt"
    run("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", ca_key)
    run("req", "-x509", "-new", "-key", ca_key, "-subj", "/CN=test all-reduce CA",
        "-days", "1", "-out", ca)  # fmt: skip
    for rank, name in enumerate(names):
        key, request = directory / f"rank-{rank}.key", directory / f"rank-{rank}.csr"
        run("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", key)
        run("req", "-new", "-key", key, "-subj", f"/CN={name}", "-out", request)
        extensions = directory / f"rank-{rank}.ext"
        extensions.write_text(f"subjectAltName=DNS:{name}\n")
        certificate = directory / f"rank-{rank}.crt"
        run("x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
            "-days", "1", "-extfile", extensions, "-out", certificate)  # fmt: skip
