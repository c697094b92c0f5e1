"""Node-to-node gRPC encryption (``encrypt = true``): mutual TLS with one certificate that every
holder of the cluster key derives itself (HKDF key, fixed name and validity, RFC 6979 signature), so
nothing is copied between machines; :mod:`meshnode.trust.auth`'s HMAC stays on top.

It keeps everything secret and intact from anyone without the key; a key holder can impersonate any
node, sizes and timing stay visible, and the HTTP API and tensor ring are not covered (docs/operations.md).
"""

from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

if TYPE_CHECKING:
    import grpc

__all__ = [
    "TlsIdentity",
    "derive_identity",
    "server_credentials",
    "channel_credentials",
    "channel_options",
    "SERVER_NAME",
]

LABEL = b"meshnode grpc tls v1"
SERVER_NAME = "mesh.meshnode.invalid"  # the certificate's only name; never resolved
_NOT_BEFORE = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)
_NOT_AFTER = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC)
# Order of the P-256 group.
_P256_N = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


@dataclass(frozen=True, repr=False)
class TlsIdentity:
    """The cluster's certificate and private key, PEM encoded."""

    cert_pem: bytes
    key_pem: bytes

    def __repr__(self) -> str:  # never show the private key
        return "TlsIdentity(<derived from the cluster key>)"


def _hkdf(key: bytes, info: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=LABEL, info=info).derive(key)


@functools.lru_cache(maxsize=4)
def derive_identity(cluster_key: str) -> TlsIdentity:
    """The same certificate and key, byte for byte, on every node holding ``cluster_key``."""
    if not cluster_key:
        raise ValueError("encryption needs a cluster key")
    secret = cluster_key.encode("utf-8")
    # 48 bytes reduced mod n-1, plus 1: a uniform scalar in [1, n-1] (bias < 2^-128).
    scalar = int.from_bytes(_hkdf(secret, b"private key", 48), "big") % (_P256_N - 1) + 1
    private = ec.derive_private_key(scalar, ec.SECP256R1())
    serial = int.from_bytes(_hkdf(secret, b"serial", 19), "big") >> 1 or 1  # positive, < 2^152
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshnode cluster"),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(serial)
        .not_valid_before(_NOT_BEFORE)
        .not_valid_after(_NOT_AFTER)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(private, hashes.SHA256(), ecdsa_deterministic=True)
    )
    key_pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return TlsIdentity(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def server_credentials(identity: TlsIdentity) -> grpc.ServerCredentials:
    """For ``server.add_secure_port``: present the cluster certificate, require it from clients."""
    import grpc

    return grpc.ssl_server_credentials(
        [(identity.key_pem, identity.cert_pem)], root_certificates=identity.cert_pem, require_client_auth=True
    )


def channel_credentials(identity: TlsIdentity) -> grpc.ChannelCredentials:
    """For ``grpc.aio.secure_channel``: trust only the cluster certificate and present it."""
    import grpc

    return grpc.ssl_channel_credentials(
        root_certificates=identity.cert_pem, private_key=identity.key_pem, certificate_chain=identity.cert_pem
    )


def channel_options() -> list[tuple[str, str]]:
    """Peers are dialled by address: check the certificate's fixed name instead."""
    return [("grpc.ssl_target_name_override", SERVER_NAME), ("grpc.default_authority", SERVER_NAME)]
