"""Server-Sent Events framing for §5.8: `data` and `control` events."""

from __future__ import annotations

import base64
import json
import re

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def event(kind: str, payload: str) -> bytes:
    lines = _LINE_BREAK.split(payload)
    return (f"event: {kind}\n" + "".join(f"data:{line}\n" for line in lines) + "\n").encode()


def data_payload(messages: list[bytes], *, json_mode: bool, base64_mode: bool) -> str:
    if base64_mode:
        return base64.b64encode(b"".join(messages)).decode("ascii")
    if json_mode:
        return "[" + ",".join(m.decode("utf-8") for m in messages) + "]"
    return b"".join(messages).decode("utf-8", errors="replace")


def control(next_offset: str, *, cursor: str | None, up_to_date: bool, closed: bool) -> bytes:
    fields: dict[str, object] = {"streamNextOffset": next_offset}
    if closed:
        fields["streamClosed"] = True
        fields["upToDate"] = True
    else:
        if cursor is not None:
            fields["streamCursor"] = cursor
        if up_to_date:
            fields["upToDate"] = True
    return event("control", json.dumps(fields, separators=(",", ":")))
