"""One verified read of chunks from a store, in either layout.

`format.chunk_source(manifest, index)` says which object, and which bytes of
it, hold a chunk's blob; this module reads them from a `Backend` and checks
what it read:

- `read_chunk(backend, source, fp)`: the blob `source` names (a whole chunk
  object, bounded by `MAX_CHUNK_BLOB_BYTES`, or a byte range of a pack),
  decoded and checked against the chunk's full 128-bit fingerprint;
- `read_run(backend, run, fps)`: the chunks of one `format.Run` (adjacent
  blobs of one pack) with a single range read, each decoded and checked on
  its own.

A range that comes back short (a pack cut or replaced) is a `ChunkError`,
as are bytes that do not verify: never wrong bytes.  Errors of the store
itself are its `StoreError`s.
"""
from __future__ import annotations

from ..format import MAX_CHUNK_BLOB_BYTES, ChunkError, ChunkSource, Fprint, Run, decode_chunk


def read_blob(backend, source: ChunkSource) -> bytes:
    """The bytes `source` names: a whole object of at most
    MAX_CHUNK_BLOB_BYTES (else `TooLarge`, unread), or exactly the range
    (else ChunkError)."""
    if source.end is None:
        return backend.get(source.key, max_bytes=MAX_CHUNK_BLOB_BYTES)
    data = backend.get_range(source.key, source.start, source.end)
    if len(data) != source.end - source.start:
        raise ChunkError("%s holds %d bytes at [%d, %d), not %d: the pack was cut or replaced"
                         % (source.key, len(data), source.start, source.end, source.end - source.start))
    return data


def read_chunk(backend, source: ChunkSource, fp: Fprint) -> tuple[int, bytes]:
    """(bytes read, the verified chunk) of chunk `fp` at `source`."""
    blob = read_blob(backend, source)
    return len(blob), decode_chunk(blob, fp)


def read_run(backend, run: Run, fps: dict[int, Fprint]) -> list[tuple[int, bytes]]:
    """(index, verified chunk) for every chunk of `run` (`fps` gives each
    index's fingerprint), read with one request: the first chunk that does
    not verify is a ChunkError."""
    if run.end is None:
        ((index, _, _),) = run.parts
        return [(index, read_chunk(backend, ChunkSource(run.key), fps[index])[1])]
    data = read_blob(backend, ChunkSource(run.key, run.start, run.end))
    return [(index, decode_chunk(data[lo:hi], fps[index])) for index, lo, hi in run.parts]
