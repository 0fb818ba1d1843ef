"""The cold tier's bookkeeping on a stream's disk log, each step under its I/O lock: a sealed
segment read for upload, the verified upload recorded in the manifest (index sidecar first),
the local copy dropped. The archiver (archiver.py) calls these; the disk log itself knows only
the manifest entries they leave (`DiskLog.cold_entries`), which its deletes and retention use."""

from __future__ import annotations

import os
from pathlib import Path

from streamkeep.segments.manifest import INDEX_SUFFIX
from streamkeep.storage import files
from streamkeep.storage.cold.store import read_whole
from streamkeep.storage.disk import manifest
from streamkeep.storage.disk.index import Segment
from streamkeep.storage.disk.log import DiskLog
from streamkeep.storage.files import FileSystem


async def read_sealed(stream_log: DiskLog, segment: Segment) -> bytes | None:
    """A sealed segment's bytes for the archiver to upload, or None if the stream is gone. The file
    is opened under the stream's I/O lock (so a delete or re-create cannot swap it underneath),
    read whole and closed at once: no descriptor is held while the bytes travel to the bucket,
    where boto3 can wait minutes (timeouts, retries) and a deleted stream's blocks would stay
    pinned meanwhile."""
    host = stream_log.host
    fd: int | None = None
    try:
        async with stream_log.exclusive():
            if stream_log.deleted or not segment.local or segment.retained_away:
                return None
            fd = await host.run_io(host.fs.open, segment.path, os.O_RDONLY)
        return await host.run_io(_read_whole, host.fs, fd)
    finally:
        if fd is not None:
            host.fs.close(fd)


async def record_upload(
    stream_log: DiskLog, segment: Segment, entry: dict, index: bytes | None = None
) -> bool:
    """Notes an uploaded, verified segment in the manifest (after writing its index sidecar, the
    `index` bytes the archiver also uploaded, or made from the segment file when not given).
    False if the stream was deleted or the segment retained away meanwhile (the object is then
    an orphan to delete)."""
    async with stream_log.exclusive():
        if stream_log.deleted or segment.retained_away:
            return False
        entries = [*stream_log.cold_entries, entry]
        fs = stream_log.host.fs
        await stream_log.host.run_io(_record_upload, fs, segment.path, stream_log.directory, entries, index)
        stream_log.cold_entries = entries
        segment.cold_key = entry["key"]
        return True


async def drop_local(stream_log: DiskLog, segment: Segment) -> None:
    """Removes the local copy of an uploaded segment: its reads go to the bucket from now on."""
    async with stream_log.exclusive():
        if stream_log.deleted or not segment.local or segment.cold_key is None or segment.retained_away:
            return
        segment.local = False
        await stream_log.host.run_io(files.unlink_quietly, stream_log.host.fs, segment.path)


def _read_whole(fs: FileSystem, fd: int) -> bytes:
    return read_whole(fs, fd, fs.fsize(fd))


def _record_upload(
    fs: FileSystem, segment_path: Path, directory: Path, entries: list[dict], index: bytes | None
) -> None:
    """Index sidecar first, then the manifest: a manifest entry always has its sidecar."""
    if index is None:
        manifest.write_index(fs, segment_path)
    else:
        files.replace(fs, directory, segment_path.name + INDEX_SUFFIX, index)
    manifest.save_manifest(fs, directory, entries)
