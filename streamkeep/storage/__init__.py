"""Where streams are kept. Every layer above uses only the interfaces at this level; a backend
is one folder behind them, chosen once when the server is assembled.

    base.py        the interfaces: Storage, StreamLog, AppendRecord, Commit, ReadResult, ByteBudget
    errors.py      storage failures and how they become protocol errors (404, 410, 503, 507)
    forks.py       reads and pins through a fork's chain of sources, over any backend
    files.py       the FileSystem every file operation goes through (so faults can be injected)
    memory.py      the in-memory backend (MemoryStorage)
    disk/          the disk backend: DiskStorage and each stream's DiskLog (commit protocol and
                   sealing in log.py, reads, retention steps), the group committer, segment
                   writer, recovery, the data directory, retention's policy, and what it asks of a
                   cold tier (tiering.py)
    cold/          the cold tier behind it: the bucket (store.py), the archiver, the upload
                   bookkeeping on a disk log, and the format migration of bucket keys

Imports go downwards only: cold/ may import disk/, disk/ never imports cold/; neither is imported
by the top level here. The on-disk format itself (records, names, floor and manifest codecs) is
streamkeep/segments/, below all of this.
"""
