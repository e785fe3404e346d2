"""Certificates made for a test: a CA, a server certificate for 127.0.0.1 / localhost, a client
certificate, and a client certificate from a CA nobody trusts."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # signed by another CA
    rogue_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(
    folder: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> tuple[Path, Path]:
    cert_path, key_path = folder / f"{stem}.pem", folder / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def _issue(
    subject: str,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    server: bool = False,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for `subject`, signed by `issuer` (None: a self-signed CA)."""
    key = ec.generate_private_key(ec.SECP256R1())
    issuer_name, signing_key = issuer if issuer is not None else (_name(subject), key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    if issuer is not None:
        usage = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if server:
            usage.append(ExtendedKeyUsageOID.SERVER_AUTH)
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return builder.sign(signing_key, hashes.SHA256()), key


def make_pki(folder: Path) -> Pki:
    ca_cert, ca_key = _issue("pdmesh test CA", None)
    ca = (ca_cert.subject, ca_key)
    rogue_ca_cert, rogue_ca_key = _issue("someone else's CA", None)
    ca_path, _ = _write(folder, "ca", ca_cert, ca_key)
    server = _write(folder, "server", *_issue("pdmesh", ca, server=True))
    client = _write(folder, "client", *_issue("test client", ca))
    rogue = _write(folder, "rogue", *_issue("rogue", (rogue_ca_cert.subject, rogue_ca_key)))
    return Pki(ca_path, *server, *client, *rogue)
