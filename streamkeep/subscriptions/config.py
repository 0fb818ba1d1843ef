"""A subscription's configuration: validation, normalization, the idempotency hash, which paths
its pattern links."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from streamkeep.protocol.errors import ProtocolError, bad_request
from streamkeep.protocol.globs import Glob, compile_glob
from streamkeep.protocol.names import REGISTRY_STREAM, check_stream_name

DEFAULT_LEASE_MS = 30_000
MIN_LEASE_MS = 1_000
MAX_LEASE_MS = 600_000
_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")


def check_id(subscription_id: str) -> None:
    if not _ID.fullmatch(subscription_id):
        raise bad_request("INVALID_SUBSCRIPTION_ID", "subscription ids are 1-128 of A-Z a-z 0-9 . _ ~ -")


def not_found(subscription_id: str) -> ProtocolError:
    return ProtocolError(404, "SUBSCRIPTION_NOT_FOUND", f"no subscription {subscription_id!r}")


@dataclass(frozen=True)
class SubscriptionConfig:
    type: str  # "webhook" or "pull-wake"
    pattern: str | None
    streams: tuple[str, ...]
    webhook_url: str | None
    wake_stream: str | None
    lease_ttl_ms: int
    description: str | None

    @classmethod
    def parse(cls, body: bytes) -> SubscriptionConfig:
        try:
            raw = json.loads(body or b"null")
        except (ValueError, RecursionError):
            raise bad_request("INVALID_JSON", "the subscription body must be a JSON object") from None
        if not isinstance(raw, dict):
            raise bad_request("INVALID_SUBSCRIPTION", "the subscription body must be a JSON object")
        kind = raw.get("type")
        if kind not in ("webhook", "pull-wake"):
            raise bad_request("INVALID_SUBSCRIPTION", "type must be webhook or pull-wake")
        pattern = raw.get("pattern")
        if pattern is not None and (not isinstance(pattern, str) or not pattern or len(pattern) > 1024):
            raise bad_request("INVALID_SUBSCRIPTION", "pattern must be a non-empty glob string")
        streams = normalize_streams(raw.get("streams", []))
        if pattern is None and not streams:
            raise bad_request("INVALID_SUBSCRIPTION", "give a pattern, streams, or both")
        webhook_url = wake_stream = None
        if kind == "webhook":
            webhook = raw.get("webhook")
            if not isinstance(webhook, dict) or not isinstance(webhook.get("url"), str):
                raise bad_request("INVALID_SUBSCRIPTION", "a webhook subscription needs webhook.url")
            webhook_url = webhook["url"]
        else:
            wake_stream = raw.get("wake_stream")
            if not isinstance(wake_stream, str):
                raise bad_request("INVALID_SUBSCRIPTION", "a pull-wake subscription needs wake_stream")
            _check_path(wake_stream)
            refuse_wake_stream(wake_stream, streams)
        lease = raw.get("lease_ttl_ms", DEFAULT_LEASE_MS)
        if isinstance(lease, bool) or not isinstance(lease, int) or not MIN_LEASE_MS <= lease <= MAX_LEASE_MS:
            raise bad_request(
                "INVALID_SUBSCRIPTION", "lease_ttl_ms must be a whole number from 1000 to 600000"
            )
        description = raw.get("description")
        if description is not None and (not isinstance(description, str) or len(description) > 4096):
            raise bad_request(
                "INVALID_SUBSCRIPTION", "description must be a string of at most 4096 characters"
            )
        return cls(kind, pattern, streams, webhook_url, wake_stream, lease, description)

    def to_json(self) -> dict:
        return {
            "type": self.type,
            "pattern": self.pattern,
            "streams": list(self.streams),
            "webhook_url": self.webhook_url,
            "wake_stream": self.wake_stream,
            "lease_ttl_ms": self.lease_ttl_ms,
            "description": self.description,
        }

    @classmethod
    def from_json(cls, raw: dict) -> SubscriptionConfig:
        return cls(
            raw["type"],
            raw["pattern"],
            tuple(raw["streams"]),
            raw["webhook_url"],
            raw["wake_stream"],
            raw["lease_ttl_ms"],
            raw["description"],
        )

    @property
    def hash(self) -> str:
        """The normalized configuration's hash: re-confirmation must match it exactly (§6.2)."""
        canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @cached_property
    def _glob(self) -> Glob | None:
        return None if self.pattern is None else compile_glob(self.pattern)

    def matches(self, path: str) -> bool:
        """Whether the pattern links `path`. Never the subscription's own wake stream: each wake
        event appended to it would be pending work, which wakes again, forever."""
        return self._glob is not None and path != self.wake_stream and self._glob.match(path)


def normalize_streams(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise bad_request("INVALID_SUBSCRIPTION", "streams must be a list of stream paths")
    for path in value:
        _check_path(path)
    return tuple(sorted(set(value)))


def refuse_wake_stream(wake_stream: str | None, streams: Iterable[str]) -> None:
    if wake_stream == REGISTRY_STREAM:
        # Wake events in it would make it no longer a State Protocol stream of streams: its
        # readers' fold breaks, and the server would refuse it at the next start (found by review).
        raise ProtocolError(
            403,
            "reserved_stream",
            f"{REGISTRY_STREAM} is the server's list of streams: it cannot be a wake stream",
        )
    if wake_stream is not None and wake_stream in streams:
        raise bad_request(
            "INVALID_SUBSCRIPTION",
            f"wake_stream {wake_stream[:100]!r} cannot also be one of the subscription's streams: "
            "each wake event appended to it would wake the subscription again",
        )


def _check_path(path: str) -> None:
    try:
        check_stream_name(path)
    except ProtocolError as error:
        raise bad_request("INVALID_STREAM_PATH", f"{path[:100]!r}: {error.message}") from None


__all__ = [
    "SubscriptionConfig",
    "check_id",
    "normalize_streams",
    "not_found",
    "refuse_wake_stream",
]
