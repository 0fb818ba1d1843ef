"""Signed read links: a URL that lets whoever holds it read one stream until a set time.

A link is `?signed=v1.<kid>.<expires>.<mac>`, an HMAC-SHA256 over the version, the kid, the expiry
and the decoded stream name. It needs no token and no issuer, so it suits sharing a live view with
a browser; and it is bearer material in a URL, so it grants the least that is useful: read, one
stream, named literally (a `*` in the name is not a wildcard), until it expires.

Its keys are its own, never the JWT secret: a link secret leaked from a URL-signing service must
not mint tokens, and the other way round. Keys carry a kid so they can be rotated: the first key
of the ring signs, all of them verify, and links signed with a key dropped from the ring stop
working - which is also how to revoke every link at once.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import quote

from streamkeep.auth.errors import unauthorized
from streamkeep.auth.scopes import Grants
from streamkeep.auth.tokens import Principal
from streamkeep.protocol.names import STREAM_PREFIX
from streamkeep.storage import files

log = logging.getLogger("streamkeep.auth")

VERSION = "v1"
KID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,32}")
MIN_SECRET_CHARS = 16
MAX_KEYS = 5  # kept by rotate: enough for a few rotations while old links run out
_EXPIRES = re.compile(r"0|[1-9][0-9]{0,15}")  # canonical decimal only, so one link has one spelling
_MAC = re.compile(r"[A-Za-z0-9_-]{43}")  # 32 bytes of base64url without padding
MAX_LINK_CHARS = 2 + 1 + 32 + 1 + 16 + 1 + 43


class LinkKeys:
    """A ring of link keys: `current` signs, every kid in `kids` verifies."""

    def __init__(self, ring: Iterable[tuple[str, str]]) -> None:
        ring = list(ring)
        if not ring:
            raise ValueError("no link keys: give at least one kid=SECRET")
        self._secrets: dict[str, bytes] = {}
        for kid, secret in ring:
            if not KID_PATTERN.fullmatch(kid):
                raise ValueError(f"link key id {kid!r} must be 1-32 letters, digits, _ or -")
            if kid in self._secrets:
                raise ValueError(f"link key id {kid!r} appears twice")
            if len(secret) < MIN_SECRET_CHARS or any(c.isspace() for c in secret):
                raise ValueError(
                    f"the secret of link key {kid!r} must be at least {MIN_SECRET_CHARS} characters without "
                    "spaces (e.g. from `openssl rand -base64 32`)"
                )
            self._secrets[kid] = secret.encode("utf-8")
        self._ring = ring
        self.current = ring[0][0]

    @property
    def kids(self) -> list[str]:
        """Signing kid first."""
        return [kid for kid, _ in self._ring]

    def secret(self, kid: str) -> bytes | None:
        return self._secrets.get(kid)

    def __repr__(self) -> str:
        return f"LinkKeys(kids={self.kids})"  # never the secrets

    # ---- where keys come from ------------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> LinkKeys:
        """Keys given as `kid1=SECRET1,kid2=SECRET2` (the first signs); raises ValueError."""
        ring = []
        for item in text.split(","):
            kid, equals, secret = item.strip().partition("=")
            if not equals:
                raise ValueError(f"expected kid=SECRET, got {kid[:32]!r}...; separate keys with commas")
            ring.append((kid.strip(), secret.strip()))
        return cls(ring)

    @classmethod
    def load_or_create(
        cls, path: Path, *, now: float | None = None, fs: files.FileSystem = files.OS
    ) -> LinkKeys:
        """The keys in `path` (lines `kid secret`, the first signs), which is created with one
        new key if it is missing. An empty file is treated as missing: nothing can have been
        signed with it. Raises ValueError when the file does not parse."""
        keys = cls._read(path)
        if keys is None:
            keys = cls([_new_key(now, ())])
            keys._save(path, fs)
            log.info("created link key %s in %s", keys.current, path)
        return keys

    @classmethod
    def rotate(cls, path: Path, *, now: float | None = None) -> LinkKeys:
        """Adds a new signing key in front of those in `path` (created if missing); the older
        keys keep verifying, up to MAX_KEYS in all (the oldest beyond that are dropped, and
        the links they signed stop working)."""
        old = cls._read(path)
        ring = [] if old is None else old._ring
        keys = cls([_new_key(now, {kid for kid, _ in ring}), *ring][:MAX_KEYS])
        keys._save(path)
        return keys

    @classmethod
    def _read(cls, path: Path) -> LinkKeys | None:
        try:
            text = path.read_text("utf-8")
        except FileNotFoundError:
            return None
        if not text.strip():
            return None
        ring = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split()
            if len(fields) != 2:
                raise ValueError(f"{path}:{number}: expected `kid secret`")
            ring.append((fields[0], fields[1]))
        try:
            keys = cls(ring)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
        mode = path.stat().st_mode
        if mode & 0o077:
            log.warning("%s can be read by other users (mode %o); chmod 600 it", path, mode & 0o777)
        return keys

    def _save(self, path: Path, fs: files.FileSystem = files.OS) -> None:
        text = "".join(f"{kid} {secret}\n" for kid, secret in self._ring)
        files.makedirs(fs, path.parent)
        # Atomic: a crash leaves the old ring or the new one, never a torn file that signs nothing.
        files.replace(fs, path.parent, path.name, text.encode("utf-8"), mode=0o600)
        # The mode applies only when the temp file is created; one left by a crash may have another.
        os.chmod(path, 0o600)


def _new_key(now: float | None, taken: Iterable[str]) -> tuple[str, str]:
    taken = set(taken)
    kid = "k" + time.strftime("%Y%m%d", time.gmtime(time.time() if now is None else now))
    while kid in taken:
        kid = kid[:9] + "-" + secrets.token_hex(3)  # a second key on the same day
    return kid, secrets.token_urlsafe(32)


# ---- signing and checking ---------------------------------------------------------------


def _mac(secret: bytes, kid: str, expires: str, name: str) -> str:
    message = b"\n".join((VERSION.encode(), kid.encode(), expires.encode(), name.encode("utf-8")))
    digest = hmac.new(secret, message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def sign(keys: LinkKeys, name: str, expires_at: int) -> str:
    """The `signed` query value granting read on stream `name` (decoded, e.g. `a/b c`) until
    `expires_at` (unix seconds), signed with the current key."""
    if isinstance(expires_at, bool) or not isinstance(expires_at, int) or not 0 <= expires_at < 10**16:
        raise ValueError(f"expires_at must be unix seconds as an int, not {expires_at!r}")
    if not name:
        raise ValueError("a signed link needs a stream name")
    kid = keys.current
    secret = keys.secret(kid)
    assert secret is not None
    expires = str(expires_at)
    return f"{VERSION}.{kid}.{expires}.{_mac(secret, kid, expires, name)}"


def verify(keys: LinkKeys, value: str, name: str, now: float) -> Principal:
    """The principal of a valid link for stream `name` (decoded); raises AuthError 401
    `bad_link` or `expired_link`."""
    parts = value.split(".") if len(value) <= MAX_LINK_CHARS else []
    if (
        len(parts) != 4
        or parts[0] != VERSION
        or not KID_PATTERN.fullmatch(parts[1])
        or not _EXPIRES.fullmatch(parts[2])
        or not _MAC.fullmatch(parts[3])
    ):
        raise unauthorized(
            "bad_link", "the signed link is malformed (cut short when copied?); ask for a new one"
        )
    _, kid, expires, mac = parts
    secret = keys.secret(kid)
    if secret is None:
        raise unauthorized(
            "bad_link", "the signed link's key was retired from this server; ask for a new link"
        )
    # The MAC covers the name, so a link for another stream fails here too.
    if not hmac.compare_digest(_mac(secret, kid, expires, name), mac):
        raise unauthorized("bad_link", "the signed link is not valid for this stream; ask for a new one")
    # Expiry after the MAC: only a genuine link learns that it merely expired.
    if now >= int(expires):
        raise unauthorized("expired_link", "the signed link has expired; ask for a new one")
    return Principal(
        subject=f"link:{kid}", grants=Grants.exact_read(name), expires_at=float(int(expires)), via="link"
    )


def link_url(base_url: str, name: str, value: str) -> str:
    """The URL reading stream `name` with the signed-link `value`, e.g.
    `https://host/v1/stream/a/b%20c?signed=v1...`."""
    return f"{base_url.rstrip('/')}{STREAM_PREFIX}{quote(name, safe='/')}?signed={quote(value, safe='')}"
