"""`streamkeep archive status|verify`: what of each stream is local and what is cold, checked
against the bucket, without a running server (and safe beside one).

Retention (storage/disk/retention.py) moves a stream's floor; what ends at or before it is retained
away. `status` counts only retained segments and shows the floor; segments still there below it
(pinned by a fork, or a drop under way) are counted apart. A drop takes a segment out of the
manifest before anything else, so `verify` never checks a dropped segment's object: an object left
in the bucket is in no manifest, an orphan, and one below its stream's floor whose local file is
gone too is reported as an orphan at once, whatever its age (nothing can record it any more)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote

from streamkeep.cluster.placement import Member, Placement
from streamkeep.segments import layout
from streamkeep.segments.manifest import INDEX_SUFFIX
from streamkeep.storage import files
from streamkeep.storage.cold import describe
from streamkeep.storage.cold.store import ColdConfig, S3Store
from streamkeep.storage.disk import floor as floors
from streamkeep.storage.disk import manifest
from streamkeep.storage.disk.directory import DataDirectory
from streamkeep.storage.disk.meta import decode_meta

DEFAULT_ORPHAN_MIN_AGE = 3600.0


def _progress(done: int, total: int, label: str) -> None:
    if not sys.stderr.isatty() and done not in (total,) and done % 100:
        return
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r{label} [{'#' * filled}{' ' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _streams(data_dir: Path) -> list[tuple[str, str, Path]]:
    """(name, stream id, directory) of every stream."""
    fs = files.OS
    out = []
    root = data_dir / layout.STREAMS
    for directory in sorted(root.iterdir()) if root.is_dir() else []:
        if directory.name.startswith(".") or not (directory / layout.META).exists():
            continue
        meta = decode_meta(files.read_file(fs, directory / layout.META))
        out.append((meta.name, meta.stream_id, directory))
    return out


def _floor(directory: Path) -> int | None:
    """The stream's floor, None when retention never moved it (no floor.cbor)."""
    checkpoint = floors.load(files.OS, directory)
    return None if checkpoint is None else checkpoint.floor


def status(settings: SimpleNamespace) -> int:
    data_dir = Path(settings.storage.data_dir)
    rows = []
    for name, _stream_id, directory in _streams(data_dir):
        local = {p.name: p for p in directory.glob("*" + layout.SEGMENT_SUFFIX)}
        entries = manifest.load_manifest(files.OS, directory)
        floor = _floor(directory)  # after the listing: whatever a drop took from it is below this
        names = sorted(set(local) | {entry["file"] for entry in entries})
        # Retained: the last segment, and every one ending after the floor (the next one's start).
        retained = {
            n
            for i, n in enumerate(names)
            if i + 1 == len(names) or layout.segment_start(names[i + 1]) > (floor or 0)
        }
        kept_local = [p for n, p in local.items() if n in retained]
        kept_cold = [entry for entry in entries if entry["file"] in retained]
        uploaded = {entry["file"] for entry in entries}
        pending = [n for n in retained if n in local and n not in uploaded and n != names[-1]]
        rows.append(
            (
                name,
                len(kept_local),
                sum(p.stat().st_size for p in kept_local),
                len(kept_cold),
                sum(e["size"] for e in kept_cold),
                len(pending),
                "-" if floor is None else str(floor),
                len(names) - len(retained),
            )
        )
    print(
        f"{'stream':40} {'local segs':>10} {'local bytes':>12} {'cold segs':>10} {'cold bytes':>12} "
        f"{'to upload':>10} {'floor':>12} {'below floor':>11}"
    )
    for name, local_n, local_b, cold_n, cold_b, pending_n, floor_text, held in rows:
        print(
            f"{name[:40]:40} {local_n:>10} {local_b:>12} {cold_n:>10} {cold_b:>12} {pending_n:>10} "
            f"{floor_text:>12} {held:>11}"
        )
    held_total = sum(r[7] for r in rows)
    print(
        f"{len(rows)} streams; {sum(r[3] for r in rows)} segments cold, {sum(r[5] for r in rows)} waiting for upload"
        + (
            f"; {held_total} retained away but still held (a fork reads them, or a drop is under way)"
            if held_total
            else ""
        )
    )
    return 0


def verify(
    settings: SimpleNamespace, *, delete_orphans: bool, orphan_min_age: float = DEFAULT_ORPHAN_MIN_AGE
) -> int:
    """HEADs every object a manifest names, checks that each stream with uploaded segments has its
    description and sidecars (describe.py), and lists objects nothing names (orphans), under
    `PREFIX/streams/` and `PREFIX/meta/` alike.

    An orphan is deleted (with `delete_orphans`) only when no live stream can still claim it: its
    stream is gone or is another incarnation now, or the object is older than `orphan_min_age`
    seconds. A younger object of a live stream may be an upload a running server has not yet
    recorded in its manifest, so it is kept and reported. A sidecar is judged as its segment is; a
    live stream's description is never an orphan.
    """
    config = ColdConfig.from_settings(settings)
    if config is None:
        print(
            "streamkeep archive verify: no cold tier configured; pass --cold-url s3://BUCKET/PREFIX",
            file=sys.stderr,
        )
        return 2
    owned = _owned_by_this_member(settings)
    if owned is None:
        print(
            "streamkeep archive verify: the [cluster] members share this bucket; pass --cluster-member "
            "with this data directory's member id, so other members' objects are not taken for orphans",
            file=sys.stderr,
        )
        return 2
    store = S3Store(config)
    data_dir = Path(settings.storage.data_dir)
    streams = _streams(data_dir)
    # Before the manifests: a segment is recorded in its manifest before its local file goes, so a
    # file missing now and a manifest read after that without it mean the segment was dropped.
    held = {
        directory.name: (
            _floor(directory) or 0,
            {p.name for p in directory.glob("*" + layout.SEGMENT_SUFFIX)},
        )
        for _, _, directory in streams
    }
    manifests = [
        (name, stream_id, directory, manifest.load_manifest(files.OS, directory))
        for name, stream_id, directory in streams
    ]
    entries = [(name, entry) for name, _, _, stream_entries in manifests for entry in stream_entries]
    problems = 0
    for done, (name, entry) in enumerate(entries, 1):
        try:
            found = store.head(entry["key"])
            if found != (entry["size"], entry["sha256"]):
                raise OSError(f"expected size {entry['size']} and sha256 {entry['sha256']}, found {found}")
        except Exception as error:
            problems += 1
            sys.stderr.write(f"\nMISMATCH {name}/{entry['file']} ({entry['key']}): {error}\n")
        _progress(done, len(entries), "verifying")
    # Listed after the manifests were read: a sidecar reaches the bucket before its manifest entry
    # is written (bookkeeping.record_upload), so every entry read has its sidecar listed here.
    segment_objects = store.list_objects(config.root)
    meta_objects = dict(store.list_objects(describe.meta_root(config.prefix)))
    now = time.time()
    companions = _check_companions(
        config, manifests, meta_objects, dict(segment_objects), now=now, orphan_min_age=orphan_min_age
    )
    problems += len(companions.missing)
    for line in companions.missing:
        sys.stderr.write(f"MISSING {line}\n")
    known = {entry["key"] for _, entry in entries}
    live = {directory.name: stream_id for _, stream_id, directory in streams}
    listed = dict(live)  # as `held` saw them
    doomed = (
        {key for _, keys in DataDirectory(files.OS, data_dir).pending_object_deletes() for key in keys}
        if (data_dir / layout.TRASH).is_dir()
        else set()
    )
    fresh: set[str] = set()

    def live_id(stream_dir: str, stream_id: str | None) -> str | None:
        """The id of the stream live in `stream_dir`. Read again (once) when an object does not
        match what `live` says: the stream may have been created, or created again, since."""
        if stream_dir not in fresh and live.get(stream_dir) != stream_id and not stream_dir.startswith("."):
            fresh.add(stream_dir)
            try:
                meta = decode_meta(
                    files.read_file(files.OS, data_dir / layout.STREAMS / stream_dir / layout.META)
                )
            except FileNotFoundError:
                pass
            else:
                live[stream_dir] = meta.stream_id
        return live.get(stream_dir)

    # (key, modified, (stream dir, stream id, segment file) or None, the key of the segment it is or
    # belongs to): what no manifest names, under both roots.
    candidates: list[tuple[str, float, tuple[str, str | None, str | None] | None, str]] = [
        (key, modified, layout.parse_cold_key(config.root, key), key)
        for key, modified in segment_objects
        if key not in known
    ]
    for key, modified in meta_objects.items():
        meta_key = describe.parse_meta_key(config.prefix, key)
        if meta_key is None:
            candidates.append((key, modified, None, key))
            continue
        stream_dir, stream_id, file = meta_key
        if file.endswith(layout.SEGMENT_SUFFIX + INDEX_SUFFIX):
            segment_file = file[: -len(INDEX_SUFFIX)]
            segment_key = config.key(stream_dir, stream_id, segment_file)
            if segment_key not in known:  # not its segment's manifest entry (any more, or yet)
                candidates.append((key, modified, (stream_dir, stream_id, segment_file), segment_key))
        elif file != describe.STREAM_OBJECT or live_id(stream_dir, stream_id) != stream_id:
            candidates.append((key, modified, (stream_dir, stream_id, None), key))
    orphans, kept, dropped = [], [], 0
    others = 0
    for key, modified, parsed, segment_key in candidates:
        if parsed is not None and live_id(parsed[0], parsed[1]) is None and not owned(parsed[0]):
            others += 1  # another cluster member's stream: only its own verify can judge it
            continue
        claimed = parsed is not None and parsed[0] in live and parsed[1] in (None, live[parsed[0]])
        if (
            claimed
            and parsed is not None
            and parsed[2] is not None
            and listed.get(parsed[0]) == live[parsed[0]]  # `held` is of that incarnation
            and _retained_away(parsed[2], *held[parsed[0]])
        ):
            dropped += 1  # its segment went with retention: no upload can be recording it
            orphans.append(key)
        elif claimed and segment_key not in doomed and now - modified < orphan_min_age:
            kept.append(key)
        else:
            orphans.append(key)
    print(
        f"{len(entries)} manifest entries, {companions.descriptions} descriptions and "
        f"{companions.sidecars} sidecars checked, {problems} problems; {len(orphans)} orphaned objects"
        + (f" ({dropped} of segments retention dropped)" if dropped else "")
    )
    if companions.not_yet:
        print(
            f"{companions.not_yet} streams uploaded a segment in the last {orphan_min_age:.0f} s and have "
            "no description in the bucket yet: a running server writes it after the upload (a stopped "
            "one at its next start); missing once older"
        )
    if companions.legacy:
        print(
            f"{len(companions.legacy)} segments have no sidecar in the bucket and are older than every "
            "segment of their stream that has one: uploaded before sidecars went to the bucket, so "
            "`restore --from-bucket` downloads and indexes them instead"
        )
        for key in companions.legacy[:20]:
            print(f"  no sidecar: {key}")
    if others:
        print(f"{others} objects belong to other cluster members' streams: left to their own verify")
    for key in orphans[:20]:
        print(f"  orphan: {key}")
    if kept:
        print(
            f"{len(kept)} recent objects of live streams are in no manifest yet (uploads in flight?); "
            f"kept: they count as orphans once older than {orphan_min_age:.0f} s"
        )
    if orphans and delete_orphans:
        failed = store.delete(orphans)
        print(
            f"deleted {len(orphans) - len(failed)} orphaned objects"
            + (f"; {len(failed)} failed" if failed else "")
        )
    elif orphans:
        print("run again with --delete-orphans to remove them (objects no manifest refers to)")
    return 1 if problems else 0


@dataclass
class _Companions:
    """What `_check_companions` found: `missing` are problems, one line each."""

    descriptions: int = 0
    sidecars: int = 0
    missing: list[str] = field(default_factory=list)
    not_yet: int = 0  # descriptions of streams whose last upload is recent
    legacy: list[str] = field(default_factory=list)  # segments uploaded before sidecars were


def _check_companions(
    config: ColdConfig,
    manifests: list[tuple[str, str, Path, list[dict]]],
    meta_objects: dict[str, float],
    segment_objects: dict[str, float],
    *,
    now: float,
    orphan_min_age: float,
) -> _Companions:
    """Whether each stream with an uploaded segment has its description and each manifest entry its
    sidecar in the bucket (`meta_objects`, listed after the manifests were read).

    A sidecar is uploaded before its manifest entry is written, so one missing is damage, except for
    segments uploaded by a streamkeep that wrote no sidecars to the bucket: those form the start of
    their stream's manifest, before the first entry that has one, and restore indexes them itself.
    A description, though, is written after the upload, at the end of the archiver's pass (at most
    256 a pass, retried with backoff after a failure), and a server stopped in between writes it at
    its next start only. One missing for a stream whose last upload is younger than `orphan_min_age`
    is "not yet", as an unrecorded upload of that age is not an orphan yet. A stream with no upload
    is not checked: it has nothing in the bucket to restore (its description is written anyway).
    What is missing is checked once more against the stream's manifest as it is now: a stream
    deleted, or a segment dropped by retention, since the manifests were read took its objects."""
    out = _Companions()
    prefix = config.prefix
    for name, stream_id, directory, entries in manifests:
        if not entries:
            continue
        out.descriptions += 1
        missing: list[tuple[str, str]] = []  # (what, the manifest entry's key or "" for the stream)
        description = describe.stream_object_key(prefix, directory.name, stream_id)
        if description not in meta_objects:
            newest = max((segment_objects.get(entry["key"], 0.0) for entry in entries), default=0.0)
            if now - newest < orphan_min_age:
                out.not_yet += 1
            else:
                missing.append((f"description {name} ({description})", ""))
        seen_sidecar = False
        for entry in sorted(entries, key=lambda e: e["start"]):
            parsed = layout.parse_cold_key(config.root, entry["key"])
            if parsed is None or parsed[1] is None:
                continue  # a format-1 key: no sidecar was ever written for it
            out.sidecars += 1
            sidecar = describe.index_object_key(prefix, parsed[0], parsed[1], parsed[2])
            if sidecar in meta_objects:
                seen_sidecar = True
            elif seen_sidecar:
                missing.append((f"sidecar {name}/{entry['file']} ({sidecar})", entry["key"]))
            else:
                out.legacy.append(entry["key"])
        if missing:
            now_entries = _current_entries(directory, stream_id)
            out.missing.extend(
                what for what, key in missing if now_entries is not None and (not key or key in now_entries)
            )
    return out


def _current_entries(directory: Path, stream_id: str) -> set[str] | None:
    """The keys the stream's manifest names now; None if the stream is gone or another one now."""
    try:
        meta = decode_meta(files.read_file(files.OS, directory / layout.META))
        if meta.stream_id != stream_id:
            return None
        return {entry["key"] for entry in manifest.load_manifest(files.OS, directory)}
    except FileNotFoundError:
        return None


def _owned_by_this_member(settings: SimpleNamespace) -> Callable[[str], bool] | None:
    """Whether a stream directory's name is one this member owns (all of them outside a cluster);
    None when a [cluster] is configured without saying which member this is. A hashed directory
    name ("~...") cannot be mapped back to its stream: it counts as another member's (kept)."""
    members = settings.cluster.members
    if not members:
        return lambda _directory: True
    if not settings.cluster.member:
        return None
    placement = Placement.of([Member(m, a) for m, a in members], settings.cluster.epoch)
    me = settings.cluster.member

    def owned(directory: str) -> bool:
        return not directory.startswith("~") and placement.owner(unquote(directory)).id == me

    return owned


def _retained_away(segment_file: str, floor: int, local: set[str]) -> bool:
    """A segment of a live stream that starts below its floor and has no local file: dropped. (One
    below the floor with its file still there may be pinned by a fork and uploading right now.)"""
    try:
        start = layout.segment_start(segment_file)
    except ValueError:
        return False
    return start < floor and segment_file not in local
