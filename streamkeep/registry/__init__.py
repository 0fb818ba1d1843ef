"""`__registry__`: a JSON stream, kept by the server, that lists every live stream.

- `entries.py`: its name, its messages (State Protocol, in the shape upstream's `registry-hook`
  writes and its test-ui reads) and which requests on it are refused. No I/O.
- `keeper.py`: keeps it equal to the streams in storage: an entry per create and delete, told by
  the stream actors; a reconciliation at start and after a failed write.

In a cluster one member keeps it for all (streamkeep/cluster/registry.py); the others relay to it.
"""
