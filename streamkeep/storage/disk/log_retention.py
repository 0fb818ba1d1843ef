"""Retention's two steps on one stream, each crash-safe (retention.py decides when; these do it):
the floor readers see moves up, its checkpoint durable first; then the sealed segments below it
that no fork pins go, the manifest without them first, then their files."""

from __future__ import annotations

import logging
from pathlib import Path

from streamkeep.segments.floor import FloorCheckpoint
from streamkeep.segments.manifest import INDEX_SUFFIX
from streamkeep.storage import files
from streamkeep.storage.disk import floor as floors
from streamkeep.storage.disk import manifest
from streamkeep.storage.disk.index import Segment
from streamkeep.storage.disk.log_state import LogState
from streamkeep.storage.errors import from_os_error
from streamkeep.storage.files import FileSystem

log = logging.getLogger(__name__)


class LogRetention(LogState):
    """The floor and what is held below it, moved crash-safely (docs/segment-format.md, "Retention")."""

    __slots__ = ()

    def checkpoint_at(self, floor: int, snapshot_end: int | None = None) -> FloorCheckpoint:
        """The durable state now, as a floor checkpoint at `floor`."""
        meta = self._durable_meta
        times = [segment.last_ms for segment in self.segments if segment.last_ms is not None]
        return FloorCheckpoint(
            floor,
            dict(self._durable_producers),
            meta.last_stream_seq,
            self._pub_closed,
            meta.closed_by,
            snapshot_end,
            max(times, default=self.last_append_ms),
        )

    async def raise_floor(self, new_floor: int, snapshot_end: int | None = None) -> bool:
        """Moves the floor readers see up to `new_floor` (a segment start), the checkpoint made
        durable before anything below it goes. False if there was nothing to move. A compaction
        passes where its snapshot (starting at `new_floor`) ends."""
        async with self.exclusive():
            if self.deleted or new_floor < self.floor or (new_floor == self.floor and snapshot_end is None):
                return False
            if snapshot_end is None and self.snapshot_end is not None and self.snapshot_end > new_floor:
                snapshot_end = self.snapshot_end  # retention below a snapshot keeps it in view
            checkpoint = self.checkpoint_at(new_floor, snapshot_end)
            try:
                if self.dirty:
                    # fsync=interval/never: the checkpoint must not claim producer state or a
                    # close whose records a power cut could still take back.
                    await self.host.run_io(self.writer.sync, self.active_segment)
                    self.dirty = False
                await self.host.run_io(floors.save, self.host.fs, self.directory, checkpoint)
            except OSError as error:
                raise from_os_error(error, f"retention checkpoint of {self.meta.name!r}") from None
            self.floor = new_floor
            self.snapshot_end = snapshot_end
            return True

    async def drop_held(self, limit: int) -> tuple[int, list[str]]:
        """Deletes the sealed segments that end at or before `limit` (never past the floor): the
        manifest without them first, then their files, oldest first (docs/segment-format.md,
        "Retention"). Returns the bytes freed and the bucket keys to delete."""
        async with self.exclusive():
            limit = min(limit, self.floor)
            sealed = self.segments[:-1]
            count = 0
            while count < len(sealed) and self.segments[count + 1].start <= limit:
                count += 1
            if self.deleted or not count:
                return 0, []
            doomed = self.segments[:count]
            new_start = self.segments[count].start
            names = {segment.path.name for segment in doomed}
            entries = [entry for entry in self.cold_entries if entry["file"] not in names]
            keys = [segment.cold_key for segment in doomed if segment.cold_key is not None]
            for segment in doomed:
                segment.retained_away = True  # reads that hold it now answer 410
            fs = self.host.fs
            # Saved even when the list in memory names none of them: an upload whose manifest
            # save failed after its rename (its directory sync) left a manifest on disk that
            # lists a doomed segment, and dropping its files under it lost the whole stream at
            # the next start (torture sim seed 3178).
            try:
                await self.host.run_io(manifest.save_manifest, fs, self.directory, entries)
            except OSError as error:
                for segment in doomed:
                    segment.retained_away = False
                raise from_os_error(error, f"retention of {self.meta.name!r}") from None
            # From here the drop has happened (the floor and the manifest say so): files that
            # cannot be removed now are below the floor, removed by the next pass or at start.
            try:
                await self.host.run_io(_drop_files, fs, self.directory, doomed)
            except OSError as error:
                log.warning("retention of %r: leftover files below the floor: %s", self.meta.name, error)
            freed = new_start - self.segments[0].start
            self.cold_entries = entries
            del self.segments[:count]
            self.index.drop_before(new_start)
            self.host.budget.release(freed)
            return freed, keys


def _drop_files(fs: FileSystem, directory: Path, doomed: list[Segment]) -> None:
    """The doomed segments' files, oldest first (the manifest no longer lists them): a crash
    leaves a suffix of them (recovery finishes a gap below the floor) and bucket objects no
    manifest lists, which `archive verify` finds."""
    for segment in doomed:
        files.unlink_quietly(fs, segment.path)
        files.unlink_quietly(fs, str(segment.path) + INDEX_SUFFIX)
    files.fsync_dir(fs, directory)
