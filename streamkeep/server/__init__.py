"""The request path, with no HTTP library in it: what happens between the edge's `Request` and
its `Response`.

- `service.py`: `Service`, the pipeline (authenticate, classify, place, authorize, dispatch,
  finish) and the stream operations' handlers.
- `finish.py`: what every response carries, and its accounting.
- `reads.py`: catch-up reads; `live.py`: long-poll and SSE; `fanout.py`: one read and one
  encoding of each change for all of a stream's live readers.
- `forwarding.py`: the cluster's front door and the views that span members.
- `probes.py`: `/healthz`, `/readyz`, `/stats`, `/metrics`.
- `admin.py`: the stream browser's JSON API.
"""
