"""The torture model's sliding TTL across a restart of one server: reads' touches live in the
serving process only, so they are forgotten when it stops (kill, SIGTERM, power cut, crash), not
when the rig records the restart.

Black-box seed 12 (CI, issue 26): fork/1, with a Stream-TTL of 9 s and no record of its own, was
read at 7.07; the server was killed at 10.41; the new process answered the client's append at
12.13 with 404 stream_not_found (it counts the TTL from the last access on disk, the create at
2.15), 90 ms before the rig recorded the restart (it waits for /readyz to stop saying
recovering). The model still counted the read's touch, and reported a 404 for a live stream. The
server was right; these histories pin the model's rule down, both ways.
"""

from __future__ import annotations

import json

from ops.torture.history import Call, Outcome
from tests.test_torture_checker import Script, tok

TTL = 9
INC = 101
GONE = json.dumps({"error": {"code": "stream_not_found", "message": "stream 'ttl/0' does not exist"}})
READ = Call("GET", "/v1/stream/ttl/0", query={"offset": "-1"})


def created_and_read(read_at: float, read_took: float = 0.1) -> Script:
    """ttl/0 created at 0 with a sliding TTL, then read (answered 200) at `read_at`."""
    s = Script()
    params = {"content_type": "text/plain", "ttl": TTL, "expires_at": None, "closed": False}
    put = Call("PUT", "/v1/stream/ttl/0", headers={"Content-Type": "text/plain", "Stream-TTL": str(TTL)})
    s.op("create", "ttl/0", put, Outcome(201, {"stream-next-offset": tok(INC, 0)}), params, at=0.0, took=0.05)
    headers = {"stream-next-offset": tok(INC, 0), "content-type": "text/plain", "stream-up-to-date": "true"}
    s.op("read", "ttl/0", READ, Outcome(200, headers), {"offset": "-1"}, at=read_at, took=read_took)
    return s


def append_404(s: Script, at: float) -> None:
    body = "w0.1:xx;"
    params = {"record": "w0.1", "stored": body, "record_ids": ["w0.1"]}
    call = Call("POST", "/v1/stream/ttl/0", headers={"Content-Type": "text/plain"}, body=body)
    s.op("append", "ttl/0", call, Outcome(404, body=GONE), params, at=at, took=0.03)


def test_a_404_from_the_new_process_before_the_restart_is_recorded_is_no_finding() -> None:
    """Seed 12's shape: the read's touch died with the killed process; the process after it
    answered before the rig recorded the restart. The create's touch (0 + 9 s) is all it knows."""
    s = created_and_read(read_at=5.0)
    s.fault("kill", at=8.4)
    append_404(s, at=10.0)  # the new process serves; the rig has not seen /readyz say so yet
    s.fault("restart", at=10.1)
    assert s.check() == []


def test_the_same_404_with_no_restart_is_still_a_finding() -> None:
    """The rule only forgets what a stopped process held: the read at 5 keeps ttl/0 alive until
    14 in a server that never stopped, so a 404 at 10 is a wrong status."""
    s = created_and_read(read_at=5.0)
    append_404(s, at=10.0)
    assert s.check() == ["wrong-status"]


def test_a_read_answered_after_the_restart_still_counts() -> None:
    """A touch in the process that serves now lasts: a read after the restart keeps ttl/0 alive
    until 18, so a 404 at 12 is a wrong status."""
    s = created_and_read(read_at=5.0)
    s.fault("kill", at=8.4)
    s.fault("restart", at=8.6)
    headers = {"stream-next-offset": tok(INC, 0), "content-type": "text/plain", "stream-up-to-date": "true"}
    s.op("read", "ttl/0", READ, Outcome(200, headers), {"offset": "-1"}, at=9.0, took=0.1)
    append_404(s, at=12.0)
    assert s.check() == ["wrong-status"]


def test_a_read_that_overlapped_the_kill_is_forgotten_too() -> None:
    """A read in flight when the kill was recorded, answered by the process being killed: its
    touch died with that process, although the checker judges it after the kill."""
    s = created_and_read(read_at=2.0)
    s.clock = 8.3
    headers = {"stream-next-offset": tok(INC, 0), "content-type": "text/plain", "stream-up-to-date": "true"}
    started = s.history.start("read", "w0", "ttl/0", {"offset": "-1"}, READ)
    s.fault("kill", at=8.4)
    s.clock = 8.6
    s.history.end(started, Outcome(200, headers, verdict="ok"))
    append_404(s, at=10.0)
    s.fault("restart", at=10.1)
    assert s.check() == []
