"""Subscriptions beyond the conformance suite: failing receivers, forged callbacks, crashes."""

from __future__ import annotations

import base64
import itertools
import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ops.serverproc import ROOT, ServerProcess, start
from streamkeep.protocol.errors import ProtocolError
from streamkeep.protocol.globs import glob_match
from streamkeep.subscriptions.config import SubscriptionConfig
from streamkeep.subscriptions.signing import Keys
from streamkeep.subscriptions.urls import check_webhook_url
from tests.webhooks import Receiver

JSON = {"Content-Type": "application/json"}


# ---- pure rules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        ("events/*", "events/a", True),
        ("events/*", "events/a/b", False),
        ("events/**", "events/a/b", True),
        ("events/**", "events", True),
        ("**/x", "a/b/x", True),
        ("ev*/a", "events/a", True),
        ("events/*", "other/a", False),
    ],
)
def test_glob(pattern: str, path: str, expected: bool) -> None:
    assert glob_match(pattern, path) is expected


def _reference_match(pattern: list[str], path: list[str]) -> bool:
    """The matcher before issue 11, kept as the definition of the semantics (exponential in `**`)."""
    if not pattern:
        return not path
    head = pattern[0]
    if head == "**":
        return any(_reference_match(pattern[1:], path[i:]) for i in range(len(path) + 1))
    if not path:
        return False
    if head == "*" or head == path[0]:
        return _reference_match(pattern[1:], path[1:])
    if "*" in head:
        regex = "[^/]*".join(re.escape(part) for part in head.split("*"))
        return re.fullmatch(regex, path[0]) is not None and _reference_match(pattern[1:], path[1:])
    return False


@pytest.mark.parametrize("seed", range(5))
def test_glob_agrees_with_the_reference_on_random_cases(seed: int) -> None:
    rng = random.Random(seed)
    pattern_parts = ["a", "b", "ab", "*", "**", "a*", "*b", "a**b", "*a*"]
    path_parts = ["a", "b", "ab", "ba", "aab", "x"]
    for _ in range(2000):
        pattern = [rng.choice(pattern_parts) for _ in range(rng.randint(1, 6))]
        path = [rng.choice(path_parts) for _ in range(rng.randint(1, 6))]
        expected = _reference_match(pattern, path)
        assert glob_match("/".join(pattern), "/".join(path)) is expected, (pattern, path)


HOSTILE = """
import time
from streamkeep.protocol.globs import glob_match
began = time.perf_counter()
results = [
    glob_match("**/" * 200 + "x", "/".join(["a"] * 100)),
    glob_match("**/a/" * 150 + "x", "/".join(["a"] * 300)),
    glob_match("**/*a*/" * 120 + "b", "/".join(["aaa"] * 400)),
    glob_match("x/" + "*a" * 120 + "*b", "x/" + "a" * 250),  # stars within one segment
]
print(results, time.perf_counter() - began)
"""


def test_glob_with_many_double_stars_stays_fast() -> None:
    # In a child process, so an exponential matcher is killed instead of hanging the tests.
    try:
        done = subprocess.run(
            [sys.executable, "-c", HOSTILE], capture_output=True, text=True, timeout=10, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        pytest.fail("matching hostile globs did not finish in 10 s")
    assert done.returncode == 0, done.stderr
    results, seconds = done.stdout.rsplit(" ", 1)
    assert results == "[False, False, False, False]"
    assert float(seconds) < 2.0, seconds  # generous: linear matching takes milliseconds


def test_hostile_glob_does_not_stall_publishing() -> None:
    server = start("--storage", "memory")
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            body = {"type": "pull-wake", "pattern": "**/" * 300 + "x", "wake_stream": "w"}
            assert client.put("/v1/stream/__ds/subscriptions/hostile", json=body).status_code == 201
            deep = "/".join(["a"] * 200)
            began = time.monotonic()
            created = client.put(f"/v1/stream/{deep}", content=b"x", headers={"Content-Type": "text/plain"})
            for _ in range(20):
                client.post(f"/v1/stream/{deep}", content=b"x", headers={"Content-Type": "text/plain"})
            assert created.status_code == 201 and time.monotonic() - began < 5
            assert client.get("/healthz").status_code == 200
    except httpx.TimeoutException:
        pytest.fail("the server stalled matching a hostile glob")
    finally:
        server.stop(signal.SIGKILL)


@pytest.mark.parametrize(
    ("url", "loopback_allowed", "ok"),
    [
        ("https://hooks.example.com/x", False, True),
        ("http://hooks.example.com/x", False, False),
        ("https://10.0.0.1/hook", False, False),
        ("https://192.168.1.5/hook", False, False),
        ("https://169.254.169.254/latest/meta-data", False, False),
        ("http://localhost:9000/hook", False, False),
        ("http://localhost:9000/hook", True, True),
        ("http://127.0.0.5:9000/hook", True, True),
        ("http://127.1.0.1:9000/hook", True, False),
        ("https://[::1]/hook", False, False),
        ("https://user:pw@hooks.example.com/", False, False),
        ("ftp://hooks.example.com/", False, False),
    ],
)
def test_webhook_url_rules(url: str, loopback_allowed: bool, ok: bool) -> None:
    if ok:
        check_webhook_url(url, allow_loopback=loopback_allowed)
    else:
        with pytest.raises(ProtocolError) as caught:
            check_webhook_url(url, allow_loopback=loopback_allowed)
        assert caught.value.code == "WEBHOOK_URL_REJECTED"


async def test_host_names_resolving_to_private_addresses_are_refused() -> None:
    from streamkeep.subscriptions.urls import check_resolved

    with pytest.raises(ProtocolError):
        await check_resolved("https://localhost/hook", allow_loopback=False)  # resolves to 127.0.0.1
    await check_resolved("http://localhost:9/hook", allow_loopback=True)
    await check_resolved("https://127.0.0.1/hook", allow_loopback=False)  # literals: checked at create


def test_config_hash_is_normalized() -> None:
    a = SubscriptionConfig.parse(b'{"type":"pull-wake","wake_stream":"w","streams":["b","a","a"]}')
    b = SubscriptionConfig.parse(b'{"streams":["a","b"],"wake_stream":"w","type":"pull-wake"}')
    c = SubscriptionConfig.parse(
        b'{"type":"pull-wake","wake_stream":"w","streams":["a","b"],"description":"x"}'
    )
    assert a.hash == b.hash != c.hash


def test_keys_sign_verifiably_and_persist(tmp_path: Path) -> None:
    keys = Keys(tmp_path)
    header = keys.signature_header(b'{"x":1}', now=1700000000)
    timestamp, kid, signature = (part.split("=", 1)[1] for part in header.split(","))
    jwk = keys.jwks()["keys"][0]
    public = Ed25519PublicKey.from_public_bytes(base64.urlsafe_b64decode(jwk["x"] + "=="))
    public.verify(base64.urlsafe_b64decode(signature + "=="), f"{timestamp}.".encode() + b'{"x":1}')
    assert kid == jwk["kid"] == Keys(tmp_path).kid  # stable across restarts
    token = keys.token("sub", 3, "w_1", "callback", 60)
    assert keys.check_token(token, "sub", "callback")["g"] == 3
    assert keys.check_token(token, "other", "callback") is None
    assert keys.check_token(token, "sub", "claim") is None
    assert Keys(None).check_token(token, "sub", "callback") is None  # another server's secret
    _payload, _, mac = token.partition(".")
    forged = (
        base64.urlsafe_b64encode(
            json.dumps({"s": "sub", "g": 4, "w": "w_1", "k": "callback", "e": 9999999999}).encode()
        )
        .rstrip(b"=")
        .decode()
    )
    assert keys.check_token(f"{forged}.{mac}", "sub", "callback") is None
    assert keys.check_token(keys.token("sub", 3, "w_1", "callback", -5), "sub", "callback") is None


# ---- a server and its webhook receivers ---------------------------------------------------------


@pytest.fixture(scope="module")
def sub_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    process = start(
        "--storage", "disk", "--data-dir", str(tmp_path_factory.mktemp("subs")), "--allow-loopback-webhooks"
    )
    yield process
    process.stop()


def subscribe(client: httpx.Client, sub_id: str, body: dict) -> dict:
    response = client.put(f"/v1/stream/__ds/subscriptions/{sub_id}", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def acked(client: httpx.Client, sub_id: str, path: str) -> str | None:
    body = client.get(f"/v1/stream/__ds/subscriptions/{sub_id}").json()
    return next((s["acked_offset"] for s in body["streams"] if s["path"] == path), None)


def test_failing_receiver_is_retried_with_backoff_and_cursor_waits(sub_server: ServerProcess) -> None:
    receiver = Receiver([(500, {}, 0.0), (500, {}, 0.0), (200, {"done": True}, 0.0)])
    try:
        with httpx.Client(base_url=sub_server.url, timeout=10) as client:
            subscribe(
                client,
                "retry",
                {
                    "type": "webhook",
                    "pattern": "retry/*",
                    "webhook": {"url": receiver.url},
                    "lease_ttl_ms": 1000,
                },
            )
            client.put("/v1/stream/retry/a", content=b'{"n":1}', headers=JSON)
            before = acked(client, "retry", "retry/a")
            receiver.wait(1)
            time.sleep(0.3)
            status = client.get("/v1/stream/__ds/subscriptions/retry").json()["status"]
            assert status == "failed" and acked(client, "retry", "retry/a") == before  # no cursor advance
            receiver.wait(3)
            times = [t for t, _ in receiver.requests]
            gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
            assert 0.75 <= gaps[0] <= 1.5 and 1.55 <= gaps[1] <= 3.0, gaps  # 1 s, then 2 s, ±20%
            generations = [body["generation"] for _, body in receiver.requests]
            assert generations == sorted(set(generations))  # every attempt is a new, higher generation
            deadline = time.monotonic() + 5
            tail = client.head("/v1/stream/retry/a").headers["stream-next-offset"]
            while acked(client, "retry", "retry/a") != tail:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert client.get("/v1/stream/__ds/subscriptions/retry").json()["status"] == "active"
    finally:
        receiver.close()


def test_unreachable_receiver_leaves_cursor_alone(sub_server: ServerProcess) -> None:
    receiver = Receiver([])
    url = receiver.url
    receiver.close()
    receiver.server.server_close()  # nobody listens there any more
    with httpx.Client(base_url=sub_server.url, timeout=10) as client:
        subscribe(client, "down", {"type": "webhook", "streams": ["down/a"], "webhook": {"url": url}})
        client.put("/v1/stream/down/a", content=b'{"n":1}', headers=JSON)
        start_offset = acked(client, "down", "down/a")
        time.sleep(1.5)
        body = client.get("/v1/stream/__ds/subscriptions/down").json()
        assert body["status"] == "failed" and acked(client, "down", "down/a") == start_offset


def test_slow_receiver_loses_its_lease_and_old_callbacks_are_fenced(sub_server: ServerProcess) -> None:
    receiver = Receiver([(200, {}, 1.5), (200, {}, 0.0)])  # first answer after the 1 s lease
    try:
        with httpx.Client(base_url=sub_server.url, timeout=10) as client:
            subscribe(
                client,
                "slow",
                {
                    "type": "webhook",
                    "streams": ["slow/a"],
                    "webhook": {"url": receiver.url},
                    "lease_ttl_ms": 1000,
                },
            )
            client.put("/v1/stream/slow/a", content=b'{"n":1}', headers=JSON)
            receiver.wait(2)
            first, second = receiver.requests[0][1], receiver.requests[1][1]
            assert second["generation"] > first["generation"] and second["wake_id"] != first["wake_id"]
            tail = first["streams"][0]["tail_offset"]
            stale = client.post(
                first["callback_url"].replace(first["callback_url"].split("/v1")[0], ""),
                json={
                    "wake_id": first["wake_id"],
                    "generation": first["generation"],
                    "acks": [{"stream": "slow/a", "offset": tail}],
                    "done": True,
                },
                headers={"Authorization": f"Bearer {first['callback_token']}"},
            )
            assert stale.status_code == 409 and stale.json()["error"]["code"] == "FENCED"
            assert acked(client, "slow", "slow/a") != tail
            current = client.post(
                "/v1/stream/__ds/subscriptions/slow/callback",
                json={
                    "wake_id": second["wake_id"],
                    "generation": second["generation"],
                    "acks": [{"stream": "slow/a", "offset": tail}],
                    "done": True,
                },
                headers={"Authorization": f"Bearer {second['callback_token']}"},
            )
            assert current.status_code == 200 and acked(client, "slow", "slow/a") == tail
    finally:
        receiver.close()


def test_forged_and_replayed_callbacks_are_rejected(sub_server: ServerProcess) -> None:
    receiver = Receiver([(200, {}, 0.0)])
    try:
        with httpx.Client(base_url=sub_server.url, timeout=10) as client:
            subscribe(
                client,
                "forge",
                {
                    "type": "webhook",
                    "streams": ["forge/a"],
                    "webhook": {"url": receiver.url},
                    "lease_ttl_ms": 60000,
                },
            )
            client.put("/v1/stream/forge/a", content=b'{"n":1}', headers=JSON)
            receiver.wait(1)
            wake = receiver.requests[0][1]
            tail = wake["streams"][0]["tail_offset"]
            body = {
                "wake_id": wake["wake_id"],
                "generation": wake["generation"],
                "acks": [{"stream": "forge/a", "offset": tail}],
                "done": True,
            }
            url = "/v1/stream/__ds/subscriptions/forge/callback"
            foreign = Keys(None).token("forge", wake["generation"], wake["wake_id"], "callback", 60)
            for token in (foreign, wake["callback_token"][:-4] + "AAAA", "junk"):
                forged = client.post(url, json=body, headers={"Authorization": f"Bearer {token}"})
                assert forged.status_code == 401, token
            wrong_wake = client.post(
                url,
                json={**body, "wake_id": "w_other"},
                headers={"Authorization": f"Bearer {wake['callback_token']}"},
            )
            assert wrong_wake.status_code == 409
            assert acked(client, "forge", "forge/a") != tail  # nothing above moved the cursor
            ok = client.post(url, json=body, headers={"Authorization": f"Bearer {wake['callback_token']}"})
            assert ok.json() == {"ok": True, "next_wake": False}
            replay = client.post(
                url, json=body, headers={"Authorization": f"Bearer {wake['callback_token']}"}
            )
            assert replay.status_code == 409 and replay.json()["error"]["code"] == "FENCED"
            client.delete("/v1/stream/__ds/subscriptions/forge")
            after_delete = client.post(
                url, json=body, headers={"Authorization": f"Bearer {wake['callback_token']}"}
            )
            assert after_delete.status_code == 404
    finally:
        receiver.close()


def test_crash_between_wake_and_ack_loses_and_skips_nothing(tmp_path: Path) -> None:
    def claim(client: httpx.Client) -> dict:
        response = client.post("/v1/stream/__ds/subscriptions/pull/claim", json={"worker": "w1"})
        assert response.status_code == 200, response.text
        return response.json()

    server = start("--storage", "disk", "--data-dir", str(tmp_path))
    with httpx.Client(base_url=server.url, timeout=10) as client:
        client.put("/v1/stream/wake/pool", content=b"[]", headers=JSON)
        subscribe(
            client,
            "pull",
            {"type": "pull-wake", "pattern": "jobs/*", "wake_stream": "wake/pool", "lease_ttl_ms": 60000},
        )
        client.put("/v1/stream/jobs/1", content=b'{"job":1}', headers=JSON)
        first = claim(client)
        tail = first["streams"][0]["tail_offset"]
    server.stop(signal.SIGKILL)  # the worker took the wake, the server died before its ack

    server = start("--storage", "disk", "--data-dir", str(tmp_path))
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            assert acked(client, "pull", "jobs/1") != tail  # not acked: not skipped
            late = client.post(
                "/v1/stream/__ds/subscriptions/pull/ack",
                json={
                    "wake_id": first["wake_id"],
                    "generation": first["generation"],
                    "acks": [{"stream": "jobs/1", "offset": tail}],
                    "done": True,
                },
                headers={"Authorization": f"Bearer {first['token']}"},
            )
            assert late.status_code == 409  # the pre-crash wake is over
            second = claim(client)
            assert second["generation"] > first["generation"]
            assert second["streams"][0]["tail_offset"] == tail and second["streams"][0]["has_pending"]
            done = client.post(
                "/v1/stream/__ds/subscriptions/pull/ack",
                json={
                    "wake_id": second["wake_id"],
                    "generation": second["generation"],
                    "acks": [{"stream": "jobs/1", "offset": tail}],
                    "done": True,
                },
                headers={"Authorization": f"Bearer {second['token']}"},
            )
            assert done.json() == {"ok": True, "next_wake": False}
        server.stop(signal.SIGKILL)
        server = start("--storage", "disk", "--data-dir", str(tmp_path))
        with httpx.Client(base_url=server.url, timeout=10) as client:
            assert acked(client, "pull", "jobs/1") == tail  # the ack survived the next crash
            nothing = client.post("/v1/stream/__ds/subscriptions/pull/claim", json={"worker": "w1"})
            assert nothing.status_code == 409  # nothing is replayed once acked
            wakes = client.get("/v1/stream/wake/pool", params={"offset": "-1"}).json()
            assert wakes and all(w["subscription_id"] == "pull" for w in wakes)
    finally:
        server.stop()
