"""A real Postgres for the sync tests: one server per test worker (initdb as user postgres into a
temporary directory, logical decoding on, a free port), a fresh database for each test."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops import pgserver


@pytest.fixture(scope="session")
def postgres() -> Iterator[pgserver.PostgresServer]:
    # Not under pytest's temporary root: a second pytest session on the machine sets that root back
    # to mode 0700 as it starts, and user postgres then loses its way to its own data directory
    # (seen: `pg_ctl stop` failing with "Permission denied" at the end of a CI run).
    root = Path(tempfile.mkdtemp(prefix="streamkeep-pg-"))
    try:
        server = pgserver.create(root / "data")
        yield server
        if server.running:
            server.stop("immediate")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def database(postgres: pgserver.PostgresServer, request: pytest.FixtureRequest) -> str:
    """The DSN of a new database named after the test (a crash test may have stopped the server:
    it is started again first)."""
    if not postgres.running:
        postgres.start()
    name = re.sub(r"[^a-z0-9_]", "_", request.node.name.lower())[-50:]
    return postgres.create_database(f"t_{name}")
