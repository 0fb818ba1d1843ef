"""Segment files: the on-disk record format (`format`), shared by the disk store and readers such
as Spark. docs/segment-format.md is the specification."""
