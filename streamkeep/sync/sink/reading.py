"""Reading the stream for a sink: a task that reads from the stored offset and hands each `Batch`
(or how the reading ended) to the applier through a small channel, so the next answer is read
while the last one is written to Postgres."""

from __future__ import annotations

from dataclasses import dataclass

import trio

from streamkeep.client import Batch, LiveMode, Stream, StreamGone, StreamNotFound


@dataclass(frozen=True)
class Gone:
    """410: the stream was re-created, or retention dropped the offset we asked for."""

    error: StreamGone


@dataclass(frozen=True)
class NotFound:
    """404: the stream was deleted."""


@dataclass(frozen=True)
class Failed:
    """Any other failure (the server unreachable past the client's retries ...): transient."""

    error: Exception


@dataclass(frozen=True)
class Closed:
    """The stream is closed and everything in it was read."""


Item = Batch | Gone | NotFound | Failed | Closed


async def read_into(
    stream: Stream, offset: str, live: LiveMode, raw: bool, send: trio.MemorySendChannel[Item]
) -> None:
    """`raw`: the bodies as they came (no JSON parsing here); else messages for a JSON stream."""
    async with send:
        try:
            async with stream.read(offset=offset, live=live, json=False if raw else None) as reader:
                async for batch in reader:
                    await send.send(batch)
            await send.send(Closed())
        except StreamGone as error:
            await send.send(Gone(error))
        except StreamNotFound:
            await send.send(NotFound())
        except Exception as error:  # handed over so the applier raises it, outside any nursery
            await send.send(Failed(error))
