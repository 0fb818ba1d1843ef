"""Authentication and authorization, as rules with (almost) no I/O in them.

Who is asking: `tokens` checks bearer JWTs (HS256 with a shared secret; RS256, ES256 and EdDSA
with the issuer's keys, which `jwks` keeps loaded), and `links` checks signed read links. What
they may do: `scopes` turns a token's scope claim into grants over stream names. How much:
`quotas` meters appends per subject. Every refusal is an `errors.AuthError` with a stable reason.

The HTTP layer calls these on every request, so they are synchronous and cheap: the only I/O, the
key set fetch, runs in `JwksSource.run`'s own task, never in a request.
"""

from streamkeep.auth.errors import AuthError, forbidden, rate_limited, unauthorized
from streamkeep.auth.jwks import JwksKeys, JwksSource
from streamkeep.auth.links import LinkKeys, link_url
from streamkeep.auth.links import sign as sign_link
from streamkeep.auth.links import verify as verify_link
from streamkeep.auth.quotas import Quotas
from streamkeep.auth.scopes import ACTIONS, Grants
from streamkeep.auth.tokens import KeyProvider, Principal, TokenVerifier, UnknownKey

__all__ = [
    "ACTIONS",
    "AuthError",
    "Grants",
    "JwksKeys",
    "JwksSource",
    "KeyProvider",
    "LinkKeys",
    "Principal",
    "Quotas",
    "TokenVerifier",
    "UnknownKey",
    "forbidden",
    "link_url",
    "rate_limited",
    "sign_link",
    "unauthorized",
    "verify_link",
]
