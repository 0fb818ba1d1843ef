"""Shared setup for the Spark jobs: a session whose Python workers can import streamkeep."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def session(app: str, master: str = "local[2]") -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from streamkeep.segments.spark import source as sk

    spark = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    sk.register(spark)
    return spark


def source_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a streamkeep data directory or s3://bucket/prefix")
    parser.add_argument("--streams", default="", help="stream names or globs, comma-separated")
    parser.add_argument("--cold-url", default="", help="the data directory's bucket, s3://bucket/prefix")
    parser.add_argument("--endpoint", default="", help="S3 endpoint (MinIO, moto); else $AWS_ENDPOINT_URL")
    parser.add_argument("--master", default="local[2]")


def load(spark: Any, args: argparse.Namespace) -> Any:
    reader = spark.read.format("streamkeep")
    for key, value in (("streams", args.streams), ("cold_url", args.cold_url), ("endpoint", args.endpoint)):
        if value:
            reader = reader.option(key, value)
    return reader.load(args.source)


def parse_job(argv: list[str] | None, doc: str | None, app: str) -> tuple[argparse.Namespace, Any]:
    """The arguments every job takes (a source and a Parquet output directory) and its session."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    source_arguments(parser)
    parser.add_argument("out", help="Parquet output directory (replaced)")
    args = parser.parse_args(argv)
    return args, session(app, args.master)
