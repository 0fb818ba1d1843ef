"""The protocol over real sockets, each test over HTTP/1.1 and over h2c (HTTP/2 prior knowledge)."""

from __future__ import annotations

import base64
import json
import ssl
import threading
import time
from pathlib import Path

import httpx
import pytest

from ops.serverproc import ServerProcess


def create(
    client: httpx.Client, url: str, content_type: str = "text/plain", **headers: str
) -> httpx.Response:
    response = client.put(url, headers={"Content-Type": content_type, **headers})
    assert response.status_code == 201, response.text
    return response


def test_quickstart_round_trip(client: httpx.Client, stream_url: str) -> None:
    created = create(client, stream_url)
    assert created.headers["location"].endswith(stream_url)
    first = client.post(stream_url, content=b"hello ", headers={"Content-Type": "text/plain"})
    second = client.post(stream_url, content=b"world", headers={"Content-Type": "text/plain"})
    assert first.status_code == second.status_code == 204
    assert first.headers["stream-next-offset"] < second.headers["stream-next-offset"]
    read = client.get(stream_url, params={"offset": "-1"})
    assert read.status_code == 200 and read.content == b"hello world"
    assert read.headers["stream-up-to-date"] == "true"
    resumed = client.get(stream_url, params={"offset": first.headers["stream-next-offset"]})
    assert resumed.content == b"world"
    assert client.delete(stream_url).status_code == 204
    assert client.get(stream_url).status_code == 404


def test_http_version_is_what_the_client_asked_for(
    client: httpx.Client, request: pytest.FixtureRequest
) -> None:
    expected = "HTTP/2" if request.node.callspec.params["client"] == "h2c" else "HTTP/1.1"
    assert client.get("/healthz").http_version == expected


def test_json_mode_keeps_message_boundaries(client: httpx.Client, stream_url: str) -> None:
    create(client, stream_url, "application/json")
    client.post(stream_url, content=b'[{"a":1},{"b":2}]', headers={"Content-Type": "application/json"})
    client.post(stream_url, content=b'{"c": [3]}', headers={"Content-Type": "application/json"})
    body = client.get(stream_url, params={"offset": "-1"}).json()
    assert body == [{"a": 1}, {"b": 2}, {"c": [3]}]
    bad = client.post(stream_url, content=b"{nope", headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


def test_long_poll_wakes_on_append(client: httpx.Client, server: ServerProcess, stream_url: str) -> None:
    tail = create(client, stream_url).headers["stream-next-offset"]

    def append_later() -> None:
        time.sleep(0.3)
        httpx.post(f"{server.url}{stream_url}", content=b"late", headers={"Content-Type": "text/plain"})

    threading.Thread(target=append_later).start()
    response = client.get(stream_url, params={"offset": tail, "live": "long-poll"})
    assert response.status_code == 200 and response.content == b"late"
    assert response.headers["stream-cursor"].isdigit()


def test_long_poll_times_out_with_204_and_cursor(client: httpx.Client, stream_url: str) -> None:
    create(client, stream_url)
    response = client.get(stream_url, params={"offset": "now", "live": "long-poll", "cursor": "1"})
    assert response.status_code == 204
    assert response.headers["stream-up-to-date"] == "true"
    assert int(response.headers["stream-cursor"]) > 1


def test_sse_sends_data_then_control_and_closes_after_stream_closed(
    client: httpx.Client, stream_url: str
) -> None:
    create(client, stream_url, "application/octet-stream")
    client.post(stream_url, content=b"\x00\x01\x02", headers={"Content-Type": "application/octet-stream"})
    client.post(stream_url, headers={"Stream-Closed": "true"})
    with client.stream("GET", stream_url, params={"offset": "-1", "live": "sse"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["stream-sse-data-encoding"] == "base64"
        text = "".join(response.iter_text())
    events = [block for block in text.split("\n\n") if block]
    assert (
        events[0].startswith("event: data") and base64.b64decode(events[0].split("data:", 1)[1]) == b"\0\1\2"
    )
    control = json.loads(events[1].split("data:", 1)[1])
    assert control["streamClosed"] is True and events[1].startswith("event: control")


def test_etag_gives_304_and_changes_on_close(client: httpx.Client, stream_url: str) -> None:
    create(client, stream_url)
    client.post(stream_url, content=b"x", headers={"Content-Type": "text/plain"})
    first = client.get(stream_url, params={"offset": "-1"})
    again = client.get(stream_url, params={"offset": "-1"}, headers={"If-None-Match": first.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    client.post(stream_url, headers={"Stream-Closed": "true"})
    after_close = client.get(
        stream_url, params={"offset": "-1"}, headers={"If-None-Match": first.headers["etag"]}
    )
    assert after_close.status_code == 200 and after_close.headers["stream-closed"] == "true"


def test_idempotent_producer_over_the_wire(client: httpx.Client, stream_url: str) -> None:
    create(client, stream_url)
    headers = {"Content-Type": "text/plain", "Producer-Id": "p1", "Producer-Epoch": "0", "Producer-Seq": "0"}
    assert client.post(stream_url, content=b"a", headers=headers).status_code == 200
    retry = client.post(stream_url, content=b"a", headers=headers)
    assert retry.status_code == 204 and retry.headers["producer-seq"] == "0"
    gap = client.post(stream_url, content=b"c", headers={**headers, "Producer-Seq": "5"})
    assert gap.status_code == 409 and gap.headers["producer-expected-seq"] == "1"
    assert client.get(stream_url, params={"offset": "-1"}).content == b"a"


def test_cors_preflight_allows_if_none_match(client: httpx.Client, stream_url: str) -> None:
    response = client.options(
        stream_url, headers={"Origin": "https://app.example", "Access-Control-Request-Method": "GET"}
    )
    assert response.status_code == 204
    assert "if-none-match" in response.headers["access-control-allow-headers"].lower()
    assert response.headers["x-content-type-options"] == "nosniff"


def test_https_negotiates_h2_with_alpn(tls_server: tuple[ServerProcess, Path], stream_url: str) -> None:
    process, ca = tls_server
    with httpx.Client(
        base_url=process.url, http2=True, verify=ssl.create_default_context(cafile=str(ca))
    ) as tls_client:
        created = tls_client.put(stream_url, headers={"Content-Type": "text/plain"})
        assert created.status_code == 201 and created.http_version == "HTTP/2"
        tls_client.post(stream_url, content=b"secure", headers={"Content-Type": "text/plain"})
        assert tls_client.get(stream_url, params={"offset": "-1"}).content == b"secure"
    with httpx.Client(base_url=process.url, verify=ssl.create_default_context(cafile=str(ca))) as h1:
        assert h1.get("/healthz").http_version == "HTTP/1.1"


def test_a_recreated_stream_shares_no_offsets_or_cached_reads_with_its_predecessor(
    client: httpx.Client, stream_url: str
) -> None:
    create(client, stream_url)
    old = client.post(stream_url, content=b"old incarnation", headers={"Content-Type": "text/plain"})
    old_token = old.headers["stream-next-offset"]
    middle = old_token[:17] + f"{4:016d}"
    chunk = client.get(stream_url, params={"offset": middle})
    assert chunk.content == b"incarnation" and chunk.headers["cache-control"].startswith("public, max-age=60")
    entry = client.get(stream_url, params={"offset": "-1"})
    assert entry.headers["cache-control"] == "public, no-cache"  # the same URL for every incarnation
    assert client.delete(stream_url).status_code == 204
    create(client, stream_url)
    client.post(stream_url, content=b"new stream, longer", headers={"Content-Type": "text/plain"})
    stale = client.get(stream_url, params={"offset": middle})
    assert stale.status_code == 410 and stale.json()["error"]["code"] == "offset_of_deleted_stream"
    fresh = client.get(stream_url, params={"offset": "-1"})
    assert fresh.content == b"new stream, longer" and fresh.headers["stream-next-offset"][:16] != middle[:16]
    by_hand = client.get(stream_url, params={"offset": "0000000000000000_0000000000000004"})
    assert by_hand.content == b"stream, longer"  # a token without incarnation means this one
