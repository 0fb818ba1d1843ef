"""`streamkeep sync` and `streamkeep sync reset NAME`: the config checked, then the process run
(or one mapping reset), with errors that say what to do next."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from streamkeep.config.values import ConfigError
from streamkeep.sync import config as sync_config


def main(config_path: str, log_level: str, reset_mapping: str | None) -> int:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level != "debug":  # a line per request drowns the progress lines
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        loaded = sync_config.load(Path(config_path))
        chosen = loaded.mapping(reset_mapping) if reset_mapping is not None else None
    except ConfigError as error:
        print(f"streamkeep sync: configuration error: {error}", file=sys.stderr)
        return 2
    try:
        import psycopg  # noqa: F401 - the extra's one dependency, checked before anything starts
    except ImportError:
        print("streamkeep sync needs psycopg: pip install 'streamkeep[postgres]'", file=sys.stderr)
        return 2
    if chosen is not None:
        from streamkeep.sync import sink, source

        try:
            done = source.reset(chosen) if isinstance(chosen, sync_config.PgToStream) else sink.reset(chosen)
        except Exception as error:  # a person runs this: say what failed, not a traceback
            print(f"streamkeep sync reset {chosen.name}: {error}", file=sys.stderr)
            return 1
        print(f"streamkeep sync reset {chosen.name}: {done}")
        return 0
    import trio

    from streamkeep.sync import process

    trio.run(process.run, loaded)
    return 0
