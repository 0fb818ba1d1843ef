"""Settings from four layers, later winning: defaults, a TOML file, DS_* variables, CLI flags.

One table (`SETTINGS`) defines each setting once; the CLI flags, TOML keys (`[server] port`) and
environment variables (`DS_SERVER__PORT`, the style of seed 000) are all derived from it. Bad values
fail at start with a message that names the setting and where it came from.

`values.py` parses values (one syntax for every duration and size), `settings.py` is the table,
and this module layers them; the names below are the package's API.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from streamkeep.config.settings import SETTINGS, Setting
from streamkeep.config.values import (
    DURATION_SYNTAX,
    SIZE_SYNTAX,
    ConfigError,
    boolean,
    byte_size,
    cors_origins,
    duration,
    duration_or_off,
    existing_file,
    jwks_location,
    non_negative,
    one_of,
    optional_port,
    port,
    positive_int,
    s3_url,
    text,
)


def _apply(values: dict[tuple[str, str], Any], setting: Setting, raw: Any, origin: str) -> None:
    try:
        values[(setting.section, setting.name)] = setting.parse(raw)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{setting.section}.{setting.name} from {origin}: {raw!r} {error}") from None


def load(
    config_file: str | None = None,
    env: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
) -> SimpleNamespace:
    """Effective settings as `settings.server.port` etc.; raises ConfigError naming the setting."""
    values: dict[tuple[str, str], Any] = {(s.section, s.name): s.default for s in SETTINGS}
    rules: list[dict[str, Any]] = []
    members: list[tuple[str, str]] = []
    replicas: list[tuple[str, str]] = []
    by_key = {(s.section, s.name): s for s in SETTINGS}
    by_key.update({(s.section, old): s for s in SETTINGS for old in s.old_names})
    if config_file:
        path = Path(config_file)
        try:
            document = tomllib.loads(path.read_text())
        except OSError as error:
            raise ConfigError(f"--config {path}: cannot read it: {error.strerror}") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"--config {path}: not valid TOML: {error}") from None
        for section, table in document.items():
            if section == "retention" and isinstance(table, list):
                rules.extend(_retention_rules(table, path))
                continue
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key {section!r} must be a [section]")
            if section == "cluster" and "members" in table:
                table = dict(table)
                members = _cluster_members(table.pop("members"), path)
            if section == "cluster" and "replicas" in table:
                table = dict(table)
                replicas = _cluster_members(table.pop("replicas"), path, "replica")
            for name, raw in table.items():
                setting = by_key.get((section, name))
                if setting is None:
                    raise ConfigError(f"{path}: unknown setting [{section}] {name}")
                _apply(values, setting, raw, str(path))
    environment = os.environ if env is None else env
    for setting in SETTINGS:
        for variable in (*setting.aliases, setting.env_var):
            if variable in environment:
                _apply(values, setting, environment[variable], f"${variable}")
    for key, raw in (cli or {}).items():
        if raw is not None:
            setting = next(s for s in SETTINGS if s.name == key or f"{s.section}_{s.name}" == key)
            _apply(values, setting, raw, setting.cli_flag)
    if values[("limits", "max_inflight_body_bytes")] < values[("limits", "max_body_bytes")]:
        raise ConfigError("limits.max_inflight_body_bytes must be at least limits.max_body_bytes")
    if values[("cold", "url")] and values[("storage", "mode")] != "disk":
        raise ConfigError("cold.url needs storage.mode disk: the cold tier archives disk segments")
    if (values[("tls", "cert")] is None) != (values[("tls", "key")] is None):
        raise ConfigError("tls.cert and tls.key go together: give both (--tls-cert and --tls-key) or neither")
    secret = values[("auth", "jwt_secret")]
    if secret and len(secret.encode()) < 32:
        # RFC 7518 §3.2: an HS256 key at least as long as the hash; shorter ones can be guessed.
        raise ConfigError("auth.jwt_secret: use at least 32 bytes (e.g. `openssl rand -base64 32`)")
    if values[("auth", "link_keys")]:
        from streamkeep.auth.links import LinkKeys

        try:
            LinkKeys.parse(values[("auth", "link_keys")])
        except ValueError as error:
            raise ConfigError(f"auth.link_keys: {error}") from None
    if values[("retention", "max_age")] or values[("retention", "max_bytes")]:
        rules.append(
            {
                "streams": "**",
                "max_age": values[("retention", "max_age")] or None,
                "max_bytes": values[("retention", "max_bytes")] or None,
            }
        )
    if rules and values[("storage", "mode")] != "disk":
        raise ConfigError("retention needs storage.mode disk: it drops segment files")
    sections: dict[str, dict[str, Any]] = {}
    for (section, name), value in values.items():
        sections.setdefault(section, {})[name] = value
    sections["retention"]["rules"] = rules
    sections["cluster"]["members"] = members
    sections["cluster"]["replicas"] = _replicas_of(replicas, members)
    cluster_secret = values[("cluster", "secret")]
    if cluster_secret and len(cluster_secret.encode()) < 32:
        raise ConfigError("cluster.secret: use at least 32 bytes (e.g. `openssl rand -base64 32`)")
    member = values[("cluster", "member")]
    if member and member not in [member_id for member_id, _ in members]:
        raise ConfigError(
            f"cluster.member {member!r} is not one of the [cluster] members "
            f"({', '.join(m for m, _ in members) or 'none listed'}): list every member in the TOML file"
        )
    _check_replication(values, member)
    return SimpleNamespace(**{section: SimpleNamespace(**items) for section, items in sections.items()})


def _check_replication(values: dict[tuple[str, str], Any], member: str) -> None:
    replicas = values[("replication", "replicas")]
    if replicas == 1:
        return
    if replicas != 2:
        raise ConfigError(f"replication.replicas: 1 or 2 (not {replicas}); more copies are not built yet")
    missing = [
        flag
        for flag, key in (
            ("--cluster-member", ("cluster", "member")),
            ("--replica", ("replication", "replica")),
            ("--replication-listen", ("replication", "listen")),
            ("--etcd", ("replication", "etcd")),
            ("--cluster-secret", ("cluster", "secret")),
        )
        if not values[key]
    ]
    if missing:
        raise ConfigError(
            f"--replicas 2 needs {', '.join(missing)} (`streamkeep cluster run --replicas 2` sets them all)"
        )
    if values[("storage", "mode")] != "disk":
        raise ConfigError("--replicas 2 needs storage.mode disk: what is replicated is the data directory")
    if values[("storage", "fsync")] != "always":
        # Rounds are published before any sync under the other modes: a reader could see bytes
        # that a failover then takes back.
        raise ConfigError("--replicas 2 needs --fsync always: an append is acknowledged once on both disks")
    if values[("replication", "replica")] not in (f"{member}a", f"{member}b"):
        raise ConfigError(f"--replica must be {member}a or {member}b (the member's two replicas)")


def _replicas_of(
    replicas: list[tuple[str, str]], members: list[tuple[str, str]]
) -> dict[str, list[tuple[str, str]]]:
    """`[cluster] replicas`, by member: both of a member's replicas (`<member>a`, `<member>b`), for
    every member, or none at all (an unreplicated cluster)."""
    if not replicas:
        return {}
    by_member: dict[str, list[tuple[str, str]]] = {}
    for replica, address in replicas:
        member = replica[:-1]
        if replica[-1:] not in ("a", "b") or member not in [m for m, _ in members]:
            raise ConfigError(
                f"[cluster] replica {replica!r}: name a member's replica as <member>a or <member>b"
            )
        by_member.setdefault(member, []).append((replica, address))
    missing = [m for m, _ in members if len(by_member.get(m, [])) != 2]
    if missing:
        raise ConfigError(f"[cluster] replicas: members {', '.join(missing)} need both replicas (a and b)")
    return by_member


def _cluster_members(raw: Any, path: Path, kind: str = "member") -> list[tuple[str, str]]:
    """`members = [{id = "a", address = "127.0.0.1:7001"}, ...]` in `[cluster]` (or `replicas`)."""
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{path}: [cluster] {kind}s must be a list of {{id = ..., address = ...}} tables")
    members: list[tuple[str, str]] = []
    for number, entry in enumerate(raw, 1):
        if not isinstance(entry, dict) or set(entry) != {"id", "address"}:
            raise ConfigError(f"{path}: [cluster] {kind} number {number} needs exactly id and address")
        member_id, address = str(entry["id"]), str(entry["address"])
        host, _, port_text = address.rpartition(":")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", member_id):
            raise ConfigError(
                f"{path}: [cluster] member id {member_id!r}: use letters, digits, '_', '.', '-'"
            )
        if not host or not port_text.isdigit():
            raise ConfigError(
                f"{path}: [cluster] member {member_id!r}: address must be host:port, not {address!r}"
            )
        if member_id in [m for m, _ in members]:
            raise ConfigError(f"{path}: [cluster] member id {member_id!r} is listed twice")
        members.append((member_id, address))
    return members


def _retention_rules(tables: list[Any], path: Path) -> list[dict[str, Any]]:
    """`[[retention]]` tables: `streams` (a glob), `max_age`, `max_bytes`; the first match wins."""
    rules = []
    for number, table in enumerate(tables, 1):
        where = f"{path}: [[retention]] number {number}"
        if not isinstance(table, dict):
            raise ConfigError(f"{where} must be a table")
        known = {"streams", "max_age", "max_bytes", "compact", "compact_ratio", "compact_min_bytes"}
        unknown = set(table) - known
        if unknown:
            raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r} ({', '.join(sorted(known))})")
        compact = table.get("compact")
        if compact not in (None, "state"):
            raise ConfigError(f'{where}: compact = "state" (State Protocol streams) is the one kind there is')
        streams = table.get("streams")
        if not isinstance(streams, str) or not streams:
            raise ConfigError(f'{where} needs streams = "GLOB" (e.g. "logs/**")')
        max_age = _rule_value(table, "max_age", duration_or_off, 0.0, where)
        max_bytes = _rule_value(table, "max_bytes", byte_size, 0, where)
        ratio = _rule_value(table, "compact_ratio", _compact_ratio, 4.0, where)
        min_bytes = _rule_value(table, "compact_min_bytes", byte_size, 1 << 20, where)
        # A rule with neither limit keeps its streams whole: a way to exempt them from later rules.
        rule: dict[str, Any] = {
            "streams": streams,
            "max_age": max_age or None,
            "max_bytes": max_bytes or None,
        }
        if compact is not None:
            rule.update(compact=compact, compact_ratio=ratio, compact_min_bytes=min_bytes)
        rules.append(rule)
    return rules


def _compact_ratio(value: Any) -> float:
    try:
        number = non_negative(value)
    except ValueError:
        number = 0.0
    if number < 1:
        raise ValueError("is not a number of at least 1 (history at least the snapshot's size)")
    return number


def _rule_value(
    table: dict[str, Any], key: str, parse: Callable[[Any], Any], default: Any, where: str
) -> Any:
    if key not in table:
        return default
    try:
        return parse(table[key])
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{where}: {key} {table[key]!r} {error}") from None


def cli_dest(setting: Setting) -> str:
    return setting.name if setting.flag is None else f"{setting.section}_{setting.name}"


__all__ = [
    "DURATION_SYNTAX",
    "SETTINGS",
    "SIZE_SYNTAX",
    "ConfigError",
    "Setting",
    "boolean",
    "byte_size",
    "cli_dest",
    "cors_origins",
    "duration",
    "duration_or_off",
    "existing_file",
    "jwks_location",
    "load",
    "non_negative",
    "one_of",
    "optional_port",
    "port",
    "positive_int",
    "s3_url",
    "text",
]
