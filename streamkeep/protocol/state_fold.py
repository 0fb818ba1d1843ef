"""The State Protocol's materialization (seed 001, section 6), as compaction needs it: no I/O.

A `StateFold` applies a JSON stream's messages in order: `insert`, `update` and `upsert` store
the value at (type, key), `delete` removes it, a `reset` control clears everything, and snapshot
boundaries change nothing. This is what the protocol's reference materializer
(`@durable-streams/state`'s `MaterializedState`, with `reset` handled as its StreamDB does) does,
and the tests check the two agree. `snapshot` turns the state into the messages a compaction
appends: `snapshot-start`, one `insert` per live (type, key), `snapshot-end`.

A message that is not the protocol's shape stops the fold (`NotStateMessage`) unless the fold
was told to drop such messages, which it then counts.
"""

from __future__ import annotations

import json
from typing import Any

from streamkeep.protocol.jsonmode import encode_message

OPERATIONS = frozenset(("insert", "update", "upsert", "delete"))
CONTROLS = frozenset(("snapshot-start", "snapshot-end", "reset"))


class NotStateMessage(ValueError):
    """A message of the stream is not a State Protocol change or control message."""


class StateFold:
    __slots__ = ("drop_invalid", "dropped", "folded", "state")

    def __init__(self, *, drop_invalid: bool = False) -> None:
        self.state: dict[tuple[str, str], Any] = {}
        self.drop_invalid = drop_invalid
        self.dropped = 0  # messages not of the protocol's shape, skipped (with drop_invalid)
        self.folded = 0  # messages applied

    def apply(self, raw: bytes) -> None:
        """Applies one stored message (the bytes of one JSON value); the caller adds where it is
        to a NotStateMessage."""
        try:
            message = json.loads(raw)
            self._apply(message)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            if self.drop_invalid:
                self.dropped += 1
                return
            shown = raw[:120].decode("utf-8", "replace")
            raise NotStateMessage(
                f"is not a State Protocol message ({error}): {shown!r}; compaction stops "
                "(compact with drop_invalid to skip such messages, counted)"
            ) from None
        self.folded += 1

    def _apply(self, message: Any) -> None:
        if not isinstance(message, dict) or not isinstance(message.get("headers"), dict):
            raise ValueError("expected an object with a headers object")
        headers = message["headers"]
        operation = headers.get("operation")
        if operation is not None:
            if operation not in OPERATIONS:
                raise ValueError(f"unknown operation {operation!r}")
            kind, key = message["type"], message["key"]
            if not isinstance(kind, str) or not isinstance(key, str) or not kind or not key:
                raise ValueError("type and key must be non-empty strings")
            if operation == "delete":
                self.state.pop((kind, key), None)
            else:
                if "value" not in message:
                    raise ValueError(f"{operation} needs a value")
                self.state[(kind, key)] = message["value"]
            return
        control = headers.get("control")
        if control not in CONTROLS:
            raise ValueError("headers holds neither a known operation nor a known control")
        if control == "reset":
            self.state.clear()

    def snapshot(self, offset: str) -> list[bytes]:
        """The messages of a snapshot of the state as it stands at stream offset `offset`."""
        messages = [encode_message({"headers": {"control": "snapshot-start", "offset": offset}})]
        for (kind, key), value in sorted(self.state.items()):
            messages.append(
                encode_message({"type": kind, "key": key, "value": value, "headers": {"operation": "insert"}})
            )
        messages.append(encode_message({"headers": {"control": "snapshot-end", "offset": offset}}))
        return messages

    def view(self) -> dict[str, dict[str, Any]]:
        """The state as {type: {key: value}}, the shape tests compare with the reference's."""
        out: dict[str, dict[str, Any]] = {}
        for (kind, key), value in sorted(self.state.items()):
            out.setdefault(kind, {})[key] = value
        return out
