"""The retention rules and compaction both torture tiers run with (unless `--no-retention`).

Per family of stream names, so every kind of floor happens in one run: JSON streams (State
Protocol changes, ops/torture/payloads.py) are compacted and their floor moves only with a
snapshot; text streams are held to a size, binary ones to an age; forks of either kind get the
same as their family would (JSON compacted, the rest by size); TTL streams keep everything.
Sizes are in segments of the tier (`segment_bytes`), so both tiers drop and compact as often.
"""

from __future__ import annotations

from typing import Any


def rules(segment_bytes: int) -> list[dict[str, Any]]:
    compact = {"compact": "state", "compact_ratio": 2.0, "compact_min_bytes": segment_bytes // 2}
    return [
        {"streams": "json/**", "max_age": None, "max_bytes": None, **compact},
        {"streams": "fork/**", "max_age": None, "max_bytes": 2 * segment_bytes, **compact},
        {"streams": "txt/**", "max_age": None, "max_bytes": 2 * segment_bytes},
        {"streams": "bin/**", "max_age": 20.0, "max_bytes": None},
    ]


def toml(segment_bytes: int) -> str:
    """The same rules as `[[retention]]` tables, for a server process."""
    out = []
    for rule in rules(segment_bytes):
        out.append("[[retention]]")
        for key, value in rule.items():
            if value is None:
                continue
            out.append(f"{key} = {value!r}".replace("'", '"'))
        out.append("")
    return "\n".join(out)
