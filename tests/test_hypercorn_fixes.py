"""The hypercorn guard, against the smallest app that answers before reading the request body."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from streamkeep.http import hypercorn_fixes


async def answers_at_once(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"no"})


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl with HTTP/2 (Debian curl)")
async def test_data_after_response_leaves_the_worker_serving(tmp_path: Path) -> None:
    hypercorn_fixes.apply()
    body = tmp_path / "body"
    body.write_bytes(b"q" * (1 << 20))
    config = Config()
    config.bind = ["127.0.0.1:0"]
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, answers_at_once, config))
        url = binds[0]
        codes = []
        for _ in range(4):
            result = await trio.run_process(
                [
                    "curl",
                    "-s",
                    "-o",
                    "/dev/null",
                    "-m",
                    "10",
                    "-w",
                    "%{http_code}",
                    "--http2-prior-knowledge",
                    "--data-binary",
                    f"@{body}",
                    f"{url}/x",
                ],
                capture_stdout=True,
                check=False,
            )
            codes.append(result.stdout.decode())
        assert codes == ["404"] * 4
        nursery.cancel_scope.cancel()
