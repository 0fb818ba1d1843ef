"""The on-disk format of a stream directory, shared by the disk store and readers such as Spark
(docs/segment-format.md is the specification): `format` (segment records), `layout` (file and
object names), `floor` (`floor.cbor`), `manifest` (`cold.cbor` and index sidecars). Codecs only:
no I/O through the server's file system, and nothing here imports `streamkeep.storage`.
`spark/` is the PySpark data source built on them."""
