"""Small file systems for fault tests: a tmpfs of a given size (ENOSPC at write) and an ext4 loop
image (ENOSPC can also surface at fsync, through delayed allocation). Root only."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def ext4(path: Path, size: str) -> Iterator[Path]:
    image = path.with_suffix(".img")
    subprocess.run(["truncate", "-s", size, str(image)], check=True)
    mkfs = shutil.which("mkfs.ext4") or shutil.which("mkfs.ext4", path="/usr/sbin:/sbin") or "mkfs.ext4"
    subprocess.run([mkfs, "-q", "-F", str(image)], check=True, capture_output=True)
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        image.unlink(missing_ok=True)


def open_fds(pid: int) -> tuple[int, int]:
    """(open descriptors, descriptors on deleted files) of a process."""
    total = deleted = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        total += 1
        try:
            if fd.readlink().name.endswith(" (deleted)"):
                deleted += 1
        except OSError:
            pass
    return total, deleted
