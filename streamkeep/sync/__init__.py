"""`streamkeep sync`: a bridge process between streamkeep and Postgres, both ways, exactly once.

It talks to streamkeep only over HTTP through `streamkeep.client` (so it works through a cluster's
front door and with auth) and to Postgres through psycopg (`pip install 'streamkeep[postgres]'`).

- `config`: sync.toml, checked whole at start.
- `source/`: Postgres -> stream, one `[[pg_to_stream]]` mapping per logical replication slot.
- `sink/`: stream -> Postgres, one `[[stream_to_pg]]` mapping per stream.
- `process`: runs every mapping in one trio nursery, serves /metrics and /healthz, stops on SIGTERM.
"""
