"""API keys and TLS material for the access tests."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

KEY_A, KEY_B = "key-alpha-0123456789", "key-bravo-9876543210"


def write_keys(path: Path) -> Path:
    """An API keys file holding KEY_A (alice) and KEY_B (bob), with the comments the format allows."""
    path.write_text(f"# comment line\n{KEY_A} alice\n\n{KEY_B}   bob  # trailing comment\n")
    return path


def self_signed_cert(folder: Path):
    """A self-signed certificate for 127.0.0.1 / localhost in `folder`: (cert file, key file, cert PEM bytes)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = certificate.public_bytes(serialization.Encoding.PEM)
    (folder / "cert.pem").write_bytes(cert_pem)
    (folder / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(folder / "cert.pem"), str(folder / "key.pem"), cert_pem
