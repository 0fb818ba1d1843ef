"""`streamkeep archive status|verify`: what of each stream is local and what is cold, checked
against the bucket, without a running server (and safe beside one)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

from streamkeep.segments import layout
from streamkeep.storage import files, manifest
from streamkeep.storage.coldstore import ColdConfig, S3Store
from streamkeep.storage.directory import DataDirectory
from streamkeep.storage.meta import decode_meta

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


def status(settings: SimpleNamespace) -> int:
    data_dir = Path(settings.storage.data_dir)
    rows = []
    for name, _stream_id, directory in _streams(data_dir):
        local = sorted(directory.glob("*" + layout.SEGMENT_SUFFIX))
        entries = manifest.load_manifest(files.OS, directory)
        uploaded = {entry["file"] for entry in entries}
        pending = [p for p in local[:-1] if p.name not in uploaded]
        rows.append(
            (
                name,
                len(local),
                sum(p.stat().st_size for p in local),
                len(entries),
                sum(e["size"] for e in entries),
                len(pending),
            )
        )
    print(
        f"{'stream':40} {'local segs':>10} {'local bytes':>12} {'cold segs':>10} {'cold bytes':>12} {'to upload':>10}"
    )
    for name, local_n, local_b, cold_n, cold_b, pending_n in rows:
        print(f"{name[:40]:40} {local_n:>10} {local_b:>12} {cold_n:>10} {cold_b:>12} {pending_n:>10}")
    print(
        f"{len(rows)} streams; {sum(r[3] for r in rows)} segments cold, {sum(r[5] for r in rows)} waiting for upload"
    )
    return 0


def verify(
    settings: SimpleNamespace, *, delete_orphans: bool, orphan_min_age: float = DEFAULT_ORPHAN_MIN_AGE
) -> int:
    """HEADs every object a manifest names, and lists objects no manifest names (orphans).

    An orphan is deleted (with `delete_orphans`) only when no live stream can still claim it: its
    stream is gone or is another incarnation now, or the object is older than `orphan_min_age`
    seconds. A younger object of a live stream may be an upload a running server has not yet
    recorded in its manifest, so it is kept and reported.
    """
    config = ColdConfig.from_settings(settings)
    if config is None:
        print(
            "streamkeep archive verify: no cold tier configured; pass --cold-url s3://BUCKET/PREFIX",
            file=sys.stderr,
        )
        return 2
    store = S3Store(config)
    data_dir = Path(settings.storage.data_dir)
    streams = _streams(data_dir)
    entries = [
        (name, entry)
        for name, _, directory in streams
        for entry in manifest.load_manifest(files.OS, directory)
    ]
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
    known = {entry["key"] for _, entry in entries}
    live = {directory.name: stream_id for _, stream_id, directory in streams}
    doomed = (
        {key for _, keys in DataDirectory(files.OS, data_dir).pending_object_deletes() for key in keys}
        if (data_dir / layout.TRASH).is_dir()
        else set()
    )
    now = time.time()
    orphans, kept = [], []
    for key, modified in store.list_objects(config.root):
        if key in known:
            continue
        parsed = layout.parse_cold_key(config.root, key)
        claimed = parsed is not None and parsed[0] in live and parsed[1] in (None, live[parsed[0]])
        if claimed and key not in doomed and now - modified < orphan_min_age:
            kept.append(key)
        else:
            orphans.append(key)
    print(f"{len(entries)} manifest entries checked, {problems} problems; {len(orphans)} orphaned objects")
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
