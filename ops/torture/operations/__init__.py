"""Every operation a client or operator can do, as a registry of small classes.

Each operation kind has:

- `generate(ctx)`: a seeded choice of what to do next (a `Planned` HTTP call, its parameters, and
  the stream names whose state it changes, which the driver locks so state changes on one name
  never overlap), from a `ClientView`: what the clients know from the answers they got. It is the
  same in both tiers.
- `after(ctx, planned, outcome)`: the client's own bookkeeping (cursors, producer seqs, claims).
- `on_start(model, started)` and `judge(model, started, ended)`: the model update and the checks
  (ops/torture/model.py has the shared rules; the checker has already applied the ones common to
  every operation).

Executing a call is the tier's business (ops/torture/transport.py for the black box; the
in-process tier sends the same `Call` to `Service.handle`). A new feature adds a class here: its
generator, its judge, and its statuses in ops/torture/contract.py.

A tier drives it like this (ops/torture/blackbox.py is one driver):

    history = History(clock=tier_clock)
    checker = Checker(RunConfig(fsync="interval", fsync_interval=0.5))
    ctx = GenContext("w0", random.Random(f"{seed}/worker/0"), view)  # one ClientView for all
    planned = REGISTRY[kind].generate(ctx)  # None: not applicable now; hold planned.locks
    started = history.start(planned.op, ctx.worker, planned.name, planned.params, planned.call)
    outcome = send(planned.call)  # Outcome(status, keep_headers(...), body, verdict=classify(...))
    history.end(started, outcome)
    REGISTRY[planned.op].after(ctx, planned, outcome)
    history.fault("power_cut")  # faults by the kinds of contract.WINDOWS / PROCESS_FAULTS
    ...
    for event in history.since(fed): checker.observe(event)  # as it goes, or all at the end
    # at the end: a full catch-up read of every stream, params {"offset": ..., "final": True}
    checker.finish(); checker.summary()
"""

from ops.torture.operations import (
    client,
    cluster,
    probes,
    reads,
    registry,
    replication,
    streams,
    subscriptions,
)
from ops.torture.operations.base import REGISTRY, ClientView, GenContext, Operation, Planned, all_names

__all__ = [
    "REGISTRY",
    "ClientView",
    "GenContext",
    "Operation",
    "Planned",
    "all_names",
    "client",
    "cluster",
    "probes",
    "reads",
    "registry",
    "replication",
    "streams",
    "subscriptions",
]
