"""`streamkeep restore --from-bucket`: a data directory rebuilt from the cold tier alone, for when
every local copy is gone (docs/cold-and-spark.md, "Restoring from the bucket").

The bucket holds, beside each stream's sealed segments, its description and the segments' index
sidecars (streamkeep/storage/cold/describe.py). Per stream this writes what recovery reads:
`meta.cbor` and `floor.cbor` as described, `cold.cbor` naming the segments still in the bucket,
their sidecars (downloaded; a segment uploaded before sidecars went to the bucket is downloaded
and indexed here instead), and an empty active segment where the uploaded data ends, with the
stream's close in it if nothing but the close followed. Producer state, `Stream-Seq` and the
closed flag then come from the records' headers, as at any start: as of the last uploaded
segment. Nothing is downloaded into place but these small files: reads fetch the segments from
the bucket as they would for any cold segment.

Only into an empty (or new) directory, so it can never mix with or overwrite anything; each stream
is built aside and renamed into place, as the server creates one (creates.py `create_now`, a
round of one). In a cluster sharing the
bucket, `--cluster-member` takes the streams that member owns.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from streamkeep.cluster.placement import Member, Placement
from streamkeep.replication.roles import marker_for, write_marker
from streamkeep.segments import format as fmt
from streamkeep.segments import layout
from streamkeep.segments.floor import FLOOR_FILE, FloorCheckpoint
from streamkeep.segments.manifest import INDEX_SUFFIX, MANIFEST, decode_index, encode_index, encode_manifest
from streamkeep.storage import files
from streamkeep.storage.cold import describe
from streamkeep.storage.cold.store import ColdConfig, ObjectStore, S3Store, get_whole
from streamkeep.storage.disk.creates import create_now
from streamkeep.storage.disk.directory import DataDirectory
from streamkeep.storage.disk.meta import decode_meta

USAGE = "streamkeep restore"


@dataclass
class Outcome:
    """What became of one stream directory of the bucket."""

    stream_dir: str
    name: str | None = None
    segments: int = 0
    readable: tuple[int, int] | None = None  # the positions restored, [from, to)
    downloaded: int = 0  # segments fetched whole because the bucket had no sidecar for them
    older: int = 0  # descriptions of older incarnations left in the bucket, ignored
    other_member: bool = False
    failed: str | None = None
    notes: list[str] = field(default_factory=list)


def restore(settings: SimpleNamespace, *, out: Callable[[str], None] | None = None) -> int:
    say = out or (lambda line: print(line, file=sys.stderr, flush=True))
    config = ColdConfig.from_settings(settings)
    if config is None:
        say(f"{USAGE}: no cold tier configured; pass --cold-url s3://BUCKET/PREFIX (and --cold-endpoint)")
        return 2
    root = Path(settings.storage.data_dir)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        say(
            f"{USAGE}: {root} is not empty; a restore only writes into an empty or new directory, so it "
            f"never mixes with what is there. Move it aside (mv {root} {root}.old) or pass another --data-dir"
        )
        return 2
    owned = _owned_by(settings)
    if isinstance(owned, str):
        say(f"{USAGE}: {owned}")
        return 2
    store = S3Store(config)
    try:
        described = _described_streams(store, config)
        segment_keys = {key for key, _ in store.list_objects(config.root)}
    except Exception as error:  # boto3's errors: an unreachable endpoint, a missing bucket, no access
        say(f"{USAGE}: cannot list s3://{config.bucket}/{config.prefix}: {error}")
        return 1
    index_keys = {key for ids in described.values() for _, sidecars in ids.values() for key in sidecars}
    directory = DataDirectory(files.OS, root)
    directory.open()
    total = len(described)
    say(f"restoring from s3://{config.bucket}/{config.prefix}: {total} stream directories described")
    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(max_workers=config.transfers) as pool:
        futures = [
            pool.submit(
                _restore_stream,
                store,
                config,
                directory,
                stream_dir,
                candidates,
                segment_keys,
                index_keys,
                owned,
            )
            for stream_dir, candidates in sorted(described.items())
        ]
        for done, future in enumerate(as_completed(futures), 1):
            outcome = future.result()
            outcomes.append(outcome)
            _progress(done, total)
            if outcome.failed is not None:
                sys.stderr.write(f"\n  FAILED {outcome.name or outcome.stream_dir}: {outcome.failed}\n")
            for note in outcome.notes:
                sys.stderr.write(f"\n  {outcome.name or outcome.stream_dir}: {note}\n")
    code = _summary(say, root, config, outcomes)
    if code == 0 and settings.cluster.member:
        # A replica (--replicas 2) serves only a directory marked as a complete copy of its member:
        # this one is, as far as the bucket goes; etcd's record still decides which replica owns.
        origin = f"s3://{config.bucket}/{config.prefix}"
        write_marker(root, {**marker_for(settings.cluster.member, 0), "restored_from": origin})
        say(
            f"marked {root} as member {settings.cluster.member}'s data, for a replica to serve (replica.json)"
        )
    return code


def _described_streams(store: ObjectStore, config: ColdConfig) -> dict[str, dict[str, tuple[str, list[str]]]]:
    """Per stream directory, per stream id: the description's key and the sidecars' keys."""
    out: dict[str, dict[str, tuple[str, list[str]]]] = {}
    sidecars: dict[tuple[str, str], list[str]] = {}
    for key, _ in store.list_objects(describe.meta_root(config.prefix)):
        parsed = describe.parse_meta_key(config.prefix, key)
        if parsed is None:
            continue
        stream_dir, stream_id, name = parsed
        if name == describe.STREAM_OBJECT:
            out.setdefault(stream_dir, {})[stream_id] = (
                key,
                sidecars.setdefault((stream_dir, stream_id), []),
            )
        elif name.endswith(layout.SEGMENT_SUFFIX + INDEX_SUFFIX):
            sidecars.setdefault((stream_dir, stream_id), []).append(key)
    return out


def _restore_stream(
    store: ObjectStore,
    config: ColdConfig,
    directory: DataDirectory,
    stream_dir: str,
    candidates: dict[str, tuple[str, list[str]]],
    segment_keys: set[str],
    index_keys: set[str],
    owned: Callable[[str], bool],
) -> Outcome:
    outcome = Outcome(stream_dir)
    try:
        _build(store, config, directory, stream_dir, candidates, segment_keys, index_keys, owned, outcome)
    except Exception as error:  # the bucket or a damaged object: this stream only
        outcome.failed = f"{type(error).__name__}: {error}"
    return outcome


def _build(
    store: ObjectStore,
    config: ColdConfig,
    directory: DataDirectory,
    stream_dir: str,
    candidates: dict[str, tuple[str, list[str]]],
    segment_keys: set[str],
    index_keys: set[str],
    owned: Callable[[str], bool],
    outcome: Outcome,
) -> None:
    found = []
    for stream_id, (key, _) in candidates.items():
        data = get_whole(store, key)
        if data is not None:  # None: deleted since the listing, with its stream
            found.append((describe.StreamObject.decode(data), stream_id))
    if not found:
        outcome.failed = "its description vanished from the bucket while restoring"
        return
    # A stream deleted in the moment before every copy was lost may have left its description: the
    # newest incarnation is the stream.
    found.sort(key=lambda item: item[0].written)
    description, stream_id = found[-1]
    outcome.older = len(found) - 1
    meta = decode_meta(description.meta)
    outcome.name = meta.name
    if not owned(meta.name):
        outcome.other_member = True
        return
    checkpoint = FloorCheckpoint.decode(description.floor) if description.floor is not None else None
    low = max(meta.fork_base, checkpoint.floor if checkpoint is not None else 0)
    contents: dict[str, bytes] = {layout.META: description.meta}
    kept: list[dict] = []
    position: int | None = None
    closed = False
    for entry in sorted(description.segments, key=lambda e: e["start"]):
        if entry["key"] not in segment_keys:
            if kept:
                outcome.notes.append(
                    f"segment {entry['file']} is missing from the bucket: restored up to position {position}"
                )
                break
            continue  # dropped by retention after the description was written: see below
        if position is not None and entry["start"] != position:
            outcome.notes.append(
                f"segments are missing before {entry['file']}: restored up to position {position}"
            )
            break
        index_key = describe.index_object_key(config.prefix, stream_dir, stream_id, entry["file"])
        index = get_whole(store, index_key) if index_key in index_keys else None
        if index is None:  # uploaded before sidecars went to the bucket: index the segment here
            data = get_whole(store, entry["key"])
            if data is None or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise OSError(f"segment object {entry['key']} is gone or does not match its manifest entry")
            index = encode_index(data, entry["file"])
            outcome.downloaded += 1
        records = decode_index(index)
        at = entry["start"]
        for record in records:
            if record.start != at:
                raise fmt.CorruptRecord(f"sidecar of {entry['file']} is out of order at position {at}")
            at += record.payload_len
            closed = closed or record.closes
        contents[entry["file"] + INDEX_SUFFIX] = index
        kept.append(entry)
        position = at
    floor_bytes = description.floor
    if kept and kept[0]["start"] > low:
        # Its front is gone from the bucket (retention dropped it after the description was
        # written): readers start where the bucket does. What those records decided for producers
        # is what the last checkpoint says.
        base = checkpoint or FloorCheckpoint(floor=0)
        floor_bytes = FloorCheckpoint(
            floor=kept[0]["start"],
            producers=base.producers,
            last_stream_seq=base.last_stream_seq,
            closed=base.closed,
            closed_by=base.closed_by,
            last_append_ms=base.last_append_ms,
        ).encode()
        outcome.notes.append(f"the bucket holds it from position {kept[0]['start']} on (the floor was {low})")
        low = kept[0]["start"]
    end = low if position is None else position
    if end < low:  # everything uploaded lies below a floor that moved past it (a compaction): none readable
        outcome.notes.append(
            f"its floor {low} lies past all it has in the bucket (up to {end}): restored empty"
        )
        for entry in kept:
            del contents[entry["file"] + INDEX_SUFFIX]
        kept, end = [], low
    if floor_bytes is not None:
        contents[FLOOR_FILE] = floor_bytes
    if kept:
        contents[MANIFEST] = encode_manifest(kept)
    # The active segment: empty, where the uploaded data ends; with the close if only that followed.
    active = fmt.encode_segment_header(meta.name, end, meta.content_type, meta.stream_id)
    close = description.close
    if close is not None and close.position == end and not closed:
        header = fmt.append_header(end, close.time_ms, [], producer=close.closed_by, closes=True)
        active += fmt.frame_append(header, b"")
    contents[layout.segment_filename(end)] = active
    create_now(directory.fs, directory.streams, directory.streams / stream_dir, contents)
    outcome.segments = len(kept)
    outcome.readable = (kept[0]["start"] if kept else end, end)


def _owned_by(settings: SimpleNamespace) -> Callable[[str], bool] | str:
    """Which stream names to restore: all, or in a cluster the ones `--cluster-member` owns. A
    message when the settings do not say."""
    members = settings.cluster.members
    member = settings.cluster.member
    if not members:
        if member:
            return "--cluster-member needs the cluster's members: pass the cluster's --config ([cluster] members)"
        return lambda _name: True
    if not member:
        return (
            "the [cluster] members share this bucket: pass --cluster-member with the id of the member "
            "whose data directory this is, so only its streams are restored"
        )
    placement = Placement.of([Member(m, a) for m, a in members], settings.cluster.epoch)
    if member not in {m.id for m in placement.members}:
        return f"--cluster-member {member!r} is not one of the [cluster] members"
    return lambda name: placement.owner(name).id == member


def _progress(done: int, total: int) -> None:
    if not sys.stderr.isatty() and done != total and done % 100:
        return
    width = 30
    filled = width * done // max(total, 1)
    end = "\n" if done == total or not sys.stderr.isatty() else ""
    sys.stderr.write(f"\rrestoring [{'#' * filled}{' ' * (width - filled)}] {done}/{total} streams{end}")
    sys.stderr.flush()


def _summary(say: Callable[[str], None], root: Path, config: ColdConfig, outcomes: list[Outcome]) -> int:
    restored = [o for o in outcomes if o.failed is None and not o.other_member and o.readable is not None]
    failed = [o for o in outcomes if o.failed is not None]
    others = sum(1 for o in outcomes if o.other_member)
    segments = sum(o.segments for o in restored)
    readable = sum(o.readable[1] - o.readable[0] for o in restored if o.readable is not None)
    downloaded = sum(o.downloaded for o in restored)
    older = sum(o.older for o in outcomes)
    say(
        f"restored {len(restored)} streams into {root}: {segments} segments, {readable} bytes readable"
        + (
            f"; {downloaded} segments had no sidecar in the bucket and were indexed here"
            if downloaded
            else ""
        )
    )
    if others:
        say(f"{others} streams belong to other cluster members: left to their own restore")
    if older:
        say(f"{older} descriptions of older incarnations of a stream name were ignored")
    if failed:
        say(
            f"{len(failed)} streams could not be restored (above); run again into an empty directory to retry"
        )
    say(
        "not restored: what was not uploaded yet (per stream at most --segment-max-age of appends, more if "
        "the bucket was unreachable), subscriptions, keys/ (new signing keys are made at start)"
    )
    say(
        f"serve it with the same cold tier: streamkeep serve --data-dir {root} --cold-url s3://{config.bucket}/{config.prefix}"
    )
    return 1 if failed else 0
