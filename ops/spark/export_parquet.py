"""Export the archive to Parquet, partitioned by stream and day of append.

python -m ops.spark.export_parquet DATA_DIR OUT_DIR [--streams 'events/*']
"""

from __future__ import annotations

import argparse
import sys

from ops.spark.common import load, session, source_arguments


def main(argv: list[str] | None = None) -> int:
    from pyspark.sql import functions as F

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source_arguments(parser)
    parser.add_argument("out", help="Parquet output directory (replaced)")
    args = parser.parse_args(argv)
    spark = session("streamkeep-export", args.master)
    messages = load(spark, args).withColumn("day", F.to_date("append_time"))
    messages.write.mode("overwrite").partitionBy("stream", "day").parquet(args.out)
    print(f"exported {spark.read.parquet(args.out).count()} messages to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
