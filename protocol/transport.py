"""Transport security: TLS 1.3 with certificates bound to the run, for gRPC and the TCP data plane alike.

Rules, in a screen:
- Beyond loopback every connection between nodes is TLS 1.3 with both sides presenting a certificate
  (mutual TLS): gRPC through its own TLS stack, the data plane through Python's `ssl` (OpenSSL). Nothing is a
  home-made cipher mode; every record is AES-GCM (or ChaCha20-Poly1305) with TLS's sequence numbers, so a byte
  altered, dropped, replayed or reordered on the wire fails the record's tag and the connection.
- The keys are bound to the run. Either the operator gives a CA, a certificate and its key (network.tls_*), or
  the run's CA is *derived from the run secret*: its P-256 key is HKDF-SHA256(secret, run id), so every node
  holding the secret has the same CA key, issues itself a certificate for a fresh key at start, and trusts only
  certificates signed by that CA. An outsider (no secret) can neither complete a handshake (it has no
  certificate the CA signed) nor read one (ECDHE: the session keys never cross the wire). Within TLS every call
  still carries the run's HMAC token (protocol/auth.py), which names the sender.
- Loopback (the demo, the tests) stays plaintext by default: `network.encryption = "auto"` turns TLS on exactly
  when the node listens beyond 127.0.0.1 / ::1. "tls" forces it, "off" turns it off (refused beyond loopback
  without auth.insecure_no_secret, as a swarm without a secret is).
- Certificates name `SERVER_NAME`, not a host: a node is reached by any address it has (behind NAT, on IPv6,
  by a DNS name), and the client checks the CA's signature, not the address.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAME = "farloco-peer"  # the DNS name in every run-derived certificate, and what clients check
_CA_NAME = "farloco run CA"
# A fixed window: every node rebuilds the same CA (same key, same name, same validity) from the secret, and a
# node's own certificate lives as long as its process (a fresh key each start).
_NOT_BEFORE = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
_NOT_AFTER = datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC)


@dataclass(frozen=True)
class TlsConfig:
    """Mutual TLS material (PEM bytes). Each side presents `certificate_chain`/`private_key` and trusts
    `root_certificates`; `server_name` overrides the name a client checks in the server certificate."""

    root_certificates: bytes
    certificate_chain: bytes
    private_key: bytes
    server_name: str | None = None


def _derive_ca_key(secret: bytes, run_id: str) -> ec.EllipticCurvePrivateKey:

    # P-256's order n; a 48-byte HKDF output reduced mod (n - 1), plus 1, is uniform enough (bias < 2^-128).
    order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
    okm = HKDF(algorithm=hashes.SHA256(), length=48, salt=b"farloco-run-ca-v1", info=run_id.encode()).derive(
        secret
    )
    scalar = int.from_bytes(okm, "big") % (order - 1) + 1
    return ec.derive_private_key(scalar, ec.SECP256R1())


def _name(common_name: str) -> x509.Name:

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_ca(
    key: ec.EllipticCurvePrivateKey,
    common_name: str,
    *,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
) -> bytes:
    """A self-signed CA certificate (PEM) for `key`."""

    public = key.public_key()
    # The serial from the key, so every node's rebuilt CA of one run is the same certificate but its signature.
    serial = (
        int.from_bytes(
            hashlib.sha256(
                public.public_bytes(
                    serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
                )
            ).digest()[:16],
            "big",
        )
        >> 1
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(public)
        .serial_number(serial or 1)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def issue(
    ca_key: ec.EllipticCurvePrivateKey, ca_pem: bytes, common_name: str, *, days: float = 36500.0
) -> tuple[bytes, bytes]:
    """A fresh P-256 key and a certificate for it signed by the CA: (certificate PEM, key PEM). The certificate
    names `SERVER_NAME` and is good for both ends of a connection."""

    ca = x509.load_pem_x509_certificate(ca_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))  # clocks of the swarm are not exact
        .not_valid_after(min(now + datetime.timedelta(days=days), _NOT_AFTER))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def run_credentials(secret: bytes, run_id: str, common_name: str) -> TlsConfig:
    """This node's TLS material for run `run_id`: the CA derived from the run secret and a certificate for a
    fresh key, signed by it (see the module's docstring)."""
    ca_key = _derive_ca_key(secret, run_id)
    ca_pem = make_ca(ca_key, _CA_NAME, not_before=_NOT_BEFORE, not_after=_NOT_AFTER)
    cert_pem, key_pem = issue(ca_key, ca_pem, common_name[:64] or "farloco node")
    return TlsConfig(
        root_certificates=ca_pem, certificate_chain=cert_pem, private_key=key_pem, server_name=SERVER_NAME
    )


def make_pki(nodes: list[str], *, days: float = 3650.0) -> dict[str, bytes]:
    """An operator's own PKI for network.tls_*: a CA (ca.pem, ca.key) and, per node name, NAME.pem and NAME.key
    signed by it, all naming `SERVER_NAME`. Returns file name -> PEM bytes (the `.key` ones are secrets)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_pem = make_ca(
        ca_key,
        _CA_NAME,
        not_before=now - datetime.timedelta(hours=1),
        not_after=now + datetime.timedelta(days=days),
    )
    files = {"ca.pem": ca_pem, "ca.key": _pem_key(ca_key)}
    for node in nodes:
        files[f"{node}.pem"], files[f"{node}.key"] = issue(ca_key, ca_pem, node, days=days)
    return files


def ssl_context(tls: TlsConfig, *, server: bool) -> ssl.SSLContext:
    """The data plane's server or client context for `tls`: TLS 1.3 only, a certificate required both ways,
    trusting only `tls.root_certificates`, no session tickets (a stream is one connection; no state outlives
    it). The client passes the name to check (`tls.server_name`, else the host it dials) per connection."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=tls.root_certificates.decode())
    _load_chain(context, tls)
    if server:
        context.num_tickets = 0
    else:
        context.check_hostname = True  # against tls.server_name, else the host dialled (as gRPC does)
    return context


def _load_chain(context: ssl.SSLContext, tls: TlsConfig) -> None:
    """`ssl` loads a certificate and key from files only: through a private directory, removed at once."""
    with tempfile.TemporaryDirectory(prefix="farloco-tls-") as directory:
        cert, key = Path(directory) / "cert.pem", Path(directory) / "key.pem"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(tls.private_key)
        cert.write_bytes(tls.certificate_chain)
        context.load_cert_chain(cert, key)
