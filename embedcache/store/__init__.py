"""The Zarr v3 feature store (docs/contracts.md, section 4): one shard per (backbone, client,
split).

- `layout`: the format tag, where groups live, root metadata, locks, consolidated metadata
- `writer`: creating, writing, finalising shards (what `embedcache extract` calls)
- `checked_reads`: the chunk/row digests and the reads checked against them
- `reader`: `open_store`, `load_split`, `iter_split_chunks` (numpy + zarr only)
- `maintenance`: `inspect`, `verify [--repair]`, `gc`, `rm`
- `import_sources` / `importer`: reading foreign feature files / writing them in as shards
- `export`: every shard to HDF5 or an npz directory

Nothing is imported here, so reading the store never loads the writer."""
