"""Local chunk cache: a bounded diskcache keyed by chunk fingerprint.

Chunks are content-addressed, so one cache directory is shared by every
database and every mount, and survives remounts. Only chunks that were
verified against their fingerprint are stored; they are verified again when
read back (UMASH in C, cheap next to a disk read), so a damaged cache file is
dropped and refetched, never served.

Everything here blocks: the fetcher calls it from worker threads.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict

import diskcache

from verneuil_fuse.format import Fprint, fingerprint

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "/var/cache/verneuil"
DEFAULT_CACHE_SIZE = 2 << 30  # 2 GiB


def default_cache_dir() -> str:
    if os.geteuid() == 0:
        return DEFAULT_CACHE_DIR
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "verneuil")


class ChunkCache:
    """Verified chunk bytes on local disk, bounded by ``size_limit`` bytes."""

    def __init__(self, directory: str, size_limit: int = DEFAULT_CACHE_SIZE):
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self._cache = diskcache.Cache(
            directory,
            size_limit=size_limit,
            eviction_policy="least-recently-stored",
            # Chunk files are written whole; sqlite only holds the index.
            disk_min_file_size=0,
        )

    @staticmethod
    def _key(fp: Fprint) -> str:
        return "%016x%016x" % (fp.major, fp.minor)

    def get(self, fp: Fprint) -> bytes | None:
        data = self._cache.get(self._key(fp))
        if data is None:
            return None
        if fingerprint(data) != fp:
            log.warning("dropping corrupt cache entry for chunk %016x/%016x", *fp)
            self._cache.delete(self._key(fp))
            return None
        return data

    def contains(self, fp: Fprint) -> bool:
        return self._key(fp) in self._cache

    def put(self, fp: Fprint, data: bytes) -> None:
        self._cache.set(self._key(fp), data)

    def volume(self) -> int:
        return self._cache.volume()

    def close(self) -> None:
        self._cache.close()


class MemoryLRU:
    """A small in-process LRU of hot chunks (thread-safe, bounded in bytes)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._size = 0
        self._items: OrderedDict[Fprint, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, fp: Fprint) -> bytes | None:
        with self._lock:
            data = self._items.get(fp)
            if data is not None:
                self._items.move_to_end(fp)
            return data

    def __contains__(self, fp: Fprint) -> bool:
        return fp in self._items

    def put(self, fp: Fprint, data: bytes) -> None:
        if len(data) > self.capacity:
            return
        with self._lock:
            old = self._items.pop(fp, None)
            if old is not None:
                self._size -= len(old)
            self._items[fp] = data
            self._size += len(data)
            while self._size > self.capacity:
                _, dropped = self._items.popitem(last=False)
                self._size -= len(dropped)
