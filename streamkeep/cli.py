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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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

    try:
        run(settings)
    except OSError as error:
        print(
            f"streamkeep: cannot serve on {settings.server.host}:{settings.server.port}: {error}",
            file=sys.stderr,
        )
        return 1
    return 0
