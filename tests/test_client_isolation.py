"""Importing streamkeep.client loads nothing of the server: a program that only talks to a server
(the Postgres bridge, a user's script) must not pay for, or depend on, trio, hypercorn or quart."""

from __future__ import annotations

import json
import subprocess
import sys


def test_importing_the_client_loads_no_server_module() -> None:
    code = (
        "import json, sys, streamkeep.client, streamkeep.client.sync; print(json.dumps(sorted(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    modules = json.loads(result.stdout)
    ours = {m for m in modules if m == "streamkeep" or m.startswith("streamkeep.")}
    assert "streamkeep.client.http" in ours  # the check sees what was imported
    assert all(m == "streamkeep" or m.startswith("streamkeep.client") for m in ours), sorted(ours)
    for foreign in ("trio", "hypercorn", "quart", "quart_trio", "httptools"):
        assert foreign not in modules, f"{foreign} was imported"
