"""The reader: replicas in a store seen as files, read lazily and verified.

- `catalog`: the tree of databases in the store and their versions, kept
  fresh by polling; `/.verneuil/stats` and `/.verneuil/metrics`.
- `past`: past states of a database (``app.db@TIME``), resolved on lookup.
- `replica`: one version of one database as a file: reads, prefetch policy.
- `btree`: SQLite b-tree pages, parsed to prefetch what a scan reads next.
- `fetcher`: chunks from memory, the disk cache or the store: single-flight,
  verified, retried, bounded (the only module here that uses threads).
- `cache`: the disk cache of chunks (segment files shared by mounts).

No pyfuse3 here: `verneuil_fuse.fs` adapts this to FUSE and
`verneuil_fuse.mount` is the program (docs/READER.md, docs/DESIGN.md).
"""
