"""`make sessions-demo`: seed 000's durable sessions stack on this machine, both flows live.

Starts a local Postgres (logical decoding on), `streamkeep serve` and `streamkeep sync` with the
seed's two mappings, then prints what to type:

- `items` -> `pg-items`: an INSERT, UPDATE or DELETE on table `items` appears as a State Protocol
  message on stream `pg-items` for every reader (after the table's rows, copied first);
- `session-events` -> `session_events`: each message appended to stream `session-events`
  becomes a row of table `session_events`.

Everything lives under --dir (default: a new temporary directory); Ctrl-C stops all three."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ops import pgserver, serverproc

SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
    id serial PRIMARY KEY,
    name text NOT NULL,
    price numeric(10, 2) NOT NULL DEFAULT 0
);
-- Every column in each change: an UPDATE then carries the whole row (large text values included).
ALTER TABLE items REPLICA IDENTITY FULL;
INSERT INTO items (name, price) SELECT 'first item', 9.50 WHERE NOT EXISTS (SELECT 1 FROM items);
"""

CONFIG = """\
[streamkeep]
url = "{url}"

[sync]
port = {sync_port}

[[pg_to_stream]]
name = "items"
dsn = "{dsn}"
tables = ["public.items"]
stream = "pg-items"

[[stream_to_pg]]
name = "sessions"
stream = "session-events"
dsn = "{dsn}"
table = "public.session_events"
mode = "log"
"""


def wait_healthy(url: str, sync: subprocess.Popen[str], timeout: float = 60.0) -> dict[str, object]:
    """Until /healthz says every mapping streams (or the process died: then its output says why)."""
    deadline = time.monotonic() + timeout
    last: dict[str, object] = {}
    while time.monotonic() < deadline:
        if sync.poll() is not None:
            raise RuntimeError(f"streamkeep sync exited with {sync.returncode}")
        try:
            last = httpx.get(url, timeout=2).json()
            mappings = last.get("mappings", {})
            if isinstance(mappings, dict) and all(m.get("state") == "streaming" for m in mappings.values()):
                return last
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the sync did not reach streaming in {timeout:.0f} s: {last}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.sessions_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="where Postgres, streams and the config live")
    parser.add_argument("--port", type=int, default=4437, help="streamkeep's port")
    parser.add_argument("--sync-port", type=int, default=4440, help="the sync's /metrics and /healthz")
    parser.add_argument("--pg-port", type=int, default=None, help="Postgres' port (default: a free one)")
    parser.add_argument("--check", action="store_true", help="run both flows once, print what came out, stop")
    args = parser.parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="streamkeep-sessions-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"[1/4] Postgres in {root / 'postgres'} ...", flush=True)
    pg_dir = root / "postgres"
    if (pg_dir / "PG_VERSION").exists():
        postgres = pgserver.PostgresServer(pg_dir, args.pg_port or pgserver.free_port())
        postgres.start()
    else:
        postgres = pgserver.create(pg_dir, args.pg_port)
    import psycopg

    dsn = postgres.dsn
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
    print(f"[2/4] streamkeep on port {args.port} (data in {root / 'streams'}) ...", flush=True)
    server = serverproc.launch(
        [
            sys.executable,
            "-m",
            "streamkeep",
            "serve",
            "--port",
            str(args.port),
            "--data-dir",
            str(root / "streams"),
        ]
    )
    config = root / "sync.toml"
    config.write_text(CONFIG.format(url=server.url, sync_port=args.sync_port, dsn=dsn))
    print(f"[3/4] streamkeep sync --config {config} ...", flush=True)
    sync = subprocess.Popen([sys.executable, "-m", "streamkeep", "sync", "--config", str(config)], text=True)
    try:
        health_url = f"http://127.0.0.1:{args.sync_port}/healthz"
        httpx.put(f"{server.url}/v1/stream/session-events", headers={"content-type": "application/json"})
        wait_healthy(health_url, sync)
        print("[4/4] both flows are live.\n", flush=True)
        psql = f"psql '{dsn}'"
        print(
            "Postgres -> stream (every reader sees the table's rows, then each change):\n"
            f"  curl -N '{server.url}/v1/stream/pg-items?offset=-1&live=sse'\n"
            f"  {psql} -c \"INSERT INTO items (name, price) VALUES ('lamp', 25)\"\n"
            f"  {psql} -c \"UPDATE items SET price = 20 WHERE name = 'lamp'\"\n\n"
            "stream -> Postgres (each message becomes a row of session_events):\n"
            f'  curl -X POST -H \'content-type: application/json\' -d \'{{"user": "ada", "event": "login"}}\' '
            f"'{server.url}/v1/stream/session-events'\n"
            f"  {psql} -c 'SELECT * FROM session_events'\n\n"
            f"Metrics: http://127.0.0.1:{args.sync_port}/metrics   health: {health_url}\n"
            "Ctrl-C stops Postgres, streamkeep and the sync.",
            flush=True,
        )
        if args.check:
            return check(server.url, dsn)
        signal.sigwait([signal.SIGINT, signal.SIGTERM])
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        sync.send_signal(signal.SIGTERM)
        try:
            sync.wait(15)
        except subprocess.TimeoutExpired:
            sync.kill()
        server.stop()
        postgres.stop()


def check(url: str, dsn: str) -> int:
    """Both flows once: an INSERT seen on pg-items, an append seen in session_events."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO items (name, price) VALUES ('lamp', 25)")
    httpx.post(
        f"{url}/v1/stream/session-events",
        headers={"content-type": "application/json"},
        content=b'{"user": "ada", "event": "login"}',
    ).raise_for_status()
    deadline = time.monotonic() + 30
    items: list[object] = []
    rows: list[tuple[object, ...]] = []
    while time.monotonic() < deadline:
        items = httpx.get(f"{url}/v1/stream/pg-items", params={"offset": "-1"}).json()
        with psycopg.connect(dsn, autocommit=True) as conn:
            rows = conn.execute("SELECT * FROM session_events").fetchall()
        if any(isinstance(m, dict) and m.get("value", {}).get("name") == "lamp" for m in items) and rows:
            print(f"pg-items: {len(items)} messages, the last: {items[-1]}")
            print(f"session_events: {rows}")
            return 0
        time.sleep(0.2)
    print(f"the flows did not complete in 30 s: pg-items {items}, session_events {rows}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
