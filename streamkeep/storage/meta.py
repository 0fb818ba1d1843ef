"""meta.cbor: a stream's fixed configuration, as bytes (docs/segment-format.md, "meta.cbor")."""

from __future__ import annotations

import cbor2

from streamkeep.protocol.stream import StreamMeta


def encode_meta(meta: StreamMeta) -> bytes:
    return cbor2.dumps(
        {
            "v": 1,
            "name": meta.name,
            "id": meta.stream_id,
            "ct": meta.content_type,
            "created": meta.created_at,
            "ttl": meta.ttl_seconds,
            "exp": meta.expires_at,
            "exp_ts": meta.expires_at_ts,
            "from": meta.forked_from,
            "base": meta.fork_base,
            "foff": meta.fork_offset,
            "fsub": meta.fork_sub_offset,
            "deleted": meta.soft_deleted,
        }
    )


def decode_meta(data: bytes) -> StreamMeta:
    raw = cbor2.loads(data)
    return StreamMeta(
        name=raw["name"],
        stream_id=raw["id"],
        content_type=raw["ct"],
        created_at=raw["created"],
        ttl_seconds=raw.get("ttl"),
        expires_at=raw.get("exp"),
        expires_at_ts=raw.get("exp_ts"),
        forked_from=raw.get("from"),
        fork_base=raw.get("base") or 0,
        fork_offset=raw.get("foff"),
        fork_sub_offset=raw.get("fsub") or 0,
        soft_deleted=bool(raw.get("deleted")),
    )
