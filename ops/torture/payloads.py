"""Self-identifying append bodies, so a read can be parsed back into the appends it holds.

A text or binary append is one record `<id>:<filler>;` (ids and fillers never hold `:` or `;`). A
JSON append is one message or an array of them (a batch: one request, several messages), each a
State Protocol change (seed 001) that also names itself: `{"id":"<id>","f":"<filler>","type":
"row","key":"k<n>","value":"<id>","headers":{"operation":"upsert"}}` (or a `delete` without a
value), so compaction can fold JSON streams and the model can judge the snapshots it appends:
a snapshot's `insert` of a key carries the id of the change that set it. Ids are `<worker>.<n>`, unique in a run; fillers are seed-derived
letters of seed-derived length, so segments rotate by size as well as by count.

Positions: streamkeep's offset tokens count stored bytes. A byte stream stores the body as sent; a
JSON stream stores each message in its canonical form (`canonical`: compact separators, no ASCII
escaping, keys in the order given), which is what positions count. The model keeps every stream's
content as these stored bytes: for JSON streams the concatenation of canonical messages.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
_DECODER = json.JSONDecoder()
LETTERS = string.ascii_lowercase


def canonical(value: object) -> bytes:
    return _ENCODER.encode(value).encode()


def filler(rng: random.Random) -> str:
    """Mostly short, now and then a few KiB: rotation by size needs big appends too."""
    size = rng.choice((4, 12, 40, 90, 200)) if rng.random() < 0.93 else rng.randrange(600, 3000)
    return "".join(rng.choices(LETTERS, k=size))


def text_record(record_id: str, fill: str) -> bytes:
    return f"{record_id}:{fill};".encode()


STATE_TYPE = "row"
STATE_KEYS = 6  # few keys: the state stays small, so history soon outgrows it and compaction runs


def json_message(record_id: str, fill: str, key: str = "k0", delete: bool = False) -> bytes:
    message: dict[str, object] = {"id": record_id, "f": fill, "type": STATE_TYPE, "key": key}
    if delete:
        message["headers"] = {"operation": "delete"}
    else:
        message["value"] = record_id
        message["headers"] = {"operation": "upsert"}
    return canonical(message)


def state_change(value: object) -> tuple[str, str | None] | None:
    """(key, the id it now holds or None for a delete) of a change message of ours, else None."""
    if not isinstance(value, dict) or value.get("type") != STATE_TYPE:
        return None
    headers = value.get("headers")
    key = value.get("key")
    if not isinstance(headers, dict) or not isinstance(key, str):
        return None
    operation = headers.get("operation")
    if operation == "delete":
        return key, None
    if operation in ("insert", "update", "upsert") and isinstance(value.get("value"), str):
        return key, value["value"]
    return None


def snapshot_control(value: object) -> tuple[str, str] | None:
    """("snapshot-start" | "snapshot-end", its offset) of a snapshot boundary, else None."""
    if not isinstance(value, dict) or set(value) != {"headers"} or not isinstance(value["headers"], dict):
        return None
    control, offset = value["headers"].get("control"), value["headers"].get("offset")
    if control in ("snapshot-start", "snapshot-end") and isinstance(offset, str):
        return control, offset
    return None


@dataclass(frozen=True)
class Unit:
    """One parsed record or message: where it sits in the stored content and its id (None when
    the bytes are not a record any client of this run could have written)."""

    position: int
    length: int
    record_id: str | None
    value: object = None  # a JSON unit's decoded message


def parse_text(data: bytes, base: int = 0) -> tuple[list[Unit], int]:
    """The complete records of `data` (stored content starting at position `base`), and how many
    trailing bytes are an incomplete record."""
    units: list[Unit] = []
    at = 0
    while True:
        end = data.find(b";", at)
        if end < 0:
            return units, len(data) - at
        piece = data[at:end]
        record_id: str | None = None
        head, sep, _ = piece.partition(b":")
        if sep and head and all(c in b"abcdefghijklmnopqrstuvwxyz0123456789." for c in head):
            record_id = head.decode()
        units.append(Unit(base + at, end + 1 - at, record_id))
        at = end + 1


def parse_json_units(data: bytes, base: int = 0) -> tuple[list[Unit], int]:
    """The canonical messages concatenated in `data`, and how many trailing bytes do not parse."""
    text = data.decode("utf-8", errors="replace")
    if len(text.encode()) != len(data):  # not UTF-8: nothing a client of ours wrote
        return [Unit(base, len(data), None)], 0
    units: list[Unit] = []
    at = 0
    position = 0
    while at < len(text):
        try:
            value, end = _DECODER.raw_decode(text, at)
        except ValueError:
            return units, len(data) - position
        size = len(text[at:end].encode())
        stored = canonical(value)
        record_id = value.get("id") if isinstance(value, dict) and isinstance(value.get("id"), str) else None
        if len(stored) != size:
            record_id = None  # not in canonical form: the server did not store it as we count
        units.append(Unit(base + position, size, record_id, value))
        position += size
        at = end
    return units, 0


def json_read_to_stored(body: bytes) -> bytes | None:
    """A JSON read's body (an array) as the stored bytes it covers, or None if it is not an array."""
    try:
        value = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(value, list):
        return None
    return b"".join(canonical(item) for item in value)
