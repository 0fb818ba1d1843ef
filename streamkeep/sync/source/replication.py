"""A `replication=database` connection driven through libpq's copy-data calls under trio.

psycopg 3 has no replication API (psycopg#71), but its `pq.PGconn` is libpq: replication commands
run as simple queries, and START_REPLICATION's CopyBoth is read with `get_copy_data(async)` after
`trio.lowlevel.wait_readable` on the socket, and answered with `put_copy_data` + `flush`.
Commands before streaming (CREATE_REPLICATION_SLOT, ...) block, so they run in a worker thread."""

from __future__ import annotations

import time
from dataclasses import dataclass

import trio
from psycopg import conninfo, pq

from streamkeep.sync.source.pgoutput import (
    POSTGRES_EPOCH_UNIX,
    Keepalive,
    XLogData,
    decode_copy,
    lsn_parse,
    lsn_text,
    standby_status,
)


class ReplicationError(Exception):
    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def _error(pgconn: pq.abc.PGconn, result: pq.abc.PGresult | None, doing: str) -> ReplicationError:
    if result is not None:
        message = result.error_message.decode("utf-8", "replace").strip()
        raw = result.error_field(pq.DiagnosticField.SQLSTATE)
        sqlstate = raw.decode() if raw else None
    else:
        message, sqlstate = pgconn.error_message.decode("utf-8", "replace").strip(), None
    return ReplicationError(f"{doing}: {message or 'connection lost'}", sqlstate)


@dataclass(frozen=True)
class SlotCreated:
    consistent_point: int
    snapshot_name: str | None


class ReplicationConnection:
    def __init__(self, pgconn: pq.abc.PGconn) -> None:
        self.pgconn = pgconn
        self.streaming = False
        # The bridge's reader (keepalive replies) and appender (confirms) both send status
        # updates: two tasks waiting to write on one socket is an error in trio.
        self.sending = trio.Lock()

    @classmethod
    async def open(cls, dsn: str) -> ReplicationConnection:
        info = conninfo.make_conninfo(dsn, replication="database", application_name="streamkeep-sync")

        def connect() -> pq.abc.PGconn:
            pgconn = pq.PGconn.connect(info.encode())
            if pgconn.status != pq.ConnStatus.OK:
                message = pgconn.error_message.decode("utf-8", "replace").strip()
                pgconn.finish()
                raise ReplicationError(f"replication connection failed: {message}")
            return pgconn

        return cls(await trio.to_thread.run_sync(connect, abandon_on_cancel=True))

    def close(self) -> None:
        self.pgconn.finish()

    async def command(self, sql: str) -> list[tuple[str | None, ...]]:
        """A replication command's rows (as text), run to completion in a worker thread."""

        def run() -> list[tuple[str | None, ...]]:
            result = self.pgconn.exec_(sql.encode())
            if result.status not in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
                raise _error(self.pgconn, result, sql.split(" (")[0])
            return [
                tuple(
                    None if (v := result.get_value(row, col)) is None else bytes(v).decode()
                    for col in range(result.nfields)
                )
                for row in range(result.ntuples)
            ]

        # Not abandoned on cancel: `close` must not finish the connection under a running call.
        return await trio.to_thread.run_sync(run)

    async def create_slot(self, slot: str, export_snapshot: bool) -> SlotCreated:
        how = "EXPORT_SNAPSHOT" if export_snapshot else "NOEXPORT_SNAPSHOT"
        rows = await self.command(f"CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput {how}")
        _name, point, snapshot, _plugin = rows[0]
        assert point is not None
        return SlotCreated(lsn_parse(point), snapshot)

    async def start(self, slot: str, lsn: int, publication: str) -> None:
        sql = (
            f"START_REPLICATION SLOT {slot} LOGICAL {lsn_text(lsn)} "
            f"(proto_version '1', publication_names '{publication}')"
        )
        self.pgconn.nonblocking = 1
        self.pgconn.send_query(sql.encode())  # raises psycopg.OperationalError on failure
        await self._flush()
        while True:
            self.pgconn.consume_input()
            if self.pgconn.is_busy():
                await trio.lowlevel.wait_readable(self.pgconn.socket)
                continue
            result = self.pgconn.get_result()
            if result is None or result.status != pq.ExecStatus.COPY_BOTH:
                # Drain what is left so the error is the server's own.
                while self.pgconn.get_result() is not None:
                    pass
                raise _error(self.pgconn, result, "START_REPLICATION")
            self.streaming = True
            return

    def receive_nowait(self) -> bytes | None:
        """The next CopyData libpq has already read (an XLogData or a keepalive, see
        pgoutput.decode_copy), or None: no await and no cancel scope per message, which
        dominated a drain's CPU (a slot holds many small messages)."""
        size, data = self.pgconn.get_copy_data(1)
        if size > 0:
            return bytes(data)
        if size == 0:
            return None
        # -1: the server ended the copy (an error follows); -2: the connection failed.
        result = self.pgconn.get_result()
        raise _error(self.pgconn, result, "replication stream ended")

    async def wait(self) -> None:
        """Until the socket has more to read (then read into libpq's buffer)."""
        await trio.lowlevel.wait_readable(self.pgconn.socket)
        self.pgconn.consume_input()

    async def receive(self) -> XLogData | Keepalive:
        """The next message from the server, waiting as long as it takes (the server sends a
        keepalive at least every wal_sender_timeout / 2)."""
        while (data := self.receive_nowait()) is None:
            await self.wait()
        return decode_copy(data)

    async def send_status(self, written: int, flushed: int) -> None:
        now = int((time.time() - POSTGRES_EPOCH_UNIX) * 1_000_000)
        message = standby_status(written, flushed, now)
        async with self.sending:
            while not self.pgconn.put_copy_data(message):
                await trio.lowlevel.wait_writable(self.pgconn.socket)
            await self._flush()

    async def _flush(self) -> None:
        while self.pgconn.flush():
            await trio.lowlevel.wait_writable(self.pgconn.socket)
