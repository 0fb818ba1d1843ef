"""One trio task per stream (`StreamActor`), spawned and hibernated by a `Supervisor`."""
