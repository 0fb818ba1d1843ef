"""`streamkeep sync` as users deploy it: through a cluster's front door (HAProxy over two members),
over HTTP/2, with auth on and the token from the environment, both directions at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from ops.pgserver import free_port
from ops.serverproc import start
from streamkeep.client import StreamNotFound
from streamkeep.client.sync import Client
from tests.postgres import database, postgres  # noqa: F401
from tests.test_auth import SECRET, token
from tests.test_cluster import Cluster


class AuthCluster(Cluster):
    def start_member(self, member: str) -> None:
        self.members[member] = start(
            "--config", str(self.toml), "--cluster-member", member, "--port", str(self.ports[member]),
            "--storage", "disk", "--data-dir", str(self.root / member), "--fsync", "always",
            "--log-level", "warning", "--auth-jwt-secret", SECRET,
        )  # fmt: skip


@pytest.fixture
def front_door(tmp_path: Path) -> Iterator[AuthCluster]:
    built = AuthCluster(tmp_path)
    try:
        built.start_member("a")
        built.start_member("b")
        built.start_haproxy()
        yield built
    finally:
        built.stop()


def wait_for(check: Any, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def streaming(port: int) -> bool:
    """Every mapping past its start: the source's slot made and its snapshot copied."""
    try:
        mappings = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).json()["mappings"]
    except (httpx.HTTPError, ValueError):
        return False
    return all(m["state"] == "streaming" for m in mappings.values())


def test_both_directions_through_the_front_door_over_http2_with_auth(
    front_door: AuthCluster,
    database: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    admin = token("admin", sub="sync")  # made now: a token made at import expires in a long run
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id integer PRIMARY KEY, name text NOT NULL)")
        conn.execute("ALTER TABLE items REPLICA IDENTITY FULL")  # text could be TOASTed: whole rows
        conn.execute("INSERT INTO items VALUES (1, 'before the sync')")
    port = free_port()
    config = tmp_path / "sync.toml"
    config.write_text(
        f'[streamkeep]\nurl = "{front_door.front}"\nhttp2 = true\n[sync]\nport = {port}\n'
        f'[[pg_to_stream]]\nname = "fd_items"\ndsn = "{database}"\ntables = ["items"]\nstream = "pg-items"\n'
        f'[[stream_to_pg]]\nname = "fd_sessions"\nstream = "session-events"\ndsn = "{database}"\n'
        'table = "public.session_events"\nmode = "log"\n'
    )
    sync = subprocess.Popen(
        [sys.executable, "-m", "streamkeep", "sync", "--config", str(config)],
        env={**os.environ, "STREAMKEEP_TOKEN": admin},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with Client(front_door.front, token=admin, http2=True) as client:
            events = client.stream("session-events")
            events.create(content_type="application/json")
            wait_for(lambda: streaming(port))  # changes made earlier would be in the snapshot
            with psycopg.connect(database, autocommit=True) as conn:
                conn.execute("INSERT INTO items VALUES (2, 'after')")
                conn.execute("UPDATE items SET name = 'changed' WHERE id = 1")
            for n in range(3):
                events.append({"user": "ada", "n": n})

            def items_on_stream() -> list[Any]:
                try:
                    return [m for m in client.stream("pg-items").messages() if "type" in m]
                except StreamNotFound:  # the sync has not created it yet
                    return []

            wait_for(lambda: len(items_on_stream()) == 3)
            values = [(m["headers"]["operation"], m["value"]) for m in items_on_stream()]
            assert values == [
                ("insert", {"id": 1, "name": "before the sync"}),  # the snapshot
                ("insert", {"id": 2, "name": "after"}),
                ("update", {"id": 1, "name": "changed"}),
            ]

            def session_rows() -> list[Any]:
                with psycopg.connect(database, autocommit=True) as conn:
                    if conn.execute("SELECT to_regclass('session_events')").fetchone() == (None,):
                        return []  # the sink has not created it yet
                    return conn.execute(
                        "SELECT message FROM session_events ORDER BY stream_offset, message_index"
                    ).fetchall()

            wait_for(lambda: len(session_rows()) == 3)
            assert [row[0] for row in session_rows()] == [{"user": "ada", "n": n} for n in range(3)]
        # Both streams live on the members behind the front door, reached with the token only.
        assert httpx.get(f"{front_door.front}/v1/stream/pg-items").status_code == 401
    finally:
        sync.send_signal(signal.SIGTERM)
        output, _ = sync.communicate(timeout=30)
        print(output)  # shown when the test fails: the sync's own account
    assert sync.returncode == 0, output
    assert "Traceback" not in output, output
