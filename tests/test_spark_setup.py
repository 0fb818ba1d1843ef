"""Spark without surprises: what a newcomer sees when Spark's Python workers cannot load the source.

PySpark reads PYSPARK_PYTHON once, when the SparkContext starts, so each session here runs in its
own process with the environment under test. The workers' "wrong Python" is a bare venv of this
interpreter (same version, no site-packages: no cbor2, pyarrow or numpy), so the failure is the one
the issue reports and does not depend on what the machine's other Pythons happen to have.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from ops.serverproc import ROOT, launch, start
from streamkeep.segments.spark import workers

pytest.importorskip("pyspark", reason="pyspark is in the spark extra; make test installs it")

SESSION = """
from pyspark.sql import SparkSession
spark = (
    SparkSession.builder.master("local[2]")
    .config("spark.ui.enabled", "false")
    .config("spark.ui.showConsoleProgress", "false")
    .getOrCreate()
)
"""


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An interpreter like this one without any packages, checked to lack cbor2."""
    where = tmp_path_factory.mktemp("bare") / "venv"
    venv.create(where, with_pip=False)
    python = where / "bin" / "python"
    probe = subprocess.run([python, "-c", "import cbor2"], capture_output=True, text=True, check=False)
    assert probe.returncode != 0 and "No module named 'cbor2'" in probe.stderr
    return python


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory (under a folder of its own, as `./data`) holding 5 JSON messages."""
    data = tmp_path_factory.mktemp("newcomer") / "data"
    server = start("--data-dir", str(data))
    with httpx.Client(base_url=server.url, timeout=30) as client:
        headers = {"Content-Type": "application/json"}
        assert client.put("/v1/stream/events", headers=headers).status_code == 201
        for i in range(5):
            client.post("/v1/stream/events", content=json.dumps([{"i": i}]), headers=headers)
    server.stop()
    return data


def run_python(code: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the variables a newcomer would not have set (test_spark.py sets
    PYSPARK_PYTHON in this process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")}
    return {**env, **extra}


def docs_example() -> str:
    """The Python block of the Spark section of docs/cold-and-spark.md, as a newcomer would paste it."""
    page = (ROOT / "docs" / "cold-and-spark.md").read_text()
    section = page.split("## Spark over the archive", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_docs_example_works_without_setting_anything(
    tmp_path: Path, bare_python: Path, data_dir: Path
) -> None:
    # `python3` on PATH (Spark's default worker) is one without cbor2 or streamkeep, as on a machine
    # where streamkeep lives in a venv that was not activated.
    shadow = tmp_path / "bin"
    shadow.mkdir()
    (shadow / "python3").symlink_to(bare_python)
    env = clean_env(PATH=f"{shadow}{os.pathsep}{os.environ['PATH']}")
    default = subprocess.run(["python3", "-c", "import cbor2"], env=env, capture_output=True, check=False)
    assert default.returncode != 0  # so the example only works if register() picks the interpreter
    example = docs_example()
    assert "PYSPARK_PYTHON" not in example and "sk.register(spark)" in example
    after = """
import json, sys
from streamkeep.segments.spark import workers
print("RESULT", json.dumps({
    "exec": spark.sparkContext.pythonExec,
    "checked": sorted(workers._checked),
    "expected": [spark.sparkContext.applicationId, sys.executable],
}))
"""
    result = run_python(example + after, data_dir.parent, env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"\|\s*events\s*\|\s*5\s*\|", result.stdout), result.stdout
    facts = json.loads(result.stdout.split("RESULT ", 1)[1])
    assert facts["exec"] == "python3"  # the session's own UDFs keep Spark's choice
    assert facts["checked"] == [facts["expected"]]  # the check passed, on the driver's interpreter


def test_workers_without_cbor2_get_one_clear_line(bare_python: Path, data_dir: Path) -> None:
    # The repository on the workers' path, as when a checkout is the working directory: streamkeep
    # imports there, its dependency cbor2 does not (the ModuleNotFoundError).
    env = clean_env(PYSPARK_PYTHON=str(bare_python), PYTHONPATH=str(ROOT))
    code = (
        SESSION
        + f"""
import json
from streamkeep.segments.spark import source as sk
out = {{}}
try:
    sk.register(spark)
except sk.SparkSetupError as error:
    out["message"] = str(error)
    out["cause"] = repr(error.__cause__)
    out["suppressed"] = error.__suppress_context__
    out["report"] = error.worker_error
# What register() spares the user: the same read without the check fails inside Spark.
sk.register(spark, check=False)
try:
    spark.read.format("streamkeep").load({str(data_dir)!r}).count()
except Exception as error:
    out["raw"] = str(error)
print("RESULT", json.dumps(out))
"""
    )
    result = run_python(code, ROOT, env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.split("RESULT ", 1)[1])
    message = out.get("message", "")
    assert message.startswith("streamkeep: Spark's Python workers"), out
    assert f"({bare_python}, PYSPARK_PYTHON) cannot import cbor2" in message
    assert f"set PYSPARK_PYTHON={sys.executable}" in message and "before the SparkSession starts" in message
    assert "\n" not in message and out["cause"] == "None" and out["suppressed"]  # one line, no chain
    assert "No module named 'cbor2'" in out["report"]
    assert "No module named 'cbor2'" in out.get("raw", "")


def test_the_server_never_imports_spark(tmp_path: Path) -> None:
    """`pip install streamkeep` stays without pyspark: starting and serving must not import it."""
    command = [sys.executable, "-X", "importtime", "-m", "streamkeep", "serve", "--port", "0"]
    server = launch([*command, "--data-dir", str(tmp_path / "data")], env=clean_env())
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            headers = {"Content-Type": "application/json"}
            assert client.put("/v1/stream/s", headers=headers).status_code == 201
            assert client.post("/v1/stream/s", content=b"[1]", headers=headers).status_code in (200, 204)
            assert client.get("/v1/stream/s", params={"offset": "-1"}).json() == [1]
    finally:
        server.stop()
    imported = [line.rsplit("|", 1)[-1].strip() for line in server.output if line.startswith("import time:")]
    assert any(name.startswith("streamkeep") for name in imported)  # -X importtime did report
    heavy = [n for n in imported if n.split(".")[0] in ("pyspark", "py4j", "pyarrow", "numpy", "pandas")]
    assert heavy == []


def fake_context(
    master: str = "local[2]", python: str = "python3", conf: dict | None = None
) -> SimpleNamespace:
    settings = dict(conf or {})
    return SimpleNamespace(
        master=master, pythonExec=python, getConf=lambda: SimpleNamespace(get=settings.get)
    )


def test_which_python_the_source_gets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    assert workers.worker_python(fake_context()) == sys.executable
    assert workers.worker_python(fake_context("local-cluster[2,1,1024]")) == sys.executable
    assert workers.worker_python(fake_context("yarn")) == "python3"  # a cluster: Spark's choice
    chosen = fake_context(conf={"spark.pyspark.python": "/opt/py"})
    assert workers.worker_python(chosen) == "python3"
    assert workers.worker_python(fake_context(python="/opt/env/bin/python")) == "/opt/env/bin/python"
    assert workers.worker_python(None) is None  # Spark Connect: the server decides
    monkeypatch.setenv("PYSPARK_PYTHON", "/opt/env/bin/python")
    assert workers.worker_python(fake_context(python="/opt/env/bin/python")) == "/opt/env/bin/python"


def test_messages_say_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    missing = RuntimeError("Traceback ...\nModuleNotFoundError: No module named 'streamkeep'\n SQLSTATE")
    cluster = str(workers.explain(missing, fake_context("yarn"), "python3"))
    assert "cannot import streamkeep" in cluster and "pip install 'streamkeep[spark]'" in cluster
    assert "spark.archives" in cluster and "renamed to .zip with --py-files" in cluster
    local = str(workers.explain(missing, fake_context(), sys.executable))
    assert f"install into it: {sys.executable} -m pip install" in local  # it is this Python already
    mismatch = RuntimeError(
        "[PYTHON_VERSION_MISMATCH] Python in worker has different version: 3.13 than that in driver: "
        "3.11, PySpark cannot run with different minor versions."
    )
    line = str(workers.explain(mismatch, fake_context(python="/usr/bin/python3.13"), "/usr/bin/python3.13"))
    assert "are Python 3.13 but this driver is Python 3.11" in line and "set PYSPARK_PYTHON=" in line
    monkeypatch.setenv("PYSPARK_PYTHON", "/opt/env/bin/python")  # set after the context started
    late = str(workers.explain(missing, fake_context(), "python3"))
    assert "was set after the SparkContext started" in late
    for text in (cluster, local, line, late):
        assert "\n" not in text and text.startswith("streamkeep: ")


class FakeSession:
    """Records what check() asks of Spark: loads (a Python worker on the driver) and collects (a task)."""

    def __init__(self, master: str, failure: str | None = None) -> None:
        self.sparkContext = fake_context(master)
        self.sparkContext.applicationId = f"app-{master}-{failure}"
        self.calls: list[str] = []
        self.failure = failure

    @property
    def read(self) -> FakeSession:
        return self

    def format(self, name: str) -> FakeSession:
        assert name == "streamkeep"
        return self

    def option(self, key: str, value: str) -> FakeSession:
        assert (key, value) == (workers.PROBE_OPTION, "true")
        return self

    def load(self) -> FakeSession:
        self.calls.append("load")
        return self

    def collect(self) -> list:
        self.calls.append("collect")
        if self.failure:
            raise RuntimeError(self.failure)
        return []


def test_the_check_runs_a_task_only_off_local_mode_and_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    local, cluster = FakeSession("local[2]"), FakeSession("spark://master:7077")
    for session in (local, cluster, local, cluster):
        workers.check(session, "/opt/env/bin/python")
    assert local.calls == ["load"]  # the driver's worker is every worker's Python
    assert cluster.calls == ["load", "collect"]  # and once only: the second call was cached
    broken = FakeSession("yarn", "Traceback ...\nModuleNotFoundError: No module named 'cbor2'")
    for _ in range(2):  # a failure is not cached: fixing the cluster and calling again re-checks
        with pytest.raises(workers.SparkSetupError, match="cannot import cbor2: give the workers"):
            workers.check(broken, "./environment/bin/python")
    assert broken.calls == ["load", "collect"] * 2
