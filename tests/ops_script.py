"""Runs an `ops/` script as a person would (`python -m ops.NAME ... --json FILE`) and reads its report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ops.serverproc import ROOT


def run_with_json(module: str, *args: str, out: Path, timeout: float = 120) -> tuple[str, Any]:
    """The script's output and the JSON it wrote to `out`; fails the test if it exited non-zero."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(out.read_text())
