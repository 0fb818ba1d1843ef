"""The auth gate: who is asking (a bearer token, a `token` query parameter, a signed link) and
whether the route they ask for is theirs, before any actor sees the request.

Authentication comes first, so a request without a valid credential gets 401 whatever it names;
authorization is checked on the canonical stream name `routes.classify` decoded, before the
stream is looked up, so neither 401 nor 403 says whether a stream exists. A few paths are public
by design: CORS preflights (browsers send no credentials with them), the liveness and readiness
probes, the subscriptions' JWKS, and the wake endpoints, which check tokens of their own.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable

from streamkeep.auth.errors import AuthError, forbidden, rate_limited, unauthorized
from streamkeep.auth.jwks import JwksSource
from streamkeep.auth.links import LinkKeys
from streamkeep.auth.links import verify as verify_link
from streamkeep.auth.quotas import Quotas
from streamkeep.auth.scopes import Grants
from streamkeep.auth.tokens import Principal, TokenVerifier, UnknownKey
from streamkeep.protocol import responses, routes
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Request, Response
from streamkeep.protocol.names import CONTROL_PREFIX, STREAM_PREFIX, WAKE_ACTIONS, parse_stream_name
from streamkeep.registry.entries import NAME as REGISTRY

REALM = 'Bearer realm="streamkeep"'
_WAKE_ENDPOINTS = tuple(f"/{action}" for action in WAKE_ACTIONS)
_READ_METHODS = ("GET", "HEAD")
# Which grants allow an action on the registry, named exactly (globs never reach it, see below).
_REGISTRY_GRANTS = {
    "read": ("read", "write", "read_names"),
    "append": ("append", "write"),
    "write": ("write",),
}
# Writes the append quota counts: appends, closes, and creates and forks (which may carry a body).
_CHARGED = frozenset((routes.APPEND, routes.CLOSE, routes.CREATE, routes.FORK))


def is_public(request: Request) -> bool:
    """Paths anyone may call: they either reveal nothing or check credentials of their own."""
    method = request.method
    path = request.raw_path
    if method == "OPTIONS":
        return True
    if path in ("/healthz", "/readyz"):
        return method in _READ_METHODS
    if path == "/ui" or path.startswith(routes.UI_PREFIX):
        # The stream browser's own files: the same for everyone and holding no data (a browser
        # opening /ui/ sends no token); what the page shows comes from APIs behind the gate.
        return method in _READ_METHODS
    if path.startswith(CONTROL_PREFIX):
        rest = path[len(CONTROL_PREFIX) :]
        if rest == "jwks.json":
            return True
        return method == "POST" and rest.startswith("subscriptions/") and rest.endswith(_WAKE_ENDPOINTS)
    return False


class Gate:
    def __init__(
        self,
        verifier: TokenVerifier,
        *,
        jwks: JwksSource | None = None,
        link_keys: LinkKeys | None = None,
        quotas: Quotas | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.verifier = verifier
        self.jwks = jwks
        self.link_keys = link_keys
        self.quotas = quotas
        self._now = clock
        self.refusals: Counter[str] = Counter()  # by reason, for metrics

    # ---- who is asking -------------------------------------------------------------------

    async def authenticate(self, request: Request) -> Principal | None:
        """The principal behind `request`, or None for a public path; raises AuthError (401)."""
        if is_public(request):
            return None
        try:
            return await self._authenticate(request)
        except AuthError as error:
            self.refusals[error.reason] += 1
            raise

    async def _authenticate(self, request: Request) -> Principal:
        header = request.headers.get("authorization")
        if header is not None:
            scheme, _, token = header.strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise unauthorized("malformed_token", "send Authorization: Bearer <token>")
            request.credential = token.strip()
            return await self._verify(request.credential, "bearer")
        if request.method in _READ_METHODS and request.query_string:
            # EventSource cannot send headers: a read may carry its token in the URL instead.
            tokens = request.query("token")
            if tokens:
                request.credential = tokens[0]
                return await self._verify(tokens[0], "query")
            signed = request.query("signed")
            if signed:
                return self._link(request, signed[0])
        raise unauthorized(
            "missing_token",
            "this server needs a token: send Authorization: Bearer <token> (or ?token= on a GET)",
        )

    async def _verify(self, token: str, via: str) -> Principal:
        try:
            return self.verifier.verify(token, via)
        except UnknownKey as unknown:
            # A key the JWKS did not have when it was last fetched: maybe it rotated. Fetch again
            # (rate-limited inside, so random kids cannot become a flood) and try once more.
            if self.jwks is None or not await self.jwks.refresh_for(unknown.kid):
                raise
            return self.verifier.verify(token, via)

    def _link(self, request: Request, value: str) -> Principal:
        if self.link_keys is None:
            raise unauthorized(
                "bad_link", "signed links are not configured on this server (--auth-link-keys)"
            )
        if not request.raw_path.startswith(STREAM_PREFIX):
            raise unauthorized("bad_link", "a signed link grants reading one stream only")
        try:
            name = parse_stream_name(request.raw_path)
        except Exception:
            raise unauthorized("bad_link", "this signed link is not valid for this path") from None
        return verify_link(self.link_keys, value, name, self._now())

    # ---- may they ------------------------------------------------------------------------

    def authorize(self, principal: Principal | None, route: routes.Route, request: Request) -> None:
        """Raises AuthError (403, or 429 past a quota) unless `principal` may take `route`."""
        try:
            self._authorize(principal, route, request)
        except AuthError as error:
            self.refusals[error.reason] += 1
            raise

    def allows(self, principal: Principal | None, route: routes.Route, request: Request) -> bool:
        """`authorize` as a question, counting no refusal: the admin API lists only the streams
        its caller could read, by the very rule a read would meet."""
        try:
            self._authorize(principal, route, request)
        except AuthError:
            return False
        return True

    def _authorize(self, principal: Principal | None, route: routes.Route, request: Request) -> None:
        kind = route.kind
        if principal is None:
            return  # a public path (authenticate let nothing else through without a principal)
        grants = principal.grants
        if route.name is not None:
            needed = routes.NEEDS[kind]
            if not grants.allows(needed, route.name):
                raise forbidden(f"this token does not grant {needed} on {route.name!r}")
            if route.name == REGISTRY and not _names_registry(grants, needed):
                raise forbidden(
                    f"{REGISTRY} lists every stream: it needs {needed}:{REGISTRY} itself or admin, not a glob"
                )
            if route.fork_source is not None and not grants.allows("read", route.fork_source):
                raise forbidden(f"a fork needs read on its source {route.fork_source!r}")
            if kind in _CHARGED and self.quotas is not None:
                self._charge(principal, request)
            return
        if kind in (routes.METRICS, routes.STATS) and not grants.admin:
            raise forbidden(f"{request.raw_path} needs the admin scope")
        # Subscriptions check ownership themselves (SubscriptionManager), with the principal the
        # service hands them; other paths answer 404 to anyone who authenticated.

    def _charge(self, principal: Principal, request: Request) -> None:
        assert self.quotas is not None
        # Tokens without `sub` are limited one by one, by their signature: one token has one
        # signature however its header is spelt (PyJWT >= 2.14 refuses loose base64).
        key = principal.subject or f"token:{request.credential.rpartition('.')[2]}"
        wait = self.quotas.charge(key, len(request.body))
        if wait is not None:
            seconds = max(1, math.ceil(wait))
            raise rate_limited(
                seconds,
                f"append quota of this token exceeded; retry in {seconds} s or ask for a bigger quota",
            )

    def stats(self) -> dict:
        out: dict[str, object] = {"refusals": dict(self.refusals), "token_cache": self.verifier.cache_info()}
        if self.jwks is not None:
            out["jwks"] = self.jwks.stats()
        if self.quotas is not None:
            out["quotas"] = self.quotas.stats()
        return out


def _names_registry(grants: Grants, needed: str) -> bool:
    """Whether `grants` name the registry literally. It lists the names of every stream, so a
    glob (`read:**`, `read:*`) does not reach it: a token for `read:team-a/**` must not learn the
    other teams' stream names, and even `read:**` reads streams it can name, which is not the
    same as listing them all. `read:__registry__` (or a signed link to it) or admin do."""
    return grants.admin or any(REGISTRY in getattr(grants, kind) for kind in _REGISTRY_GRANTS.get(needed, ()))


def auth_response(error: AuthError) -> Response:
    """401 with `WWW-Authenticate: Bearer` (RFC 6750), 403 insufficient_scope, or 429."""
    headers = [("Cache-Control", responses.NO_STORE)]
    if error.status == 401:
        challenge = REALM
        if error.reason != "missing_token":
            challenge += f', error="invalid_token", error_description="{_quoted(error.message)}"'
        headers.append(("WWW-Authenticate", challenge))
    elif error.status == 403:
        headers.append(("WWW-Authenticate", f'{REALM}, error="insufficient_scope"'))
    if error.retry_after is not None:
        headers.append(("Retry-After", str(max(1, math.ceil(error.retry_after)))))
    return responses.error(ProtocolError(error.status, error.reason, error.message, headers))


def _quoted(text: str) -> str:
    return "".join(c for c in text if c not in '"\\' and 0x20 <= ord(c) < 0x7F)
