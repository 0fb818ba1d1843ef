"""`streamkeep` command line: `streamkeep serve [options]`."""

from __future__ import annotations

import argparse
import logging
import sys

from streamkeep import __version__, config


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
            "flags win over variables, variables over the file."
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
                const=True,
                help=described,
            )
            continue
        serve.add_argument(
            setting.cli_flag,
            dest=config.cli_dest(setting),
            metavar=setting.name.split("_")[-1].upper(),
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
        "--delete-orphans", action="store_true", help="with verify: delete objects no manifest lists"
    )
    archive.add_argument(
        "--orphan-min-age",
        type=float,
        default=3600.0,
        metavar="SECONDS",
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
    return parser


def _offline_settings(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    cli = {
        "storage_data_dir": args.storage_data_dir,
        "cold_url": args.cold_url,
        "cold_endpoint": args.cold_endpoint,
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

    from streamkeep.storage import files, migrate
    from streamkeep.storage.coldstore import ColdConfig, S3Store
    from streamkeep.storage.directory import FormatError

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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "archive":
        return _archive(args)
    if args.command == "migrate":
        return _migrate(args)
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
    from streamkeep.http.server import run
    from streamkeep.storage.directory import FormatError
    from streamkeep.subscriptions.signing import KeyFileError

    try:
        run(settings)
    except BaseException as raised:  # trio wraps what ends the run in exception groups
        error = _first(raised, (FormatError, KeyFileError, OSError))
        if error is None:
            raise
        if isinstance(error, FormatError | KeyFileError):
            print(f"streamkeep: {error}", file=sys.stderr)
        else:
            print(
                f"streamkeep: cannot serve on {settings.server.host}:{settings.server.port} "
                f"(or open {settings.storage.data_dir}): {error}",
                file=sys.stderr,
            )
        return 1
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
