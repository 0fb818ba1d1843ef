"""Webhook signing keys (Ed25519, published as a JWK Set) and callback/claim tokens (HMAC).

Alone, a server makes its signing key once and keeps it in its data directory. In a cluster every
member must sign with the same key, so a receiver that fetched the JWKS from any member (the front
door routes `jwks.json` like a stream path, to whichever member its slot names) verifies a webhook
sent by any other: the key is derived from the cluster secret the members already share (HMAC-SHA256
under a label of its own, used as the Ed25519 seed). Nothing to distribute or keep in sync, and the
same on every member by construction; rotating the cluster secret rotates the key (its `kid`, a
thumbprint, changes with it, so receivers look it up again). Callback and claim tokens stay per
member: only the member that owns a subscription checks them (the others forward its requests).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from streamkeep.storage import files

log = logging.getLogger("streamkeep.subscriptions")
T = TypeVar("T")


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


KEY_FILE = "webhook-ed25519.pem"
SECRET_FILE = "token-secret"
SECRET_BYTES = 32
# What the cluster's webhook key is derived under: a key of its own, never usable as anything else.
CLUSTER_KEY_LABEL = b"streamkeep cluster webhook signing key v1"


class KeyFileError(Exception):
    """A key file exists but cannot be used; the server must not guess what it was."""


class Keys:
    """The server's webhook signing key and token secret; persisted in `directory` when given, so
    `kid`s stay stable and tokens stay valid across restarts."""

    def __init__(
        self, directory: Path | None, *, cluster_secret: str | None = None, fs: files.FileSystem = files.OS
    ) -> None:
        if directory is None:
            self._secret = secrets.token_bytes(SECRET_BYTES)
        else:
            files.makedirs(fs, directory)
            self._secret = _load_or_create(fs, directory, SECRET_FILE, _new_secret, _parse_secret)
        if cluster_secret is not None:
            self._private = cluster_key(cluster_secret)
        elif directory is None:
            self._private = Ed25519PrivateKey.generate()
        else:
            self._private = _load_or_create(fs, directory, KEY_FILE, _new_key_pem, _parse_key)
        raw = self._private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self._x = b64url(raw)
        # RFC 7638 thumbprint: stable for the key's life and unique within the set.
        thumbprint = json.dumps({"crv": "Ed25519", "kty": "OKP", "x": self._x}, separators=(",", ":"))
        self.kid = "ds_" + b64url(hashlib.sha256(thumbprint.encode()).digest())[:22]

    def jwks(self) -> dict:
        return {
            "keys": [
                {"kty": "OKP", "crv": "Ed25519", "kid": self.kid, "use": "sig", "alg": "EdDSA", "x": self._x}
            ]
        }

    def signature_header(self, body: bytes, now: int | None = None) -> str:
        timestamp = int(time.time()) if now is None else now
        signature = self._private.sign(f"{timestamp}.".encode() + body)
        return f"t={timestamp},kid={self.kid},ed25519={b64url(signature)}"

    def token(self, subscription_id: str, generation: int, wake_id: str, kind: str, ttl_s: float) -> str:
        payload = {
            "s": subscription_id,
            "g": generation,
            "w": wake_id,
            "k": kind,
            "e": int(time.time() + ttl_s),
        }
        body = b64url(json.dumps(payload, separators=(",", ":")).encode())
        mac = hmac.new(self._secret, body.encode(), hashlib.sha256).digest()
        return f"{body}.{b64url(mac)}"

    def check_token(self, token: str, subscription_id: str, kind: str) -> dict | None:
        """The token's claims if it is ours, for this subscription and use, and unexpired."""
        body, _, mac = token.partition(".")
        try:
            expected = hmac.new(self._secret, body.encode(), hashlib.sha256).digest()
            if not hmac.compare_digest(expected, _unb64url(mac)):
                return None
            claims = json.loads(_unb64url(body))
        except (ValueError, TypeError):
            return None
        if not isinstance(claims, dict) or claims.get("s") != subscription_id or claims.get("k") != kind:
            return None
        if not isinstance(claims.get("e"), int) or claims["e"] < time.time():
            return None
        return claims


def cluster_key(cluster_secret: str) -> Ed25519PrivateKey:
    """The webhook signing key every member of a cluster derives from its shared secret."""
    seed = hmac.new(cluster_secret.encode(), CLUSTER_KEY_LABEL, hashlib.sha256).digest()
    return Ed25519PrivateKey.from_private_bytes(seed)


def _load_or_create(
    fs: files.FileSystem, directory: Path, name: str, create: Callable[[], bytes], parse: Callable[[bytes], T]
) -> T:
    """The key in `directory/name`, created crash-safely (temp file, fsync, rename, fsync the
    directory) if missing. An empty file is what a crash during an older, unsafe first start
    left: nothing was ever signed with it, so it is made anew. Anything else that does not parse
    may have signed tokens or webhooks: that is for a person to decide, not the server."""
    path = directory / name
    data = files.read_file(fs, path) if fs.exists(path) else None
    if data == b"":
        log.warning("%s is empty (left by a crash while it was created); creating a new one", path)
        data = None
    if data is None:
        data = create()
        files.replace(fs, directory, name, data, mode=0o600)
    try:
        return parse(data)
    except ValueError as error:
        raise KeyFileError(
            f"{path} is damaged ({error}). If it never signed anything in use, move it away and "
            "start again to create a new one; else restore it from a backup"
        ) from None


def _new_key_pem() -> bytes:
    return Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _parse_key(data: bytes) -> Ed25519PrivateKey:
    try:
        loaded = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as error:
        raise ValueError(f"not a PEM private key: {error}") from None
    if not isinstance(loaded, Ed25519PrivateKey):
        raise ValueError(f"not an Ed25519 key but {type(loaded).__name__}")
    return loaded


def _new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def _parse_secret(data: bytes) -> bytes:
    if len(data) != SECRET_BYTES:
        raise ValueError(f"{len(data)} bytes where a token secret has {SECRET_BYTES}")
    return data
