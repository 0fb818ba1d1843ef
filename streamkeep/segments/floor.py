"""`floor.cbor`: where a stream's retained data begins, and what the records before it decided.

Retention drops whole sealed segments from the front of a stream. The server rebuilds producer
state, the closed flag and `Stream-Seq` from the records themselves, so before any record goes,
this checkpoint is written durably: the new floor and that state as it stands (durable) when it
is written. Recovery starts from it and replays the records still there on top; records before
the floor can only be older than those, so the result is the state a full replay would give.

The floor is what clients see (`410` below it, `offset=-1` starts there). What is physically
deleted may lag behind it while forks pin their source's bytes (docs/segment-format.md,
"Retention"). The codec lives here, beside the segment format, because the Spark source reads
floors too; the server reads and writes the file through storage/disk/floor.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cbor2

from streamkeep.protocol.stream import ProducerMark, ProducerState

FLOOR_FILE = "floor.cbor"


@dataclass(frozen=True)
class FloorCheckpoint:
    floor: int
    producers: dict[str, ProducerState] = field(default_factory=dict)
    last_stream_seq: str | None = None
    closed: bool = False
    closed_by: ProducerMark | None = None
    # Where the snapshot that starts at the floor ends, when a compaction put the floor there:
    # its size decides when the next compaction is due (storage/disk/retention.py).
    snapshot_end: int | None = None
    # The time (ms) of the last append when the checkpoint was written: a sliding TTL counts from
    # it after a restart if retention left no record to read it from.
    last_append_ms: int | None = None

    def encode(self) -> bytes:
        return cbor2.dumps(
            {
                "v": 1,
                "floor": self.floor,
                "producers": {pid: [s.epoch, s.last_seq] for pid, s in self.producers.items()},
                "seq": self.last_stream_seq,
                "closed": self.closed,
                "closed_by": None
                if self.closed_by is None
                else [self.closed_by.producer_id, self.closed_by.epoch, self.closed_by.seq],
                "snap": self.snapshot_end,
                "last_ms": self.last_append_ms,
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> FloorCheckpoint:
        raw = cbor2.loads(data)
        if raw.get("v") != 1:
            raise ValueError(f"{FLOOR_FILE} has version {raw.get('v')!r}; this server reads version 1")
        closed_by = raw.get("closed_by")
        return cls(
            floor=int(raw["floor"]),
            producers={pid: ProducerState(int(e), int(s)) for pid, (e, s) in raw["producers"].items()},
            last_stream_seq=raw.get("seq"),
            closed=bool(raw.get("closed")),
            closed_by=None if closed_by is None else ProducerMark(*closed_by),
            snapshot_end=raw.get("snap"),
            last_append_ms=raw.get("last_ms"),
        )
