"""The cold tier: sealed segments of the disk backend moved to an S3-compatible bucket.

    store.py        the bucket: ObjectStore (what the tier needs), S3Store (boto3), ColdConfig
    archiver.py     Archiver, the disk backend's ColdTier: uploads, cold reads, object deletes,
                    sealing idle segments
    bookkeeping.py  an upload's steps on a DiskLog, under its I/O lock: read (the descriptor is
                    closed before the upload), record, drop the copy
    describe.py     what the bucket holds beside the segments for `streamkeep restore --from-bucket`:
                    each stream's description and each segment's index sidecar, under PREFIX/meta/
    migrate.py      upgrades a data directory and its bucket to the current format (format 1 -> 2
                    gave bucket keys the stream's incarnation)

It builds on storage/disk/ and the disk backend knows only `disk/tiering.ColdTier`.
"""
