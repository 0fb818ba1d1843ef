"""`streamkeep archive status|verify`: what of each stream is local and what is cold, checked
against the bucket, without a running server."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

from streamkeep.segments import layout
from streamkeep.storage import cold
from streamkeep.storage.disk import decode_meta


def _progress(done: int, total: int, label: str) -> None:
    if not sys.stderr.isatty() and done not in (total,) and done % 100:
        return
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r{label} [{'#' * filled}{' ' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _streams(data_dir: Path) -> list[tuple[str, Path]]:
    out = []
    root = data_dir / layout.STREAMS
    for directory in sorted(root.iterdir()) if root.is_dir() else []:
        if directory.name.startswith(".") or not (directory / layout.META).exists():
            continue
        out.append((decode_meta((directory / layout.META).read_bytes()).name, directory))
    return out


def status(settings: SimpleNamespace) -> int:
    data_dir = Path(settings.storage.data_dir)
    rows = []
    for name, directory in _streams(data_dir):
        local = sorted(directory.glob("*" + layout.SEGMENT_SUFFIX))
        manifest = cold.load_manifest(directory)
        uploaded = {entry["file"] for entry in manifest}
        pending = [p for p in local[:-1] if p.name not in uploaded]
        rows.append(
            (
                name,
                len(local),
                sum(p.stat().st_size for p in local),
                len(manifest),
                sum(e["size"] for e in manifest),
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


def verify(settings: SimpleNamespace, *, delete_orphans: bool) -> int:
    from streamkeep.http.server import cold_config

    config = cold_config(settings)
    if config is None:
        print(
            "streamkeep archive verify: no cold tier configured; pass --cold-url s3://BUCKET/PREFIX",
            file=sys.stderr,
        )
        return 2
    store = cold.ColdStore(config)
    data_dir = Path(settings.storage.data_dir)
    streams = _streams(data_dir)
    entries = [(name, entry) for name, directory in streams for entry in cold.load_manifest(directory)]
    problems = 0
    for done, (name, entry) in enumerate(entries, 1):
        try:
            store.verify(entry["key"], entry["size"], entry["sha256"])
        except Exception as error:
            problems += 1
            sys.stderr.write(f"\nMISMATCH {name}/{entry['file']} ({entry['key']}): {error}\n")
        _progress(done, len(entries), "verifying")
    known = {entry["key"] for _, entry in entries}
    prefix = config.key("", "").rstrip("/") + "/"
    orphans = [key for key in store.list_keys(prefix) if key not in known]
    print(f"{len(entries)} manifest entries checked, {problems} problems; {len(orphans)} orphaned objects")
    for key in orphans[:20]:
        print(f"  orphan: {key}")
    if orphans and delete_orphans:
        store.delete(orphans)
        print(f"deleted {len(orphans)} orphaned objects")
    elif orphans:
        print("run again with --delete-orphans to remove them (objects no manifest refers to)")
    return 1 if problems else 0
