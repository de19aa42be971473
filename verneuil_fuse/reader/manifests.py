"""Manifest blobs on the reader's disk: `ManifestCache`.

The catalog keeps a few hundred decoded manifests in memory; this module
keeps the blobs they were decoded from (chunk lists, bundled chunks) on disk,
so that a database that went idle leaves memory and is decoded again at its
next open without a GET, and so that a remount, or another mount of the same
store on the host, finds the manifests it has seen before.

It is a `diskcache.Cache` (SQLite index, bounded, safe across processes) in
``<cache_dir>/manifests``. Entries are keyed by the store and the manifest
key and hold what the store's listing said of the blob (size, mtime), when it
was fetched, the version it decodes to (its contents fingerprint, hex) and
the blob itself, exactly as the store gave it: it is decoded and validated
again on every use, like a blob from the store: one that does not decode
(a crash with delayed allocation leaves zeroed blocks) is dropped
(`drop`) and the store asked again, never taken for the store's answer.

Every method is blocking (a SQLite transaction, a file read): the catalog
calls them from a worker thread. Errors of the cache (a full or broken disk)
are logged and make it answer "not cached": the store stays the source. Like
the chunk cache beside it, it keeps its file system's reserve free: a blob
that would eat into it is not kept (`skipped`).
"""
from __future__ import annotations

import logging
import os
from typing import NamedTuple

import diskcache

from verneuil_fuse.reader.segments import disk_room

log = logging.getLogger(__name__)

# Bound of the manifests kept on disk. A small database's manifest is ~10 KB
# (chunk 0 bundled, zstd), a 1 GiB one's ~300 KB: 256 MiB keeps every
# manifest of a fleet of ~25,000 small databases, beside a chunk cache of
# gigabytes.
MANIFEST_CACHE_BYTES = 256 << 20
# How long a call waits for another process's transaction on the index before
# it gives up and answers "not cached" (diskcache's default is 60 s, far more
# than a FUSE request should wait for a cache).
TIMEOUT_SECONDS = 2.0
SUBDIR = "manifests"
# Room wanted past a blob's own bytes before it is kept: diskcache's SQLite
# index and its write-ahead log grow by some pages per entry and the log
# reaches a few hundred KiB between checkpoints.
WRITE_SLACK_BYTES = 512 << 10


class Cached(NamedTuple):
    size: int  # listed size of the blob
    mtime: float  # listed mtime of the blob
    fetched_at: float  # when it was fetched from the store
    version: str  # contents fingerprint it decodes to, hex
    blob: bytes


def _well_formed(value: object) -> bool:
    """Whether a cached value has the shape of a `Cached` record."""
    if not isinstance(value, tuple) or len(value) != len(Cached._fields):
        return False
    size, mtime, fetched_at, version, blob = value
    return (isinstance(size, int) and isinstance(mtime, (int, float)) and isinstance(fetched_at, (int, float))
            and isinstance(version, str) and isinstance(blob, bytes))


class ManifestCache:
    """Manifest blobs of one store, on disk, bounded (see module docstring)."""

    def __init__(self, cache_dir: str, store_id: str, size_limit: int = MANIFEST_CACHE_BYTES):
        self.directory = os.path.join(cache_dir, SUBDIR)
        self.store_id = store_id
        self.hits = 0
        self.misses = 0
        self.errors = 0
        self.skipped = 0
        self._cache = diskcache.Cache(self.directory, size_limit=size_limit, timeout=TIMEOUT_SECONDS,
                                      eviction_policy="least-recently-used")

    def get(self, key: str) -> Cached | None:
        try:
            value = self._cache.get((self.store_id, key))
        except Exception as e:  # noqa: BLE001 - a broken cache is a miss
            self.errors += 1
            log.warning("manifest cache %s: cannot read %s (%s): dropped, read from the store",
                        self.directory, key, e)
            self.drop(key)
            return None
        if value is None:
            self.misses += 1
            return None
        if not _well_formed(value):
            self.errors += 1
            log.warning("manifest cache %s: the entry of %s is damaged: dropped, read from the store",
                        self.directory, key)
            self.drop(key)
            return None
        self.hits += 1
        return Cached(*value)

    def drop(self, key: str) -> None:
        """Delete the entry of ``key`` (a damaged one): the store is asked
        next time."""
        try:
            self._cache.delete((self.store_id, key))
        except Exception as e:  # noqa: BLE001 - the store stays the source
            self.errors += 1
            log.warning("manifest cache %s: cannot drop %s: %s", self.directory, key, e)

    def put(self, key: str, entry: Cached) -> None:
        room = disk_room(self.directory)
        if room is not None and room < len(entry.blob) + WRITE_SLACK_BYTES:
            self.skipped += 1
            log.debug("manifest cache %s: no room past the disk's reserve: %s not kept", self.directory, key)
            return
        try:
            self._cache.set((self.store_id, key), tuple(entry))
        except Exception as e:  # noqa: BLE001 - the store stays the source
            self.errors += 1
            log.warning("manifest cache %s: cannot keep %s: %s", self.directory, key, e)

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "errors": self.errors, "skipped": self.skipped}

    def close(self) -> None:
        self._cache.close()
