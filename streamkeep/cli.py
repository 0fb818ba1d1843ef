"""`streamkeep` command line: `streamkeep serve [options]`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from types import SimpleNamespace

from streamkeep import __version__, config
from streamkeep.cluster.haproxy import MEMBER_MAXCONN

# What --help shows for a value, where the setting's name says less.
_METAVARS: dict[object, str] = {
    config.duration: "DURATION",
    config.duration_or_off: "DURATION",
    config.byte_size: "SIZE",
}


def _metavar(setting: config.Setting) -> str:
    named = setting.name.split("_")[-1].upper()
    if named == "SIZE":  # --mailbox-size counts messages: SIZE is the syntax of bytes
        named = "COUNT"
    return _METAVARS.get(setting.parse, named)


def _flag_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """`parse` as an argparse type, refusing a bad value the way the settings do."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{text!r} {error}") from None

    return convert


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamkeep",
        description="A Durable Streams server: one trio actor per stream, HTTP/1.1 and HTTP/2.",
    )
    parser.add_argument("--version", action="version", version=f"streamkeep {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the server",
        description=(
            "Run the server. Every option can also be set in the TOML file given by --config "
            "(e.g. [server] port = 4437) or by an environment variable (e.g. DS_SERVER__PORT=4437); "
            "flags win over variables, variables over the file. Durations are "
            f"{config.DURATION_SYNTAX}; sizes are {config.SIZE_SYNTAX}."
        ),
        epilog=(
            "Auth is off unless --auth-jwt-secret or --auth-jwks-url is given; then every request "
            "needs Authorization: Bearer <jwt> (or ?token=<jwt> on a GET, for EventSource) whose scope "
            "claim grants read:<glob>, append:<glob>, write:<glob> or admin on the stream name. "
            "`streamkeep sign STREAM --ttl 1h` prints a signed read link. /metrics (Prometheus), "
            "/healthz (liveness) and /readyz (readiness) are described in docs/operations.md, "
            "'Running in production'."
        ),
    )
    serve.add_argument("--config", metavar="FILE", help="TOML file with [server], [limits], ... tables")
    for setting in config.SETTINGS:
        described = f"{setting.help} [{setting.env_var}] (default: {setting.default})"
        if setting.parse is config.boolean:
            serve.add_argument(
                setting.cli_flag,
                dest=config.cli_dest(setting),
                action="store_const",
                const=not setting.default,  # a setting on by default has a --no-... flag
                help=described,
            )
            continue
        serve.add_argument(
            setting.cli_flag,
            dest=config.cli_dest(setting),
            metavar=_metavar(setting),
            default=None,
            help=described,
        )
    archive = commands.add_parser(
        "archive",
        help="inspect the cold tier: what is local and what is in the bucket",
        description="Reads the data directory (and the bucket) directly; the server need not run.",
    )
    archive.add_argument(
        "action", choices=("status", "verify"), help="status: per stream; verify: HEAD every object"
    )
    archive.add_argument("--config", metavar="FILE", help="TOML file, as for serve")
    archive.add_argument("--data-dir", dest="storage_data_dir", default=None)
    archive.add_argument("--cold-url", dest="cold_url", default=None)
    archive.add_argument("--cold-endpoint", dest="cold_endpoint", default=None)
    archive.add_argument(
        "--cluster-member",
        dest="cluster_member",
        default=None,
        help="in a cluster sharing one bucket: this data directory's member id ([cluster] in --config); "
        "verify then judges only this member's streams' objects",
    )
    archive.add_argument(
        "--delete-orphans", action="store_true", help="with verify: delete objects no manifest lists"
    )
    archive.add_argument(
        "--orphan-min-age",
        type=_flag_type(config.duration_or_off),
        default=3600.0,
        metavar="DURATION",
        help="with verify: an object of a live stream that no manifest lists yet counts as an orphan "
        "only once this old (a running server may be uploading it)",
    )
    migrate = commands.add_parser(
        "migrate",
        help="upgrade a data directory (and its bucket) to this version's format",
        description="Upgrades in place, crash-safely: run it again after an interruption. "
        "`streamkeep serve` does the same at start.",
    )
    migrate.add_argument("--config", metavar="FILE", help="TOML file, as for serve")
    migrate.add_argument("--data-dir", dest="storage_data_dir", default=None)
    migrate.add_argument("--cold-url", dest="cold_url", default=None)
    migrate.add_argument("--cold-endpoint", dest="cold_endpoint", default=None)
    restore = commands.add_parser(
        "restore",
        help="rebuild a data directory from the cold tier's bucket when every local copy is gone",
        description="Writes into an empty or new --data-dir every stream the bucket describes (only "
        "--cluster-member's in a cluster), as recovery reads it: what was uploaded is restored, with "
        "its offsets, producer state and closed flag; what was not is lost (docs/cold-and-spark.md).",
    )
    restore.add_argument(
        "--from-bucket", action="store_true", required=True, help="restore from the cold tier (--cold-url)"
    )
    restore.add_argument("--config", metavar="FILE", help="TOML file, as for serve")
    restore.add_argument(
        "--data-dir", dest="storage_data_dir", default=None, metavar="DIR", help="empty or new"
    )
    restore.add_argument("--cold-url", dest="cold_url", default=None, metavar="s3://BUCKET/PREFIX")
    restore.add_argument("--cold-endpoint", dest="cold_endpoint", default=None, metavar="URL")
    restore.add_argument("--cold-region", dest="cold_region", default=None, metavar="REGION")
    restore.add_argument(
        "--cluster-member",
        dest="cluster_member",
        default=None,
        metavar="ID",
        help="in a cluster sharing one bucket ([cluster] in --config): restore only this member's streams",
    )
    sign = commands.add_parser(
        "sign",
        help="print a signed link that grants reading one stream until it expires",
        description="Prints a URL that lets whoever has it read STREAM (catch-up, long-poll, SSE) "
        "until it expires, without a token. Signed with the server's link key (--auth-link-keys, "
        "else DATA_DIR/keys/link-keys), not its JWT secret; `--rotate` starts a new key (links signed "
        "with the last four keys keep working).",
    )
    sign.add_argument("stream", nargs="?", help="the stream's name, as in /v1/stream/NAME (decoded)")
    sign.add_argument(
        "--ttl", default="1h", help="how long the link works: 90s, 15m, 1h, 7d, 2w (default 1h)"
    )
    sign.add_argument(
        "--base-url",
        default=None,
        help="where clients reach the server (default: http(s)://HOST:PORT from the settings)",
    )
    sign.add_argument("--rotate", action="store_true", help="start a new signing key in DATA_DIR first")
    sign.add_argument("--config", metavar="FILE", help="TOML file, as for serve")
    sign.add_argument("--data-dir", dest="storage_data_dir", default=None)
    sign.add_argument("--auth-link-keys", dest="auth_link_keys", default=None)
    compact = commands.add_parser(
        "compact",
        help="compact a State Protocol stream on a running server (append a snapshot, move the floor)",
        description="Asks the server at BASE_URL to fold STREAM's State Protocol messages into a "
        "snapshot appended to it, then move the stream's floor to the snapshot (docs/retention.md, "
        "'Compaction'). Prints progress while it runs and the result as JSON. With auth on, the "
        "token needs the admin scope.",
    )
    compact.add_argument("base_url", help="the server, e.g. http://127.0.0.1:4437")
    compact.add_argument("stream", help="the stream's name, as in /v1/stream/NAME (decoded)")
    compact.add_argument(
        "--token", default=None, help="a bearer token with the admin scope (or $STREAMKEEP_TOKEN)"
    )
    compact.add_argument(
        "--drop-invalid",
        action="store_true",
        help="skip messages that are not State Protocol change or control messages (counted) "
        "instead of stopping",
    )
    sync = commands.add_parser(
        "sync",
        help="bridge Postgres and streams both ways, exactly once (docs/postgres-sync.md)",
        description="Runs every mapping of the config: [[pg_to_stream]] (a table's changes, by "
        "logical replication, appended to a stream) and [[stream_to_pg]] (a stream's messages applied "
        "to a table). Serves /metrics and /healthz ([sync] port). Stops on Ctrl-C or SIGTERM. "
        "`streamkeep sync reset NAME` makes a mapping start over (a new snapshot, or the stream's "
        "beginning). Needs `pip install 'streamkeep[postgres]'`.",
    )
    sync.add_argument("--config", metavar="FILE", required=True, help="sync.toml (see docs/postgres-sync.md)")
    sync.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sync_commands = sync.add_subparsers(dest="sync_command", metavar="COMMAND")
    reset = sync_commands.add_parser(
        "reset",
        help="make one mapping start over at its next start (stop the sync process first)",
        description="pg_to_stream: drops the mapping's slot and checkpoint, so the next start copies "
        "the tables again behind a `reset` control message. stream_to_pg: forgets the stored offset "
        "and empties the table, so the next start applies the stream from its beginning.",
    )
    reset.add_argument("mapping", metavar="NAME", help="the mapping's name in the config")
    cluster = commands.add_parser(
        "cluster",
        help="run streamkeep as several processes behind HAProxy (docs/scaling.md)",
        description="Tools for a cluster of single-writer processes that own streams by a hash "
        "of their names ([cluster] in the TOML file: member list and placement epoch).",
    )
    cluster_commands = cluster.add_subparsers(dest="cluster_command", metavar="COMMAND")
    haproxy = cluster_commands.add_parser(
        "haproxy-config",
        help="write the HAProxy configuration and slot map for the [cluster] section",
        description="Writes haproxy.cfg and slots.map into --out: HAProxy routes each stream path "
        "to its owner by slot (crc32 of the path mod 4096), with no redispatch, and answers 503 "
        "with Retry-After while an owner is down. Run: haproxy -f OUT/haproxy.cfg",
    )
    haproxy.add_argument("--config", metavar="FILE", required=True, help="the TOML file with [cluster]")
    haproxy.add_argument("--out", metavar="DIR", default=".", help="where to write the two files")
    haproxy.add_argument("--bind", default="127.0.0.1", help="address HAProxy listens on")
    haproxy.add_argument("--port", type=int, default=8080, help="port HAProxy listens on")
    haproxy.add_argument(
        "--tls-cert", default=None, help="a PEM holding certificate and key: TLS with ALPN h2"
    )
    haproxy.add_argument(
        "--threads",
        type=int,
        default=None,
        help="HAProxy's threads (default: a third of this machine's cores, at least 1)",
    )
    haproxy.add_argument(
        "--member-maxconn",
        type=int,
        default=MEMBER_MAXCONN,
        help=f"requests at a member at once, live reads aside; more wait in HAProxy (default {MEMBER_MAXCONN})",
    )
    run = cluster_commands.add_parser(
        "run",
        help="run N processes on this machine behind HAProxy (development)",
        description="Starts N single-writer processes, each with its own data directory under "
        "--data-dir, and HAProxy in front on --port (HTTP/1.1 and h2c; TLS with ALPN h2 with "
        "--tls-cert/--tls-key). Any other flag is a serve flag, given to every process (e.g. "
        "--storage memory, --fsync always). Stops them all on Ctrl-C or SIGTERM.",
    )
    run.add_argument("--processes", type=int, default=2, help="how many processes (default 2)")
    run.add_argument("--port", type=int, default=4437, help="the front door's port (default 4437)")
    run.add_argument("--host", default="127.0.0.1", help="the front door's address")
    run.add_argument("--data-dir", default="data/cluster", help="one directory per process below this")
    run.add_argument("--tls-cert", default=None, help="PEM certificate for the front door (with --tls-key)")
    run.add_argument("--tls-key", default=None, help="PEM private key for the front door")
    run.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="copies of each member (2: each member's streams on two processes, every commit on both "
        "before it is acknowledged, failover without an operator; etcd coordinates)",
    )
    run.add_argument(
        "--etcd",
        default=None,
        help="with --replicas 2: the etcd cluster's client URLs (default: start one etcd on loopback)",
    )
    resize = cluster_commands.add_parser(
        "resize",
        help="add or remove processes of a stopped `cluster run` cluster, moving streams that change owner",
        description="Moves every stream whose owner changes to its new member (growing from N to N+1 "
        "moves only the ~1/(N+1) of the slots the newcomer wins), puts fork pins right and bumps the "
        "placement epoch. Every member must have stopped cleanly. Safe to run again after an "
        "interruption: it finishes the same plan. docs/scaling.md §9.",
    )
    resize.add_argument("--data-dir", required=True, help="the cluster's directory (as given to cluster run)")
    resize.add_argument("--processes", type=int, required=True, help="how many processes from now on")
    return parser


def parse_ttl(text: str) -> int:
    """Whole seconds, at least 1, from a duration in the settings' syntax (`90`, `15m`, `7d`)."""
    try:
        seconds = config.duration(text)
    except ValueError as error:
        raise ValueError(f"--ttl {text!r} {error}") from None
    if seconds < 1:
        raise ValueError(f"--ttl {text!r} is shorter than the 1 s a link lasts at least")
    return int(seconds)


def _sign(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from streamkeep.auth import links, setup
    from streamkeep.protocol.errors import ProtocolError
    from streamkeep.protocol.names import check_stream_name

    try:
        settings = config.load(
            args.config,
            cli={"storage_data_dir": args.storage_data_dir, "auth_link_keys": args.auth_link_keys},
        )
        ttl = parse_ttl(args.ttl)
    except (config.ConfigError, ValueError) as error:
        print(f"streamkeep sign: {error}", file=sys.stderr)
        return 2
    data_dir = Path(settings.storage.data_dir)
    if settings.storage.mode == "memory" and not settings.auth.link_keys:
        print(
            "streamkeep sign: a server with --storage memory keeps no key file; give it and this "
            "command the same --auth-link-keys kid=SECRET",
            file=sys.stderr,
        )
        return 2
    if args.rotate:
        if settings.auth.link_keys:
            print(
                "streamkeep sign: --rotate changes the key file in the data directory, but keys are "
                "configured (--auth-link-keys): put a new kid=SECRET first in that list instead",
                file=sys.stderr,
            )
            return 2
        rotated = links.LinkKeys.rotate(data_dir / setup.LINK_KEYS_FILE)
        print(
            f"new signing key {rotated.current}; restart the server (or servers) to sign and accept it",
            file=sys.stderr,
        )
        if not args.stream:
            return 0
    if not args.stream:
        print("streamkeep sign: name the stream to sign a link for (streamkeep sign STREAM)", file=sys.stderr)
        return 2
    try:
        check_stream_name(args.stream)
    except ProtocolError as error:
        print(f"streamkeep sign: {error.message}", file=sys.stderr)
        return 2
    try:
        keys = setup.link_keys(settings, data_dir)
    except (OSError, ValueError) as error:
        print(f"streamkeep sign: cannot read the link keys: {error}", file=sys.stderr)
        return 1
    if keys is None:
        print("streamkeep sign: no link keys: give --auth-link-keys or --data-dir", file=sys.stderr)
        return 2
    expires_at = int(time.time()) + ttl
    base = args.base_url or _default_base_url(settings)
    print(links.link_url(base, args.stream, links.sign(keys, args.stream, expires_at)))
    print(
        f"reads {args.stream!r} until {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(expires_at))} "
        f"(key {keys.current})",
        file=sys.stderr,
    )
    return 0


def _compact(args: argparse.Namespace) -> int:
    import json
    import os
    from urllib.parse import quote

    import httpx

    token = args.token or os.environ.get("STREAMKEEP_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{args.base_url.rstrip('/')}/v1/compact/{quote(args.stream, safe='/')}"
    params = {"drop_invalid": "true"} if args.drop_invalid else {}
    try:
        with httpx.stream(
            "POST", url, headers=headers, params=params, timeout=httpx.Timeout(30, read=None)
        ) as answer:
            if answer.status_code != 200:
                answer.read()
                print(f"streamkeep compact: {answer.status_code}: {_message(answer.text)}", file=sys.stderr)
                return 1
            for line in answer.iter_lines():
                if not line:
                    continue
                event = json.loads(line)
                if "error" in event:
                    print(f"streamkeep compact: {event['error']['message']}", file=sys.stderr)
                    return 1
                if event.get("done"):
                    print(json.dumps({k: v for k, v in event.items() if k != "done"}, indent=2))
                    return 0
                print(
                    f"{event['phase']}: {event['folded_bytes']:,} of {event['of']:,} bytes, {event['seconds']} s",
                    file=sys.stderr,
                    flush=True,
                )
    except httpx.HTTPError as error:
        print(f"streamkeep compact: cannot reach {args.base_url}: {error}", file=sys.stderr)
        return 1
    print("streamkeep compact: the server ended the answer early; check its log and retry", file=sys.stderr)
    return 1


def _message(text: str) -> str:
    import json

    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:300]


def _default_base_url(settings: SimpleNamespace) -> str:
    scheme = "https" if settings.tls.cert else "http"
    host = settings.server.host
    if host in ("0.0.0.0", "::", ""):
        host = "localhost"
    elif ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{settings.server.port}"


def _offline_settings(args: argparse.Namespace) -> SimpleNamespace:
    cli = {
        "storage_data_dir": args.storage_data_dir,
        "cold_url": args.cold_url,
        "cold_endpoint": args.cold_endpoint,
        "cluster_member": getattr(args, "cluster_member", None),
    }
    return config.load(args.config, cli=cli)


def _archive(args: argparse.Namespace) -> int:
    from streamkeep import archive

    try:
        settings = _offline_settings(args)
    except config.ConfigError as error:
        print(f"streamkeep: configuration error: {error}", file=sys.stderr)
        return 2
    if args.action == "status":
        return archive.status(settings)
    return archive.verify(settings, delete_orphans=args.delete_orphans, orphan_min_age=args.orphan_min_age)


def _migrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from streamkeep.storage import files
    from streamkeep.storage.cold import migrate
    from streamkeep.storage.cold.store import ColdConfig, S3Store
    from streamkeep.storage.disk.directory import FormatError

    try:
        settings = _offline_settings(args)
    except config.ConfigError as error:
        print(f"streamkeep: configuration error: {error}", file=sys.stderr)
        return 2
    cold = ColdConfig.from_settings(settings)
    store = S3Store(cold) if cold is not None else None
    root = Path(settings.storage.data_dir)
    try:
        changed = migrate.upgrade(
            files.OS, root, store, lambda line: print(line, file=sys.stderr, flush=True)
        )
    except (FormatError, OSError) as error:
        print(f"streamkeep migrate: {error}", file=sys.stderr)
        return 1
    if not changed:
        print(f"{root} is already in the current format; nothing to do", file=sys.stderr)
    return 0


def _restore(args: argparse.Namespace) -> int:
    from streamkeep.restore import restore

    try:
        settings = config.load(
            args.config,
            cli={
                "storage_data_dir": args.storage_data_dir,
                "cold_url": args.cold_url,
                "cold_endpoint": args.cold_endpoint,
                "cold_region": args.cold_region,
                "cluster_member": args.cluster_member,
            },
        )
    except config.ConfigError as error:
        print(f"streamkeep: configuration error: {error}", file=sys.stderr)
        return 2
    return restore(settings)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "cluster" and getattr(args, "cluster_command", None) == "run":
        return _cluster_run(args, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "archive":
        return _archive(args)
    if args.command == "migrate":
        return _migrate(args)
    if args.command == "restore":
        return _restore(args)
    if args.command == "sign":
        return _sign(args)
    if args.command == "compact":
        return _compact(args)
    if args.command == "sync":
        from streamkeep.sync.command import main as sync_main

        return sync_main(args.config, args.log_level, getattr(args, "mapping", None))
    if args.command == "cluster":
        if args.cluster_command == "haproxy-config":
            return _haproxy_config(args)
        if args.cluster_command == "resize":
            return _cluster_resize(args)
        parser.parse_args(["cluster", "--help"])
        return 2
    if args.command != "serve":
        parser.print_help()
        return 2
    cli_values = {config.cli_dest(s): getattr(args, config.cli_dest(s)) for s in config.SETTINGS}
    try:
        settings = config.load(args.config, cli=cli_values)
    except config.ConfigError as error:
        print(f"streamkeep: configuration error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log.level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if settings.log.format == "json":
        from streamkeep.telemetry.accesslog import JsonFormatter

        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
    if settings.replication.replicas > 1:
        from streamkeep.replica import run
    else:
        from streamkeep.assemble import run
    from streamkeep.storage.disk.directory import FormatError
    from streamkeep.subscriptions.signing import KeyFileError

    try:
        run(settings)
    except BaseException as raised:  # trio wraps what ends the run in exception groups
        cause = _first(raised, (FormatError, KeyFileError, OSError))
        if cause is None:
            raise
        if isinstance(cause, FormatError | KeyFileError):
            print(f"streamkeep: {cause}", file=sys.stderr)
        else:
            print(
                f"streamkeep: cannot serve on {settings.server.host}:{settings.server.port} "
                f"(or open {settings.storage.data_dir}): {cause}",
                file=sys.stderr,
            )
        return 1
    return 0


def _cluster_run(args: argparse.Namespace, serve_args: list[str]) -> int:
    from pathlib import Path

    from streamkeep.cluster.run import ClusterError, run
    from streamkeep.cluster.run_replicated import run_replicated

    if args.replicas not in (1, 2):
        print("streamkeep cluster run: --replicas must be 1 or 2", file=sys.stderr)
        return 2
    try:
        if args.replicas == 2:
            return run_replicated(
                processes=args.processes, port=args.port, data_dir=Path(args.data_dir), host=args.host,
                tls_cert=args.tls_cert, tls_key=args.tls_key, serve_args=serve_args, etcd=args.etcd,
            )  # fmt: skip
        return run(
            processes=args.processes, port=args.port, data_dir=Path(args.data_dir), host=args.host,
            tls_cert=args.tls_cert, tls_key=args.tls_key, serve_args=serve_args,
        )  # fmt: skip
    except ClusterError as error:
        print(f"streamkeep cluster run: {error}", file=sys.stderr)
        return 2


def _cluster_resize(args: argparse.Namespace) -> int:
    from pathlib import Path

    from streamkeep.cluster.resize import ResizeError, resize

    try:
        resize(Path(args.data_dir), args.processes)
    except ResizeError as error:
        print(f"streamkeep cluster resize: {error}", file=sys.stderr)
        return 2
    return 0


def _haproxy_config(args: argparse.Namespace) -> int:
    from pathlib import Path

    from streamkeep.cluster import haproxy
    from streamkeep.cluster.placement import Member, Placement

    try:
        settings = config.load(args.config)
    except config.ConfigError as error:
        print(f"streamkeep cluster haproxy-config: {error}", file=sys.stderr)
        return 2
    if not settings.cluster.members:
        print(
            f"streamkeep cluster haproxy-config: {args.config} has no [cluster] members; add "
            'members = [{id = "a", address = "127.0.0.1:7001"}, ...]',
            file=sys.stderr,
        )
        return 2
    placement = Placement.of([Member(m, a) for m, a in settings.cluster.members], settings.cluster.epoch)
    live = max(settings.server.long_poll_timeout, settings.server.sse_close_after)
    replicas = settings.cluster.replicas or None
    config_path = haproxy.write(
        placement,
        Path(args.out),
        bind=args.bind,
        port=args.port,
        tls_cert=args.tls_cert,
        live_seconds=live,
        replicas=replicas,
        threads=args.threads,
        member_maxconn=args.member_maxconn,
    )
    for member in placement.members:
        served = (
            ""
            if replicas is None
            else " (replicas " + ", ".join(f"{r} at {a}" for r, a in replicas[member.id]) + ")"
        )
        print(f"member {member.id} at {member.address}: {placement.slots_of(member.id)} slots{served}")
    print(
        f"wrote {config_path} and {config_path.parent / 'slots.map'} (epoch {placement.epoch}); "
        f"run: haproxy -f {config_path}"
    )
    return 0


def _first(raised: BaseException, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of `kinds` in `raised` or the groups nested in it."""
    if isinstance(raised, kinds):
        return raised
    if isinstance(raised, BaseExceptionGroup):
        for inner in raised.exceptions:
            found = _first(inner, kinds)
            if found is not None:
                return found
    return None
