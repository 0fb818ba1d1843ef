"""Subscriptions (PROTOCOL.md §6-7): durable cursors over streams that wake workers by webhook or
by pull-wake.

Pure rules: `config` (validation, the configuration hash), `urls` (webhook targets); path
patterns are `protocol/globs.py`. `signing` holds the keys and tokens. The stateful part: `state`
(a subscription and its file format), `store` (saving it, or undoing a change that cannot be
saved), `links` (which streams and incarnations each follows), `delivery` (the drivers: webhooks
and pull-wake), `api` (the owners' control endpoints), `wakes` (the workers' wake endpoints and
leases), `faults` (failures told once and retried), and `manager`, which wires them together for
the server.
"""
