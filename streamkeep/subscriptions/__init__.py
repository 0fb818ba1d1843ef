"""Subscriptions (PROTOCOL.md §6-7): durable cursors over streams that wake workers by webhook or
by pull-wake. `config` and `urls` are pure rules, `signing` the keys and tokens, `manager` the
stateful part."""
