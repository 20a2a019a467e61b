"""A throw-away certificate authority and a leaf certificate for 127.0.0.1 it signed (``make_certs``): what
an HTTPS fake upstream serves in benchmarks, and — with ``names`` — a stand-in for a provider's host
(``api.anthropic.com`` reached through the proxy's ``--resolve``)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

LOOPBACK = ipaddress.ip_address("127.0.0.1")


def make_certs(d: Path, names: tuple[str, ...] = ()) -> tuple[Path, Path, Path]:
    """A throw-away CA and a leaf for 127.0.0.1 (and localhost, and each of ``names``) signed by it:
    (ca.pem, cert.pem, key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lgt bench CA")])
    no = dict.fromkeys(("content_commitment", "key_encipherment", "data_encipherment",
                        "key_agreement", "encipher_only", "decipher_only"), False)

    def cert(subject: x509.Name, pub, ca: bool) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(pub)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=7))
                .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(pub), critical=False)
                .add_extension(x509.KeyUsage(digital_signature=not ca, key_cert_sign=ca,
                                             crl_sign=ca, **no), critical=True))

    ca = cert(ca_name, ca_key.public_key(), True).sign(ca_key, hashes.SHA256())
    leaf_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    leaf = (cert(leaf_name, key.public_key(), False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        *map(x509.DNSName, names),
                                                        x509.IPAddress(LOOPBACK)]), False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           False)
            .sign(ca_key, hashes.SHA256()))
    paths = d / "ca.pem", d / "cert.pem", d / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths
