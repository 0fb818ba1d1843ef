"""Synchronous replication of a member's data directory to its follower (docs/scaling.md §4).

`mirror` is the owner's side (a FileSystem that sends every change of the data directory down an
ordered channel and makes each sync wait for the follower's), `follower` applies that channel to a
copy, `wire` is the frame format between them, `roles` decides with etcd who owns and who follows.
"""
