"""The Zarr v3 feature store (docs/contracts.md, section 4): one shard per (backbone, client,
split).

- `layout`: the format tag, where groups live, root metadata, locks, consolidated metadata
- `writer`: creating, writing, finalising shards (what `embedcache extract` calls)
- `checked_reads`: the chunk/row digests and the reads checked against them
- `chunk_files` / `zstd_prefix`: whole chunks of the writer's layout read straight from their
  files (a padded edge chunk: only its rows decoded), so many small shards cost no zarr calls
- `reader`: `open_store`, `load_split`, `iter_split_chunks` (numpy + zarr only)
- `maintenance`: `inspect`, `verify [--repair]`, `gc`, `rm`
- `import_sources` / `importer`: reading foreign feature files / writing them in as shards
- `export`: every shard to HDF5 or an npz directory

Nothing is imported here, so reading the store never loads the writer."""
