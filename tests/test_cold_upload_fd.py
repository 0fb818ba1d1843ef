"""An upload in flight when its stream is deleted gives the deleted segment's descriptor back at
once, however the bucket is stuck; a surviving stream is still archived once the bucket answers.

Real parts: `streamkeep serve` as a process, moto_server as the bucket, frozen with SIGSTOP (as the
black box's `s3_freeze` does): the kernel still takes connections and request bytes, nothing
answers. The black box once saw the server hold `trash/<id>/0000000000000000.seg (deleted)` for
8.5 s (seed 85, interval/ext4): the upload held its descriptor through boto3's wait for an answer
(30 s read timeout, then retries), and asked whether the stream was still wanted only when boto3
read the body, at the start of each attempt.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from streamkeep.segments import layout
from tests.conftest import segment_files
from tests.test_cold import OCTETS, Moto, cold_server, read_all, wait_until

# The black box judges a descriptor of a deleted file still open 8 s later a leak; a delete's own
# reads and writes give theirs back within milliseconds.
GIVE_BACK_WITHIN = 3.0
SEGMENT_HALF = 600_000  # two appends of it fill a 1 MiB segment


class FreezableMoto(Moto):
    def freeze(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            self.thaw()  # a stopped process ignores SIGTERM until it runs again
        super().stop()


@pytest.fixture
def moto() -> Iterator[FreezableMoto]:
    server = FreezableMoto()
    server.start()
    yield server
    server.stop()


def bytes_on_the_wire_to(port: int) -> int:
    """Bytes sent to a TCP port on loopback that its (frozen) process has not read: in the
    senders' send queues and the port's receive queues (/proc/net/tcp)."""
    queued = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        tx, rx = (int(n, 16) for n in fields[4].split(":"))
        if int(fields[1].rsplit(":", 1)[1], 16) == port:
            queued += rx
        elif int(fields[2].rsplit(":", 1)[1], 16) == port:
            queued += tx
    return queued


def fds(pid: int, matching: Callable[[str], bool]) -> list[str]:
    """The process's descriptors whose target (/proc/PID/fd readlink) matches."""
    found = []
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if matching(target):
            found.append(f"{entry.name} -> {target}")
    return found


def deleted_segment(target: str) -> bool:
    """A segment file deleted, or moved to trash/ to be."""
    return layout.SEGMENT_SUFFIX in target and (target.endswith(" (deleted)") or "/trash/" in target)


def test_a_deleted_streams_upload_gives_its_descriptor_back_while_the_bucket_is_frozen(
    tmp_path: Path, moto: FreezableMoto
) -> None:
    data = tmp_path / "data"
    server = cold_server(data, moto)  # segments of 1 MiB
    pid = server.process.pid
    kept_url, doomed_url = f"{server.url}/v1/stream/kept", f"{server.url}/v1/stream/doomed"
    kept: list[bytes] = []
    frozen = False
    try:
        with httpx.Client(timeout=30) as client:

            def seal_a_segment(url: str) -> None:
                """Two appends fill a segment; the third goes to a new one and seals it."""
                for size in (SEGMENT_HALF, SEGMENT_HALF, 10):
                    chunk = os.urandom(size)
                    assert client.post(url, content=chunk, headers=OCTETS).status_code == 204
                    if url == kept_url:
                        kept.append(chunk)

            assert client.put(kept_url, headers=OCTETS).status_code == 201
            assert client.put(doomed_url, headers=OCTETS).status_code == 201
            seal_a_segment(kept_url)
            wait_until(lambda: len(segment_files(data, "kept")) == 1, what="kept's first segment to move out")
            time.sleep(2.5)  # two passes: the descriptions written, nothing of the archiver's on the wire

            moto.freeze()
            frozen = True
            seal_a_segment(doomed_url)  # its upload starts and gets no answer
            # Nothing else the archiver sends is near this size (descriptions, sidecars: < 1 KiB).
            wait_until(
                lambda: bytes_on_the_wire_to(moto.port) >= SEGMENT_HALF,
                what="doomed's segment to be on its way to the bucket",
            )
            held_before = fds(pid, lambda target: layout.stream_dirname("doomed") in target)
            seal_a_segment(kept_url)  # one more of kept's, behind the stuck upload

            assert client.delete(doomed_url).status_code == 204
            deleted_at = time.monotonic()
            while held := fds(pid, deleted_segment):
                assert time.monotonic() - deleted_at < GIVE_BACK_WITHIN, (
                    f"the server still holds {held} {GIVE_BACK_WITHIN} s after the delete, with the "
                    f"bucket frozen (held before the delete: {held_before})"
                )
                time.sleep(0.05)

            moto.thaw()
            frozen = False
            # Nothing acknowledged is lost: kept's segments reach the bucket, and read back whole.
            wait_until(
                lambda: len(segment_files(data, "kept")) == 1, timeout=120, what="kept's backlog to move out"
            )
            assert read_all(kept_url) == b"".join(kept)
            assert client.get(doomed_url).status_code == 404
            # And whatever of doomed's reached the bucket goes (the delete found nothing uploaded).
            doomed_dir = layout.stream_dirname("doomed")
            wait_until(
                lambda: not [k for k in moto.keys("archive", "prod/") if doomed_dir in k],
                what="doomed's orphaned objects to be deleted",
            )
            assert server.alive
    finally:
        if frozen:
            moto.thaw()
        server.stop()
