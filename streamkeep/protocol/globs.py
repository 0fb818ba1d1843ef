"""Globs over stream paths (subscriptions §6.2, token scopes, retention rules): `*` is one
segment, `**` zero or more segments, and a `*` inside a segment is a wildcard within that segment.

Matching runs on every publish of every stream, against patterns of up to 1 KiB that anyone may
submit, so it must never backtrack. A pattern compiles to an NFA with one state per segment (runs
of `**` collapse into one), and the set of live states is a bit mask advanced once per path
segment: O(path segments x wildcard segments) steps, whatever the pattern. Wildcards inside a
segment match greedily left to right, which is exact for `*`-only patterns and linear too.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache


class Glob:
    __slots__ = ("_accept", "_any", "_literals", "_stars", "_wildcards")

    def __init__(self, pattern: str) -> None:
        segments: list[str] = []
        for segment in pattern.split("/"):
            if not (segment == "**" and segments and segments[-1] == "**"):  # `**/**` is `**`
                segments.append(segment)
        self._accept = 1 << len(segments)  # the state after the last segment
        self._stars = 0  # states at a `**`: they may stay put while a path segment is consumed
        self._any = 0  # states at a `*`: any one segment moves them on
        self._literals: dict[str, int] = {}  # segment text -> states it moves on
        self._wildcards: list[tuple[int, Callable[[str], bool]]] = []
        for index, segment in enumerate(segments):
            bit = 1 << index
            if segment == "**":
                self._stars |= bit
            elif segment == "*":
                self._any |= bit
            elif "*" in segment:
                self._wildcards.append((bit, _segment_matcher(segment)))
            else:
                self._literals[segment] = self._literals.get(segment, 0) | bit

    def _closure(self, states: int) -> int:
        # A `**` may match nothing: its state also stands at the next segment. Runs of `**` were
        # collapsed, so one step reaches everything.
        return states | ((states & self._stars) << 1)

    def match(self, path: str) -> bool:
        states = self._closure(1)
        for segment in path.split("/"):
            moves = self._literals.get(segment, 0) | self._any
            for bit, matches in self._wildcards:
                if states & bit and matches(segment):
                    moves |= bit
            states = self._closure((states & self._stars) | ((states & moves) << 1))
            if not states:
                return False
        return bool(states & self._accept)


def _segment_matcher(pattern: str) -> Callable[[str], bool]:
    """A `*` wildcard within one segment: the text starts with the first literal part, ends with the
    last, and holds the middle parts in order between them (leftmost placement is always best)."""
    first, *middle, last = pattern.split("*")

    def matches(text: str) -> bool:
        end = len(text) - len(last)
        if end < len(first) or not text.startswith(first) or not text.endswith(last):
            return False
        position = len(first)
        for part in middle:
            found = text.find(part, position, end)
            if found < 0:
                return False
            position = found + len(part)
        return True

    return matches


@lru_cache(maxsize=1024)
def compile_glob(pattern: str) -> Glob:
    return Glob(pattern)


def glob_match(pattern: str, path: str) -> bool:
    return compile_glob(pattern).match(path)
