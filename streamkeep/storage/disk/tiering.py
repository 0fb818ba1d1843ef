"""What the disk storage asks of a cold tier. The archiver (streamkeep/storage/cold/archiver.py)
implements it and depends on the disk storage; the disk storage knows only this, so the interface
lives here, with the side that uses it, and storage/cold/ may import storage/disk/, never the
other way round."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class ColdTier(Protocol):
    def sealed(self) -> None:
        """A segment was sealed: there may be something to upload."""
        ...

    def appends_blocked(self) -> str | None:
        """Why appends must wait (sealed bytes piling up while the bucket is unreachable), or None."""
        ...

    async def read(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes at `start` of an object; raises on any failure, never returns less."""
        ...

    def forget(self, pending: Path | None, keys: list[str]) -> None:
        """The objects of a deleted stream: delete them (`pending` lists them durably until done)."""
        ...
