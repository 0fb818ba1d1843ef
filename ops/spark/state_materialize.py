"""Materialize State Protocol streams (seed 001) into Parquet: the latest state per type/key.

    python -m ops.spark.state_materialize DATA_DIR OUT_DIR [--streams 'state/*']

Messages are applied in stream order per stream: insert/update store the value at type/key,
delete removes it, a `reset` control message clears the stream's state. Equivalently (and in
parallel): after a stream's last reset, each key's state is its last change, unless that change is
a delete. Messages that are neither a valid change nor a valid control message are counted as
rejected and left out. Output columns: stream, type, key, value (JSON text), offset.

A stream that retention shortened is read from its floor, as its readers see it: the state is that
of the messages kept, which is the whole state when a compaction put the floor at a snapshot.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ops.spark.common import load, parse_job

OPERATIONS = ("insert", "update", "delete")
CONTROLS = ("snapshot-start", "snapshot-end", "reset")


def classify(text: str | None) -> tuple[str, str | None, str | None, str | None]:
    """(kind, type, key, value JSON) with kind one of change-insert/-update/-delete, control-<x>,
    or rejected."""
    try:
        message = json.loads(text) if text is not None else None
    except ValueError:
        return ("rejected", None, None, None)
    if not isinstance(message, dict) or not isinstance(message.get("headers"), dict):
        return ("rejected", None, None, None)
    headers = message["headers"]
    if "control" in headers:
        control = headers["control"]
        return (
            (f"control-{control}", None, None, None)
            if control in CONTROLS
            else ("rejected", None, None, None)
        )
    operation = headers.get("operation")
    kind, key = message.get("type"), message.get("key")
    if (
        operation not in OPERATIONS
        or not isinstance(kind, str)
        or not kind
        or not isinstance(key, str)
        or not key
    ):
        return ("rejected", None, None, None)
    if operation != "delete" and "value" not in message:
        return ("rejected", None, None, None)
    return (f"change-{operation}", kind, key, json.dumps(message.get("value"), separators=(",", ":")))


def materialize(messages: Any) -> tuple[Any, int]:
    """The latest state per (stream, type, key), and the number of rejected messages."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType, StructField, StructType

    schema = StructType([StructField(n, StringType()) for n in ("kind", "type", "key", "value")])
    parsed = (
        messages.where(F.col("json").isNotNull())
        .select("stream", "offset", F.udf(classify, schema)("json").alias("m"))
        .select("stream", "offset", "m.*")
        .cache()
    )
    rejected = parsed.where(F.col("kind") == "rejected").count()
    resets = (
        parsed.where(F.col("kind") == "control-reset")
        .groupBy("stream")
        .agg(F.max("offset").alias("reset_at"))
    )
    changes = (
        parsed.where(F.col("kind").startswith("change-"))
        .join(resets, "stream", "left")
        .where(
            F.col("reset_at").isNull() | (F.col("offset") > F.col("reset_at"))
        )  # offsets sort as positions
    )
    latest = Window.partitionBy("stream", "type", "key").orderBy(F.col("offset").desc())
    state = (
        changes.withColumn("rank", F.row_number().over(latest))
        .where((F.col("rank") == 1) & (F.col("kind") != "change-delete"))
        .select("stream", "type", "key", "value", "offset")
    )
    return state, rejected


def main(argv: list[str] | None = None) -> int:
    args, spark = parse_job(argv, __doc__, "streamkeep-state-materialize")
    state, rejected = materialize(load(spark, args))
    state.write.mode("overwrite").parquet(args.out)
    rows = spark.read.parquet(args.out).count()
    print(f"state: {rows} live entities written to {args.out}; {rejected} messages rejected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
