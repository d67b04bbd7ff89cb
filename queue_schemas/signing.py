"""Who sent a batch record: an Ed25519 signature over the record's value by a key registered to its team.

A submitter signs the exact bytes of the record value with the team's private key and sends two Kafka
headers with it: `sluice-key-id` (which of the team's keys) and `sluice-signature` (the signature, base64).
Only public keys are stored (a Redis hash per team, key id -> base64 public key). The value names the
team; the signature proves that the team's key holder produced these bytes, so the team, the reply topic
and the request id inside them are the team's own. Works with any Kafka client that can set headers.

Pure: key making, signing and verification. Reading keys from Redis lives with the services.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KEY_ID_HEADER = "sluice-key-id"
SIGNATURE_HEADER = "sluice-signature"
KEY_ID_LENGTH = 16
Headers = Sequence[tuple[str, bytes]]


def public_key_id(public_raw: bytes) -> str:
    """A short name for a public key: the first hex digits of its SHA-256."""
    return hashlib.sha256(public_raw).hexdigest()[:KEY_ID_LENGTH]


def new_signing_key() -> tuple[str, str, str]:
    """(private key as PKCS#8 PEM, public key as base64 of its 32 raw bytes, key id)."""
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return pem, base64.b64encode(raw).decode(), public_key_id(raw)


def load_private_key(pem: str) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(pem.encode(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("the signing key is not an Ed25519 private key")
    return key


def sign_record(private: Ed25519PrivateKey, value: bytes) -> list[tuple[str, bytes]]:
    """The headers that prove `value` came from the holder of `private`."""
    raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    signature = base64.b64encode(private.sign(value))
    return [(KEY_ID_HEADER, public_key_id(raw).encode()), (SIGNATURE_HEADER, signature)]


def read_signature(headers: Headers | None) -> tuple[str, bytes] | str:
    """(key id, signature bytes) from a record's headers, or why there is none."""
    found = {name: value for name, value in headers or ()}
    key, sig = found.get(KEY_ID_HEADER), found.get(SIGNATURE_HEADER)
    if key is None or sig is None:
        return f"unsigned record: headers {KEY_ID_HEADER!r} and {SIGNATURE_HEADER!r} are required"
    try:
        key_id = key.decode("ascii")
        signature = base64.b64decode(sig, validate=True)
    except (UnicodeDecodeError, binascii.Error):
        return "the signature headers are not readable (key id: ASCII, signature: base64)"
    if len(key_id) != KEY_ID_LENGTH or len(signature) != 64:
        return "the signature headers are malformed"
    return key_id, signature


def signature_valid(public_b64: bytes | str, value: bytes, signature: bytes) -> bool:
    try:
        public = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_b64, validate=True))
        public.verify(signature, value)
    except (InvalidSignature, ValueError, binascii.Error):
        return False
    return True
