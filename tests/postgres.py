"""A real Postgres for the sync tests: one server per test worker (initdb as user postgres into a
temporary directory, logical decoding on, a free port), a fresh database for each test."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from ops import pgserver


@pytest.fixture(scope="session")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pgserver.PostgresServer]:
    server = pgserver.create(tmp_path_factory.mktemp("postgres") / "data")
    yield server
    if server.running:
        server.stop("immediate")


@pytest.fixture
def database(postgres: pgserver.PostgresServer, request: pytest.FixtureRequest) -> str:
    """The DSN of a new database named after the test (a crash test may have stopped the server:
    it is started again first)."""
    if not postgres.running:
        postgres.start()
    name = re.sub(r"[^a-z0-9_]", "_", request.node.name.lower())[-50:]
    return postgres.create_database(f"t_{name}")
