"""Subscriptions off the happy path (issue 11): a full disk, faults inside the delivery tasks, and
key files left behind by a crash at first start. Nothing may end the server; everything recovers
by itself once the fault is gone."""

from __future__ import annotations

import errno
import inspect
import json
import logging
import os
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from ops.serverproc import start
from streamkeep.actors.supervisor import Supervisor
from streamkeep.protocol.model import Headers, Request, Response
from streamkeep.server.service import Recovered, Service, ServiceOptions
from streamkeep.storage import files
from streamkeep.storage.memory import MemoryStorage
from streamkeep.subscriptions.manager import SubscriptionManager
from streamkeep.subscriptions.signing import Keys
from tests.conftest import assert_alive
from tests.webhooks import Receiver

JSON = {"Content-Type": "application/json"}
SUBS = "/v1/stream/__ds/subscriptions"


# ---- a real full disk --------------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a disk that fills up for real."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], check=True)


def fill(directory: Path) -> Path:
    """Writes a ballast file until the file system has no byte left."""
    ballast = directory / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        chunk = 1 << 16
        while chunk:
            try:
                os.write(fd, bytes(chunk))
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                chunk //= 2
    finally:
        os.close(fd)
    return ballast


def wait_for(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_full_disk_answers_507_keeps_serving_and_recovers(tmp_path: Path) -> None:
    data = tmp_path / "data"
    state = data / "subscriptions"
    state.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(state)], check=True)
    receiver = Receiver([(200, {"done": True}, 0.0)] * 10)
    server = start("--storage", "disk", "--data-dir", str(data), "--allow-loopback-webhooks")
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            hook = {"type": "webhook", "pattern": "full/*", "webhook": {"url": receiver.url}}
            assert client.put(f"{SUBS}/disk", json=hook).status_code == 201
            client.put("/v1/stream/pullq", content=b"[]", headers=JSON)
            pull = {"type": "pull-wake", "streams": ["pull/a"], "wake_stream": "pullq"}
            assert client.put(f"{SUBS}/pull", json=pull).status_code == 201
            client.put("/v1/stream/full/a", content=b'{"n":1}', headers=JSON)
            client.put("/v1/stream/pull/a", content=b'{"n":1}', headers=JSON)
            receiver.wait(1)
            claimed = client.post(f"{SUBS}/pull/claim", json={"worker": "w"}).json()
            acked_before = stream_link(client, "pull", "pull/a")["acked_offset"]

            ballast = fill(state)

            refused = client.put(f"{SUBS}/later", json=hook)
            assert refused.status_code == 507, refused.text
            assert refused.json()["error"]["code"] == "storage_full"
            assert int(refused.headers["retry-after"]) >= 1
            assert client.get(f"{SUBS}/later").status_code == 404  # not created in memory either

            tail = claimed["streams"][0]["tail_offset"]
            ack = client.post(
                f"{SUBS}/pull/ack",
                json={
                    "wake_id": claimed["wake_id"],
                    "generation": claimed["generation"],
                    "acks": [{"stream": "pull/a", "offset": tail}],
                    "done": True,
                },
                headers={"Authorization": f"Bearer {claimed['token']}"},
            )
            assert ack.status_code == 507 and "retry-after" in ack.headers, ack.text
            assert stream_link(client, "pull", "pull/a")["acked_offset"] == acked_before  # not claimed

            add = client.post(f"{SUBS}/disk/streams", json={"streams": ["full/extra"]})
            assert add.status_code == 507
            assert stream_link(client, "disk", "full/extra") is None

            # The driver cannot save the next wake: it backs off and retries, the server stays up.
            client.post("/v1/stream/full/a", content=b'{"n":2}', headers=JSON)
            time.sleep(3.5)
            assert_alive(server)
            assert len(receiver.requests) == 1
            failures = [line for line in server.output if "subscriptions: cannot save" in line]
            assert len(failures) == 1, failures  # once per cause, not once per retry

            ballast.unlink()
            tail = client.head("/v1/stream/full/a").headers["stream-next-offset"]
            wait_for(lambda: stream_link(client, "disk", "full/a")["acked_offset"] == tail, 40, "recovery")
            assert len(receiver.requests) == 2
            assert any("subscriptions: saving works again" in line for line in server.output)
            assert client.put(f"{SUBS}/later", json=hook).status_code == 201
            assert_alive(server)
    finally:
        server.stop()
        receiver.close()
        if subprocess.run(["umount", str(state)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(state)], check=True)


def stream_link(client: httpx.Client, sub_id: str, path: str) -> dict | None:
    body = client.get(f"{SUBS}/{sub_id}").json()
    return next((item for item in body["streams"] if item["path"] == path), None)


# ---- in process: the manager with the real service, faults injected at its seams ---------------


@asynccontextmanager
async def service_with(state_dir: Path | None, keys: Keys | None = None) -> AsyncIterator[Service]:
    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(MemoryStorage(max_stream_bytes=1 << 20, max_total_bytes=1 << 22), nursery)
        manager = SubscriptionManager(
            supervisor, keys or Keys(None), state_dir=state_dir, allow_loopback_webhooks=True
        )
        service = Service(supervisor, ServiceOptions(), recovering="subscriptions loading")
        await nursery.start(manager.run)
        service.serve_streams(Recovered(subscriptions=manager))
        yield service
        nursery.cancel_scope.cancel()


async def call(service: Service, method: str, target: str, body: object = None) -> Response:
    data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    path, _, query = target.partition("?")
    headers = Headers([("Content-Type", "application/json")])
    return await service.handle(Request(method, path, query, headers, data))


class FaultPlan:
    """Fails the next `count` calls with `error` once armed; deterministic, so replayable."""

    def __init__(self, error: BaseException, count: int) -> None:
        self.error, self.count, self.armed, self.raised = error, count, False, 0

    def check(self) -> None:
        if self.armed and self.raised < self.count:
            self.raised += 1
            raise self.error


async def wait_until(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    """Polls `condition` (a function returning a bool or an awaitable bool) until it holds."""
    with trio.move_on_after(timeout):
        while True:
            result = condition()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return
            await trio.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


async def test_a_bug_in_the_driver_is_logged_once_and_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    plan = FaultPlan(RuntimeError("injected: a bug while saving"), count=2)
    real_rename = files.OS.rename

    def rename(source: files.PathLike, target: files.PathLike) -> None:
        plan.check()
        real_rename(source, target)

    monkeypatch.setattr(files.OS, "rename", rename)
    caplog.set_level(logging.INFO)
    async with service_with(tmp_path) as service:
        await call(service, "PUT", "/v1/stream/wake", b"[]")
        sub = {"type": "pull-wake", "pattern": "jobs/*", "wake_stream": "wake"}
        assert (await call(service, "PUT", f"{SUBS}/bug", sub)).status == 201
        plan.armed = True
        await call(service, "PUT", "/v1/stream/jobs/1", {"n": 1})
        assert service.subscriptions is not None
        stats = service.subscriptions.stats
        await wait_until(lambda: stats()["in_backoff"] == 1, 5, "the driver to back off")
        assert "injected" in stats()["last_error"]["message"]

        async def woken() -> bool:
            events = json.loads((await call(service, "GET", "/v1/stream/wake?offset=-1")).body or b"[]")
            return any(event["subscription_id"] == "bug" for event in events)

        await wait_until(woken, 10, "the wake event after the fault cleared")
        assert plan.raised == 2 and stats()["in_backoff"] == 0 and stats()["task_failures"] == 2
    tracebacks = [r for r in caplog.records if r.exc_info and "injected" in str(r.exc_info[1])]
    assert len(tracebacks) == 1  # logged once with its traceback, not once per retry


async def test_a_bug_in_a_webhook_delivery_is_logged_once_and_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plan = FaultPlan(RuntimeError("injected: a bug while building a wake"), count=1)

    class FlakyKeys(Keys):
        def token(self, *args, **kwargs) -> str:  # type: ignore[no-untyped-def]
            plan.check()
            return super().token(*args, **kwargs)

    receiver = Receiver([(200, {"done": True}, 0.0)])
    caplog.set_level(logging.INFO)
    try:
        async with service_with(None, FlakyKeys(None)) as service:
            sub = {"type": "webhook", "pattern": "hooks/*", "webhook": {"url": receiver.url}}
            assert (await call(service, "PUT", f"{SUBS}/flaky", sub)).status == 201
            plan.armed = True
            await call(service, "PUT", "/v1/stream/hooks/1", {"n": 1})

            async def delivered() -> bool:
                return len(receiver.requests) == 1

            await wait_until(delivered, 10, "the webhook after the fault")
            assert plan.raised == 1 and receiver.requests[0][1]["generation"] == 2  # the retry

            async def acked() -> bool:
                view = json.loads((await call(service, "GET", f"{SUBS}/flaky")).body)
                return (
                    view["streams"][0]["acked_offset"] == receiver.requests[0][1]["streams"][0]["tail_offset"]
                )

            await wait_until(acked, 5, "the done wake to be acked")
    finally:
        receiver.close()
    tracebacks = [r for r in caplog.records if r.exc_info and "injected" in str(r.exc_info[1])]
    assert len(tracebacks) == 1


async def test_stats_report_failing_saves_on_a_full_disk(tmpfs: Path) -> None:
    async with service_with(tmpfs / "state") as service:
        manager = service.subscriptions
        assert manager is not None
        sub = {"type": "pull-wake", "streams": ["a"], "wake_stream": "w"}
        assert (await call(service, "PUT", f"{SUBS}/one", sub)).status == 201
        assert manager.stats()["save_failures"] == 0 and manager.stats()["saves_failing"] is False
        ballast = fill(tmpfs)
        refused = await call(service, "PUT", f"{SUBS}/two", sub)
        assert refused.status == 507 and ("Retry-After", "1") in refused.headers
        stats = manager.stats()
        assert stats["subscriptions"] == 1 and stats["save_failures"] == 1 and stats["saves_failing"]
        assert "full" in stats["last_error"]["message"]
        ballast.unlink()
        assert (await call(service, "PUT", f"{SUBS}/two", sub)).status == 201
        assert manager.stats()["saves_failing"] is False and manager.stats()["subscriptions"] == 2


# ---- key files left by a crash at first start ------------------------------------------------


def test_keys_created_on_a_full_disk_leave_nothing_that_stops_the_next_start(tmpfs: Path) -> None:
    keys_dir = tmpfs / "keys"
    keys_dir.mkdir()
    ballast = fill(tmpfs)
    with pytest.raises(OSError):
        Keys(keys_dir)
    ballast.unlink()
    keys = Keys(keys_dir)  # the next start works
    assert Keys(keys_dir).kid == keys.kid
    for name in ("webhook-ed25519.pem", "token-secret"):
        assert (keys_dir / name).stat().st_size > 0
        assert (keys_dir / name).stat().st_mode & 0o777 == 0o600


def test_empty_key_files_are_regenerated_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "webhook-ed25519.pem").write_bytes(b"")
    (tmp_path / "token-secret").write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        keys = Keys(tmp_path)
    warned = " ".join(record.getMessage() for record in caplog.records if record.levelno == logging.WARNING)
    assert "webhook-ed25519.pem" in warned and "token-secret" in warned
    again = Keys(tmp_path)
    assert again.kid == keys.kid
    assert again.check_token(keys.token("s", 1, "w", "claim", 60), "s", "claim") is not None


@pytest.mark.parametrize(
    ("name", "content"), [("webhook-ed25519.pem", b"garbage"), ("token-secret", b"short")]
)
def test_damaged_key_files_are_an_error_that_names_them(tmp_path: Path, name: str, content: bytes) -> None:
    Keys(tmp_path)
    (tmp_path / name).write_bytes(content)
    with pytest.raises(Exception) as caught:  # the message is what matters
        Keys(tmp_path)
    message = str(caught.value)
    assert str(tmp_path / name) in message and "move it away" in message
    assert (tmp_path / name).read_bytes() == content  # never overwritten: it may have signed things
