"""The auth gate as the settings describe it: on when a JWT secret or a JWKS is configured."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from streamkeep.auth.gate import Gate
from streamkeep.auth.jwks import JwksKeys, JwksSource
from streamkeep.auth.links import LinkKeys
from streamkeep.auth.quotas import Quotas
from streamkeep.auth.tokens import TokenVerifier
from streamkeep.storage.files import OS, FileSystem

log = logging.getLogger("streamkeep.auth")

LINK_KEYS_FILE = Path("keys") / "link-keys"


def enabled(settings: SimpleNamespace) -> bool:
    return bool(settings.auth.jwt_secret or settings.auth.jwks_url)


def link_keys(settings: SimpleNamespace, data_dir: Path | None, fs: FileSystem = OS) -> LinkKeys | None:
    """The signed-link key ring: configured, else kept in the data directory (made at first use)."""
    if settings.auth.link_keys:
        return LinkKeys.parse(settings.auth.link_keys)
    if data_dir is None:
        return None
    return LinkKeys.load_or_create(data_dir / LINK_KEYS_FILE, fs=fs)


def build_gate(settings: SimpleNamespace, data_dir: Path | None, fs: FileSystem = OS) -> Gate | None:
    if not enabled(settings):
        return None
    auth = settings.auth
    keys = source = None
    verifier: TokenVerifier
    if auth.jwks_url:
        keys = JwksKeys()
    verifier = TokenVerifier(
        secret=auth.jwt_secret or None,
        keys=keys,
        issuer=auth.issuer or None,
        audience=auth.audience or None,
        scope_claim=auth.scope_claim,
        leeway=auth.leeway,
        cache_size=auth.token_cache_size,
    )
    if keys is not None:
        source = JwksSource(
            auth.jwks_url,
            keys,
            refresh_interval=auth.jwks_refresh,
            min_refresh_gap=auth.jwks_min_refresh_interval,
            on_change=verifier.forget_kids,
        )
    quota = settings.quota
    quotas = None
    if quota.appends_per_second or quota.bytes_per_second:
        quotas = Quotas(
            appends_per_second=quota.appends_per_second or None,
            bytes_per_second=quota.bytes_per_second or None,
            burst_seconds=quota.burst,
        )
    return Gate(verifier, jwks=source, link_keys=link_keys(settings, data_dir, fs), quotas=quotas)


def jwks_readiness(gate: Gate | None) -> Callable[[], str | None] | None:
    if gate is None or gate.jwks is None:
        return None
    source = gate.jwks

    def check() -> str | None:
        if source.loaded.is_set():
            return None
        return "waiting for the first load of the JWKS (see the log, or /stats with an admin token)"

    return check


def describe(gate: Gate | None) -> str:
    if gate is None:
        return "off (anyone who reaches the port may do anything; set --auth-jwt-secret or --auth-jwks-url)"
    kinds = []
    if gate.verifier.has_secret:
        kinds.append("HS256 secret")
    if gate.jwks is not None:
        kinds.append(f"JWKS {gate.jwks.location}")
    return "bearer tokens (" + ", ".join(kinds) + ")"
