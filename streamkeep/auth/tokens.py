"""Bearer tokens (JWTs) in, principals out: synchronous, no I/O, and cached.

Verification runs on the request path, so it never waits on the network: keys come from a
`KeyProvider` that already holds them. A token naming a key the provider does not have raises
`UnknownKey`, and the async caller decides whether to refresh the key set and try once more.

Each family of algorithms has its own key and nothing else: HS256 only with the shared secret,
RS256/ES256/EdDSA only with a key from the provider whose own algorithm is the token's. A token
therefore cannot pick how its signature is checked - which is the whole of the classic attack
where an HS256 token is "signed" with a public RSA key that the server then uses as an HMAC secret.

Decisions:

- `exp` is not required. Some issuers mint long-lived service tokens without one; when present
  it is enforced (with `leeway`), as are `nbf` and `iat` in the future.
- `iss` and `aud` are checked only when configured; a token's `aud` is ignored when no audience
  is configured (PyJWT would refuse every token carrying one). Configure the audience wherever the
  issuer also serves other applications.
- Time checks use the injected clock rather than PyJWT's, so cached and fresh verifications apply
  the very same rule, and a cached token expires exactly when an uncached one would.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import jwt

from streamkeep.auth.errors import AuthError, unauthorized
from streamkeep.auth.scopes import Grants

SECRET_ALGORITHMS = ("HS256",)
KEY_ALGORITHMS = ("RS256", "ES256", "EdDSA")
VIAS = ("bearer", "query", "link")
# Far above any real token (a few KiB at most), low enough that a hostile one costs little to refuse.
MAX_TOKEN_CHARS = 16 * 1024


@dataclass(frozen=True)
class Principal:
    """Who is asking and what they may do: `subject` is the token's `sub`, `expires_at` its `exp`
    (None: no expiry), `via` how it came ("bearer", "query" or "link")."""

    subject: str | None
    grants: Grants
    expires_at: float | None
    via: str


class KeyProvider(Protocol):
    def key_for(self, kid: str | None, alg: str) -> object | None:
        """The key to check a token signed with `alg` under `kid` (usable as PyJWT's `key`), or None
        when `kid` is unknown. May raise AuthError to refuse outright (a known key, wrong alg)."""
        ...


class UnknownKey(AuthError):
    """The token names a key the provider does not have (yet): refresh the keys and retry once."""

    def __init__(self, kid: str | None) -> None:
        super().__init__(
            401,
            "unknown_key",
            "the token is signed with a key this server does not know; check that the issuer's "
            "key set (--auth-jwks-url) is the one that signed it",
        )
        self.kid = kid


@dataclass(frozen=True, slots=True)
class _Verified:
    principal: Principal
    not_before: float | None  # the later of nbf and iat, when present
    kid: str | None
    from_provider: bool  # checked with a provider key, so a key removal may concern it


class TokenVerifier:
    """Checks bearer tokens against a shared secret (HS256) and/or a key provider (a JWKS)."""

    def __init__(
        self,
        *,
        secret: str | None,
        keys: KeyProvider | None,
        issuer: str | None,
        audience: str | None,
        scope_claim: str = "scope",
        leeway: float = 30.0,
        cache_size: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # Empty settings mean "not configured" (that is how the config file spells it).
        self._secret = secret or None
        self._keys = keys
        if self._secret is None and keys is None:
            raise ValueError("a token verifier needs a shared secret, a key provider, or both")
        if not scope_claim:
            raise ValueError("scope_claim must name a claim, e.g. scope, scp or permissions")
        self._issuer = issuer or None
        self._audience = audience or None
        self._scope_claim = scope_claim
        self._leeway = leeway
        self._cache_size = cache_size
        self._clock = clock
        self._cache: dict[str, _Verified] = {}
        self._hits = 0
        self._misses = 0
        self._options: dict[str, Any] = {
            "verify_signature": True,
            "verify_exp": False,  # checked with our clock, see _check_times
            "verify_nbf": False,
            "verify_iat": False,
            "verify_aud": self._audience is not None,
            "verify_iss": self._issuer is not None,
            "verify_sub": True,
            "verify_jti": True,
            "require": [],
        }

    @property
    def has_secret(self) -> bool:
        """Are HS256 tokens accepted (a shared secret is configured)?"""
        return self._secret is not None

    @property
    def has_keys(self) -> bool:
        """Are RS256, ES256 and EdDSA tokens accepted (a key provider is configured)?"""
        return self._keys is not None

    # ---- verifying -----------------------------------------------------------------------

    def verify(self, token: str, via: str = "bearer") -> Principal:
        """The principal of a valid token; raises AuthError (401) saying why not, or UnknownKey."""
        if via not in VIAS:
            raise ValueError(f"via must be one of {VIAS}, not {via!r}")
        if not token:
            raise unauthorized("missing_token", "the token is empty: send Authorization: Bearer <token>")
        now = self._clock()
        cached = self._cache.get(token)
        if cached is not None:
            try:
                self._check_times(cached.not_before, cached.principal.expires_at, now)
            except AuthError:
                del self._cache[token]
                raise
            self._hits += 1
            principal = cached.principal
            return principal if principal.via == via else replace(principal, via=via)
        self._misses += 1
        verified = self._verify(token, via, now)
        if self._cache_size > 0:
            self._cache[token] = verified
            while len(self._cache) > self._cache_size:
                del self._cache[next(iter(self._cache))]  # the oldest entry: dicts keep insertion order
        return verified.principal

    def _verify(self, token: str, via: str, now: float) -> _Verified:
        if len(token) > MAX_TOKEN_CHARS:
            raise unauthorized("malformed_token", f"the token is longer than {MAX_TOKEN_CHARS} characters")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise unauthorized(
                "malformed_token", "the token is not a JWT (header.payload.signature)"
            ) from None
        alg = header.get("alg")
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise unauthorized("malformed_token", "the token's kid header is not a string")
        key: object
        if alg in SECRET_ALGORITHMS:
            if self._secret is None:
                raise unauthorized(
                    "unsupported_algorithm",
                    "this server takes no HS256 tokens (no shared secret is configured); use a token "
                    "signed with a key from its JWKS",
                )
            key = self._secret
            from_provider = False
        elif alg in KEY_ALGORITHMS:
            if self._keys is None:
                raise unauthorized(
                    "unsupported_algorithm",
                    "this server takes HS256 tokens only (no JWKS is configured); sign with the shared secret",
                )
            found = self._keys.key_for(kid, alg)
            if found is None:
                raise UnknownKey(kid)
            key = found
            from_provider = True
        else:
            # `none` and everything else: the header's alg is not echoed, it is the attacker's text.
            raise unauthorized(
                "unsupported_algorithm",
                f"the token's algorithm is not accepted; use one of {', '.join(SECRET_ALGORITHMS + KEY_ALGORITHMS)}",
            )
        try:
            # Pinning `algorithms` to the header's own alg is safe only because the key was chosen
            # for that alg above: the secret for HS256, a provider key whose alg is exactly this.
            claims = jwt.decode(
                token,
                key,  # type: ignore[arg-type]
                algorithms=[alg],
                audience=self._audience,
                issuer=self._issuer,
                options=self._options,  # type: ignore[arg-type]
            )
        except jwt.PyJWTError as error:
            raise self._refusal(error) from None
        not_before = _latest(_numeric_date(claims, "nbf"), _numeric_date(claims, "iat"))
        expires_at = _numeric_date(claims, "exp")
        self._check_times(not_before, expires_at, now)
        principal = Principal(
            subject=claims.get("sub") or None,
            grants=Grants.from_claim(claims.get(self._scope_claim)),
            expires_at=expires_at,
            via=via,
        )
        return _Verified(principal, not_before, kid, from_provider)

    def _check_times(self, not_before: float | None, expires_at: float | None, now: float) -> None:
        # The same comparisons as PyJWT's, so a cached token is refused exactly when a fresh one is.
        if not_before is not None and not_before > now + self._leeway:
            raise unauthorized(
                "not_yet_valid", "the token is not valid yet (nbf/iat); check the clocks of issuer and server"
            )
        if expires_at is not None and expires_at <= now - self._leeway:
            raise unauthorized("expired", "the token has expired; get a new one from its issuer")

    def _refusal(self, error: jwt.PyJWTError) -> AuthError:
        # Subclasses before their bases: InvalidSignatureError is a DecodeError.
        if isinstance(error, jwt.ExpiredSignatureError):
            return unauthorized("expired", "the token has expired; get a new one from its issuer")
        if isinstance(error, jwt.ImmatureSignatureError):
            return unauthorized("not_yet_valid", "the token is not valid yet; check the clocks")
        if isinstance(error, jwt.InvalidAudienceError) or (
            isinstance(error, jwt.MissingRequiredClaimError) and error.claim == "aud"
        ):
            return unauthorized(
                "bad_audience", f"the token is not meant for this server (aud must be {self._audience!r})"
            )
        if isinstance(error, jwt.InvalidIssuerError) or (
            isinstance(error, jwt.MissingRequiredClaimError) and error.claim == "iss"
        ):
            return unauthorized(
                "bad_issuer", f"the token is not from the expected issuer (iss must be {self._issuer!r})"
            )
        if isinstance(error, jwt.InvalidSignatureError):
            return unauthorized(
                "bad_signature",
                "the token's signature does not verify: it was altered or signed with another key",
            )
        if isinstance(error, jwt.InvalidAlgorithmError | jwt.InvalidKeyError):
            return unauthorized(
                "unsupported_algorithm", "the token's algorithm does not fit this server's keys"
            )
        return unauthorized("malformed_token", "the token's header or claims are not well-formed")

    # ---- the cache -----------------------------------------------------------------------

    def forget_kids(self, kids: Iterable[str]) -> int:
        """Drops cached tokens checked with keys that are gone (a key set refresh removed or
        replaced them), so those tokens are checked again - and refused. Returns how many."""
        gone = set(kids)
        if not gone:
            return 0
        # A token without a kid was checked with whichever single key was loaded: it may be gone.
        stale = [
            token
            for token, entry in self._cache.items()
            if entry.from_provider and (entry.kid is None or entry.kid in gone)
        ]
        for token in stale:
            del self._cache[token]
        return len(stale)

    def clear_cache(self) -> None:
        self._cache.clear()

    def cache_info(self) -> dict[str, int]:
        return {"hits": self._hits, "misses": self._misses, "size": len(self._cache)}


def _numeric_date(claims: dict[str, Any], name: str) -> float | None:
    """A NumericDate claim, or None when absent. JSON numbers only: Python's JSON parser accepts
    NaN and Infinity, which would compare as never expiring, and PyJWT would accept "123"."""
    value = claims.get(name)
    if value is None:
        return None
    try:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError
        seconds = float(value)  # OverflowError for an int too large to be a date
        if not math.isfinite(seconds):
            raise ValueError
    except (ValueError, OverflowError):
        raise unauthorized(
            "malformed_token", f"the token's {name} claim is not a number of seconds"
        ) from None
    return seconds


def _latest(*values: float | None) -> float | None:
    present = [value for value in values if value is not None]
    return max(present) if present else None
