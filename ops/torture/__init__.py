"""Deterministic, seeded simulation of streamkeep: a simulated file system, threads and S3."""
