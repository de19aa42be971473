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
`CacheSlot.written` around the chunk engine's own writes); from worker
threads, those that may (`get`, `has_blocking`, `read_into`, `put`, `CacheSlot.write`); `describe` and `capacity` for its stats. All
methods are thread-safe.
"""
from __future__ import annotations

import errno
import logging
import os
import secrets
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

from verneuil_fuse.format import CHUNK_SIZE, Fprint, fingerprint

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "/var/cache/verneuil"
DEFAULT_CACHE_SIZE = 2 << 30  # 2 GiB

# The segment files live in a versioned subdirectory, so a future layout can
# sit beside this one and an old one is never misread.
FORMAT_DIR = "segments-v1"
SEG_SUFFIX = ".seg"
IDX_SUFFIX = ".idx"

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

# fp.major, fp.minor, offset, length, check (crc32 of the first 28 bytes,
# salted so that an all-zero record, left by a crash, never passes).
RECORD = struct.Struct("<QQQII")
_CHECK_SALT = 0x56434331  # "VCC1"

# Share of the cache's file system left free for the rest of the machine
# (the default cache_dir, /var/cache/verneuil, is on the root file system):
# a new segment starts only if this much stays free after it, else the
# oldest segments go first. 5 % is what ext4 keeps back for root by default;
# the mount's own writes stop short of it without relying on running as root.
FREE_RESERVE_FRACTION = 0.05
# ... but never more than 1 GiB: 5 % of a large disk is far more than other
# programs need to go on working, and would be cache taken from the user.
FREE_RESERVE_MAX = 1 << 30
# After a write to the cache failed (ENOSPC, EDQUOT, EIO) or no room is left
# past the reserve, new chunks are not cached for this long. Reads go on from
# the store meanwhile; one statvfs and one log line per pause rather than per
# chunk (a scan caches some 250 chunks a second). Short enough that space
# freed by others is used again soon.
WRITE_PAUSE_S = 10.0
# A pause is logged as a warning at most this often (else at debug level): a
# full disk stays full for hours, and one line every few minutes says so.
PAUSE_WARN_INTERVAL_S = 300.0

# How often a miss may rescan the directory for segments that other
# processes sharing the directory wrote or deleted. A rescan is a listdir and
# one fstat per segment; once a second costs nothing next to a GET.
RESCAN_INTERVAL_S = 1.0


def default_cache_dir() -> str:
    if os.geteuid() == 0:
        return DEFAULT_CACHE_DIR
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "verneuil")


def _check(major: int, minor: int, offset: int, length: int) -> int:
    return zlib.crc32(struct.pack("<QQQI", major, minor, offset, length)) ^ _CHECK_SALT


def encode_record(fp: Fprint, offset: int, length: int) -> bytes:
    return RECORD.pack(fp.major, fp.minor, offset, length, _check(fp.major, fp.minor, offset, length))


@dataclass(eq=False)
class _Segment:
    name: str
    seg_path: str
    idx_path: str
    own: bool = False  # created by this process: the only ones it appends to
    fd: int = -1  # O_RDONLY (others') or O_RDWR (own), opened lazily
    idx_fd: int = -1  # own segments only (O_APPEND)
    data_bytes: int = 0  # size of .seg (own: bytes reserved so far)
    holes: int = 0  # own: bytes of data_bytes given back unwritten (slots of failed fetches)
    pending: int = 0  # own: bytes of data_bytes in slots still reserved (their fetch under way)
    idx_bytes: int = 0  # bytes of .idx consumed (others') or written (own)
    readers: int = 0  # reads and writes under way (the descriptors stay open)
    dead: bool = False  # deleted: close the fd when the last reader leaves
    fps: list = field(default_factory=list)  # every fingerprint recorded here

    @property
    def disk_bytes(self) -> int:
        return self.data_bytes - self.holes + self.idx_bytes


@dataclass(slots=True, eq=False)
class _Run:
    """Chunks back to back in one segment, read with one ``preadv``."""

    seg: _Segment
    fd: int
    off: int  # where the run starts in the segment
    length: int  # bytes
    ks: list[int]  # positions of its chunks in the request, in segment order


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
        with `write` instead (the segment has no files yet, writes are
        paused, the chunk is cached already)."""
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


class ChunkCache:
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

    # ----------------------------------------------------------------- reads
    def get(self, fp: Fprint) -> bytes | None:
        """The chunk's verified bytes, or None (not cached, or damaged)."""
        with self._lock:
            loc = self._index.get(fp)
            if loc is None and self._rescan_due():
                self._rescan_locked()
                loc = self._index.get(fp)
            if loc is None:
                self.stats["misses"] += 1
                return None
        buf = bytearray(loc[2])
        if not self.read_into([fp], [memoryview(buf)])[0]:
            return None
        return bytes(buf)

    def get_nowait(self, fp: Fprint) -> bytearray | None:
        """The chunk's verified bytes if they are cached *and* in the kernel's
        page cache (see `read_into`), else None. The result is a bytearray
        that must be treated as read-only."""
        loc = self._index.get(fp)
        if loc is None:
            return None
        buf = bytearray(loc[2])
        return buf if self.read_into([fp], [memoryview(buf)], nowait=True)[0] else None

    def read_into(self, fps: list[Fprint], dests: list[memoryview], nowait: bool = False) -> list[bool]:
        """Read cached chunks into the caller's buffers: ``dests[k]``, a
        writable view of exactly the chunk's length, receives the verified
        bytes of ``fps[k]``. Returns, per chunk, whether it did; a chunk that
        is not cached (or has another length) is left alone, a damaged one is
        dropped from the index (after a blocking read) and logged.

        Chunks stored back to back in one segment (in any order), as a scan
        stores them, are read with one ``preadv`` into their destinations: no
        copy besides the kernel's, one lock round for a whole FUSE read
        request and one system call per run instead of one each per chunk
        (per-chunk work is what bounds a warm read in the mount's single
        Python thread).

        With ``nowait`` the reads use ``RWF_NOWAIT``: only bytes already in
        the kernel's page cache, never a wait on the disk, so the trio thread
        may call it; a chunk that would block is left for a blocking call
        from a worker thread. Never rescans the directory."""
        ok = [False] * len(fps)
        with self._lock:
            runs = self._runs_locked(fps, dests, nowait)
        hits = 0
        damaged: list[tuple[int, _Segment]] = []  # blocking reads only
        try:
            for run in runs:
                hits += self._read_run(run, fps, dests, nowait, ok)
                if not nowait:
                    damaged.extend((k, run.seg) for k in run.ks if not ok[k])
        finally:
            with self._lock:
                for run in runs:
                    self._release_locked(run.seg)
                self.stats["hits"] += hits
                if not nowait:
                    self._drop_damaged_locked(fps, damaged)
        return ok

    def _runs_locked(self, fps: list[Fprint], dests: list[memoryview], nowait: bool) -> list[_Run]:
        """The indexed chunks of ``fps`` (of the length of their ``dests``)
        grouped into runs back to back in one segment, each segment pinned
        (`_release_locked` once read)."""
        index = self._index
        found: list[tuple[str, int, int, int, _Segment]] = []  # sorts without comparing segments
        for k, fp in enumerate(fps):
            loc = index.get(fp)
            if loc is None or loc[2] != len(dests[k]):
                continue
            seg, off, length = loc
            if seg.fd < 0:
                if nowait:
                    continue
                try:
                    self._read_fd_locked(seg)
                except OSError as e:
                    log.warning("cache segment %s is unreadable (%s): dropping it", seg.name, e)
                    self._drop_locked(seg)
                    continue
            found.append((seg.name, off, k, length, seg))
        # In segment order, not in the order asked: parallel fetches store
        # a scan's chunks close together but shuffled (a warm scan of a
        # 475 MiB replica read 1954 runs this way instead of 6961).
        found.sort()
        runs: list[_Run] = []
        last: _Run | None = None
        for _, off, k, length, seg in found:
            if last is not None and last.seg is seg and last.off + last.length == off:
                last.length += length
                last.ks.append(k)
            else:
                seg.readers += 1
                last = _Run(seg, seg.fd, off, length, [k])
                runs.append(last)
        return runs

    @staticmethod
    def _read_run(run: _Run, fps: list[Fprint], dests: list[memoryview], nowait: bool, ok: list[bool]) -> int:
        """One ``preadv`` of a run into its chunks' destinations; sets
        ``ok[k]`` for each chunk read whole that matches its fingerprint.
        Returns how many did."""
        flags = os.RWF_NOWAIT if nowait else 0
        try:
            got = os.preadv(run.fd, [dests[k] for k in run.ks], run.off, flags)
        except OSError as e:  # EAGAIN (would block), EOPNOTSUPP, EIO ...
            if not nowait:
                log.warning("cannot read %d bytes at %d of cache segment %s: %s", run.length, run.off, run.seg.name, e)
            got = 0
        hits = 0
        pos = run.off
        for k in run.ks:
            pos += len(dests[k])
            if pos > run.off + got:
                break  # a short read: not in the page cache (nowait), or torn
            if fingerprint(dests[k]) == fps[k]:
                ok[k] = True
                hits += 1
        return hits

    def _drop_damaged_locked(self, fps: list[Fprint], damaged: list[tuple[int, _Segment]]) -> None:
        """Count as misses, and drop from the index, the chunks of a blocking
        read that did not come back whole and verified."""
        self.stats["misses"] += len(damaged)
        self.stats["corrupt"] += len(damaged)
        for k, seg in damaged:
            fp = fps[k]
            log.warning("dropping damaged cache entry for chunk %016x/%016x (segment %s)", fp.major, fp.minor, seg.name)
            loc = self._index.get(fp)
            if loc is not None and loc[0] is seg:
                del self._index[fp]

    def has_indexed(self, fp: Fprint) -> bool:
        """Whether the index names this chunk now: in memory, no lock, no
        I/O, so the trio thread may ask; chunks other processes stored since
        the last rescan are not seen (`has_blocking` looks for them)."""
        return fp in self._index

    def might_have(self, fp: Fprint) -> bool:
        """False when `get` and `has_blocking` would surely say no: the index
        lacks the chunk and is not due for a rescan (no I/O, no lock), so a
        caller can skip a thread hop for a chunk it must fetch anyway."""
        return fp in self._index or self._rescan_due()

    def has_blocking(self, fp: Fprint) -> bool:
        """Whether the chunk is cached, by this process or another sharing
        the directory: a miss in the index rescans the directory when a
        rescan is due (`RESCAN_INTERVAL_S`), so this may block on the disk
        (a worker thread's call). Unlike `get`, reads no chunk bytes."""
        with self._lock:
            if fp not in self._index and self._rescan_due():
                self._rescan_locked()
            return fp in self._index

    # ---------------------------------------------------------------- writes
    def reserve(self) -> CacheSlot | None:
        """Room for one chunk at the end of the segment being written, for
        a chunk whose fetch starts now (see the module's docstring): its
        `CacheSlot.write` stores the chunk there, or `CacheSlot.abandon`
        gives it back. No I/O, so the trio
        thread may call it: a new segment is only named here, its files are
        made at its first write. None while writes are paused (the chunk is
        then offered to `put`)."""
        with self._lock:
            if self._closed or (self._paused_until and time.monotonic() < self._paused_until):
                return None
            seg = self._active
            if seg is not None and (seg.dead or seg.data_bytes + CHUNK_SIZE > self.segment_bytes):
                self._seal_locked(seg)
                seg = None
            if seg is None:
                seg = self._active = self._new_locked()
            slot = CacheSlot(self, seg, seg.data_bytes)
            seg.data_bytes += CHUNK_SIZE
            seg.pending += CHUNK_SIZE
            seg.readers += 1  # keeps the descriptors open until the write
            return slot

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
            if seg.fd < 0:  # its first write: make its files
                try:
                    self._create_locked(seg)
                except OSError as e:
                    seg.dead = True  # its other slots' chunks are appended elsewhere
                    if seg is self._active:
                        self._active = None
                    self._release_locked(seg)
                    self._pause_locked("cannot start a segment: %s" % (e.strerror or e))
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

    def _target(self, slot: CacheSlot, fp: Fprint) -> tuple[int, int, int] | None:
        with self._lock:
            seg = slot._seg
            if seg is None or seg.dead or seg.fd < 0 or seg.idx_fd < 0 or self._closed or fp in self._index \
                    or (self._paused_until and time.monotonic() < self._paused_until):
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

    # ------------------------------------------------------------- internals
    def _rescan_due(self) -> bool:
        return not self._closed and time.monotonic() - self._last_rescan >= RESCAN_INTERVAL_S

    def _rescan_locked(self) -> None:
        """Learn the segments other processes created, grew or deleted."""
        self._last_rescan = time.monotonic()
        self.stats["rescans"] += 1
        try:
            names = {n[: -len(SEG_SUFFIX)] for n in os.listdir(self._dir) if n.endswith(SEG_SUFFIX)}
        except FileNotFoundError:
            # Every segment went with the directory (see `_create_locked`).
            self._make_dir_again()
            names = set()
        except OSError as e:
            log.warning("cannot list the cache directory %s: %s", self._dir, e)
            return
        for name in list(self._segments):
            if name not in names:  # deleted by another process sharing the directory
                self._drop_locked(self._segments[name])
        for name in sorted(names):
            seg = self._segments.get(name)
            if seg is None:
                seg = self._segments[name] = _Segment(
                    name, os.path.join(self._dir, name + SEG_SUFFIX), os.path.join(self._dir, name + IDX_SUFFIX)
                )
            if not seg.own:
                self._load_index_locked(seg)

    def _load_index_locked(self, seg: _Segment) -> None:
        try:
            with open(seg.idx_path, "rb") as f:
                f.seek(seg.idx_bytes)
                tail = f.read()
            # After the index: every record read names bytes written before it.
            data_bytes = os.stat(seg.seg_path).st_size
        except FileNotFoundError:
            return  # an index not written yet, or a segment deleted meanwhile
        except OSError as e:
            log.warning("cannot read cache index %s: %s", seg.idx_path, e)
            return
        seg.data_bytes = data_bytes
        usable = len(tail) - len(tail) % RECORD.size
        for major, minor, off, length, check in RECORD.iter_unpack(tail[:usable]):
            if check != _check(major, minor, off, length) or not 0 < length <= CHUNK_SIZE or off + length > data_bytes:
                continue  # torn, zero-filled or foreign: skip it
            fp = Fprint(major, minor)
            seg.fps.append(fp)
            self._index[fp] = (seg, off, length)
        # A partial record at the end may still be completed by its writer.
        seg.idx_bytes += usable

    def _new_locked(self) -> _Segment:
        """The next segment of ours, in memory only (`_create_locked` makes its
        files at its first write)."""
        name = "%016x-%d-%s" % (time.time_ns(), os.getpid(), secrets.token_hex(4))
        return _Segment(name, os.path.join(self._dir, name + SEG_SUFFIX), os.path.join(self._dir, name + IDX_SUFFIX),
                        own=True)

    def _create_locked(self, seg: _Segment) -> None:
        """Make room for a new segment of ours, then its files (raises OSError)."""
        if not self._evict_locked(self.segment_bytes):
            raise OSError(errno.ENOSPC, "no room left on its file system past the %.0f %% kept free"
                          % (FREE_RESERVE_FRACTION * 100))
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            seg.fd = os.open(seg.seg_path, flags, 0o600)
        except FileNotFoundError:
            self._make_dir_again()
            seg.fd = os.open(seg.seg_path, flags, 0o600)
        try:
            seg.idx_fd = os.open(seg.idx_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError:
            os.close(seg.fd)
            seg.fd = -1
            os.unlink(seg.seg_path)
            raise
        self._segments[seg.name] = seg

    def _make_dir_again(self) -> None:
        """The directory went (a cleaner of /var/cache, a user's ``rm -r``):
        make it again rather than stop caching until a remount."""
        log.warning("cache directory %s was removed: making it again", self._dir)
        try:
            os.makedirs(self._dir, exist_ok=True)
        except OSError as e:
            log.warning("cannot make the cache directory %s again: %s", self._dir, e)

    def _seal_locked(self, seg: _Segment) -> None:
        """Stop appending to our active segment (it stays readable)."""
        if seg is self._active:
            self._active = None
        if seg.idx_fd >= 0 and seg.readers == 0:
            os.close(seg.idx_fd)
            seg.idx_fd = -1

    @staticmethod
    def _unlinked(seg: _Segment) -> bool:
        """Another process sharing the directory evicted our segment."""
        try:
            return os.fstat(seg.fd).st_nlink == 0
        except OSError:
            return True

    def _read_fd_locked(self, seg: _Segment) -> int:
        if seg.fd < 0:
            seg.fd = os.open(seg.seg_path, os.O_RDONLY | os.O_CLOEXEC)
        return seg.fd

    def _disk_room(self) -> int | None:
        """Bytes the cache may still write to its file system, keeping the
        reserve free (negative when others ate into it); None when statvfs
        fails (the size bound alone then applies)."""
        try:
            st = os.statvfs(self._dir)
        except OSError:
            return None
        reserve = min(FREE_RESERVE_MAX, int(st.f_blocks * st.f_frsize * FREE_RESERVE_FRACTION))
        return st.f_bavail * st.f_frsize - reserve

    def _pause_locked(self, reason: str) -> None:
        """Stop writing new chunks for `WRITE_PAUSE_S` (see there)."""
        now = time.monotonic()
        self._paused_until = now + WRITE_PAUSE_S
        self.stats["write_pauses"] += 1
        if now - self._last_pause_warning >= PAUSE_WARN_INTERVAL_S:
            self._last_pause_warning = now
            log.warning("disk cache %s: %s; not caching new chunks for %g s (reads go on from the store)",
                        self.directory, reason, WRITE_PAUSE_S)
        else:
            log.debug("disk cache %s: %s; paused again", self.directory, reason)

    def _evict_locked(self, room: int) -> bool:
        """Delete the oldest segments until ``room`` more bytes fit, both in
        ``size_limit`` and on the file system past its reserve. Returns
        whether they do (only the disk can say no: when even an empty cache
        would leave too little free)."""
        total = sum(s.disk_bytes for s in self._segments.values())
        disk = self._disk_room()
        # Bytes the disk lacks, counting those promised to slots of the
        # segments there (fetches under way), which statvfs cannot see yet.
        promised = sum(s.pending for s in self._segments.values())
        short = 0 if disk is None else room + promised - disk
        for name in sorted(self._segments):
            if total + room <= self.size_limit and short <= 0:
                break
            seg = self._segments[name]
            if seg is self._active:
                continue
            for path in (seg.seg_path, seg.idx_path):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("cannot evict cache file %s: %s", path, e)
            total -= seg.disk_bytes
            short -= seg.disk_bytes
            self.stats["evicted_segments"] += 1
            log.debug("evicted cache segment %s (%d chunks)", seg.name, len(seg.fps))
            self._drop_locked(seg)
        return short <= 0

    def _drop_locked(self, seg: _Segment) -> None:
        self._segments.pop(seg.name, None)
        if seg is self._active:
            self._active = None
        for fp in seg.fps:
            loc = self._index.get(fp)
            if loc is not None and loc[0] is seg:
                del self._index[fp]
        seg.fps = []
        seg.dead = True
        if seg.readers == 0:
            self._close_fds(seg)

    def _release_locked(self, seg: _Segment) -> None:
        """One read or write of ``seg`` is over: close what nobody needs any
        more (everything once deleted; the index of a sealed segment of ours)."""
        seg.readers -= 1
        if seg.readers:
            return
        if seg.dead:
            self._close_fds(seg)
        elif seg is not self._active and seg.idx_fd >= 0:
            os.close(seg.idx_fd)
            seg.idx_fd = -1

    @staticmethod
    def _close_fds(seg: _Segment) -> None:
        for attr in ("fd", "idx_fd"):
            fd = getattr(seg, attr)
            if fd >= 0:
                setattr(seg, attr, -1)
                try:
                    os.close(fd)
                except OSError:
                    pass


class MemoryLRU:
    """A small in-process LRU of hot chunks (thread-safe, bounded in bytes)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._size = 0
        self._items: OrderedDict[Fprint, bytes] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        """Bytes held now."""
        return self._size

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
