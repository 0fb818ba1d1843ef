"""Which Python Spark's workers run for the streamkeep data source, and a check that they can load it.

Spark runs a data source's code in Python workers, started with the interpreter the SparkContext
took from `PYSPARK_PYTHON` when it started (else `python3` from PATH). That interpreter must import
streamkeep and its compiled dependency cbor2, or the first read fails deep in a worker with
`ModuleNotFoundError: No module named 'cbor2'`. `register()` (in `source.py`) uses this module to:

- in local mode with no interpreter chosen, run the source's workers on the driver's own
  interpreter (`sys.executable`, which just imported streamkeep); PySpark captures the interpreter
  in each Python function it registers, so this changes the streamkeep source only, not the
  session's UDFs;
- run one tiny read through the source (planned in the driver's Python worker, read in an
  executor's), once per application and interpreter, and turn a failure into SparkSetupError with
  one line saying what to set.

Nothing here imports pyspark: the caller passes its session in.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

SPARK_DEFAULT_PYTHON = "python3"  # pyspark's SparkContext: os.environ.get("PYSPARK_PYTHON", "python3")
PROBE_OPTION = "_streamkeep_probe"  # a read that only checks the workers can load the source
GUIDE_LOCAL = "docs/cold-and-spark.md, 'Spark over the archive'"
GUIDE_CLUSTER = "docs/cold-and-spark.md, 'Spark on a cluster'"

# (application id, interpreter) pairs whose workers loaded the source: later register() calls
# (a second session, a notebook cell run again) skip the probe job.
_checked: set[tuple[str, str]] = set()


class SparkSetupError(RuntimeError):
    """Spark's Python workers cannot load the streamkeep data source; the message says what to set."""

    def __init__(self, message: str, worker_error: str = "") -> None:
        super().__init__(message)
        self.worker_error = worker_error  # Spark's own report, for when the one line is not enough


def context(spark: Any) -> Any:
    """The session's SparkContext; None under Spark Connect, where the client has none."""
    try:
        return spark.sparkContext
    except Exception:  # Connect raises PySparkNotImplementedError (or AttributeError on old clients)
        return None


def is_local(sc: Any) -> bool:
    """local, local[n], local[*] and local-cluster[...]: every worker runs on this machine."""
    return sc is not None and str(sc.master).startswith("local")


def worker_python(sc: Any) -> str | None:
    """The interpreter the source's workers should run: the driver's own in local mode when nobody
    chose one (PySpark would start `python3` from PATH, often another installation without
    streamkeep), else whatever the context took. None under Spark Connect (the server decides)."""
    if sc is None:
        return None
    chosen = sc.pythonExec
    nobody_chose = (
        chosen == SPARK_DEFAULT_PYTHON
        and not os.environ.get("PYSPARK_PYTHON")
        and not sc.getConf().get("spark.pyspark.python")
    )
    if is_local(sc) and nobody_chose and sys.executable:
        return sys.executable
    return chosen


def register_with(spark: Any, source: type, python: str | None) -> None:
    """`spark.dataSource.register(source)`, its workers running `python`. PySpark copies
    `sc.pythonExec` into the function it registers (pyspark.sql.udf._wrap_function), and the JVM
    starts every worker of the source (planning, reading, streaming) with that copy; so swapping it
    for the call is enough, and restoring it keeps the session's other Python code as it was."""
    sc = context(spark)
    if sc is None or python is None or python == sc.pythonExec:
        spark.dataSource.register(source)
        return
    chosen, sc.pythonExec = sc.pythonExec, python
    try:
        spark.dataSource.register(source)
    finally:
        sc.pythonExec = chosen


def check(spark: Any, python: str | None) -> None:
    """Loads the source once per application and interpreter, reading nothing; raises
    SparkSetupError if a worker cannot load it.

    `load()` alone starts a Python worker on the driver (Spark asks the source for its schema
    there); the probe option makes it import what reading needs too. In local mode that is the
    interpreter and machine every worker runs on, so it is the whole check (about a second; a
    collect() would add the first job's start-up, ~4 s, to register()). Elsewhere executors have
    their own Python: one task, on one of them, reads nothing too."""
    sc = context(spark)
    key = (sc.applicationId if sc is not None else str(getattr(spark, "session_id", id(spark))), python or "")
    if key in _checked:
        return
    try:
        probe = spark.read.format("streamkeep").option(PROBE_OPTION, "true").load()
        if not is_local(sc):
            probe.collect()
    except Exception as error:
        raise explain(error, sc, python) from None  # one line, not Spark's pages (kept on the error)
    _checked.add(key)


def _how_chosen(sc: Any, python: str) -> str:
    if os.environ.get("PYSPARK_PYTHON") == python:
        return "PYSPARK_PYTHON"
    if sc is not None and sc.getConf().get("spark.pyspark.python") == python:
        return "spark.pyspark.python"
    if python == SPARK_DEFAULT_PYTHON:
        return "Spark's default, as PYSPARK_PYTHON is unset"
    if python == sys.executable:
        return "the driver's own interpreter, in local mode"
    return "PYSPARK_PYTHON when the SparkContext started"


def explain(error: Exception, sc: Any, python: str | None) -> SparkSetupError:
    """One line for a probe that failed: what the workers lack, and what to set."""
    report = str(error)
    workers = "Spark's Python workers" + (f" ({python}, {_how_chosen(sc, python)})" if python else "")
    late = os.environ.get("PYSPARK_PYTHON")
    if late and python is not None and late != python and sc is not None:
        # Set after the context started: Spark never saw it.
        hint = (
            f"PYSPARK_PYTHON={late} was set after the SparkContext started; set it before the "
            "first SparkSession (or stop the session and build a new one)"
        )
        return SparkSetupError(f"streamkeep: {workers} cannot load the data source: {hint}", report)
    here = sys.executable or "python3"
    see = GUIDE_LOCAL if is_local(sc) else GUIDE_CLUSTER
    if is_local(sc) and python == here:
        # The workers run this very interpreter: it lacks numpy or pyarrow, or this driver imported
        # streamkeep from a path the workers do not get (sys.path edited in the script).
        fix = f"install into it: {here} -m pip install 'streamkeep[spark]' (or -e '.[spark]' in a checkout)"
    elif is_local(sc):
        fix = f"set PYSPARK_PYTHON={here} (this interpreter) before the SparkSession starts"
    else:
        fix = (
            "give the workers an environment with pip install 'streamkeep[spark]' (e.g. a venv-pack "
            "archive in spark.archives, PYSPARK_PYTHON=./environment/bin/python) before the "
            "SparkSession starts"
        )
    versions = re.search(r"different version:? (\d+\.\d+)\D+?(\d+\.\d+)", report)
    if "PYTHON_VERSION_MISMATCH" in report and versions:
        worker, driver = versions.groups()
        message = (
            f"streamkeep: {workers} are Python {worker} but this driver is Python {driver} (Spark "
            f"needs the same minor version): {fix} ({see})"
        )
        return SparkSetupError(message, report)
    missing = re.search(r"No module named '([^']+)'", report)
    if missing:
        module = missing.group(1)
        if module.split(".")[0] == "streamkeep" and not is_local(sc):
            # Pure Python, so it can travel with the job; as a .zip: PySpark puts only .zip, .egg
            # and .jar files of --py-files / addPyFile on the workers' sys.path, not .whl.
            fix += (
                ", or, if the workers already have cbor2, pyarrow and numpy, ship streamkeep's wheel "
                "renamed to .zip with --py-files (or SparkContext.addPyFile, before register())"
            )
        message = f"streamkeep: {workers} cannot import {module}: {fix} ({see})"
        return SparkSetupError(message, report)
    program = re.search(r'Cannot run program "([^"]+)"', report)
    if program:
        # The JVM could not start the interpreter at all. The source plans each read in a Python
        # worker on the driver, so a path valid only on executors (./environment/bin/python of an
        # --archives environment, in client mode) fails here first.
        where = (
            f"{fix}"
            if is_local(sc)
            else "make that path valid where the driver runs too (in client mode, unpack the "
            "--archives environment there as well), or use cluster mode"
        )
        message = (
            f"streamkeep: {workers} cannot start: no such program where the driver runs "
            f"(the source plans reads in a Python worker there); {where} ({see})"
        )
        return SparkSetupError(message, report)
    message = (
        f"streamkeep: {workers} could not load the data source ({_reason(report, error)}); if they "
        f"lack streamkeep, {fix} ({see}); register(spark, check=False) skips this check; "
        "Spark's report is in this error's worker_error"
    )
    return SparkSetupError(message, report)


def _reason(report: str, error: Exception) -> str:
    """The line of Spark's report that says what failed: a Python traceback's last exception, else
    the first Java one, else its first line."""
    lines = [line.strip() for line in report.splitlines() if line.strip()]
    found = [line for line in lines if re.match(r"^:?\s*[\w.]+(Error|Exception): ", line)]
    if found:
        chosen = found[-1] if "Traceback (most recent call last)" in report else found[0]
        return chosen.lstrip(": ")[:300]
    return lines[0][:300] if lines else type(error).__name__
