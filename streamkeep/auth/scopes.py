"""What a token allows: a set of grants over stream names, checked on every request.

A token's scope claim lists entries like `read:logs/**`, `append:metrics/*` or `admin`. Issuers put
other applications' scopes in the same claim (`openid`, `profile`, `email`), so entries this server
does not know are skipped rather than refused: refusing them would make most real tokens unusable.
Since `admin` is a bare word, an issuer shared with other applications should mint tokens with an
audience for this server (and the server should require it), or `admin` from another app leaks in.

Grants are parsed once per token (the verifier caches them with the token) and then consulted on
every request, so globs compile up front and names without a wildcard become set lookups. A token
is untrusted input until its signature is checked and an issuer may still be careless, so the
number of entries and the length of each glob are capped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from streamkeep.protocol.globs import Glob, compile_glob

ACTIONS = ("read", "append", "write", "admin")
GLOB_KINDS = ("read", "append", "write")
MAX_ENTRIES = 256
MAX_GLOB_CHARS = 1024
# The stored form of a read grant on one name taken literally (a signed link): a `*` in a stream
# name is an ordinary character there, which no glob can say. Tokens cannot use it; see from_list.
EXACT_READ = "read="

# Which kinds of grant allow an action: write implies read and append (a writer can recreate a
# stream anyway); append implies neither read nor create.
_ALLOWED_BY = {"read": ("read", "write"), "append": ("append", "write"), "write": ("write",)}


class _Matcher:
    """Does any of a fixed set of patterns match a name? Literal names are one set lookup."""

    __slots__ = ("globs", "literals")

    def __init__(self, patterns: Iterable[str], exact: Iterable[str] = ()) -> None:
        self.literals = set(exact)
        self.globs: list[Glob] = []
        for pattern in sorted(set(patterns)):
            if "*" in pattern:
                self.globs.append(compile_glob(pattern))
            else:
                # Without a wildcard the glob matcher is string equality, segment by segment.
                self.literals.add(pattern)

    def match(self, name: str) -> bool:
        return name in self.literals or any(glob.match(name) for glob in self.globs)


@dataclass(frozen=True)
class Grants:
    """Immutable and hashable; build it with `from_claim` (tokens) or `from_list` (stored)."""

    admin: bool = False
    read: frozenset[str] = frozenset()
    append: frozenset[str] = frozenset()
    write: frozenset[str] = frozenset()
    read_names: frozenset[str] = frozenset()  # names readable exactly as written, no glob
    _matchers: dict[str, _Matcher] = field(init=False, repr=False, compare=False, hash=False)

    ALL: ClassVar[Grants]
    NONE: ClassVar[Grants]

    def __post_init__(self) -> None:
        # Normalise so that equal permissions compare (and hash) equal: admin subsumes the rest.
        fields = {
            "read": self.read,
            "append": self.append,
            "write": self.write,
            "read_names": self.read_names,
        }
        for name, value in fields.items():
            object.__setattr__(self, name, frozenset() if self.admin else frozenset(value))
        matchers = {
            action: _Matcher(
                (p for kind in kinds for p in getattr(self, kind)),
                self.read_names if action == "read" else (),
            )
            for action, kinds in _ALLOWED_BY.items()
        }
        object.__setattr__(self, "_matchers", matchers)

    @classmethod
    def from_claim(cls, value: object) -> Grants:
        """Grants from a token's scope claim: a space-separated string (OAuth `scope`), a list of
        strings (`scp`, `permissions`), or None. Entries it does not know are ignored."""
        if isinstance(value, str):
            # maxsplit bounds the work on a huge claim; the unsplit remainder is dropped.
            entries: Sequence[object] = value.split(None, MAX_ENTRIES)[:MAX_ENTRIES]
        elif isinstance(value, list | tuple):
            entries = value[:MAX_ENTRIES]
        else:
            return cls.NONE
        return cls._parse(entries, exact=False)

    @classmethod
    def from_list(cls, entries: Iterable[str]) -> Grants:
        """The inverse of `to_list`, for grants stored with a subscription. Unknown entries are
        ignored too: data written by a newer version then grants less, never more."""
        if isinstance(entries, str):
            raise TypeError("Grants.from_list takes a list of entries, not a string")
        return cls._parse(list(entries)[:MAX_ENTRIES], exact=True)

    @classmethod
    def exact_read(cls, name: str) -> Grants:
        """Read on `name` alone, literally: a `*` in it matches only a `*`."""
        return cls(read_names=frozenset({name}))

    @classmethod
    def _parse(cls, entries: Sequence[object], *, exact: bool) -> Grants:
        admin = False
        globs: dict[str, set[str]] = {kind: set() for kind in GLOB_KINDS}
        names: set[str] = set()
        for entry in entries:
            if not isinstance(entry, str):
                continue
            if entry == "admin":
                admin = True
                continue
            if exact and entry.startswith(EXACT_READ):
                name = entry[len(EXACT_READ) :]
                if 0 < len(name) <= MAX_GLOB_CHARS:
                    names.add(name)
                continue
            kind, colon, pattern = entry.partition(":")
            if colon and kind in globs and 0 < len(pattern) <= MAX_GLOB_CHARS:
                globs[kind].add(pattern)
        if admin:
            return cls.ALL
        return cls(
            read=frozenset(globs["read"]),
            append=frozenset(globs["append"]),
            write=frozenset(globs["write"]),
            read_names=frozenset(names),
        )

    def allows(self, action: str, name: str) -> bool:
        """May the holder do `action` (one of ACTIONS) to the stream `name`? For `admin`, the name
        is not consulted."""
        matcher = self._matchers.get(action)
        if matcher is None:
            if action != "admin":
                # A misspelt action is a bug in the caller; answering False would hide it.
                raise ValueError(f"unknown action {action!r}; expected one of {ACTIONS}")
            return self.admin
        return self.admin or matcher.match(name)

    @property
    def is_empty(self) -> bool:
        return not (self.admin or self.read or self.append or self.write or self.read_names)

    def to_list(self) -> list[str]:
        """Canonical entries (sorted, admin alone when present), for storage and display."""
        if self.admin:
            return ["admin"]
        entries = [
            f"{kind}:{pattern}"
            for kind in ("write", "append", "read")
            for pattern in sorted(getattr(self, kind))
        ]
        entries.extend(EXACT_READ + name for name in sorted(self.read_names))
        return entries


Grants.ALL = Grants(admin=True)
Grants.NONE = Grants()
