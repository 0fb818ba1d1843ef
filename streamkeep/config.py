"""Settings from four layers, later winning: defaults, a TOML file, DS_* variables, CLI flags.

One table (`SETTINGS`) defines each setting once; the CLI flags, TOML keys (`[server] port`) and
environment variables (`DS_SERVER__PORT`, the style of seed 000) are all derived from it. Bad values
fail at start with a message that names the setting and where it came from.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any


class ConfigError(Exception):
    pass


# One syntax for every size and every duration, whichever layer a value comes from. A number in
# TOML is taken as it is; text is a plain number or a number with a unit.
SIZE_SYNTAX = "bytes or 256KiB, 64MiB, 1GiB, 1TiB"
DURATION_SYNTAX = "seconds or 500ms, 90s, 15m, 12h, 7d, 2w"

# K, KB and KiB all mean 1024: sizes have always been binary here, whichever spelling was used.
_SIZE = re.compile(r"(?i)\s*(\d+)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|tib)?\s*")
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DURATION = re.compile(r"(?i)\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d|w)?\s*")
_DURATION_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def byte_size(value: Any) -> int:
    """Bytes from a whole number or `256KiB`, `64MiB`, `1GiB`, `1TiB`."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"is not a size; use {SIZE_SYNTAX}")
        return value
    match = _SIZE.fullmatch(str(value)) if isinstance(value, str) else None
    if not match:
        raise ValueError(f"is not a size; use {SIZE_SYNTAX}")
    return int(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()[:1]]


def _seconds(value: Any, off: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    else:
        match = _DURATION.fullmatch(value) if isinstance(value, str) else None
        if not match:
            raise ValueError(f"is not a duration; use {off}{DURATION_SYNTAX}")
        number = float(match.group(1)) * _DURATION_UNITS[(match.group(2) or "").lower()]
    if not 0 <= number < float("inf"):  # also refuses NaN
        raise ValueError(f"is not a duration; use {off}{DURATION_SYNTAX}")
    return number


def duration(value: Any) -> float:
    """Seconds, more than 0, from a number or `500ms`, `90s`, `15m`, `12h`, `7d`, `2w`."""
    number = _seconds(value, "")
    if number == 0:
        raise ValueError(f"is not a positive duration; use {DURATION_SYNTAX}")
    return number


def duration_or_off(value: Any) -> float:
    """As `duration`, where 0 turns the setting off."""
    return _seconds(value, "0 (off), ")


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("is not a boolean; use true or false (or 1, 0, yes, no, on, off)")


def _whole(value: Any, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*\d+\s*", value, re.ASCII):
        return int(value)
    raise ValueError(f"is not {what}")


def positive_int(value: Any) -> int:
    number = _whole(value, "a whole number of at least 1")
    if number < 1:
        raise ValueError("is not a whole number of at least 1")
    return number


def port(value: Any) -> int:
    number = _whole(value, "a port; use 0 to 65535 (0 picks a free one)")
    if not 0 <= number <= 65535:
        raise ValueError("is not a port; use 0 to 65535 (0 picks a free one)")
    return number


def text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("is not a string")
    return value


def one_of(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"is not one of {', '.join(choices)}")
        return str(value)

    return check


def s3_url(value: Any) -> str:
    text_value = str(value)
    if text_value and not re.fullmatch(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?", text_value):
        raise ValueError(
            "is not s3://BUCKET or s3://BUCKET/PREFIX (bucket names: lower-case, digits, dots, dashes)"
        )
    return text_value


def non_negative(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if isinstance(value, bool) or not 0 <= number < float("inf"):
        raise ValueError("is not 0 (off) or a positive number")
    return number


def optional_port(value: Any) -> int | None:
    if value is None or value == "":
        return None
    return port(value)


def cors_origins(value: Any) -> str:
    origins = [origin.strip() for origin in str(value).split(",") if origin.strip()]
    if not origins:
        raise ValueError("is not * or a comma-separated list of origins like https://app.example.com")
    if "*" in origins and len(origins) > 1:
        raise ValueError("mixes * with origins: * allows every origin, so give * alone or a list of origins")
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"https?://[^/\s,]+", origin):
            raise ValueError(f"holds {origin!r}, which is not an origin (scheme://host[:port], no path)")
    return ",".join(origins)


def jwks_location(value: Any) -> str:
    location = str(value).strip()
    if not location or location.startswith("https://"):
        return location
    if "://" in location:
        raise ValueError(
            "is not an https:// URL or a local file path (keys fetched over plain http can be forged)"
        )
    return location


def existing_file(value: Any) -> str:
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise ValueError(f"names no readable file ({path})")
    return str(path)


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


def _apply(values: dict[tuple[str, str], Any], setting: Setting, raw: Any, origin: str) -> None:
    try:
        values[(setting.section, setting.name)] = setting.parse(raw)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{setting.section}.{setting.name} from {origin}: {raw!r} {error}") from None


def load(
    config_file: str | None = None,
    env: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
) -> SimpleNamespace:
    """Effective settings as `settings.server.port` etc.; raises ConfigError naming the setting."""
    values: dict[tuple[str, str], Any] = {(s.section, s.name): s.default for s in SETTINGS}
    rules: list[dict[str, Any]] = []
    members: list[tuple[str, str]] = []
    by_key = {(s.section, s.name): s for s in SETTINGS}
    by_key.update({(s.section, old): s for s in SETTINGS for old in s.old_names})
    if config_file:
        path = Path(config_file)
        try:
            document = tomllib.loads(path.read_text())
        except OSError as error:
            raise ConfigError(f"--config {path}: cannot read it: {error.strerror}") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"--config {path}: not valid TOML: {error}") from None
        for section, table in document.items():
            if section == "retention" and isinstance(table, list):
                rules.extend(_retention_rules(table, path))
                continue
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key {section!r} must be a [section]")
            if section == "cluster" and "members" in table:
                table = dict(table)
                members = _cluster_members(table.pop("members"), path)
            for name, raw in table.items():
                setting = by_key.get((section, name))
                if setting is None:
                    raise ConfigError(f"{path}: unknown setting [{section}] {name}")
                _apply(values, setting, raw, str(path))
    environment = os.environ if env is None else env
    for setting in SETTINGS:
        for variable in (*setting.aliases, setting.env_var):
            if variable in environment:
                _apply(values, setting, environment[variable], f"${variable}")
    for key, raw in (cli or {}).items():
        if raw is not None:
            setting = next(s for s in SETTINGS if s.name == key or f"{s.section}_{s.name}" == key)
            _apply(values, setting, raw, setting.cli_flag)
    if values[("limits", "max_inflight_body_bytes")] < values[("limits", "max_body_bytes")]:
        raise ConfigError("limits.max_inflight_body_bytes must be at least limits.max_body_bytes")
    if values[("cold", "url")] and values[("storage", "mode")] != "disk":
        raise ConfigError("cold.url needs storage.mode disk: the cold tier archives disk segments")
    if (values[("tls", "cert")] is None) != (values[("tls", "key")] is None):
        raise ConfigError("tls.cert and tls.key go together: give both (--tls-cert and --tls-key) or neither")
    secret = values[("auth", "jwt_secret")]
    if secret and len(secret.encode()) < 32:
        # RFC 7518 §3.2: an HS256 key at least as long as the hash; shorter ones can be guessed.
        raise ConfigError("auth.jwt_secret: use at least 32 bytes (e.g. `openssl rand -base64 32`)")
    if values[("auth", "link_keys")]:
        from streamkeep.auth.links import LinkKeys

        try:
            LinkKeys.parse(values[("auth", "link_keys")])
        except ValueError as error:
            raise ConfigError(f"auth.link_keys: {error}") from None
    if values[("retention", "max_age")] or values[("retention", "max_bytes")]:
        rules.append(
            {
                "streams": "**",
                "max_age": values[("retention", "max_age")] or None,
                "max_bytes": values[("retention", "max_bytes")] or None,
            }
        )
    if rules and values[("storage", "mode")] != "disk":
        raise ConfigError("retention needs storage.mode disk: it drops segment files")
    sections: dict[str, dict[str, Any]] = {}
    for (section, name), value in values.items():
        sections.setdefault(section, {})[name] = value
    sections["retention"]["rules"] = rules
    sections["cluster"]["members"] = members
    cluster_secret = values[("cluster", "secret")]
    if cluster_secret and len(cluster_secret.encode()) < 32:
        raise ConfigError("cluster.secret: use at least 32 bytes (e.g. `openssl rand -base64 32`)")
    member = values[("cluster", "member")]
    if member and member not in [member_id for member_id, _ in members]:
        raise ConfigError(
            f"cluster.member {member!r} is not one of the [cluster] members "
            f"({', '.join(m for m, _ in members) or 'none listed'}): list every member in the TOML file"
        )
    return SimpleNamespace(**{section: SimpleNamespace(**items) for section, items in sections.items()})


def _cluster_members(raw: Any, path: Path) -> list[tuple[str, str]]:
    """`members = [{id = "a", address = "127.0.0.1:7001"}, ...]` in `[cluster]`."""
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{path}: [cluster] members must be a list of {{id = ..., address = ...}} tables")
    members: list[tuple[str, str]] = []
    for number, entry in enumerate(raw, 1):
        if not isinstance(entry, dict) or set(entry) != {"id", "address"}:
            raise ConfigError(f"{path}: [cluster] member number {number} needs exactly id and address")
        member_id, address = str(entry["id"]), str(entry["address"])
        host, _, port_text = address.rpartition(":")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", member_id):
            raise ConfigError(
                f"{path}: [cluster] member id {member_id!r}: use letters, digits, '_', '.', '-'"
            )
        if not host or not port_text.isdigit():
            raise ConfigError(
                f"{path}: [cluster] member {member_id!r}: address must be host:port, not {address!r}"
            )
        if member_id in [m for m, _ in members]:
            raise ConfigError(f"{path}: [cluster] member id {member_id!r} is listed twice")
        members.append((member_id, address))
    return members


def _retention_rules(tables: list[Any], path: Path) -> list[dict[str, Any]]:
    """`[[retention]]` tables: `streams` (a glob), `max_age`, `max_bytes`; the first match wins."""
    rules = []
    for number, table in enumerate(tables, 1):
        where = f"{path}: [[retention]] number {number}"
        if not isinstance(table, dict):
            raise ConfigError(f"{where} must be a table")
        known = {"streams", "max_age", "max_bytes", "compact", "compact_ratio", "compact_min_bytes"}
        unknown = set(table) - known
        if unknown:
            raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} ({', '.join(sorted(known))})")
        compact = table.get("compact")
        if compact not in (None, "state"):
            raise ConfigError(f'{where}: compact = "state" (State Protocol streams) is the one kind there is')
        streams = table.get("streams")
        if not isinstance(streams, str) or not streams:
            raise ConfigError(f'{where} needs streams = "GLOB" (e.g. "logs/**")')
        max_age = _rule_value(table, "max_age", duration_or_off, 0.0, where)
        max_bytes = _rule_value(table, "max_bytes", byte_size, 0, where)
        ratio = _rule_value(table, "compact_ratio", _compact_ratio, 4.0, where)
        min_bytes = _rule_value(table, "compact_min_bytes", byte_size, 1 << 20, where)
        # A rule with neither limit keeps its streams whole: a way to exempt them from later rules.
        rule: dict[str, Any] = {
            "streams": streams,
            "max_age": max_age or None,
            "max_bytes": max_bytes or None,
        }
        if compact is not None:
            rule.update(compact=compact, compact_ratio=ratio, compact_min_bytes=min_bytes)
        rules.append(rule)
    return rules


def _compact_ratio(value: Any) -> float:
    try:
        number = non_negative(value)
    except ValueError:
        number = 0.0
    if number < 1:
        raise ValueError("is not a number of at least 1 (history at least the snapshot's size)")
    return number


def _rule_value(
    table: dict[str, Any], key: str, parse: Callable[[Any], Any], default: Any, where: str
) -> Any:
    if key not in table:
        return default
    try:
        return parse(table[key])
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{where}: {key} {table[key]!r} {error}") from None


def cli_dest(setting: Setting) -> str:
    return setting.name if setting.flag is None else f"{setting.section}_{setting.name}"
