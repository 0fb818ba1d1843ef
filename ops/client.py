"""Small client helpers shared by the ops scripts and the tests."""

from __future__ import annotations

import httpx


def read_all(client: httpx.Client, url: str, offset: str = "-1") -> bytes:
    """Every byte of a stream from `offset`, following Stream-Next-Offset until up to date."""
    body = b""
    while True:
        response = client.get(url, params={"offset": offset})
        assert response.status_code == 200, f"{url}: {response.status_code} {response.text[:200]}"
        body += response.content
        offset = response.headers["stream-next-offset"]
        if response.headers.get("stream-up-to-date") == "true":
            return body
