"""One trio task per stream (`StreamActor`, actor.py), spawned and hibernated by a `Supervisor`,
taking typed messages (messages.py) that the stream's operations (stream_ops.py) answer."""
