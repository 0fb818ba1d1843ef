"""What a sink applies in one transaction: one or more consecutive read answers (`Part`s), and the
messages among them that did not fit (`Misfit`s)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from streamkeep.client import Batch


@dataclass(frozen=True)
class Part:
    """One read answer (or SSE data+control pair): where it starts and what it held."""

    offset: str
    next_offset: str
    messages: list[Any] | None  # JSON streams; None for any other (then `data`)
    data: bytes
    first_index: int = 0  # the place of messages[0] in the answer (a message split off: salvage.py)

    @classmethod
    def of(cls, batch: Batch) -> Part:
        return cls(batch.offset, batch.next_offset, batch.messages, batch.data)

    @property
    def count(self) -> int:
        if self.messages is not None:
            return len(self.messages)
        return 1 if self.data else 0


@dataclass(frozen=True)
class Misfit:
    """A message that does not fit the mapping: it goes to the dead-letter table, or stops the
    mapping with this description."""

    offset: str
    index: int
    message: Any
    error: str

    def describe(self) -> str:
        text = json.dumps(self.message, default=repr)
        shown = text if len(text) <= 200 else text[:200] + "..."
        return (
            f"message {self.index} of the batch at offset {self.offset} does not fit: {self.error}: {shown}"
        )


@dataclass(frozen=True)
class Outcome:
    """What a transaction's write did."""

    applied: int  # messages applied (state mode: controls included), misfits not
    in_snapshot: bool  # state mode: a snapshot is being staged after this transaction
    misfits: list[Misfit]


def dumps(value: Any) -> str:
    """JSON text for a jsonb column. json.dumps with no options: it reuses one C encoder, about
    twice as fast as passing separators (a new encoder per call), and Postgres parses it anyway."""
    return json.dumps(value)
