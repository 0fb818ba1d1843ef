"""The README's Python client examples run as written: the producer, then the reader, each as its
own program against a real server, with only the server's address changed."""

from __future__ import annotations

import re
import subprocess
import sys

from ops.serverproc import ROOT, ServerProcess

README = ROOT / "README.md"


def examples() -> list[str]:
    section = README.read_text().split("## Python client", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def run(code: str, url: str) -> str:
    program = code.replace("http://127.0.0.1:4437", url)
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_readme_producer_and_reader_run_as_written(server: ServerProcess) -> None:
    producer, reader = examples()
    assert "shop/orders" in producer and "shop/orders" in reader
    url = server.url
    run(producer, url)
    output = run(reader, url)
    assert output.rstrip().endswith("closed; total 9500.00"), output[-500:]
    assert "up to offset" in output
