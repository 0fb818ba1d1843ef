"""The data directory's lifecycle: its format marker, and streams appearing and disappearing in it.

Layout (docs/segment-format.md): `FORMAT`, `streams/<stream dir>/`, `trash/`. Every change is
crash-safe by construction:

- `FORMAT` is written by write + fsync + rename, so a crash at the very first start cannot leave an
  empty marker that stops the next one.
- A stream is built in `streams/.tmp-*` and renamed into place: all of it or nothing. The
  server's creates share rounds of that (creates.py `CreateCommitter`); a create on its own
  (`streamkeep restore`) is a round of one (creates.py `create_now`), the same steps.
- A deleted stream is renamed into `trash/` first, so a crash mid-delete cannot bring it back. If it
  had objects in the bucket, their keys are written to `trash/<id>.objects` before its directory
  goes, and that file stays until the objects are deleted: a crash or an S3 outage in between
  leaves work to finish, not orphans.

All methods block: callers run them in worker threads.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import cbor2

from streamkeep.segments import layout
from streamkeep.storage import files
from streamkeep.storage.disk.creates import STAGING_PREFIX
from streamkeep.storage.files import FileSystem

log = logging.getLogger(__name__)

OBJECTS_SUFFIX = ".objects"
RUNNING = "RUNNING"


class FormatError(Exception):
    """The data directory is not one this version can open as it is."""


class DataDirectory:
    def __init__(self, fs: FileSystem, root: Path) -> None:
        self.fs = fs
        self.root = root
        self.streams = root / layout.STREAMS
        self.trash = root / layout.TRASH

    # ---- the format marker ------------------------------------------------------------

    def format_version(self) -> int | None:
        """The version in FORMAT; None for a directory with no streams yet (a first start, or one
        that a crash interrupted before it wrote a whole marker)."""
        fs = self.fs
        marker = self.root / layout.FORMAT_FILE
        text = files.read_file(fs, marker).decode(errors="replace") if fs.exists(marker) else ""
        if text.startswith(layout.FORMAT_PREFIX) and text.endswith("\n"):
            number = text[len(layout.FORMAT_PREFIX) : -1]
            if number.isdigit():
                return int(number)
        if text.strip():
            raise FormatError(f"{marker} holds {text.strip()[:80]!r}, not a streamkeep format line")
        if fs.is_dir(self.streams) and any(
            not n.startswith(STAGING_PREFIX) for n in fs.listdir(self.streams)
        ):
            return 1  # streams but no whole marker: only format 1 wrote the marker without a rename
        return None

    def write_format(self, version: int) -> None:
        files.replace(self.fs, self.root, layout.FORMAT_FILE, f"{layout.FORMAT_PREFIX}{version}\n".encode())

    def open(self) -> int:
        """Creates what is missing; returns the format version the directory is in."""
        fs = self.fs
        files.makedirs(fs, self.root)
        version = self.format_version()
        if version is None:
            version = layout.FORMAT_VERSION
            self.write_format(version)
        elif version > layout.FORMAT_VERSION:
            raise FormatError(
                f"{self.root} was written by a newer streamkeep (format {version}; this one reads "
                f"{layout.FORMAT_VERSION}); run that version"
            )
        for directory in (self.streams, self.trash):
            if not fs.is_dir(directory):
                fs.mkdir(directory)
                files.fsync_dir(fs, self.root)
        return version

    # ---- clean and unclean stops -------------------------------------------------------

    def mark_running(self) -> bool:
        """Notes that a server runs on this directory; True if one was already noted, i.e. the
        last one did not stop cleanly (it crashed, was killed, or the power went)."""
        marker = self.root / RUNNING
        unclean = self.fs.exists(marker)
        if not unclean:
            files.replace(self.fs, self.root, RUNNING, b"")
        return unclean

    def mark_stopped(self) -> None:
        """After a clean stop synced everything: the next start needs no crash recovery."""
        files.unlink_quietly(self.fs, self.root / RUNNING)
        files.fsync_dir(self.fs, self.root)

    # ---- streams ----------------------------------------------------------------------

    def stream_dir(self, name: str) -> Path:
        return self.streams / layout.stream_dirname(name)

    def stream_entries(self) -> list[str]:
        return sorted(self.fs.listdir(self.streams))

    def delete_stream(
        self, directory: Path, object_keys: list[str]
    ) -> tuple[Path | None, files.NotDurable | None]:
        """Moves the stream into trash/ and removes it. An OSError means it is still there.

        Returns the file that lists its objects still to delete from the bucket, and NotDurable
        if the stream is gone but a power cut may bring it back. Objects are listed for deletion
        only once the stream's removal is durable: deleting them earlier could leave a stream
        that a power cut brought back without its cold segments. (Objects of a stream whose
        removal was not durable are orphans at worst; `archive verify` finds them.)
        """
        fs = self.fs
        target = self.trash / uuid.uuid4().hex
        fs.rename(directory, target)
        try:
            files.commit_dirs(fs, self.streams, self.trash)
        except files.NotDurable as error:
            files.rmtree(fs, target)
            return None, error
        pending = None
        if object_keys:
            pending = self.trash / f"{uuid.uuid4().hex}{OBJECTS_SUFFIX}"
            try:
                files.replace(fs, self.trash, pending.name, cbor2.dumps({"v": 1, "keys": object_keys}))
            except files.NotDurable:
                pass  # listed; if a power cut takes the list, `archive verify` finds the orphans
            except OSError as error:
                log.warning(
                    "cannot list the objects of %s to delete (%s); deleting them now", directory.name, error
                )
                pending = None
        files.rmtree(fs, target)
        return pending, None

    def finish_deletes(self) -> list[str]:
        """At start: removes what interrupted deletes and creates left behind. Returns what was
        removed (for the recovery report); lists of objects to delete stay for the cold tier."""
        fs = self.fs
        removed = []
        for name in fs.listdir(self.trash):
            if name.endswith(OBJECTS_SUFFIX) or name.startswith("."):
                continue
            files.rmtree(fs, self.trash / name)
            removed.append(f"trash/{name}")
        for name in fs.listdir(self.streams):
            if name.startswith(STAGING_PREFIX):  # a create a crash interrupted: it never happened
                files.rmtree(fs, self.streams / name)
                removed.append(f"streams/{name}")
        return removed

    # ---- objects of deleted streams ---------------------------------------------------

    def pending_object_deletes(self) -> list[tuple[Path, list[str]]]:
        fs = self.fs
        out = []
        for name in sorted(fs.listdir(self.trash)):
            if not name.endswith(OBJECTS_SUFFIX):
                continue
            path = self.trash / name
            try:
                out.append((path, list(cbor2.loads(files.read_file(fs, path))["keys"])))
            except (OSError, ValueError, KeyError, TypeError, cbor2.CBORDecodeError) as error:
                log.error(
                    "cannot read %s (%s): its objects stay in the bucket; `archive verify` lists them",
                    path,
                    error,
                )
        return out

    def objects_deleted(self, path: Path) -> None:
        files.unlink_quietly(self.fs, path)

    def update_pending(self, path: Path, keys: list[str]) -> None:
        files.replace(self.fs, os.fspath(path.parent), path.name, cbor2.dumps({"v": 1, "keys": keys}))
