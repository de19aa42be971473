"""The reader: replicas in a store seen as files, read lazily and verified.

- `catalog`: the tree of databases in the store and their versions, kept
  fresh by polling, manifests read on demand and parked past a bound;
  `/.verneuil/stats` and `/.verneuil/metrics`.
- `paths`: where a manifest key is shown in the tree, and back.
- `manifests`: manifest blobs kept on disk (shared by mounts, across remounts).
- `past`: past states of a database (``app.db@TIME``), resolved on lookup.
- `replica`: one version of one database as a file: reads, prefetch hints.
- `prefetch`: the prefetch policies (sequential readahead, b-tree siblings).
- `btree`: SQLite b-tree pages, parsed to prefetch what a scan reads next.
- `fetcher`: chunks from memory, the disk cache or the store: single-flight,
  verified, retried, bounded.
- `flights`: chunk GETs queued and handed to the S3 engine in batches, and
  their answers handed back to trio.
- `cache`: the disk cache of chunks (segment files shared by mounts).

No pyfuse3 here: `verneuil_fuse.fs` adapts this to FUSE and
`verneuil_fuse.cli.mount` is the program (docs/READER.md, docs/DESIGN.md).
"""
