"""Coordination in etcd: a small client for etcd's v3 API (`etcd.py`), and real etcd processes on
loopback for the tests and `streamkeep cluster run` (`local_etcd.py`).

Replication keeps membership, leases, the placement epoch and who owns and follows each slot in etcd
(issue 23), decided by etcd's transactions and leases rather than by a consensus of our own.
"""
