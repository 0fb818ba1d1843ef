"""Start-up: every stream rebuilt from its files, torn tails cut, interrupted work finished.

Each stream directory is read on its own (a damaged one is skipped and left for inspection, the
others load): its meta, its cold manifest and index sidecars, then every segment file with every
record checked. A torn tail of the last segment is cut (it was never acknowledged); a torn or empty
new segment that a rotation left is removed; damage anywhere else skips the stream. Producer state,
the closed flag and `Stream-Seq` come from the records themselves. Afterwards forks are linked to
their sources, and deletes of soft-deleted sources whose last fork went are finished.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import cbor2

from streamkeep.segments import format as fmt
from streamkeep.segments import layout
from streamkeep.segments.floor import FloorCheckpoint
from streamkeep.segments.manifest import INDEX_SUFFIX
from streamkeep.storage import files
from streamkeep.storage.disk import floor as floors
from streamkeep.storage.disk import manifest
from streamkeep.storage.disk.directory import DataDirectory
from streamkeep.storage.disk.index import Segment
from streamkeep.storage.disk.meta import decode_meta
from streamkeep.storage.files import FileSystem

log = logging.getLogger(__name__)

DAMAGE = (OSError, ValueError, KeyError, TypeError, fmt.CorruptRecord, cbor2.CBORDecodeError)


@dataclass
class RecoveryReport:
    streams: int = 0
    records: int = 0
    bytes: int = 0
    repaired: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self, when: str = "") -> str:
        """The log line a finished recovery says (`when`: e.g. " while serving")."""
        return (
            f"recovered {self.streams} streams ({self.records} appends, {self.bytes} bytes) in "
            f"{self.seconds:.2f} s{when}; {len(self.repaired)} repaired, {len(self.skipped)} skipped"
        )


class Loaded:
    """What recovery found of one stream, for DiskLog to adopt."""

    def __init__(self, directory: Path, meta_bytes: bytes) -> None:
        self.directory = directory
        self.meta = decode_meta(meta_bytes)
        self.cold_entries: list[dict] = []
        self.segments: list[Segment] = []
        self.records: list[tuple[Segment, fmt.Record]] = []
        self.last_ms: int | None = None
        self.floor: FloorCheckpoint | None = None  # set once retention dropped data
        # A torn tail that could not be cut now (a full or failing disk): the writer cuts it
        # before it writes anything (SegmentWriter.repair); reads never look past the records.
        self.needs_repair = False


def recover(
    fs: FileSystem,
    directory: DataDirectory,
    adopt: Callable[[Loaded], object],
) -> RecoveryReport:
    """Reads every stream; `adopt` builds the live object for each and returns it."""
    started = time.monotonic()
    report = RecoveryReport()
    found = list_streams(fs, directory, report)
    for count, path in enumerate(found.values(), 1):
        try:
            loaded = read_stream(fs, path, report)
        except DAMAGE as error:
            skip(report, path, error)
            continue
        adopt(loaded)
        report.streams += 1
        if count % 5000 == 0:
            log.info("recovery: %d of %d stream directories read", count, len(found))
    report.seconds = time.monotonic() - started
    return report


def list_streams(fs: FileSystem, directory: DataDirectory, report: RecoveryReport) -> dict[str, Path]:
    """Before any stream is read: finishes what interrupted deletes and creates left, and names
    every stream directory (by its file name; a hashed long one by its meta)."""
    report.repaired.extend(
        f"finished an interrupted delete or create: {what}" for what in directory.finish_deletes()
    )
    found: dict[str, Path] = {}
    for entry in directory.stream_entries():
        path = directory.streams / entry
        name = layout.stream_name(entry)
        if name is None:
            try:
                name = decode_meta(files.read_file(fs, path / layout.META)).name
            except DAMAGE as error:
                skip(report, path, error)
                continue
        found[name] = path
    return found


def skip(report: RecoveryReport, path: Path, error: BaseException) -> None:
    report.skipped.append(f"{path.name}: {error}")
    log.error("recovery: skipped %s: %s (left in place for inspection)", path, error)


def read_stream(fs: FileSystem, directory: Path, report: RecoveryReport) -> Loaded:
    """One stream as its files hold it, torn tails cut; raises one of DAMAGE if it cannot be."""
    loaded = Loaded(directory, files.read_file(fs, directory / layout.META))
    loaded.floor = floors.load(fs, directory)
    floor = loaded.floor.floor if loaded.floor is not None else None
    name = loaded.meta.name
    cold_entries = {entry["file"]: entry for entry in manifest.load_manifest(fs, directory)}
    loaded.cold_entries = list(cold_entries.values())
    local = {n for n in fs.listdir(directory) if n.endswith(layout.SEGMENT_SUFFIX)}
    names = sorted(local | set(cold_entries))
    if not names:
        raise ValueError("no segment files")
    expected = layout.segment_start(names[0])
    where = os.fspath(directory)  # the string its log and segments share (index.Segment)
    for number, file_name in enumerate(names):
        path = directory / file_name
        is_last = number == len(names) - 1
        entry = cold_entries.get(file_name)
        start = layout.segment_start(file_name)
        if start != expected and floor is not None and expected < start <= floor:
            # A retention drop a crash interrupted: it removed the manifest entries first and
            # files oldest first, so what is left before this gap was being dropped too.
            _forget_before(fs, loaded, name, start, report)
            expected = start
        if entry is not None and file_name not in local:  # only in the bucket: its sidecar stands in
            if file_name != layout.segment_filename(expected):
                raise fmt.CorruptRecord(f"cold segment {file_name} is out of order")
            segment = Segment(expected, where, entry["size"], cold_key=entry["key"], local=False)
            loaded.segments.append(segment)
            for record in manifest.read_index(fs, path):
                if record.start != expected:
                    raise fmt.CorruptRecord(f"cold segment {file_name} is out of order")
                loaded.records.append((segment, record))
                expected += record.payload_len
                loaded.last_ms = record.time_ms
            continue
        data = files.read_file(fs, path)
        records, valid, reason = fmt.scan(data, keep_payload=False)
        torn_header = not records or records[0].kind != fmt.KIND_SEGMENT
        if torn_header or records[0].header.get("s") != expected:
            # Only an empty or torn header is a rotation a crash interrupted. A whole header for
            # another position means segments are missing before it: never remove data for that.
            if torn_header and is_last and number > 0:
                try:
                    fs.unlink(path)
                    files.fsync_dir(fs, directory)
                except OSError as error:
                    loaded.needs_repair = True
                    log.warning(
                        "recovery: %s: cannot remove torn new segment %s yet: %s", name, file_name, error
                    )
                else:
                    report.repaired.append(f"{name}: removed torn new segment {file_name}")
                    log.warning("recovery: %s: removed torn new segment %s", name, file_name)
                break
            if torn_header:
                raise ValueError(f"segment {file_name} has no valid header for position {expected}")
            raise ValueError(
                f"segment {file_name} starts at {records[0].header.get('s')}, but the segments before it end "
                f"at {expected}: segments are missing (left in place for inspection)"
            )
        if reason is not None:
            if not is_last:
                raise fmt.CorruptRecord(f"sealed segment {file_name} is damaged: {reason}")
            try:
                _truncate(fs, path, valid)
            except OSError as error:
                loaded.needs_repair = True
                log.warning("recovery: %s: cannot cut the torn tail of %s yet: %s", name, file_name, error)
            report.repaired.append(f"{name}: truncated {file_name} to {valid} bytes ({reason})")
            log.warning(
                "recovery: %s: truncated torn tail of %s at byte %d (%s)", name, file_name, valid, reason
            )
        if file_name != layout.segment_filename(expected):  # its path follows from its start (index.Segment)
            raise ValueError(f"segment {file_name} holds position {expected} under another position's name")
        segment = Segment(expected, where, records[0].end, cold_key=entry["key"] if entry else None)
        loaded.segments.append(segment)
        for record in records[1:]:
            if record.kind != fmt.KIND_APPEND or record.start != expected:
                raise fmt.CorruptRecord(f"record at byte {record.file_offset} of {file_name} is out of order")
            loaded.records.append((segment, record))
            expected += record.payload_len
            loaded.last_ms = record.time_ms
    report.records += len(loaded.records)
    return loaded


def _forget_before(fs: FileSystem, loaded: Loaded, name: str, start: int, report: RecoveryReport) -> None:
    for segment in loaded.segments:
        if segment.local:
            files.unlink_quietly(fs, segment.path)
            files.unlink_quietly(fs, str(segment.path) + INDEX_SUFFIX)
    loaded.segments.clear()
    loaded.records.clear()
    report.repaired.append(f"{name}: finished an interrupted retention drop below position {start}")
    log.warning("recovery: %s: finished an interrupted retention drop below position %d", name, start)


def _truncate(fs: FileSystem, path: Path, size: int) -> None:
    fd = fs.open(path, os.O_RDWR)
    try:
        fs.ftruncate(fd, size)
        fs.fsync(fd)
    finally:
        fs.close(fd)
