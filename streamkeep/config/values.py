"""Parsers for setting values: one syntax for every duration and every size, wherever a value
comes from (flags, DS_* variables, TOML)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any


class ConfigError(Exception):
    pass


# One syntax for every size and every duration, whichever layer a value comes from. A number in
# TOML is taken as it is; text is a plain number or a number with a unit.
SIZE_SYNTAX = "bytes or 256KiB, 64MiB, 1GiB, 1TiB"
DURATION_SYNTAX = "seconds or 500ms, 90s, 15m, 12h, 7d, 2w"

# K, KB and KiB all mean 1024: sizes have always been binary here, whichever spelling was used.
_SIZE = re.compile(r"(?i)\s*(\d+)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|tib)?\s*")
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DURATION = re.compile(r"(?i)\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d|w)?\s*")
_DURATION_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def byte_size(value: Any) -> int:
    """Bytes from a whole number or `256KiB`, `64MiB`, `1GiB`, `1TiB`."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"is not a size; use {SIZE_SYNTAX}")
        return value
    match = _SIZE.fullmatch(str(value)) if isinstance(value, str) else None
    if not match:
        raise ValueError(f"is not a size; use {SIZE_SYNTAX}")
    return int(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()[:1]]


def _seconds(value: Any, off: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    else:
        match = _DURATION.fullmatch(value) if isinstance(value, str) else None
        if not match:
            raise ValueError(f"is not a duration; use {off}{DURATION_SYNTAX}")
        number = float(match.group(1)) * _DURATION_UNITS[(match.group(2) or "").lower()]
    if not 0 <= number < float("inf"):  # also refuses NaN
        raise ValueError(f"is not a duration; use {off}{DURATION_SYNTAX}")
    return number


def duration(value: Any) -> float:
    """Seconds, more than 0, from a number or `500ms`, `90s`, `15m`, `12h`, `7d`, `2w`."""
    number = _seconds(value, "")
    if number == 0:
        raise ValueError(f"is not a positive duration; use {DURATION_SYNTAX}")
    return number


def duration_or_off(value: Any) -> float:
    """As `duration`, where 0 turns the setting off."""
    return _seconds(value, "0 (off), ")


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("is not a boolean; use true or false (or 1, 0, yes, no, on, off)")


def _whole(value: Any, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*\d+\s*", value, re.ASCII):
        return int(value)
    raise ValueError(f"is not {what}")


def positive_int(value: Any) -> int:
    number = _whole(value, "a whole number of at least 1")
    if number < 1:
        raise ValueError("is not a whole number of at least 1")
    return number


def port(value: Any) -> int:
    number = _whole(value, "a port; use 0 to 65535 (0 picks a free one)")
    if not 0 <= number <= 65535:
        raise ValueError("is not a port; use 0 to 65535 (0 picks a free one)")
    return number


def text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("is not a string")
    return value


def one_of(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"is not one of {', '.join(choices)}")
        return str(value)

    return check


def s3_url(value: Any) -> str:
    text_value = str(value)
    if text_value and not re.fullmatch(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?", text_value):
        raise ValueError(
            "is not s3://BUCKET or s3://BUCKET/PREFIX (bucket names: lower-case, digits, dots, dashes)"
        )
    return text_value


def non_negative(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if isinstance(value, bool) or not 0 <= number < float("inf"):
        raise ValueError("is not 0 (off) or a positive number")
    return number


def optional_port(value: Any) -> int | None:
    if value is None or value == "":
        return None
    return port(value)


def cors_origins(value: Any) -> str:
    origins = [origin.strip() for origin in str(value).split(",") if origin.strip()]
    if not origins:
        raise ValueError("is not * or a comma-separated list of origins like https://app.example.com")
    if "*" in origins and len(origins) > 1:
        raise ValueError("mixes * with origins: * allows every origin, so give * alone or a list of origins")
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"https?://[^/\s,]+", origin):
            raise ValueError(f"holds {origin!r}, which is not an origin (scheme://host[:port], no path)")
    return ",".join(origins)


def jwks_location(value: Any) -> str:
    location = str(value).strip()
    if not location or location.startswith("https://"):
        return location
    if "://" in location:
        raise ValueError(
            "is not an https:// URL or a local file path (keys fetched over plain http can be forged)"
        )
    return location


def existing_file(value: Any) -> str:
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise ValueError(f"names no readable file ({path})")
    return str(path)
