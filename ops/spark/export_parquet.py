"""Export the archive to Parquet, partitioned by stream and day of append.

python -m ops.spark.export_parquet DATA_DIR OUT_DIR [--streams 'events/*']

Each stream is exported from its floor on: what retention dropped is left out, even while its
files are still there (docs/segment-format.md, "Retention").
"""

from __future__ import annotations

import sys

from ops.spark.common import load, parse_job


def main(argv: list[str] | None = None) -> int:
    from pyspark.sql import functions as F

    args, spark = parse_job(argv, __doc__, "streamkeep-export")
    messages = load(spark, args).withColumn("day", F.to_date("append_time"))
    messages.write.mode("overwrite").partitionBy("stream", "day").parquet(args.out)
    print(f"exported {spark.read.parquet(args.out).count()} messages to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
