"""Development certificates: a local CA and a gateway certificate signed by it
(``kvasir certs DIR``). For production, use a certificate from a public CA."""

from __future__ import annotations

import datetime
import ipaddress
import os
import pathlib
from collections.abc import Sequence

from kvasir_rpc import write_secret

__all__ = ["make_dev_certs"]


def _write_public(path: pathlib.Path, data: bytes) -> None:
    # Certificates are public (0644), and also replaced whole, so a reader never sees half of one.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(0o644)
    os.replace(tmp, path)


def make_dev_certs(directory: str | os.PathLike[str], hosts: Sequence[str] = ("localhost", "127.0.0.1", "::1"),
                   *, days: int = 365) -> dict[str, pathlib.Path]:
    """Write ``ca.pem``, ``ca.key``, ``gateway.pem`` and ``gateway.key``, replacing old ones;
    the keys mode 0600 (``write_secret``: an old 0644 key is replaced, never rewritten in place).

    The gateway certificate names every entry of ``hosts`` (DNS names or IP addresses).
    Returns the paths by name.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Kvasir development CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0] if hosts else "kvasir-gateway")]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    no_enc = serialization.NoEncryption()
    pkcs8 = serialization.PrivateFormat.PKCS8
    paths = {name: out / name for name in ("ca.pem", "ca.key", "gateway.pem", "gateway.key")}
    write_secret(paths["ca.key"], ca_key.private_bytes(pem, pkcs8, no_enc))
    write_secret(paths["gateway.key"], key.private_bytes(pem, pkcs8, no_enc))
    _write_public(paths["ca.pem"], ca.public_bytes(pem))
    _write_public(paths["gateway.pem"], cert.public_bytes(pem))
    return paths
