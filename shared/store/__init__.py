"""The feature store (docs/FORMAT.md): its layout, manifest, progress records, codecs, shard-file I/O,
the writer and the reader; the one contract between the two stages."""
