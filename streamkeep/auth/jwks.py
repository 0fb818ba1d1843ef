"""The issuer's public keys (a JWKS), held in memory for the verifier and kept fresh in the background.

`JwksKeys` is the pure half: a document in, `{kid: key}` out, each key bound to one algorithm. A
key set is the issuer's to change, so a key this server cannot use (an unknown type, an
encryption key, an RSA key too short to trust) is skipped and named in the stats instead of
failing the whole set: one odd entry must not lock everybody out.

`JwksSource` is the I/O half. It fetches in its own task (`run`), never in a request: a request
that meets an unknown kid asks for a refresh and waits a bounded time, and the fetch goes on even
if that request gives up. Unknown kids are attacker-controlled, so refreshes they trigger are
rate-limited and shared. A failed fetch keeps the keys already loaded - an issuer's outage must not
become ours - and retries with backoff, logging each distinct cause once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import jwt
import trio
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey

from streamkeep.auth.errors import unauthorized
from streamkeep.auth.tokens import KEY_ALGORITHMS
from streamkeep.background import Backoff
from streamkeep.health import Causes

log = logging.getLogger("streamkeep.auth")

MAX_DOCUMENT_BYTES = 1 << 20
MAX_KEYS = 100  # real sets hold a handful; the cap bounds parsing a hostile document
MIN_RSA_BITS = 2048
FETCH_TIMEOUT = 10.0
REFRESH_WAIT = 5.0  # the longest a request waits for a refresh it asked for

# Which key type (and curves) can make each algorithm's signatures.
_KEY_TYPES: dict[str, tuple[str, frozenset[str] | None]] = {
    "RS256": ("RSA", None),
    "ES256": ("EC", frozenset({"P-256"})),
    "EdDSA": ("OKP", frozenset({"Ed25519", "Ed448"})),
}
# Private members are dropped: a set published with them is a leak to report, but the public part
# still verifies, and a verifier must never hold more than it needs.
_PRIVATE_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})
_PUBLIC_MEMBERS = ("kty", "crv", "n", "e", "x", "y")


@dataclass(frozen=True, slots=True)
class _Key:
    alg: str
    key: object  # what PyJWT's decode takes
    fingerprint: str  # the public key material: the same kid with another key counts as removed


class JwksKeys:
    """The keys of the last JWKS document loaded; a `KeyProvider` for `TokenVerifier`."""

    def __init__(self) -> None:
        self._keys: dict[str, _Key] = {}
        self.skipped: list[str] = []  # keys of the last document that could not be used, and why

    def load(self, document: bytes | str | Mapping[str, object]) -> set[str]:
        """Replaces the keys with those of `document`. Returns the kids removed or whose key
        changed, so tokens checked with them can be forgotten. Raises ValueError (keeping the
        keys as they were) when the document is not a JWKS or holds no usable key."""
        keys, skipped = parse_jwks(document)
        removed = {
            kid
            for kid, old in self._keys.items()
            if kid not in keys or keys[kid].fingerprint != old.fingerprint
        }
        self._keys = keys
        self.skipped = skipped
        return removed

    def key_for(self, kid: str | None, alg: str) -> object | None:
        if kid is None:
            # Without a kid only a lone key is unambiguous.
            if len(self._keys) != 1:
                return None
            entry = next(iter(self._keys.values()))
        else:
            found = self._keys.get(kid)
            if found is None:
                return None
            entry = found
        if entry.alg != alg:
            # The key is known, so refreshing the set would not help: refuse now.
            raise unauthorized(
                "unsupported_algorithm",
                f"the token's key is for {entry.alg}, but the token says another algorithm",
            )
        return entry.key

    def knows(self, kid: str | None) -> bool:
        return len(self._keys) == 1 if kid is None else kid in self._keys

    @property
    def kids(self) -> list[str]:
        return sorted(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def parse_jwks(document: bytes | str | Mapping[str, object]) -> tuple[dict[str, _Key], list[str]]:
    """The usable keys of a JWKS document by kid (a key without one is filed under ""), and a
    line per skipped key saying why."""
    if isinstance(document, bytes | str):
        try:
            data = json.loads(document)
        except (ValueError, RecursionError) as error:
            raise ValueError(f"not JSON ({error})") from None
    else:
        data = document
    if not isinstance(data, Mapping) or not isinstance(data.get("keys"), list):
        raise ValueError('not a JWKS: expected a JSON object {"keys": [...]}')
    entries = data["keys"]
    keys: dict[str, _Key] = {}
    skipped: list[str] = []
    for index, jwk in enumerate(entries[:MAX_KEYS]):
        label = (
            f"kid {jwk['kid'][:64]!r}"
            if isinstance(jwk, dict) and isinstance(jwk.get("kid"), str)
            else f"key #{index}"
        )
        try:
            kid, key = _parse_key(jwk)
        except ValueError as error:
            skipped.append(f"{label}: {error}")
            continue
        if kid in keys:
            skipped.append(f"{label}: a second key with this kid (the first is used)")
            continue
        keys[kid] = key
    if len(entries) > MAX_KEYS:
        skipped.append(f"{len(entries) - MAX_KEYS} keys past the first {MAX_KEYS}")
    if not keys:
        reasons = "; ".join(skipped[:5]) or "the set is empty"
        raise ValueError(f"no usable signing key ({reasons})")
    return keys, skipped


def _parse_key(jwk: object) -> tuple[str, _Key]:
    if not isinstance(jwk, dict):
        raise ValueError("not a JSON object")
    use = jwk.get("use")
    if use is not None and use != "sig":
        raise ValueError(f"use is {use!r}, not sig")
    operations = jwk.get("key_ops")
    # A private JWK says "sign"; its public part is what verifies those signatures.
    if isinstance(operations, list) and "verify" not in operations and "sign" not in operations:
        raise ValueError("key_ops has neither verify nor sign")
    kid = jwk.get("kid", "")
    if not isinstance(kid, str):
        raise ValueError("kid is not a string")
    kty = jwk.get("kty")
    crv = jwk.get("crv")
    alg = jwk.get("alg") or _default_alg(kty, crv)
    if alg not in _KEY_TYPES:
        raise ValueError(f"alg {alg!r} is not one of {', '.join(KEY_ALGORITHMS)}")
    key_type, curves = _KEY_TYPES[alg]
    if kty != key_type or (curves is not None and crv not in curves):
        raise ValueError(f"a {kty} {crv or ''} key cannot make {alg} signatures".replace("  ", " "))
    public = {name: value for name, value in jwk.items() if name not in _PRIVATE_MEMBERS}
    try:
        parsed = jwt.PyJWK(public, algorithm=alg)
    except Exception as error:
        # Whatever the document holds (bad base64, a point off the curve) is this key's problem only.
        raise ValueError(f"unusable ({str(error)[:200]})") from None
    if isinstance(parsed.key, RSAPublicKey) and parsed.key.key_size < MIN_RSA_BITS:
        raise ValueError(f"RSA key of {parsed.key.key_size} bits; at least {MIN_RSA_BITS} are needed")
    fingerprint = json.dumps(
        {name: public.get(name) for name in _PUBLIC_MEMBERS} | {"alg": alg}, sort_keys=True
    )
    return kid, _Key(alg, parsed.key, fingerprint)


def _default_alg(kty: object, crv: object) -> str | None:
    if kty == "RSA":
        return "RS256"
    if kty == "EC" and crv == "P-256":
        return "ES256"
    if kty == "OKP" and crv == "Ed25519":
        return "EdDSA"
    return None


# ---- fetching ---------------------------------------------------------------------------


def check_location(location: str) -> None:
    if not location:
        raise ValueError("a JWKS location is needed: an https:// URL or a local file path")
    if "://" in location and not location.startswith("https://"):
        raise ValueError(
            "expected an https:// URL or a local file path (keys fetched over plain http can be forged)"
        )


async def fetch_location(location: str) -> bytes:
    """The bytes at an https:// URL (verified TLS; SSL_CERT_FILE and proxies from the environment)
    or in a local file; at most MAX_DOCUMENT_BYTES."""
    if location.startswith("https://"):
        return await _fetch_https(location)
    # Abandoned on cancel: a file read on a hung network mount must not pin the fetching task.
    return await trio.to_thread.run_sync(_read_file, location, abandon_on_cancel=True)


async def _fetch_https(url: str) -> bytes:
    # Redirects are not followed: one could lead to plain http, where keys can be forged.
    async with (
        httpx.AsyncClient(timeout=FETCH_TIMEOUT, trust_env=True, follow_redirects=False) as client,
        client.stream(
            "GET", url, headers={"Accept": "application/jwk-set+json, application/json"}
        ) as response,
    ):
        if response.status_code != 200:
            raise ValueError(f"HTTP {response.status_code} from the JWKS URL")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_DOCUMENT_BYTES:
            raise ValueError(f"the JWKS is larger than {MAX_DOCUMENT_BYTES} bytes")
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > MAX_DOCUMENT_BYTES:
                raise ValueError(f"the JWKS is larger than {MAX_DOCUMENT_BYTES} bytes")
        return bytes(body)


def _read_file(location: str) -> bytes:
    with Path(location).expanduser().open("rb") as file:
        data = file.read(MAX_DOCUMENT_BYTES + 1)
    if len(data) > MAX_DOCUMENT_BYTES:
        raise ValueError(f"the JWKS file is larger than {MAX_DOCUMENT_BYTES} bytes")
    return data


class _Attempt:
    """One fetch, which every request waiting on it shares."""

    __slots__ = ("done", "ok")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.ok = False


class JwksSource:
    """Keeps `keys` loaded from `location`: start `run` in a nursery, then requests may call
    `refresh_for` on an unknown kid. `on_change` gets the kids removed by each load."""

    def __init__(
        self,
        location: str,
        keys: JwksKeys,
        *,
        refresh_interval: float = 300.0,
        min_refresh_gap: float = 10.0,
        fetch: Callable[[str], Awaitable[bytes]] | None = None,
        clock: Callable[[], float] = trio.current_time,
        on_change: Callable[[set[str]], object] | None = None,
    ) -> None:
        check_location(location)
        self.location = location
        self.keys = keys
        self.refresh_interval = refresh_interval
        self.min_refresh_gap = min_refresh_gap
        self._fetch = fetch or fetch_location
        self._clock = clock
        self._on_change = on_change
        self.loaded = trio.Event()  # set by the first successful load
        self.last_error: str | None = None
        self.refreshes = 0  # successful loads
        self.failures = 0
        self.fetches = 0  # attempts, successful or not
        self.fetched_at: float | None = None  # clock time of the last successful load
        self._started_at: float | None = None  # clock time the last attempt started
        self._current: _Attempt | None = None  # under way
        self._pending: _Attempt | None = None  # asked for, not started yet
        self._wake = trio.Event()
        self._running = False
        self._logged: Causes[str, str] = Causes()  # failure causes told since the last success
        self._skipped_logged: list[str] = []

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Loads the keys, then refreshes them every `refresh_interval` seconds; after a failure,
        retries in 1 s, 2 s, ... up to 60 s. Started at once, so the server is not held up by an
        issuer that is down: wait on `loaded` for that. Never raises but Cancelled."""
        if self._running:
            raise RuntimeError("JwksSource.run is already running")
        self._running = True
        task_status.started()
        backoff = Backoff(jitter=0)
        try:
            while True:
                if await self._attempt():
                    backoff.reset()
                    delay = self.refresh_interval
                else:
                    delay = backoff.failed()
                with trio.move_on_after(delay):
                    await self._wake.wait()
                self._wake = trio.Event()
        finally:
            self._running = False

    async def refresh_for(self, kid: str | None) -> bool:
        """For a token whose `kid` is unknown: fetches the set again, unless the last fetch began
        under `min_refresh_gap` seconds ago, and waits at most REFRESH_WAIT seconds for it.
        True if `kid` is known now. Callers at the same moment share one fetch."""
        if self.keys.knows(kid):
            return True  # someone else's refresh brought it meanwhile
        attempt = self._current or self._pending
        if attempt is None:
            if not self._running:
                return False
            if self._started_at is not None and self._clock() - self._started_at < self.min_refresh_gap:
                return False
            # Fetched by run's task, so it completes for the others even if this request gives up.
            attempt = self._pending = _Attempt()
            self._wake.set()
        with trio.move_on_after(REFRESH_WAIT):
            await attempt.done.wait()
        return self.keys.knows(kid)

    async def load(self) -> bool:
        """Fetches now in the calling task, whatever the rate limit (or joins a fetch under way);
        True if the keys loaded. For tools and tests: a server calls `run`."""
        return await self._attempt()

    async def _attempt(self) -> bool:
        if self._current is not None:
            # One fetch at a time: a second would only race the first to replace the keys.
            running = self._current
            await running.done.wait()
            return running.ok
        attempt = self._pending or _Attempt()
        self._pending = None
        self._current = attempt
        self._started_at = self._clock()
        self.fetches += 1
        try:
            attempt.ok = await self._fetch_and_load()
        finally:
            self._current = None
            attempt.done.set()
        return attempt.ok

    async def _fetch_and_load(self) -> bool:
        before = set(self.keys.kids)
        try:
            with trio.fail_after(FETCH_TIMEOUT):
                data = await self._fetch(self.location)
            if len(data) > MAX_DOCUMENT_BYTES:
                raise ValueError(f"the JWKS is larger than {MAX_DOCUMENT_BYTES} bytes")
            removed = self.keys.load(data)
        except trio.TooSlowError:
            return self._failed(f"no answer within {FETCH_TIMEOUT:g} s")
        except Exception as error:
            # Network, file or document: whatever it is, the keys already loaded stay in use.
            return self._failed(_describe(error))
        self._loaded(before, removed)
        return True

    def _failed(self, cause: str) -> bool:
        self.failures += 1
        self.last_error = cause
        if len(self._logged.current) < 20 and self._logged.failed(cause, cause):
            consequence = (
                "keeping the keys loaded before"
                if self.loaded.is_set()
                else "tokens signed with its keys are refused until it loads"
            )
            log.warning("JWKS %s could not be loaded: %s; %s, retrying", self.location, cause, consequence)
        return False

    def _loaded(self, before: set[str], removed: set[str]) -> None:
        after = set(self.keys.kids)
        self.refreshes += 1
        self.fetched_at = self._clock()
        if self.last_error is not None:
            log.info("JWKS %s loaded again (%d keys)", self.location, len(after))
        elif not self.loaded.is_set():
            log.info("JWKS %s loaded: kids %s", self.location, ", ".join(sorted(after)) or '""')
        elif after != before or removed:
            log.info(
                "JWKS %s changed: added %s, removed or replaced %s",
                self.location,
                sorted(after - before),
                sorted(removed),
            )
        if self.keys.skipped != self._skipped_logged:
            self._skipped_logged = list(self.keys.skipped)
            if self._skipped_logged:
                log.warning("JWKS %s: skipped %s", self.location, "; ".join(self._skipped_logged))
        self.last_error = None
        self._logged = Causes()  # over: each cause is told again if it comes back
        self.loaded.set()
        if removed and self._on_change is not None:
            try:
                self._on_change(removed)
            except Exception:
                log.exception("JWKS %s: the change hook failed", self.location)

    def stats(self) -> dict[str, object]:
        return {
            "location": self.location,
            "loaded": self.loaded.is_set(),
            "kids": self.keys.kids,
            "skipped": list(self.keys.skipped),
            "fetches": self.fetches,
            "refreshes": self.refreshes,
            "failures": self.failures,
            "last_error": self.last_error,
            "fetched_at": self.fetched_at,
        }


def _describe(error: BaseException) -> str:
    """One line for the log and stats. httpx errors raised under trio often say nothing
    themselves (a bare "ConnectError"): the reason is down their chain of causes."""
    parts = [str(error) or type(error).__name__]
    cause = error.__cause__ or error.__context__
    while cause is not None and len(parts) < 4:
        text = str(cause)
        if text and text not in parts:
            parts.append(text)
        cause = cause.__cause__ or cause.__context__
    return ": ".join(parts)[:300]
