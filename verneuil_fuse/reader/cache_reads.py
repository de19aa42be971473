"""The disk cache's reads (`cache.ChunkCache`): a request's chunks read
straight into the caller's buffers, those back to back in one segment with
one ``preadv``, each verified against its fingerprint (a damaged one is a
miss, dropped from the index); without waiting on the disk for the trio
thread (``RWF_NOWAIT``), or blocking (a worker thread's, rescanning the
directory when due); and the index's answers to "is it cached?".

Tested by tests/test_reader_cache.py (test_put_get_and_persistence,
test_damaged_bytes_are_a_miss_never_served,
test_read_into_reads_back_to_back_chunks_with_one_call,
test_a_damaged_chunk_in_a_run_is_dropped_alone).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from verneuil_fuse.format import Fprint, fingerprint
from verneuil_fuse.reader.segments import _Segment

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Run:
    """Chunks back to back in one segment, read with one ``preadv``."""

    seg: _Segment
    fd: int
    off: int  # where the run starts in the segment
    length: int  # bytes
    ks: list[int]  # positions of its chunks in the request, in segment order


class CacheReads:
    """The reads of `cache.ChunkCache` (see the module's docstring)."""

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
