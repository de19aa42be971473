"""Local chunk cache: verified chunk bytes in append-only segment files,
keyed by fingerprint, bounded in size, kept across remounts.

Chunks are content-addressed, so one cache directory serves every database
of a mount, and every mount that names it (several processes may share one
directory). Only chunks that were verified against their fingerprint are
stored, and they are verified again when read back (UMASH in C, a few
microseconds per chunk), so a damaged, torn or foreign record is a miss,
never wrong bytes.

Why segments and not one file per chunk (or the ``diskcache`` library): a scan that hits the cache after the page cache
was dropped reads the chunks in about the order it fetched them, and chunks
appended back to back in one file are then read with the kernel's readahead
at the disk's sequential speed. One file per chunk costs an open and a
metadata lookup per 64 KiB and measured 4-5 times slower.

Chunks land in the order their fetches *started*, not the order they arrived:
the fetcher takes a `CacheSlot` (the next 64 KiB of the segment being
written) when it starts a fetch, in the trio thread, and the bytes go there
when they come (`CacheSlot.write`). Fetches started for a sequential read are in file order, so a later
sequential read finds them in file order in the segment too, and the kernel
reads them ahead as one run (`read_into` coalesces a request's chunks into
one system call). A slot left unused (the fetch failed) is a hole.

Layout of the directory (``FORMAT_DIR``)::

    <name>.seg   chunk bytes, appended back to back
    <name>.idx   one RECORD per chunk of the segment, appended after its bytes

``<name>`` is the creation time in nanoseconds (16 hex digits), the pid and
a random tag, so names sort by age and no two writers share a segment. A
process only appends to segments it created; it reads everybody's.

Crash safety without fsync: a record is appended only after its bytes were
written, carries a check word, and names a range inside the segment; a torn
or zero-filled record fails the check and is skipped, and bytes that did not
reach the disk fail the fingerprint. A crash loses cached chunks, nothing
else.

Eviction: the oldest segments are deleted first (least recently stored:
a least-recently-used order would make every read a write),
before a new segment starts, so the bytes on disk stay within
``size_limit`` (bar races between processes).

The file system is shared: the cache never fills it. Before a new segment
starts, the oldest segments are also deleted until the segment fits with a
reserve still free (`FREE_RESERVE_FRACTION`), so a ``size_limit`` larger than
the disk bounds nothing and the disk bounds the cache. A write the file system
refuses anyway (another program filled it, a quota) pauses writes to the cache
for `WRITE_PAUSE_S` with one warning: reads go on from the store, a full disk
costs neither errors nor a log line per chunk.

What the fetcher uses: from the trio thread, the calls that never wait on
the disk (`has_indexed`, `might_have`, `get_nowait`, ``read_into(...,
nowait=True)``, `reserve`, `CacheSlot.abandon`, and `CacheSlot.target` and
`CacheSlot.written` around the chunk engine's own writes, `target` making a
new segment's two files once per segment); from worker
threads, those that may (`get`, `has_blocking`, `read_into`, `put`, `CacheSlot.write`); `describe` and `capacity` for its stats. All
methods are thread-safe.

`ChunkCache` owns the writes (slots, puts, the chunk engine's writes) and
the accounting; its reads are in `cache_reads`, its segment files (the
record format, rescans, eviction, pauses) in `segments`.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict

from verneuil_fuse.format import CHUNK_SIZE, Fprint
from verneuil_fuse.reader.cache_reads import CacheReads
from verneuil_fuse.reader.segments import (FORMAT_DIR, FREE_RESERVE_FRACTION, PAUSE_WARN_INTERVAL_S, RECORD,
                                           Segments, _Segment, encode_record)

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "/var/cache/verneuil"
DEFAULT_CACHE_SIZE = 2 << 30  # 2 GiB

# Largest segment: the unit of eviction. 64 MiB keeps the number of files
# (and open descriptors) small, 32 for the default 2 GiB, while one eviction
# frees a small share of the cache.
MAX_SEGMENT_BYTES = 64 << 20
# At least 16 segments per cache, so that evicting the oldest one drops at
# most a sixteenth of a small cache ...
SEGMENTS_PER_CACHE = 16
# ... but no segment smaller than 1 MiB (16 chunks), or tiny caches would
# churn files.
MIN_SEGMENT_BYTES = 1 << 20


def default_cache_dir() -> str:
    if os.geteuid() == 0:
        return DEFAULT_CACHE_DIR
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "verneuil")


class CacheSlot:
    """Room for one chunk in a segment of ours, taken when its fetch starts,
    before its bytes exist (`ChunkCache.reserve`). It ends with one of
    `write` (the chunk's bytes go there) or `abandon` (the room is given
    back); whichever comes second does nothing, so a holder may abandon in
    a ``finally`` a slot it may have written."""

    __slots__ = ("_cache", "_seg", "_off")

    def __init__(self, cache: ChunkCache, seg: _Segment, off: int):
        self._cache = cache
        self._seg: _Segment | None = seg  # None once written or given back
        self._off = off

    def write(self, fp: Fprint, data: bytes) -> None:
        """Store a chunk whose bytes were verified against ``fp`` in this
        slot (blocking I/O: a worker thread's). When
        the slot's segment went meanwhile, the chunk is appended like a
        `ChunkCache.put`."""
        self._cache._store(fp, data, self)

    def abandon(self) -> None:
        """Give the room back (the fetch failed, or found the chunk cached):
        a hole in the segment, or its end again if it was the last slot."""
        if self._seg is not None:
            self._cache._abandon(self)

    def target(self, fp: Fprint) -> tuple[int, int, int] | None:
        """Where a writer outside Python (the chunk engine's thread) puts
        the chunk ``fp`` and then its index record: ``(segment fd, index
        fd, offset)``, kept open by the slot until `written`. None: write it
        with `write` instead (writes are paused, the segment's files cannot
        be made, the chunk is cached already). A segment's first target
        makes its files."""
        return self._cache._target(self, fp)

    def written(self, fp: Fprint, length: int, ok: bool, error: int) -> bool:
        """After a write to `target`: ``ok``, the ``length`` bytes and their
        record are there (the chunk joins the index); else ``error``, the
        errno of the failed write (writes pause), or 0 when nothing was
        written. False: nothing was, `write` still may."""
        if not ok and not error:
            return False
        self._cache._written(self, fp, length, None if ok else OSError(error, os.strerror(error)))
        return True


class ChunkCache(CacheReads, Segments):
    """Verified chunk bytes on local disk, bounded by ``size_limit`` bytes."""

    def __init__(self, directory: str, size_limit: int = DEFAULT_CACHE_SIZE):
        self.directory = directory
        self.size_limit = size_limit
        self._dir = os.path.join(directory, FORMAT_DIR)
        os.makedirs(self._dir, exist_ok=True)
        if not os.access(self._dir, os.R_OK | os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable", self._dir)
        self._lock = threading.Lock()
        self._segments: dict[str, _Segment] = {}
        self._index: dict[Fprint, tuple[_Segment, int, int]] = {}
        self._active: _Segment | None = None
        self._last_rescan = 0.0
        self._closed = False
        self._paused_until = 0.0
        self._last_pause_warning = -PAUSE_WARN_INTERVAL_S
        self.stats = dict.fromkeys(
            ("hits", "misses", "corrupt", "puts", "evicted_segments", "rescans", "write_pauses", "puts_skipped",
             "unused_slots"), 0
        )
        self.segment_bytes = self._segment_size(size_limit)
        # What the cache can hold: size_limit, or less when its disk is smaller
        # (as measured at start; the disk is checked again at every segment).
        self.capacity = size_limit
        with self._lock:
            self._rescan_locked()
            self._evict_locked(0)
            # What the disk can hold: the cache's own files plus the room left
            # past the reserve (without the reserve for a disk that statvfs
            # cannot describe).
            room = self._disk_room()
            held = sum(s.disk_bytes for s in self._segments.values())
        if room is not None and held + room < size_limit:
            usable = max(0, held + room)
            self.capacity = usable
            self.segment_bytes = self._segment_size(usable)
            log.warning(
                "cache_size (%.1f MiB) is more than the file system of %s can give the cache (%.1f MiB, keeping "
                "%.0f %% of it free): the disk bounds the cache",
                size_limit / (1 << 20), directory, usable / (1 << 20), FREE_RESERVE_FRACTION * 100,
            )

    @staticmethod
    def _segment_size(limit: int) -> int:
        return max(MIN_SEGMENT_BYTES, min(MAX_SEGMENT_BYTES, limit // SEGMENTS_PER_CACHE))

    # ---------------------------------------------------------------- writes
    def reserve(self) -> CacheSlot | None:
        """Room for one chunk at the end of the segment being written, for
        a chunk whose fetch starts now (see the module's docstring): its
        `CacheSlot.write` stores the chunk there, or `CacheSlot.abandon`
        gives it back. No I/O, so the trio
        thread may call it: a new segment is only named here, its files are
        made at its first target or write. None while writes are paused (the
        chunk is then offered to `put`)."""
        return self.reserve_many(1)[0]

    def reserve_many(self, n: int) -> list[CacheSlot | None]:
        """`reserve` for ``n`` chunks whose fetches start now, in that order,
        under one hold of the lock (a prefetch of a readahead window)."""
        with self._lock:
            if self._closed or (self._paused_until and time.monotonic() < self._paused_until):
                return [None] * n
            slots: list[CacheSlot | None] = []
            seg = self._active
            for _ in range(n):
                if seg is not None and (seg.dead or seg.data_bytes + CHUNK_SIZE > self.segment_bytes):
                    self._seal_locked(seg)
                    seg = None
                if seg is None:
                    seg = self._active = self._new_locked()
                slots.append(CacheSlot(self, seg, seg.data_bytes))
                seg.data_bytes += CHUNK_SIZE
                seg.pending += CHUNK_SIZE
                seg.readers += 1  # keeps the descriptors open until the write
            return slots

    def _abandon(self, slot: CacheSlot) -> None:
        with self._lock:
            self._free_slot_locked(slot, 0)

    def _free_slot_locked(self, slot: CacheSlot, used: int) -> _Segment | None:
        """Take ``slot`` back from its holder, keeping ``used`` bytes of it;
        returns its segment still pinned when it can take them, else None.
        The end of the segment, if the slot is its last, shrinks to fit."""
        seg, slot._seg = slot._seg, None
        if seg is None:
            return None
        seg.pending -= CHUNK_SIZE
        if seg.data_bytes == slot._off + CHUNK_SIZE:
            seg.data_bytes = slot._off + used
        else:  # a hole in the file, which takes no disk blocks
            seg.holes += CHUNK_SIZE - used
        if not used:
            self.stats["unused_slots"] += 1
        if used and not seg.dead and (seg.idx_fd >= 0 or seg.fd < 0):  # open, or not made yet
            return seg
        self._release_locked(seg)
        return None

    def put(self, fp: Fprint, data: bytes) -> None:
        """Store a chunk whose bytes were verified against ``fp`` at the end
        of the segment being written (a chunk with a slot: `CacheSlot.write`)."""
        self._store(fp, data, None)

    def _store(self, fp: Fprint, data: bytes, slot: CacheSlot | None) -> None:
        """Store a verified chunk in its ``slot`` if it has one, else at the
        end of the segment being written."""
        length = len(data)
        if not 0 < length <= min(CHUNK_SIZE, self.segment_bytes):
            if slot is not None:
                slot.abandon()
            return
        with self._lock:
            if self._closed or fp in self._index:
                if slot is not None:
                    self._free_slot_locked(slot, 0)
                return
            if self._paused_until:
                if time.monotonic() < self._paused_until:
                    self.stats["puts_skipped"] += 1
                    if slot is not None:
                        self._free_slot_locked(slot, 0)
                    return
                self._paused_until = 0.0
                log.debug("disk cache %s: writes resumed", self.directory)
            # The slot's segment, still pinned (its descriptors open), unless
            # it went meanwhile: then the chunk is appended like any other.
            seg = self._free_slot_locked(slot, length) if slot is not None else None
            if seg is not None:
                off = slot._off
            else:
                seg = self._active
                if seg is not None and (seg.dead or seg.data_bytes + length > self.segment_bytes
                                        or (seg.fd >= 0 and self._unlinked(seg))):
                    self._seal_locked(seg)
                    seg = None
                if seg is None:
                    seg = self._active = self._new_locked()
                off = seg.data_bytes
                seg.data_bytes += length
                seg.readers += 1  # keeps the descriptors open while we write
            if seg.fd < 0 and not self._make_files_locked(seg):  # its first write
                self._release_locked(seg)
                self.stats["puts_skipped"] += 1
                return
            fd, idx_fd = seg.fd, seg.idx_fd
        error: OSError | None = None
        try:
            os.pwrite(fd, data, off)
            os.write(idx_fd, encode_record(fp, off, length))
        except OSError as e:
            error = e
        with self._lock:
            self._record_locked(seg, fp, off, length, error)

    def _make_files_locked(self, seg: _Segment) -> bool:
        """Make a new segment's files (`segments.Segments._create_locked`:
        two opens, and evictions when the cache is full); on failure the
        segment is dead (its other slots' chunks are appended elsewhere) and
        writes pause."""
        try:
            self._create_locked(seg)
            return True
        except OSError as e:
            seg.dead = True
            if seg is self._active:
                self._active = None
            self._pause_locked("cannot start a segment: %s" % (e.strerror or e))
            return False

    def _target(self, slot: CacheSlot, fp: Fprint) -> tuple[int, int, int] | None:
        with self._lock:
            return self._target_locked(slot, fp)

    def targets(self, slots: list[CacheSlot | None], fps: list[Fprint]) -> list[tuple[int, int, int] | None]:
        """`CacheSlot.target` of each slot of ``slots`` (None: none) for the
        chunk of ``fps`` at the same place, under one hold of the lock (the
        chunks of one submission to the chunk engine)."""
        with self._lock:
            return [None if slot is None else self._target_locked(slot, fp) for slot, fp in zip(slots, fps)]

    def _target_locked(self, slot: CacheSlot, fp: Fprint) -> tuple[int, int, int] | None:
        seg = slot._seg
        if seg is None or seg.dead or self._closed or fp in self._index \
                or (self._paused_until and time.monotonic() < self._paused_until):
            return None
        # The segment's first chunk makes its files here, once per
        # segment, rather than at its first write: a scan's chunks go to
        # the engine long before one is written, and without files each
        # of them would be written by a thread of ours instead.
        if seg.fd < 0 and not self._make_files_locked(seg):
            return None
        if seg.idx_fd < 0:
            return None
        return seg.fd, seg.idx_fd, slot._off

    def _written(self, slot: CacheSlot, fp: Fprint, length: int, error: OSError | None) -> None:
        with self._lock:
            off = slot._off
            seg = self._free_slot_locked(slot, length)
            if seg is not None:
                self._record_locked(seg, fp, off, length, error)

    def _record_locked(self, seg: _Segment, fp: Fprint, off: int, length: int, error: OSError | None) -> None:
        """After a chunk's write to ``seg`` (pinned, released here): into
        the index, or ``error`` pauses the writes."""
        if error is None and not seg.dead:
            seg.idx_bytes += RECORD.size
            seg.fps.append(fp)
            self._index[fp] = (seg, off, length)
            self.stats["puts"] += 1
        elif error is not None:
            if seg is self._active:
                self._seal_locked(seg)  # a failed write: a new segment after the pause
            self._pause_locked("cannot write chunk %016x/%016x: %s" % (fp.major, fp.minor, error.strerror or error))
        self._release_locked(seg)

    # ------------------------------------------------------------ accounting
    def volume(self) -> int:
        """Bytes on disk, as far as this process knows."""
        with self._lock:
            return sum(s.disk_bytes for s in self._segments.values())

    def describe(self) -> dict:
        """For /.verneuil/stats: size, bound, counts and counters."""
        with self._lock:
            out = {
                "bytes": sum(s.disk_bytes for s in self._segments.values()),
                "limit": self.size_limit,
                "capacity": self.capacity,
                "chunks": len(self._index),
                "segments": len(self._segments),
                "writes_paused": bool(self._paused_until) and time.monotonic() < self._paused_until,
            }
            out.update(self.stats)
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for seg in self._segments.values():
                seg.dead = True
                if seg.readers == 0:
                    self._close_fds(seg)
            self._segments.clear()
            self._index.clear()
            self._active = None


class RunBufferCounts(dict):
    """How many chunks held somewhere (the memory LRU, the chunks held for
    reads) are views of each run buffer (`chunk_engine.RUN_BUFFER_PARTS`),
    by the buffer's id: what decides when holding them frees its memory."""

    def add(self, view: memoryview) -> bool:
        """One more chunk of ``view``'s buffer; True for its first."""
        key = id(view.obj)
        held = self.get(key, 0)
        self[key] = held + 1
        return not held

    def remove(self, view: memoryview) -> bool:
        """One chunk of ``view``'s buffer less; True for its last."""
        key = id(view.obj)
        held = self[key] - 1
        if held:
            self[key] = held
            return False
        del self[key]
        return True

    def holds(self, view: memoryview) -> bool:
        return id(view.obj) in self


class MemoryLRU:
    """A small in-process LRU of hot chunks (thread-safe, bounded in bytes).

    A chunk may be a view of a run buffer (`chunk_engine.RUN_BUFFER_PARTS`),
    which keeps the whole buffer alive: such a buffer counts once, all of
    it, while any of its chunks is here, so that the bound is on the memory
    the LRU holds, however few chunks of a run stay."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._size = 0
        self._items: OrderedDict[Fprint, bytes | memoryview] = OrderedDict()
        self._bases = RunBufferCounts()
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        """Bytes held now."""
        return self._size

    def get(self, fp: Fprint) -> bytes | memoryview | None:
        with self._lock:
            data = self._items.get(fp)
            if data is not None:
                self._items.move_to_end(fp)
            return data

    def peek(self, fp: Fprint) -> bytes | memoryview | None:
        """The chunk, if here, left where it is in the LRU order: a read in
        file order (`fetcher.Fetcher.span`) will not read it again, and the
        chunks its readahead brought in, older but not read yet, must not
        go first."""
        return self._items.get(fp)

    def __contains__(self, fp: Fprint) -> bool:
        return fp in self._items

    def _charge(self, data: bytes | memoryview) -> int:
        """Bytes that holding ``data`` adds (lock held)."""
        if type(data) is not memoryview:
            return len(data)
        return len(data.obj) if self._bases.add(data) else 0

    def _release(self, data: bytes | memoryview) -> int:
        """Bytes that dropping ``data`` frees (lock held)."""
        if type(data) is not memoryview:
            return len(data)
        return len(data.obj) if self._bases.remove(data) else 0

    def put(self, fp: Fprint, data: bytes | memoryview) -> None:
        if len(data if type(data) is not memoryview else data.obj) > self.capacity:
            return
        with self._lock:
            old = self._items.pop(fp, None)
            if old is not None:
                self._size -= self._release(old)
            self._items[fp] = data
            self._size += self._charge(data)
            while self._size > self.capacity:
                _, dropped = self._items.popitem(last=False)
                self._size -= self._release(dropped)
