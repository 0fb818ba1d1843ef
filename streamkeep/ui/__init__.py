"""The stream browser at /ui/: plain ES modules and CSS in `static/`, served as they are.

There is no build step: each page is one module (`streams.js` the list, `stream.js` one stream),
beside `app.js` (the router and the token field), `api.js` (fetch with the token, the SSE reader,
the registry follower), `chart.js` and `style.css`. Edit one and reload the page after restarting
the server: the files are read once, at start, so a request never touches the disk.

Security, since the UI shares its origin with stream content:

- The files are public (a browser opening /ui/ sends no token) and hold no data; everything the
  page shows comes from the API, behind the auth gate, with the token the user pasted. The page
  keeps it in `sessionStorage` (this tab only) and sends it as `Authorization: Bearer`, live
  reads included (fetch streaming, never EventSource and never `?token=`), so it is never in a URL.
- These files get a strict CSP of their own (`CSP` below: scripts only from /ui/, no inline
  script, not framable); every other response of the server gets `Content-Security-Policy:
  sandbox`, so a stream of text/html opened directly runs no script and has an opaque origin.
- The page renders stream content only as text (`textContent`), never as HTML.
"""

from __future__ import annotations

import hashlib
import ipaddress
from importlib import resources

from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.model import Request, Response

PREFIX = "/ui/"
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
_HEADERS = [
    ("Content-Security-Policy", CSP),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    ("Cross-Origin-Opener-Policy", "same-origin"),
    # Revalidated at every load (a 304 by ETag), so a newer server's files are never mixed with
    # an older cached module.
    ("Cache-Control", "no-cache"),
]


class UiFiles:
    """The files of `static/`, loaded once; `serve` answers GET and HEAD under /ui/."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[bytes, str, str]] = {}  # name -> body, content type, ETag
        for entry in resources.files(__package__).joinpath("static").iterdir():
            suffix = "." + entry.name.rpartition(".")[2]
            if entry.is_file() and suffix in CONTENT_TYPES:
                body = entry.read_bytes()
                tag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
                self.files[entry.name] = (body, CONTENT_TYPES[suffix], tag)

    def serve(self, request: Request) -> Response:
        path = request.raw_path
        if path == PREFIX[:-1]:  # relative module URLs need the trailing slash
            return Response(308, [("Location", PREFIX), ("Cache-Control", "no-store")])
        name = path[len(PREFIX) :] or "index.html"
        found = self.files.get(name)  # a lookup in a fixed table: no path ever reaches the disk
        if found is None:
            raise ProtocolError(404, "not_found", f"the stream browser has no file {name[:100]!r}")
        body, content_type, tag = found
        headers = [("Content-Type", content_type), ("ETag", tag), *_HEADERS]
        if request.headers.get("if-none-match") == tag:
            return Response(304, [h for h in headers if h[0] != "Content-Type"])
        return Response(200, headers, body)


def exposure_warning(host: str, *, ui_on: bool, auth_on: bool) -> str | None:
    """The warning to log at start when the UI is on, auth is off and `host` is not loopback:
    anyone who reaches the port then gets a point-and-click way to read and delete every stream."""
    if not ui_on or auth_on or is_loopback(host):
        return None
    return (
        f"the stream browser (/ui/) is on and auth is off, listening on {host or 'every address'}: "
        "anyone who reaches this port can browse, append to and delete every stream. Turn auth on "
        "(--auth-jwt-secret, --auth-jwks-url), listen on 127.0.0.1, or pass --no-ui"
    )


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name (or "" for every address): it may well face a network


__all__ = ["CSP", "PREFIX", "UiFiles", "exposure_warning", "is_loopback"]
