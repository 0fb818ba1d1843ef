"""The PySpark data source over the segment files: `source` (the Spark classes, decoding segments
into Arrow batches, streaming offsets; what Spark's workers import as
`streamkeep.segments.spark.source`), `plan` (which segments a read covers) and `workers` (which
interpreter runs them, and the check that it can). It reads the files through the segment codec
only, never through the server's storage, which does not import it."""
