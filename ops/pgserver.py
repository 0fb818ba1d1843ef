"""A real Postgres for tests, benchmarks and the sessions demo: `initdb` into a directory as user
`postgres` (initdb refuses root), logical decoding on, a free port on loopback, and the socket in the
data directory. Stopped `-m fast` for a clean stop or `-m immediate` for a crash, and started again.

`wal_level = logical` lives in postgresql.conf, not on pg_ctl's command line: a later plain start
would drop `-o` and then refuse to start while a logical slot exists."""

from __future__ import annotations

import argparse
import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SETTINGS = {
    "wal_level": "logical",
    # Every sink mapping's replication origin takes a replication state from this pool too: the
    # sink tests make dozens.
    "max_replication_slots": "100",
    "max_wal_senders": "20",
    "max_connections": "200",
    "listen_addresses": "'127.0.0.1'",
    "unix_socket_directories": "''",
    # A test database, not a production one: fsync stays on (crash tests rely on it), but a
    # checkpoint is not forced often and the log goes to a file in the data directory.
    "logging_collector": "off",
    "log_min_messages": "warning",
    "shared_buffers": "128MB",
    "max_wal_size": "2GB",
}


def bin_dir() -> Path:
    """Debian's Postgres binaries (the newest installed major version), or initdb on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    raise RuntimeError("Postgres is not installed: run `apt-get install postgresql` (make test does)")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _as_postgres(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Runs a Postgres binary as user `postgres` when we are root (initdb and postgres refuse root)."""
    if os.geteuid() == 0:
        command = ["runuser", "-u", "postgres", "--", *command]
    return subprocess.run(command, text=True, capture_output=True, check=False, **kwargs)  # type: ignore[call-overload]


@dataclass
class PostgresServer:
    data_dir: Path
    port: int
    user: str = "postgres"

    @property
    def dsn(self) -> str:
        return self.dsn_for("postgres")

    def dsn_for(self, database: str) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def _ctl(self, *args: str) -> None:
        done = _as_postgres([str(bin_dir() / "pg_ctl"), "-D", str(self.data_dir), *args])
        if done.returncode != 0:
            log = self.data_dir / "postgres.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"pg_ctl {' '.join(args)} failed: {done.stdout}{done.stderr}\n{tail}")

    def start(self) -> None:
        self._ctl("start", "-w", "-t", "60", "-l", str(self.data_dir / "postgres.log"))

    def stop(self, mode: str = "fast") -> None:
        """`fast` (a clean stop) or `immediate` (a crash: no checkpoint, recovery at the next start)."""
        self._ctl("stop", "-w", "-t", "60", "-m", mode)

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    @property
    def running(self) -> bool:
        return (self.data_dir / "postmaster.pid").exists()

    def create_database(self, name: str) -> str:
        """A fresh database (dropped first if there), its DSN returned."""
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn_for(name)


def create(data_dir: Path, port: int | None = None) -> PostgresServer:
    """initdb into `data_dir` (made, and given to user postgres when we are root), then started."""
    data_dir.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        # postgres must reach its directory: every parent needs search permission for it.
        for parent in [data_dir, *data_dir.parents]:
            if parent == Path("/"):
                break
            mode = parent.stat().st_mode
            if not mode & 0o001:
                os.chmod(parent, mode | 0o001)
        os.chown(data_dir, entry.pw_uid, entry.pw_gid)
    done = _as_postgres(
        [str(bin_dir() / "initdb"), "-D", str(data_dir), "-U", "postgres", "--auth=trust", "-E", "UTF8"]
    )
    if done.returncode != 0:
        raise RuntimeError(f"initdb failed: {done.stdout}{done.stderr}")
    server = PostgresServer(data_dir, port or free_port())
    with open(data_dir / "postgresql.conf", "a") as conf:
        for key, value in {**SETTINGS, "port": str(server.port)}.items():
            conf.write(f"{key} = {value}\n")
    server.start()
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ops.pgserver", description="Run a throwaway Postgres with logical decoding on."
    )
    parser.add_argument("--data-dir", type=Path, default=None, help="default: a new temporary directory")
    parser.add_argument("--port", type=int, default=5432)
    args = parser.parse_args(argv)
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="streamkeep-pg-"))
    if (data_dir / "PG_VERSION").exists():
        server = PostgresServer(data_dir, args.port)
        server.start()
    else:
        server = create(data_dir, args.port)
    print(f"postgres listening on {server.dsn} (data in {data_dir}); Ctrl-C stops it", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
