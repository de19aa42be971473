"""The disk cache's segment files (`cache.ChunkCache`, whose docstring
describes the layout): their names, the index records and their check
word, the segments other processes sharing the directory created, grew or
deleted (rescans), ours made at their first write and sealed, eviction of
the oldest within ``size_limit`` and the file system's reserve, the pause
of writes when the disk refuses them, the blocks a segment of ours is given
ahead, and the descriptors' lives.

Tested by tests/test_reader_cache.py (test_crash_leftovers_are_skipped,
test_size_bound_evicts_oldest_segments, test_two_processes_share_one_directory,
test_the_disk_bounds_the_cache_and_keeps_its_reserve_free,
test_a_removed_cache_directory_is_made_again,
test_a_segments_blocks_are_given_ahead_and_back).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import struct
import time
import zlib
from dataclasses import dataclass, field

from verneuil_fuse.format import CHUNK_SIZE, Fprint

log = logging.getLogger(__name__)

# The segment files live in a versioned subdirectory, so a future layout can
# sit beside this one and an old one is never misread.
FORMAT_DIR = "segments-v1"
SEG_SUFFIX = ".seg"
IDX_SUFFIX = ".idx"
# fp.major, fp.minor, offset, length, check (crc32 of the first 28 bytes,
# salted so that an all-zero record, left by a crash, never passes).
# The chunk engine writes the same records (csrc/reader/chunk_engine.c,
# `write_to_cache`: RECORD_BYTES, RECORD_SALT), after the bytes, on its own
# thread: a record must follow its bytes and be written by whoever wrote
# them, and a hop to Python per chunk is what the engine path saves. The
# cache still owns the records' places (`CacheSlot.target`) and its index
# (`CacheSlot.written`); tests/test_structure.py checks that both sides
# spell the record alike.
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
# The data file of a segment of ours gets its disk blocks when it is made
# (fallocate, FALLOC_FL_KEEP_SIZE: its size still says what it holds): ext4
# then writes chunks into blocks already allocated, without its per-page
# bookkeeping of delayed allocation, a quarter less CPU per byte written
# (1 GiB in 64 KiB pwrites: 0.19 s against 0.26 s of CPU), on the chunk
# engine's thread in a cold scan. The blocks past what the segment holds
# are given back when its files are closed (`_close_fds`); a file system
# that has no fallocate, or not the room, gets none.
_FALLOC_FL_KEEP_SIZE = 1


def _check(major: int, minor: int, offset: int, length: int) -> int:
    return zlib.crc32(struct.pack("<QQQI", major, minor, offset, length)) ^ _CHECK_SALT


def encode_record(fp: Fprint, offset: int, length: int) -> bytes:
    return RECORD.pack(fp.major, fp.minor, offset, length, _check(fp.major, fp.minor, offset, length))


def disk_room(path: str) -> int | None:
    """Bytes that may still be written to the file system of ``path`` while
    keeping its reserve (`FREE_RESERVE_FRACTION`) free: negative when others
    ate into it, None when statvfs cannot describe it. Every cache kept
    under cache_dir (chunks here, manifests in `manifests`) writes only
    within it."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    reserve = min(FREE_RESERVE_MAX, int(st.f_blocks * st.f_frsize * FREE_RESERVE_FRACTION))
    return st.f_bavail * st.f_frsize - reserve


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def _preallocate(fd: int, size: int) -> None:
    """The blocks of bytes [0, size) of new file ``fd``, if the file system
    gives them now (see `_FALLOC_FL_KEEP_SIZE`); any it gave before it
    refused are given back."""
    if _libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, size) == 0:
        return
    log.debug("no blocks given ahead for a cache segment: %s", os.strerror(ctypes.get_errno()))
    try:
        os.ftruncate(fd, 0)
    except OSError:
        pass


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


class Segments:
    """The segment files of `cache.ChunkCache` (see the module's docstring)."""

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
        _preallocate(seg.fd, self.segment_bytes)
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
        return disk_room(self._dir)

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
        if seg.own and seg.fd >= 0:
            try:  # the blocks given ahead past what it holds (`_preallocate`)
                os.ftruncate(seg.fd, seg.data_bytes)
            except OSError:
                pass
        for attr in ("fd", "idx_fd"):
            fd = getattr(seg, attr)
            if fd >= 0:
                setattr(seg, attr, -1)
                try:
                    os.close(fd)
                except OSError:
                    pass
