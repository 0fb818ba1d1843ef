"""What a request is, before anything acts on it: its kind, the stream it names and what it needs.

One pure function (`classify`) read by three parts: the service dispatches on the kind, the auth
gate checks the permission the kind needs on the canonical stream name, and metrics and the access
log count by the kind. Deciding it once keeps the three from disagreeing about, say, whether a PUT
with `Stream-Forked-From` is a fork.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.headers import closed_flag
from streamkeep.protocol.model import Request
from streamkeep.protocol.names import CLUSTER_PREFIX, CONTROL_PREFIX, STREAM_PREFIX, parse_stream_name
from streamkeep.protocol.stream import ForkSpec

STREAM_METHODS = "GET, HEAD, PUT, POST, DELETE, OPTIONS"

# Kinds, also the `route` label of the request metrics.
CREATE = "create"
FORK = "fork"
APPEND = "append"
CLOSE = "close"  # an append with `Stream-Closed: true`: it ends the stream for every writer
READ = "read"
LIVE_READ = "live_read"
HEAD = "head"
DELETE = "delete"
SUBSCRIPTION = "subscription"
PREFLIGHT = "preflight"
HEALTH = "health"
READY = "ready"
METRICS = "metrics"
STATS = "stats"
COMPACT = "compact"  # POST /v1/compact/<name>: compaction of a State Protocol stream (admin)
COMPACT_PREFIX = "/v1/compact/"
# The stream browser's files (public: the same for everyone, no data) and the JSON admin API it
# reads (streamkeep/server/admin.py): the list is filtered by the caller's read grants, one stream needs read.
UI = "ui"
UI_PREFIX = "/ui/"
ADMIN_STREAMS = "admin_streams"  # GET /v1/admin/streams
ADMIN_STREAM = "admin_stream"  # GET /v1/admin/streams/<name>
ADMIN_PREFIX = "/v1/admin/streams"
INTERNAL = "internal"  # POST /_cluster/<op>: a call between cluster members (cluster/peers.py)
OTHER = "other"

# The permission each stream operation needs on its stream (a fork also needs read on its source).
NEEDS = {
    CREATE: "write",
    FORK: "write",
    APPEND: "append",
    CLOSE: "write",
    READ: "read",
    LIVE_READ: "read",
    HEAD: "read",
    DELETE: "write",
    COMPACT: "admin",
    ADMIN_STREAM: "read",
}


@dataclass(frozen=True, slots=True)
class Route:
    kind: str
    name: str | None = None  # the canonical stream name, for stream operations
    fork_source: str | None = None  # the canonical name a fork reads from
    live: str | None = None  # "long-poll" or "sse" for live reads


def classify(request: Request) -> Route:
    """The route of `request`; raises ProtocolError for a stream path that is not a valid name
    (400) or a reserved one (404), and for a fork whose source header is malformed."""
    method = request.method
    if method == "OPTIONS":
        return Route(PREFLIGHT)
    path = request.raw_path
    if path.startswith(CLUSTER_PREFIX):
        return Route(INTERNAL)
    if path.startswith(CONTROL_PREFIX):
        return Route(SUBSCRIPTION)
    if path.startswith(STREAM_PREFIX):
        if method not in ("GET", "HEAD", "PUT", "POST", "DELETE"):
            raise ProtocolError(
                405,
                "method_not_allowed",
                f"{method[:20]} is not a stream operation",
                [("Allow", STREAM_METHODS)],
            )
        name = parse_stream_name(path)
        if method == "PUT":
            fork = ForkSpec.from_headers(request.headers)
            return Route(CREATE, name) if fork is None else Route(FORK, name, fork.source)
        if method == "POST":
            return Route(CLOSE if closed_flag(request.headers) else APPEND, name)
        if method == "DELETE":
            return Route(DELETE, name)
        if method == "HEAD":
            return Route(HEAD, name)
        live = request.query("live")
        if live and live[0] in ("long-poll", "sse"):
            return Route(LIVE_READ, name, live=live[0])
        return Route(READ, name)
    if path.startswith(COMPACT_PREFIX) and method == "POST":
        return Route(COMPACT, parse_stream_name(STREAM_PREFIX + path[len(COMPACT_PREFIX) :]))
    if method in ("GET", "HEAD"):
        if path == "/ui" or path.startswith(UI_PREFIX):
            return Route(UI)
        if path == ADMIN_PREFIX:
            return Route(ADMIN_STREAMS)
        if path.startswith(ADMIN_PREFIX + "/"):
            rest = path[len(ADMIN_PREFIX) + 1 :]
            return Route(ADMIN_STREAM, parse_stream_name(STREAM_PREFIX + rest))
        if path == "/healthz":
            return Route(HEALTH)
        if path == "/readyz":
            return Route(READY)
        if path == "/metrics":
            return Route(METRICS)
    if path == "/stats" and method == "GET":
        return Route(STATS)
    return Route(OTHER)
