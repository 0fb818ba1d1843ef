"""streamkeep.client: a Durable Streams client, async under trio and asyncio, with a blocking facade.

    from streamkeep.client import Client

    async with Client("http://127.0.0.1:4437", http2=True) as client:
        events = client.stream("orders/eu")
        await events.create(content_type="application/json")
        await events.append({"id": 1, "total": 9.5})
        async with events.read(offset="-1", live="sse") as reader:
            async for batch in reader:           # Batch: data, messages, next_offset, closed...
                for order in batch.messages or []:
                    print(order["id"], batch.next_offset)

It imports nothing else of streamkeep (only httpx, anyio and h2), so a program that only talks to
a server loads none of the server. `streamkeep.client.sync.Client` is the same API, blocking.
"""

from streamkeep.client.client import Client
from streamkeep.client.errors import (
    BadRequest,
    Conflict,
    ConnectionFailed,
    PayloadTooLarge,
    ProtocolError,
    SequenceConflict,
    StaleEpoch,
    StreamClosed,
    StreamError,
    StreamExists,
    StreamGone,
    StreamNotFound,
    Unauthorized,
    Unavailable,
)
from streamkeep.client.http import HttpTransport, RetryPolicy
from streamkeep.client.producer import IdempotentProducer, ProducerClosed, ProducerFull, Receipt
from streamkeep.client.reader import Batch, LiveMode, Messages, Reader
from streamkeep.client.stream import AppendResult, Stream, StreamInfo

__all__ = [
    "AppendResult",
    "BadRequest",
    "Batch",
    "Client",
    "Conflict",
    "ConnectionFailed",
    "HttpTransport",
    "IdempotentProducer",
    "LiveMode",
    "Messages",
    "PayloadTooLarge",
    "ProducerClosed",
    "ProducerFull",
    "ProtocolError",
    "Reader",
    "Receipt",
    "RetryPolicy",
    "SequenceConflict",
    "StaleEpoch",
    "Stream",
    "StreamClosed",
    "StreamError",
    "StreamExists",
    "StreamGone",
    "StreamInfo",
    "StreamNotFound",
    "Unauthorized",
    "Unavailable",
]
