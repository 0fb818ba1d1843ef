"""The Durable Streams protocol rules, with no I/O and no HTTP framework in them.

Everything here works on plain values: `Request` in, `Response` out, state transitions as pure
functions. The actors own state and call these rules; the HTTP edge only converts to and from them.
"""
