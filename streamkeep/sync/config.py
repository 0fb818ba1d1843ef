"""`sync.toml`: the server to talk to, the process's own listener, and the mappings.

Every key is checked at start; a bad or unknown key fails with a message that names it and says what
is accepted, before anything connects."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from streamkeep.config.values import DURATION_SYNTAX, ConfigError, duration

TOKEN_VARIABLE = "STREAMKEEP_TOKEN"  # the auth token when the config names none
_NAME = re.compile(r"[a-z][a-z0-9_]{0,40}")  # slot and publication names derive from it
_QUALIFIED = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*(\.[A-Za-z_][A-Za-z0-9_$]*)?")

T = TypeVar("T")


@dataclass(frozen=True)
class Server:
    url: str = "http://127.0.0.1:4437"
    token: str | None = None
    http2: bool = False


@dataclass(frozen=True)
class Listener:
    """Where the sync process answers /metrics and /healthz (port 0: none)."""

    host: str = "127.0.0.1"
    port: int = 4440


@dataclass(frozen=True)
class PgToStream:
    name: str
    dsn: str
    tables: tuple[str, ...]
    stream: str
    slot: str
    publication: str
    # A batch closes when the previous append is done (group commit); while one is out, at
    # batch_rows rows or once its first row has waited batch_wait seconds.
    batch_rows: int = 1000
    batch_wait: float = 0.05
    snapshot: bool = True  # copy the tables' rows first (between snapshot-start and snapshot-end)
    checkpoint_table: str = "streamkeep_sync.checkpoints"


@dataclass(frozen=True)
class StreamToPg:
    name: str
    stream: str
    dsn: str
    table: str
    mode: str  # "log" or "state"
    live: str = "sse"  # or "long-poll"
    on_gone: str = "stop"  # or "resync": from Stream-Earliest-Offset
    dead_letter: str | None = None  # a table for messages that do not fit; None: stop instead
    columns: dict[str, str] = field(default_factory=dict)  # column -> message field path (log mode)
    offsets_table: str = "streamkeep_sync.offsets"


@dataclass(frozen=True)
class SyncConfig:
    server: Server
    listener: Listener
    pg_to_stream: tuple[PgToStream, ...]
    stream_to_pg: tuple[StreamToPg, ...]

    @property
    def mappings(self) -> list[PgToStream | StreamToPg]:
        return [*self.pg_to_stream, *self.stream_to_pg]

    def mapping(self, name: str) -> PgToStream | StreamToPg:
        for mapping in self.mappings:
            if mapping.name == name:
                return mapping
        names = ", ".join(m.name for m in self.mappings) or "none"
        raise ConfigError(f"no mapping named {name!r} (the config has: {names})")


class _Table:
    """One TOML table being read: each key taken once; what is left over is an unknown key."""

    def __init__(self, where: str, raw: Any) -> None:
        if not isinstance(raw, dict):
            raise ConfigError(f"{where} must be a table")
        self.where = where
        self.raw = dict(raw)

    def take(self, key: str, parse: Callable[[Any], T], default: T | None = None) -> T:
        if key not in self.raw:
            if default is None:
                raise ConfigError(f"{self.where}: `{key}` is required")
            return default
        value = self.raw.pop(key)
        try:
            return parse(value)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{self.where}: `{key}` = {value!r} {error}") from None

    def optional(self, key: str, parse: Callable[[Any], T]) -> T | None:
        if key not in self.raw:
            return None
        return self.take(key, parse)

    def done(self) -> None:
        if self.raw:
            raise ConfigError(f"{self.where}: unknown key(s) {', '.join(sorted(self.raw))}")


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("is not a non-empty string")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("is not true or false")
    return value


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError("is not a whole number of at least 1")
    return value


def _port(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 65535:
        raise ValueError("is not a port (0-65535; 0: no listener)")
    return value


def _name(value: Any) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError("is not a mapping name (lower-case letters, digits and _, starting with a letter)")
    return value


def _qualified(value: Any) -> str:
    """`schema.table` or `table` (public); quoted names are not accepted, so SQL can use them as is."""
    if not isinstance(value, str) or not _QUALIFIED.fullmatch(value):
        raise ValueError("is not a table name (`schema.table` or `table`, unquoted identifiers)")
    return value if "." in value else f"public.{value}"


def _tables(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("is not a non-empty list of table names")
    return tuple(dict.fromkeys(_qualified(item) for item in value))


def _one_of(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"is not one of {', '.join(repr(c) for c in choices)}")
        return str(value)

    return parse


def _wait(value: Any) -> float:
    try:
        return duration(value)
    except ValueError:
        raise ValueError(f"is not a positive duration; use {DURATION_SYNTAX}") from None


def _columns(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in value.items()
    ):
        raise ValueError('is not a table of column = "field.path" strings')
    return dict(value)


def _unique(names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ConfigError(f"two mappings are named {name!r}: a mapping's name keys its checkpoint")
        seen.add(name)


def parse(raw: dict[str, Any], environ: dict[str, str] | None = None) -> SyncConfig:
    environ = dict(os.environ) if environ is None else environ
    top = _Table("sync.toml", raw)
    server_table = _Table("[streamkeep]", top.take("streamkeep", lambda v: v, {}))
    token = server_table.optional("token", _text) or environ.get(TOKEN_VARIABLE) or None
    server = Server(
        url=server_table.take("url", _text, Server.url).rstrip("/"),
        token=token,
        http2=server_table.take("http2", _bool, False),
    )
    server_table.done()
    listen_table = _Table("[sync]", top.take("sync", lambda v: v, {}))
    listener = Listener(
        host=listen_table.take("host", _text, Listener.host),
        port=listen_table.take("port", _port, Listener.port),
    )
    listen_table.done()

    sources: list[PgToStream] = []
    items: list[Any] = top.take("pg_to_stream", list, [])
    for index, item in enumerate(items):
        table = _Table(f"[[pg_to_stream]] #{index + 1}", item)
        name = table.take("name", _name)
        table.where = f"[[pg_to_stream]] {name}"
        sources.append(
            PgToStream(
                name=name,
                dsn=table.take("dsn", _text),
                tables=table.take("tables", _tables),
                stream=table.take("stream", _text),
                slot=table.take("slot", _name, f"streamkeep_{name}"),
                publication=table.take("publication", _name, f"streamkeep_{name}"),
                batch_rows=table.take("batch_rows", _count, PgToStream.batch_rows),
                batch_wait=table.take("batch_wait", _wait, PgToStream.batch_wait),
                snapshot=table.take("snapshot", _bool, True),
                checkpoint_table=table.take("checkpoint_table", _qualified, PgToStream.checkpoint_table),
            )
        )
        table.done()
    sinks: list[StreamToPg] = []
    items = top.take("stream_to_pg", list, [])
    for index, item in enumerate(items):
        table = _Table(f"[[stream_to_pg]] #{index + 1}", item)
        name = table.take("name", _name)
        table.where = f"[[stream_to_pg]] {name}"
        mode = table.take("mode", _one_of("log", "state"))
        columns: dict[str, str] = table.take("columns", _columns, {})
        if columns and mode != "log":
            raise ConfigError(f'{table.where}: `columns` applies to mode = "log" only')
        sinks.append(
            StreamToPg(
                name=name,
                stream=table.take("stream", _text),
                dsn=table.take("dsn", _text),
                table=table.take("table", _qualified),
                mode=mode,
                live=table.take("live", _one_of("sse", "long-poll"), "sse"),
                on_gone=table.take("on_gone", _one_of("stop", "resync"), "stop"),
                dead_letter=table.optional("dead_letter", _qualified),
                columns=columns,
                offsets_table=table.take("offsets_table", _qualified, StreamToPg.offsets_table),
            )
        )
        table.done()
    top.done()
    _unique([m.name for m in sources] + [m.name for m in sinks])
    if not sources and not sinks:
        raise ConfigError("sync.toml has no [[pg_to_stream]] or [[stream_to_pg]] mapping: nothing to do")
    return SyncConfig(server, listener, tuple(sources), tuple(sinks))


def load(path: Path, environ: dict[str, str] | None = None) -> SyncConfig:
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML: {error}") from None
    return parse(raw, environ)
