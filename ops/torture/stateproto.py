"""The State Protocol as `streamkeep sync`'s state-mode sink applies it, written the plain way (a
Python loop, one message after another): the oracle the sink's SQL is judged against, by the
torture (ops/torture/syncbridge.py) and the sink's tests.

It differs from the reference materializer (streamkeep/protocol/state_fold.py, where snapshot
boundaries change nothing) on purpose: between `snapshot-start` and `snapshot-end` changes are
staged, and the end replaces the table with what was staged, so the table follows compaction
(docs/postgres-sync.md). `reset` empties the table and any snapshot being staged; an end without
a start changes nothing; a second start begins the staging again."""

from __future__ import annotations

from typing import Any

Key = tuple[str, str]


def fold(messages: list[Any]) -> dict[Key, Any]:
    """The table a state-mode sink holds after applying `messages` (all of the protocol's shape:
    leave out what the sink sets aside, see `refused_by_postgres`)."""
    table: dict[Key, Any] = {}
    staging: dict[Key, Any] | None = None
    for message in messages:
        headers = message["headers"]
        if "control" in headers:
            if headers["control"] == "reset":
                table, staging = {}, None
            elif headers["control"] == "snapshot-start":
                staging = {}
            elif staging is not None:  # snapshot-end
                table, staging = staging, None
            continue
        into = table if staging is None else staging
        if headers["operation"] == "delete":
            into.pop((message["type"], message["key"]), None)
        else:
            into[(message["type"], message["key"])] = message["value"]
    return table


def refused_by_postgres(message: Any) -> bool:
    """Whether Postgres refuses `message` in a jsonb column: a string anywhere in it holding
    U+0000 (valid JSON, which jsonb cannot store). The sink dead-letters such a message."""
    if isinstance(message, str):
        return "\x00" in message
    if isinstance(message, dict):
        return any(refused_by_postgres(k) or refused_by_postgres(v) for k, v in message.items())
    if isinstance(message, list):
        return any(refused_by_postgres(v) for v in message)
    return False
