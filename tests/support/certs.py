"""Throw-away certificates for tests and benchmarks of TLS (never for production).

Made with ``cryptography`` (a test extra) at run time; nothing is committed.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path      # a client certificate from another CA
    stranger_key: Path


def make_pki(folder: Path) -> Pki:
    """A CA, a server certificate for 127.0.0.1 and localhost, a client certificate of
    the CA and one of another CA (EC P-256, valid for a day), as PEM files in ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(name: str, key: Any, issuer: tuple[x509.Name, Any] | None, *, ca: bool = False,
             server: bool = False) -> x509.Certificate:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        issuer_name, issuer_key = issuer if issuer is not None else (subject, key)
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            builder = builder.add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False), critical=True)
        elif server:
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False).add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        else:
            builder = builder.add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(name: str, obj: Any) -> Path:
        path = folder / name
        if isinstance(obj, x509.Certificate):
            path.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
        else:
            path.write_bytes(obj.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return path

    def new_key() -> Any:
        return ec.generate_private_key(ec.SECP256R1())

    ca_key, other_ca_key, server_key, client_key, stranger_key = (new_key() for _ in range(5))
    ca = cert("jitney test CA", ca_key, None, ca=True)
    other_ca = cert("another CA", other_ca_key, None, ca=True)
    return Pki(write("ca.pem", ca),
               write("server.pem", cert("jitney server", server_key, (ca.subject, ca_key), server=True)),
               write("server.key", server_key),
               write("client.pem", cert("jitney client", client_key, (ca.subject, ca_key))),
               write("client.key", client_key),
               write("stranger.pem", cert("stranger", stranger_key, (other_ca.subject, other_ca_key))),
               write("stranger.key", stranger_key))
