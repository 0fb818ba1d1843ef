"""The disk backend: each stream a directory of segment files (docs/segment-format.md).

storage.py        DiskStorage: creates, deletes and recovers streams; runs the committer and syncs
log.py            DiskLog: a stream's appends (`submit`), their commit and publication, sealing
log_state.py      the state a DiskLog's parts share: accepted vs published, segments, I/O lock
log_reads.py      reads from the tail cache, segment files or the bucket
log_retention.py  the floor raised and held segments dropped, crash-safely
retention.py      the retention policy: rules, and the background pass that applies them
committer.py      group commit across streams (CommitBatch: one stream's share of a round)
writer.py         a stream's write path: a batch laid out as records, written, synced, undone
index.py          where each published record lives (Segment, RecordIndex) and the tail cache
recovery.py       start-up: every stream rebuilt from its files
directory.py      the data directory: its format marker, streams created and deleted in it
meta.py           meta.cbor
floor.py          reading and writing floor.cbor
manifest.py       reading and writing cold.cbor and index sidecars
tiering.py        ColdTier: what this backend asks of a cold tier (storage/cold/ implements it)
"""
