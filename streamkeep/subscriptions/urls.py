"""Webhook URL rules against server-side request forgery (§12.8)."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

import trio

from streamkeep.protocol.errors import ProtocolError


def _rejected(url: str, why: str) -> ProtocolError:
    return ProtocolError(400, "WEBHOOK_URL_REJECTED", f"webhook URL {url[:200]!r} rejected: {why}")


def check_webhook_url(url: str, *, allow_loopback: bool) -> None:
    """https only, never to private, loopback, link-local or other local targets. With
    `allow_loopback` (development: --allow-loopback-webhooks), http://localhost and
    http://127.0.0.x are allowed too."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - validates the port
    except ValueError as error:
        raise _rejected(url, f"not a URL ({error})") from None
    if parts.scheme not in ("https", "http") or not host:
        raise _rejected(url, "use an https:// URL")
    if parts.username or parts.password:
        raise _rejected(url, "credentials in the URL are not allowed")
    loopback_name = host == "localhost" or host.endswith(".localhost")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    is_loopback = loopback_name or (address is not None and address.is_loopback)
    dev_ok = allow_loopback and (loopback_name or (address is not None and host.startswith("127.0.0.")))
    if is_loopback and not dev_ok:
        raise _rejected(url, "loopback targets need --allow-loopback-webhooks (development only)")
    if address is not None and not is_loopback and not address.is_global:
        raise _rejected(url, "private, link-local and reserved addresses are not allowed")
    if parts.scheme == "http" and not dev_ok:
        raise _rejected(url, "use https:// (plain http is only for loopback in development)")


async def check_resolved(url: str, *, allow_loopback: bool) -> None:
    """Refuses a webhook host name that resolves to a non-public address (checked at each delivery,
    since DNS answers change). The HTTP client resolves again, so a rebinding attacker with a
    near-zero TTL still has a small window; an egress proxy closes it fully."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        ipaddress.ip_address(host)
        return  # literals were checked when the subscription was created
    except ValueError:
        pass
    try:
        infos = await trio.socket.getaddrinfo(host, parts.port or (443 if parts.scheme == "https" else 80))
    except OSError as error:
        raise _rejected(url, f"its host does not resolve ({error})") from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        loopback_ok = allow_loopback and address.is_loopback
        if not address.is_global and not loopback_ok:
            raise _rejected(url, f"its host resolves to a non-public address ({address})")
