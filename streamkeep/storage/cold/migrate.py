"""Upgrades a data directory (and its bucket) to the current format, in place.

Format 1 -> 2: cold objects gain the stream's incarnation in their key
(`.../<stream dir>/<segment>` becomes `.../<stream dir>/<stream id>/<segment>`), so a stream
deleted and created again never shares an object with its predecessor. Per stream: copy each
object to its new key and verify it (size and SHA-256), replace the manifest (atomically), then
delete the old objects. The format marker is rewritten last. Every step is idempotent and a crash
anywhere leaves a directory that the next run finishes: a copy is redone or found done, a
manifest is old or new, and old keys are derived from new ones, so they are deleted even when the
manifest already names only new keys. A directory with no cold segments just gets its new marker.

`streamkeep serve` runs this at start; `streamkeep migrate` runs it alone, with progress.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from streamkeep.segments import layout
from streamkeep.storage import files
from streamkeep.storage.cold.store import ObjectStore
from streamkeep.storage.disk import manifest
from streamkeep.storage.disk.directory import DataDirectory, FormatError
from streamkeep.storage.disk.meta import decode_meta
from streamkeep.storage.files import FileSystem

Progress = Callable[[str], None]


def pending_version(fs: FileSystem, root: Path) -> int | None:
    """The format the directory is in if it needs upgrading, else None."""
    if not fs.is_dir(root):
        return None
    version = DataDirectory(fs, root).format_version()
    if version is None or version == layout.FORMAT_VERSION:
        return None
    if version > layout.FORMAT_VERSION:
        raise FormatError(
            f"{root} is in format {version}, newer than this streamkeep ({layout.FORMAT_VERSION})"
        )
    return version


def upgrade(fs: FileSystem, root: Path, store: ObjectStore | None, progress: Progress) -> bool:
    """Brings `root` to the current format; True if there was anything to do."""
    version = pending_version(fs, root)
    if version is None:
        return False
    directory = DataDirectory(fs, root)
    streams = _streams_with_objects(fs, directory)
    objects = sum(len(entries) for _, _, _, entries in streams)
    if objects and store is None:
        raise FormatError(
            f"{root} is in format {version} and {len(streams)} of its streams have {objects} segments in a "
            "bucket whose keys must move to the format-2 layout: give the cold tier (--cold-url, "
            "--cold-endpoint) to `streamkeep serve` or `streamkeep migrate`"
        )
    progress(
        f"upgrading {root} from format {version} to {layout.FORMAT_VERSION}: {objects} objects of {len(streams)} streams to re-key"
    )
    for number, (path, dirname, stream_id, entries) in enumerate(streams, 1):
        assert store is not None
        moved = _rekey_stream(fs, store, path, dirname, stream_id, entries)
        progress(f"  [{number}/{len(streams)}] {dirname}: {moved} objects re-keyed")
    directory.write_format(layout.FORMAT_VERSION)
    progress(f"{root} is in format {layout.FORMAT_VERSION}")
    return True


def _streams_with_objects(
    fs: FileSystem, directory: DataDirectory
) -> list[tuple[Path, str, str, list[dict]]]:
    out: list[tuple[Path, str, str, list[dict]]] = []
    if not fs.is_dir(directory.streams):
        return out
    for name in sorted(fs.listdir(directory.streams)):
        path = directory.streams / name
        if name.startswith(".") or not fs.exists(path / layout.META):
            continue
        entries = manifest.load_manifest(fs, path)
        if entries:
            meta = decode_meta(files.read_file(fs, path / layout.META))
            out.append((path, name, meta.stream_id, entries))
    return out


def _rekey_stream(
    fs: FileSystem, store: ObjectStore, path: Path, dirname: str, stream_id: str, entries: list[dict]
) -> int:
    moved = 0
    updated = []
    for entry in entries:
        new_suffix = f"{dirname}/{stream_id}/{entry['file']}"
        old_suffix = f"{dirname}/{entry['file']}"
        key = entry["key"]
        if not key.endswith(new_suffix):
            if not key.endswith(old_suffix):
                raise FormatError(f"{path}: manifest key {key!r} does not name {old_suffix!r}")
            new_key = key[: -len(old_suffix)] + new_suffix
            if store.head(new_key) != (entry["size"], entry["sha256"]):
                store.copy(key, new_key)
                found = store.head(new_key)
                if found != (entry["size"], entry["sha256"]):
                    raise OSError(f"copy of {key} to {new_key} does not match the manifest: {found}")
            entry = {**entry, "key": new_key}
            moved += 1
        updated.append(entry)
    if moved:
        manifest.save_manifest(fs, path, updated)
    stale = [layout.v1_cold_key(entry["key"]) for entry in updated]
    failed = store.delete(stale)
    if failed:
        raise OSError(
            f"{len(failed)} old objects of {dirname} could not be deleted (first: {failed[0]}); run again"
        )
    return moved
