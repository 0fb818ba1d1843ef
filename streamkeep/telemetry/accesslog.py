"""The access log (`--access-log`): one line per request, in the common log format or as JSON,
and the JSON formatter for the server's own log lines (`--log-format json`).

Lines are buffered and written once a second (or every 4,096 lines) by a background task, in a
worker thread, so a busy server pays no system call per request and a stalled stdout pipe stalls
only the log: past 100,000 waiting lines, new ones are dropped and counted. Tokens never reach the log: the `token` and
`signed` query parameters are replaced by `REDACTED` before a line is formatted.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO
from urllib.parse import unquote_plus

import trio

from streamkeep.health import Health

SECRET_PARAMETERS = ("token", "signed")
FLUSH_INTERVAL = 1.0
FLUSH_LINES = 4096
MAX_WAITING_LINES = 100_000


def redact(target: str) -> str:
    """`target` (path and query) with the values of secret query parameters replaced."""
    path, mark, query = target.partition("?")
    if not mark:
        return target
    parts = []
    for part in query.split("&"):
        name, equals, _ = part.partition("=")
        # Compared decoded, as the gate reads them: `%74oken=` is a token too.
        secret = equals and unquote_plus(name) in SECRET_PARAMETERS
        parts.append(f"{name}=REDACTED" if secret else part)
    return f"{path}?{'&'.join(parts)}"


def _clf_time(now: float) -> str:
    return time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(now))


class AccessLog:
    def __init__(self, destination: str, *, json_lines: bool, health: Health | None = None) -> None:
        self.destination = destination
        self.json_lines = json_lines
        self.health = health or Health()
        self._lines: list[str] = []
        self._out: IO[str] = sys.stdout if destination == "-" else open(destination, "a", encoding="utf-8")
        self.lines_written = 0
        self.lines_dropped = 0
        self._full = trio.Event()

    def request(
        self,
        *,
        client: str,
        subject: str | None,
        method: str,
        target: str,
        http_version: str,
        status: int,
        sent: int,
        seconds: float,
    ) -> None:
        now = time.time()
        target = redact(target)
        if self.json_lines:
            line = json.dumps(
                {
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
                    + f".{int(now % 1 * 1000):03d}Z",
                    "client": client,
                    "subject": subject,
                    "method": method,
                    "path": target,
                    "http_version": http_version,
                    "status": status,
                    "bytes": sent,
                    "duration_ms": round(seconds * 1000, 3),
                },
                separators=(",", ":"),
            )
        else:
            # The common log format, with the duration in seconds appended as many servers do.
            user = subject.replace(" ", "_").replace('"', "") if subject else "-"
            request_line = f"{method} {target} HTTP/{http_version}".replace('"', "%22")
            line = (
                f'{client or "-"} - {user} [{_clf_time(now)}] "{request_line}" {status} '
                f"{sent if sent else '-'} {seconds:.6f}"
            )
        if len(self._lines) >= MAX_WAITING_LINES:
            self.lines_dropped += 1
            return
        self._lines.append(line)
        if len(self._lines) >= FLUSH_LINES:
            self._full.set()

    def flush(self) -> None:
        """Writes what is waiting, here and now (at shutdown)."""
        lines, self._lines = self._lines, []
        self._settle(lines, self._write(lines))

    def _write(self, lines: list[str]) -> str | None:
        """In a worker thread: writes `lines`; returns why it could not."""
        if not lines:
            return None
        try:
            self._out.write("\n".join(lines) + "\n")
            self._out.flush()
        except (OSError, ValueError) as error:  # a full disk or a closed stdout: never the server's end
            return f"cannot write to {self.destination}: {error}"
        return None

    def _settle(self, lines: list[str], error: str | None) -> None:
        """Back on the event loop: counts and health, which /stats and metrics read."""
        if error is not None:
            self.lines_dropped += len(lines)
            self.health.failed("access log", error)
        elif lines:
            self.lines_written += len(lines)
            self.health.ok("access log")

    async def run(self) -> None:
        try:
            while True:
                with trio.move_on_after(FLUSH_INTERVAL):
                    await self._full.wait()
                self._full = trio.Event()
                lines, self._lines = self._lines, []
                self._settle(lines, await trio.to_thread.run_sync(self._write, lines))
        finally:
            self.flush()

    def close(self) -> None:
        self.flush()
        if self._out is not sys.stdout:
            self._out.close()


class JsonFormatter(logging.Formatter):
    """The server's own log lines as JSON objects, for log pipelines that parse them."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)
