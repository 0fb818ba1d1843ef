"""Why a request was refused, in a form the HTTP layer can answer and metrics can count.

Every refusal carries a `reason` from a small fixed vocabulary, because it becomes a Prometheus
label: free text there would make one time series per distinct message. The `message` is for the
person holding the token and says what to do next; it never echoes the token or a secret.
"""

from __future__ import annotations

REASONS = frozenset(
    {
        "missing_token",
        "malformed_token",
        "bad_signature",
        "expired",
        "not_yet_valid",
        "bad_audience",
        "bad_issuer",
        "unknown_key",
        "unsupported_algorithm",
        "bad_link",
        "expired_link",
        "insufficient_scope",
        "quota",
    }
)


class AuthError(Exception):
    """A refused request: `status` is 401 (who are you?), 403 (not allowed) or 429 (slow down);
    `retry_after` is the seconds a 429 should wait before trying again."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None) -> None:
        # A typo here would silently mint a new metrics label: fail where it is written instead.
        if reason not in REASONS:
            raise ValueError(f"unknown auth refusal reason {reason!r}")
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"AuthError({self.status}, {self.reason!r}, {self.message!r})"


def unauthorized(reason: str, message: str) -> AuthError:
    return AuthError(401, reason, message)


def forbidden(message: str) -> AuthError:
    return AuthError(403, "insufficient_scope", message)


def rate_limited(retry_after: float, message: str) -> AuthError:
    return AuthError(429, "quota", message, retry_after=retry_after)
