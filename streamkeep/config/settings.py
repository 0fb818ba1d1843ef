"""The table of settings: each defined once, with its flag, TOML key, DS_* variable and parser."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamkeep.config.values import (
    boolean,
    byte_size,
    cors_origins,
    duration,
    duration_or_off,
    existing_file,
    jwks_location,
    non_negative,
    one_of,
    optional_port,
    port,
    positive_int,
    text,
)


@dataclass(frozen=True)
class Setting:
    section: str
    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    old_names: tuple[str, ...] = ()  # TOML keys it had before a rename, still accepted

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def env_var(self) -> str:
        return f"DS_{self.section.upper()}__{self.name.upper()}"


SETTINGS: tuple[Setting, ...] = (
    Setting("server", "host", text, "127.0.0.1", "address to listen on"),
    Setting("server", "port", port, 4437, "TCP port to listen on (0 picks a free port)"),
    Setting(
        "server",
        "edge",
        one_of("lean", "quart"),
        "lean",
        "HTTP edge: lean (trio driving llhttp and h2 directly, fastest) or quart (quart-trio on hypercorn)",
        flag="--edge",
    ),
    Setting(
        "server",
        "long_poll_timeout",
        duration,
        30.0,
        "how long a long-poll waits for data before answering 204",
        aliases=("DS_SERVER__LONG_POLL_TIMEOUT_SECS",),
    ),
    Setting(
        "server",
        "sse_close_after",
        duration,
        60.0,
        "how long after its start an SSE response ends so clients reconnect (CDN collapsing)",
        aliases=("DS_SERVER__SSE_RECONNECT_INTERVAL_SECS",),
    ),
    Setting(
        "server",
        "send_stall_timeout",
        duration,
        30.0,
        "how long a streaming (SSE) client may take no bytes before it is disconnected; it resumes by offset",
    ),
    Setting(
        "server",
        "shutdown_grace",
        duration,
        10.0,
        "how long in-flight requests get to finish on SIGTERM/SIGINT",
    ),
    Setting(
        "server",
        "hibernate_after",
        duration,
        30.0,
        "how long a stream's actor stays in memory with no requests and no live readers",
    ),
    Setting(
        "server",
        "mailbox_size",
        positive_int,
        64,
        "messages queued per stream actor before senders wait (backpressure)",
    ),
    Setting("server", "backlog", positive_int, 1024, "listen backlog of the server socket"),
    Setting(
        "server",
        "h2_max_concurrent_streams",
        positive_int,
        1000,
        "HTTP/2 streams one connection may have open at once",
    ),
    Setting(
        "http",
        "cors_origins",
        cors_origins,
        "*",
        "origins browsers may call from, comma-separated (https://app.example.com,https://admin.example.com); "
        "* allows any. With a list, only a listed Origin is echoed back",
        flag="--cors-origins",
        aliases=("DS_HTTP__CORS_ORIGIN",),
        old_names=("cors_origin",),
    ),
    Setting(
        "server",
        "allow_loopback_webhooks",
        boolean,
        False,
        "let webhook subscriptions call http://localhost and http://127.0.0.x (development only)",
        flag="--allow-loopback-webhooks",
    ),
    Setting(
        "http",
        "cache_visibility",
        one_of("public", "private"),
        "public",
        "Cache-Control visibility of catch-up reads: public for shared streams, private otherwise",
    ),
    Setting(
        "limits",
        "max_body_bytes",
        byte_size,
        64 << 20,
        "largest request body; larger ones get 413 before they are buffered",
    ),
    Setting(
        "limits",
        "max_inflight_body_bytes",
        byte_size,
        512 << 20,
        "request-body bytes all connections together may have in memory; past it, 503 + Retry-After",
    ),
    Setting("limits", "max_stream_bytes", byte_size, 1 << 30, "most bytes one stream may hold"),
    Setting("limits", "max_total_bytes", byte_size, 4 << 30, "most bytes all streams together may hold"),
    Setting("limits", "read_chunk_bytes", byte_size, 1 << 20, "largest body one read returns"),
    Setting(
        "limits",
        "live_window_bytes",
        byte_size,
        4 << 20,
        "recent bytes per stream kept for live readers to share; readers further behind read by offset",
    ),
    Setting("limits", "body_timeout", duration, 300.0, "how long a client may take to send one request body"),
    Setting(
        "storage",
        "mode",
        one_of("disk", "memory"),
        "disk",
        "where streams live: disk (durable, under --data-dir) or memory (gone at exit)",
        flag="--storage",
    ),
    Setting("storage", "data_dir", text, "./data", "directory of the disk storage", flag="--data-dir"),
    Setting(
        "storage",
        "fsync",
        one_of("always", "interval", "never"),
        "always",
        "always: acknowledge an append only once it is on stable storage (group commit); "
        "interval: sync every --fsync-interval; never: leave it to the OS",
        flag="--fsync",
    ),
    Setting(
        "storage",
        "sync_method",
        one_of("fdatasync", "syncfs"),
        "fdatasync",
        "how --fsync always syncs: fdatasync per file, or one syncfs() per commit round (faster "
        "across many streams; also flushes other data on that file system, so for dedicated volumes)",
        flag="--sync-method",
    ),
    Setting(
        "storage",
        "fsync_interval",
        duration,
        1.0,
        "time between syncs under --fsync interval",
        flag="--fsync-interval",
    ),
    Setting(
        "storage",
        "segment_max_bytes",
        byte_size,
        64 << 20,
        "a segment file is sealed and a new one started past this size",
        flag="--segment-max-bytes",
    ),
    Setting(
        "storage",
        "segment_max_messages",
        positive_int,
        100_000,
        "a segment file is sealed and a new one started past this many appends",
        flag="--segment-max-messages",
    ),
    Setting(
        "storage",
        "segment_max_age",
        duration_or_off,
        0.0,
        "a segment is sealed once its first append is this old (0: off); with the cold "
        "tier, idle streams are sealed too, so their data reaches the bucket",
        flag="--segment-max-age",
    ),
    Setting(
        "storage",
        "min_free_bytes",
        byte_size,
        16 << 20,
        "free space on the data directory's file system kept for metadata: appends and creates get "
        "507 below it, while manifests, subscription state and deletes still work",
        flag="--min-free-bytes",
    ),
    Setting("storage", "io_threads", positive_int, 32, "worker threads for disk I/O", flag="--io-threads"),
    Setting(
        "storage",
        "read_before_serving",
        duration_or_off,
        1.0,
        "at start, how long to read streams from disk before serving (0: serve at once): the ones "
        "not read by then are read in the background, each at once when first asked for, so a large "
        "directory serves in seconds (deletes, the TTL sweep, retention and the cold tier wait until "
        "all are read)",
        flag="--read-before-serving",
    ),
    Setting(
        "cold",
        "url",
        text,
        "",
        "S3 bucket for sealed segments, s3://BUCKET/PREFIX (off when empty)",
        flag="--cold-url",
    ),
    Setting(
        "cold",
        "endpoint",
        text,
        "",
        "S3 endpoint URL, e.g. http://127.0.0.1:9000 for MinIO (default: $AWS_ENDPOINT_URL, else AWS)",
        flag="--cold-endpoint",
    ),
    Setting(
        "cold", "region", text, "", "S3 region (default: $AWS_REGION, else us-east-1)", flag="--cold-region"
    ),
    Setting(
        "cold",
        "create_bucket",
        boolean,
        False,
        "create the bucket if it does not exist",
        flag="--cold-create-bucket",
    ),
    Setting(
        "cold",
        "keep_local",
        boolean,
        False,
        "keep uploaded segments on local disk as a cache",
        flag="--cold-keep-local",
    ),
    Setting(
        "cold",
        "high_water_bytes",
        byte_size,
        8 << 30,
        "sealed bytes waiting for upload past which appends get 503 + Retry-After",
        flag="--cold-high-water-bytes",
    ),
    Setting(
        "cold",
        "cache_bytes",
        byte_size,
        64 << 20,
        "memory cache for cold range reads",
        flag="--cold-cache-bytes",
    ),
    Setting("cold", "transfers", positive_int, 4, "concurrent S3 transfers", flag="--cold-transfers"),
    Setting(
        "tls",
        "cert",
        existing_file,
        None,
        "PEM certificate; serves HTTPS with ALPN h2",
        flag="--tls-cert",
        aliases=("DS_TLS__CERT_PATH",),
    ),
    Setting(
        "tls",
        "key",
        existing_file,
        None,
        "PEM private key for --tls-cert",
        flag="--tls-key",
        aliases=("DS_TLS__KEY_PATH",),
    ),
    Setting(
        "log", "level", one_of("debug", "info", "warning", "error"), "info", "log level", flag="--log-level"
    ),
    Setting(
        "log",
        "format",
        one_of("text", "json"),
        "text",
        "format of the server's own log lines and of the access log: text or json (one object per line)",
        flag="--log-format",
    ),
    Setting(
        "log",
        "access_log",
        text,
        "",
        "one line per request (time, client, method, path without tokens, status, bytes, duration, "
        "HTTP version): - for stdout or a file path; off when empty. Text lines use the common log format",
        flag="--access-log",
    ),
    Setting(
        "auth",
        "jwt_secret",
        text,
        "",
        "shared secret for HS256 bearer tokens; setting it (or --auth-jwks-url) turns auth on",
        flag="--auth-jwt-secret",
    ),
    Setting(
        "auth",
        "jwks_url",
        jwks_location,
        "",
        "https:// URL or local file of a JWKS with the public keys of RS256, ES256 and EdDSA tokens; "
        "fetched in the background and on an unknown kid (rate-limited)",
        flag="--auth-jwks-url",
    ),
    Setting(
        "auth",
        "issuer",
        text,
        "",
        "required iss claim of tokens (unchecked when empty)",
        flag="--auth-issuer",
    ),
    Setting(
        "auth",
        "audience",
        text,
        "",
        "required aud claim of tokens (unchecked when empty)",
        flag="--auth-audience",
    ),
    Setting(
        "auth",
        "scope_claim",
        text,
        "scope",
        "claim holding the permissions: a space-separated string or an array (scope, scp, permissions)",
        flag="--auth-scope-claim",
    ),
    Setting(
        "auth",
        "leeway",
        duration_or_off,
        30.0,
        "clock skew allowed when checking exp and nbf",
        flag="--auth-leeway",
    ),
    Setting(
        "auth",
        "jwks_refresh",
        duration,
        300.0,
        "time between background refreshes of --auth-jwks-url",
        flag="--auth-jwks-refresh",
    ),
    Setting(
        "auth",
        "jwks_min_refresh_interval",
        duration,
        10.0,
        "least time between two JWKS fetches caused by tokens with an unknown kid (a flood guard)",
        flag="--auth-jwks-min-refresh-interval",
    ),
    Setting(
        "auth",
        "token_cache_size",
        positive_int,
        10_000,
        "verified tokens remembered (each until it expires), so a signature is checked once per token",
        flag="--auth-token-cache-size",
    ),
    Setting(
        "auth",
        "link_keys",
        text,
        "",
        "keys of signed read links, kid=SECRET,kid2=SECRET2 (the first signs, all verify); when empty, "
        "a key kept in DATA_DIR/keys/link-keys (made at first use; `streamkeep sign --rotate` adds one)",
        flag="--auth-link-keys",
    ),
    Setting(
        "quota",
        "appends_per_second",
        non_negative,
        0.0,
        "appends one token subject may make per second (0: no limit); past it, 429 + Retry-After",
        flag="--quota-appends-per-second",
    ),
    Setting(
        "quota",
        "bytes_per_second",
        byte_size,
        0,
        "bytes one token subject may append per second (0: no limit); past it, 429 + Retry-After",
        flag="--quota-bytes-per-second",
    ),
    Setting(
        "quota",
        "burst",
        duration,
        2.0,
        "how much of its quota (as time at its rate) a quiet subject may save up and spend at once",
        flag="--quota-burst",
    ),
    Setting(
        "registry",
        "enabled",
        boolean,
        True,
        "keep __registry__, a JSON stream listing every stream (State Protocol inserts and deletes, "
        "as upstream's test-ui reads it); --no-registry turns it off and frees the name",
        flag="--no-registry",
    ),
    Setting(
        "retention",
        "max_age",
        duration_or_off,
        0.0,
        "drop a stream's sealed segments once their last append is this old (7d, 12h; 0: keep); "
        "the default rule, after any [[retention]] rules in the TOML file",
        flag="--retention-max-age",
    ),
    Setting(
        "retention",
        "max_bytes",
        byte_size,
        0,
        "drop a stream's oldest sealed segments while it holds more than this without them (0: keep)",
        flag="--retention-max-bytes",
    ),
    Setting(
        "retention",
        "interval",
        duration,
        30.0,
        "time between retention passes",
        flag="--retention-interval",
    ),
    Setting(
        "cluster",
        "member",
        text,
        "",
        "this process's id among the [cluster] members of the TOML file (empty: not in a cluster); "
        "each stream is served by the member that owns it (docs/scaling.md)",
        flag="--cluster-member",
    ),
    Setting(
        "cluster",
        "secret",
        text,
        "",
        "the secret cluster members sign requests they forward to each other with (the same on every "
        "member; without it a member refuses streams it does not own instead of forwarding them)",
        flag="--cluster-secret",
    ),
    Setting(
        "cluster",
        "epoch",
        positive_int,
        1,
        "the version of the [cluster] member list; members stamped with another refuse each other",
        flag="--cluster-epoch",
    ),
    Setting(
        "replication",
        "replicas",
        positive_int,
        1,
        "copies of each member's streams (1: one disk, as a single server; 2: every commit round is "
        "durable on the owner and on a follower before it is acknowledged, and the follower takes "
        "over when the owner's etcd lease expires; docs/scaling.md)",
        flag="--replicas",
    ),
    Setting(
        "replication",
        "replica",
        text,
        "",
        "with --replicas 2: which of the member's two replicas this process is, <member>a or "
        "<member>b (a starts as the owner)",
        flag="--replica",
    ),
    Setting(
        "replication",
        "listen",
        text,
        "",
        "with --replicas 2: host:port this replica accepts its follower on while it owns the member "
        "(the follower finds it in etcd)",
        flag="--replication-listen",
    ),
    Setting(
        "replication",
        "etcd",
        text,
        "",
        "with --replicas 2: the etcd cluster's client URLs, comma-separated (http://10.0.0.1:2379,...)",
        flag="--etcd",
    ),
    Setting(
        "replication",
        "etcd_prefix",
        text,
        "/streamkeep",
        "the key prefix of this cluster's records in etcd (one etcd may serve several clusters)",
        flag="--etcd-prefix",
    ),
    Setting(
        "replication",
        "lease_ttl",
        positive_int,
        4,
        "seconds a replica's etcd lease outlives its last renewal: an owner silent this long is "
        "taken for dead and its follower promoted",
        flag="--lease-ttl",
    ),
    Setting(
        "ui",
        "enabled",
        boolean,
        True,
        "serve the stream browser at /ui/ (its files are public; what it shows needs the same "
        "tokens as the API); --no-ui turns it off",
        flag="--no-ui",
    ),
    Setting(
        "metrics",
        "enabled",
        boolean,
        True,
        "serve Prometheus metrics at /metrics (admin-only when auth is on); --no-metrics turns them off",
        flag="--no-metrics",
    ),
    Setting(
        "metrics",
        "host",
        text,
        "127.0.0.1",
        "address --metrics-port listens on (loopback by default: metrics need no token there)",
        flag="--metrics-host",
    ),
    Setting(
        "metrics",
        "port",
        optional_port,
        None,
        "serve /metrics (with /healthz and /readyz) on this port of --metrics-host instead, without "
        "auth, and not on the main port: keep it off the public network",
        flag="--metrics-port",
    ),
)
