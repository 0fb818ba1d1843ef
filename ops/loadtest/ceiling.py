"""The ceiling for the edge: streamkeep's lean HTTP edge with an empty app (every request -> 204).

    python -m ops.loadtest.ceiling [--port 0]

Nothing is stored and no protocol rule runs, so what it costs per request is what the trio loop
driving h11/h2 costs: the most any streamkeep request path on this edge could reach.
"""

from __future__ import annotations

import argparse
from functools import partial

import trio

from streamkeep.http.budget import BodyBudget
from streamkeep.http.lean import EdgeLimits, serve_lean
from streamkeep.protocol.model import Request, Response
from streamkeep.service import ServiceOptions


class EmptyApp:
    """Stands in for `streamkeep.service.Service` as far as the edge can tell."""

    options = ServiceOptions()

    async def handle(self, request: Request) -> Response:
        return Response(204, [])


async def main(port: int) -> None:
    limits = EdgeLimits(
        max_body_bytes=64 << 20, body_timeout=60.0, h2_max_concurrent_streams=100, budget=BodyBudget(1 << 30)
    )
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(
            partial(
                serve_lean,
                EmptyApp(),  # type: ignore[arg-type]
                host="127.0.0.1",
                port=port,
                backlog=1024,
                limits=limits,
                ssl_context=None,
                shutdown_grace=1.0,
                shutdown=shutdown,
            )
        )
        print(f"streamkeep listening on {urls[0]}", flush=True)
        with trio.open_signal_receiver(2, 15) as signals:
            async for _ in signals:
                shutdown.set()
                return


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=0)
    trio.run(main, parser.parse_args().port)
