"""Webhook signing keys (Ed25519, published as a JWK Set) and callback/claim tokens (HMAC)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from streamkeep.storage import files


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Keys:
    """The server's webhook signing key and token secret; persisted in `directory` when given, so
    `kid`s stay stable and tokens stay valid across restarts."""

    def __init__(self, directory: Path | None) -> None:
        if directory is None:
            self._private = Ed25519PrivateKey.generate()
            self._secret = secrets.token_bytes(32)
        else:
            directory.mkdir(parents=True, exist_ok=True)
            key_file, secret_file = directory / "webhook-ed25519.pem", directory / "token-secret"
            if not key_file.exists():
                pem = Ed25519PrivateKey.generate().private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
                files.write_new(files.OS, key_file, pem, mode=0o600)
            if not secret_file.exists():
                files.write_new(files.OS, secret_file, secrets.token_bytes(32), mode=0o600)
            loaded = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
            assert isinstance(loaded, Ed25519PrivateKey)
            self._private = loaded
            self._secret = secret_file.read_bytes()
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
