"""Torture tests of streamkeep (issue 11): seeded operations and faults, every answer judged against
one reference model of the protocol (history.py, model.py, checker.py, operations/), in two tiers:
a real server process (blackbox.py; or, with `--cluster N`, N members behind HAProxy killed one at a
time, cluster.py and membership.py) and a deterministic in-process simulation (sim.py, on the
simulated file system, threads and S3 of simfs.py, simthreads.py, sims3.py)."""
