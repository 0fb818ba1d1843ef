"""meta.cbor: a stream's fixed configuration, as bytes (docs/segment-format.md, "meta.cbor")."""

from __future__ import annotations

import cbor2

from streamkeep.protocol.stream import StreamMeta, shared_content_type


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
            # Only in a cluster: absent keys keep meta.cbor of a single process as it was.
            **({"rforks": [list(pin) for pin in meta.remote_forks]} if meta.remote_forks else {}),
            **({"flow": meta.fork_low} if meta.fork_low else {}),
            **({"finc": list(meta.source_incarnations)} if meta.source_incarnations else {}),
        }
    )


def decode_meta(data: bytes) -> StreamMeta:
    raw = cbor2.loads(data)
    return StreamMeta(
        name=raw["name"],
        stream_id=raw["id"],
        content_type=shared_content_type(ct) if isinstance(ct := raw["ct"], str) else ct,
        created_at=raw["created"],
        ttl_seconds=raw.get("ttl"),
        expires_at=raw.get("exp"),
        expires_at_ts=raw.get("exp_ts"),
        forked_from=raw.get("from"),
        fork_base=raw.get("base") or 0,
        fork_offset=raw.get("foff"),
        fork_sub_offset=raw.get("fsub") or 0,
        soft_deleted=bool(raw.get("deleted")),
        remote_forks=tuple((str(i), str(n), int(low)) for i, n, low in raw.get("rforks") or ()),
        fork_low=raw.get("flow") or 0,
        source_incarnations=tuple(int(i) for i in raw.get("finc") or ()),
    )
