"""Rows as State Protocol messages, deterministically: a batch rebuilt after a crash must hold
the same messages as the one that may already be on the stream (the server deduplicates on the
producer seq and never compares bodies, so a different body would be silently lost).

Values come as Postgres' text representation (pgoutput's text mode, and the snapshot reads the
types' output text too), so both paths give the same JSON. Integers and booleans become JSON numbers and
booleans, json/jsonb parsed JSON (a number past a float's range as its text; a duplicate key
keeps its last value and long decimals a float's precision, as the server stores JSON anyway),
floats numbers when finite; everything else (numeric, timestamps,
uuids, arrays, ...) keeps its text, since a JSON number would lose numeric's precision and a
timestamp has no JSON type."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

JSON_TYPE = "application/json"
INTEGER_TYPES = frozenset((20, 21, 23, 26))  # int8, int2, int4, oid
FLOAT_TYPES = frozenset((700, 701))  # float4, float8
BOOL_TYPE = 16
JSON_TYPES = frozenset((114, 3802))  # json, jsonb


def _bool(text: str) -> bool:
    return text == "t"


def _float(text: str) -> float | str:
    value = float(text)
    # NaN and the infinities have no JSON form: their text goes instead.
    return value if value not in (_INFINITIES) and value == value else text


def _text(text: str) -> str:
    return text


_INFINITIES = (float("inf"), float("-inf"))


def _finite_or_text(text: str) -> float | str:
    value = float(text)
    return text if value in _INFINITIES else value


def _json(text: str) -> Any:
    """A json/jsonb value. A number past a float's range (1e400: valid json in Postgres) keeps its
    text, as a float column's infinity does: it has no JSON form a server could store."""
    return json.loads(text, parse_float=_finite_or_text)


def converter(type_oid: int) -> Callable[[str], Any]:
    """The function from a (non-NULL) value's text to its JSON value, chosen once per column."""
    if type_oid in INTEGER_TYPES:
        return int
    if type_oid == BOOL_TYPE:
        return _bool
    if type_oid in FLOAT_TYPES:
        return _float
    if type_oid in JSON_TYPES:
        return _json
    return _text


def to_json(type_oid: int, text: str | None) -> Any:
    return None if text is None else converter(type_oid)(text)


def key_text(values: Sequence[str | None]) -> str:
    """The primary key as the message's `key`: the value's text, or a JSON array of texts for a
    key of several columns."""
    if len(values) == 1 and values[0] is not None:
        return values[0]
    return dumps(list(values))


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def change(
    table: str, key: str, operation: str, value: dict[str, Any] | None, txid: int | None, lsn: str
) -> dict[str, Any]:
    """A change message; a snapshot row has no transaction id (`txid` None) and the slot's
    consistent point as its `lsn`."""
    message: dict[str, Any] = {"type": table, "key": key}
    if value is not None:
        message["value"] = value
    headers: dict[str, str] = {"operation": operation}
    if txid is not None:
        headers["txid"] = str(txid)
    headers["lsn"] = lsn
    message["headers"] = headers
    return message


def headers(operation: str, txid: int) -> dict[str, str]:
    """A transaction's headers for one operation, shared by its messages of that operation; its
    `lsn` (the commit's, known at Commit) is filled in once for all of them."""
    return {"operation": operation, "txid": str(txid), "lsn": ""}


def control(name: str) -> dict[str, Any]:
    return {"headers": {"control": name}}


def payload(messages: Sequence[dict[str, Any]]) -> bytes:
    """One append's body: a JSON array, which a JSON stream stores as one message per element."""
    return dumps(list(messages)).encode("utf-8")
