"""Copiers: move a spool (docs/SPOOL.md) into a store, wait-free for writers.

A `Copier` makes passes over the current boot root of one spool.  For each
database directory it

1. finishes `consuming` if there is one (its owner may have died, or is
   still at it: helping is harmless, every step is idempotent);
2. takes `ready` by renaming it to `consuming`, and consumes it: every chunk
   is uploaded (and unlinked) before the manifest, which is uploaded under
   the database's advisory lock; the snapshot directory is pinned with an
   O_PATH descriptor so that every path goes through /proc/self/fd/N;
3. uploads and unlinks the chunks in `staging/chunks`, then uploads the
   staged manifest if the sequence-lock check passes: same file identity
   before and after checking that `staging/chunks` is empty and that there
   is neither `ready` nor `consuming`.  The check runs under the lock, so a
   manifest upload never overtakes a newer one from this host.

A manifest of a database past `max_db_size` (`format.MAX_REPLICATED_DB_SIZE`
by default, the writer's own bound; VERNEUIL_CONFIG lowers it for the
writer, the copiers and `lag` alike) is refused: said once per database at
ERROR, recorded in `copier.stopped` (removed once a manifest of it is
uploaded again), the chunks of a refused `ready` snapshot deleted unsent,
its manifest moved to the (bounded) dead letters.

Uploads are zstd frames (docs/FORMAT.md); requests are paced by a token bucket
and transient errors retried with jittered exponential backoff.  Chunks
uploaded recently are remembered (bounded LRU) and not sent again.  Chunks of
live manifests are touched about once a day.  Any number of copiers, in any
number of processes, may work on one spool.

On a store of the packed layout (``layout=packed``) the chunk files go into
packs and each manifest is uploaded with the place of every chunk; the steps
and their order stay the same (`packer.Packer`, docs/COPIER.md "The packed
layout").
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import random
import shutil
import stat
import threading
import time
from typing import Callable, Iterator, Optional

from .. import format as fmt
from ..store import NotFound, StoreError, TransientError
from . import spool as sp
from .packer import Packer, Unplaced
from .pacing import (DEFAULT_BURST, DEFAULT_RATE, Backoff, RecentSet, Stopped,
                     TokenBucket, retry)
from .pool import DaemonPool, InFlight

log = logging.getLogger(__name__)

DAY = 86400.0
# Chunk PUTs one database's pass keeps in flight on the store's HTTP engine
# when uploads are unpaced: 64 answers per 20 ms round trip is ~200 MB/s of
# 64 KiB chunks, past what a plain multipart upload reaches on this machine,
# and the engine's own bound is 128.
ASYNC_PUTS_IN_FLIGHT = 64
# Threads that read, check and compress the chunk files for those PUTs:
# zstd and the fingerprint release the GIL, so about one per core, plus one
# for the file system calls; more only contend for the GIL.
PREPARE_THREADS = 3


class BadSnapshot(Exception):
    """A spooled snapshot we will not upload (moved aside or skipped)."""


class PastBound(BadSnapshot):
    """A snapshot of a database past `max_db_size`: the database stops
    replicating until it is back under the bound."""


class OtherStore(StoreError):
    """A database of the spool was shipped to another chunk store: its chunks
    went there and left the spool, so a manifest uploaded to this store would
    name chunks this store does not have. Nothing is uploaded for it."""


@dataclasses.dataclass
class CopierStats:
    passes: int = 0
    chunks_uploaded: int = 0
    chunks_skipped: int = 0        # in the recent-uploads LRU: not sent again
    chunk_bytes_raw: int = 0
    chunk_bytes_sent: int = 0      # compressed
    manifests_uploaded: int = 0
    manifests_skipped: int = 0     # staged manifest already in the store
    packs_uploaded: int = 0        # packed layout: packs put (chunks_uploaded counts their chunks)
    chunks_repacked: int = 0       # packed layout: chunks packed again by compaction
    packs_deleted: int = 0         # packed layout: packs no kept version needs, deleted
    dead_letters: int = 0
    touches: int = 0
    touch_missing: int = 0
    errors: int = 0
    requests: int = 0
    last_error: str = ""
    last_upload: float = 0.0       # time.time() of the last manifest upload

    def snapshot(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """The counters in one short line, for the log."""
        return ("%d passes, %d chunks uploaded (%d bytes sent), %d manifests uploaded, %d requests, %d errors"
                % (self.passes, self.chunks_uploaded, self.chunk_bytes_sent, self.manifests_uploaded,
                   self.requests, self.errors))


@dataclasses.dataclass
class _DbState:
    """What this process remembers about one database directory."""

    staged_done: dict = dataclasses.field(default_factory=dict)   # name -> Identity
    staged_bad: dict = dataclasses.field(default_factory=dict)    # name -> Identity
    last_raw: dict = dataclasses.field(default_factory=dict)      # name -> Fprint of raw bytes
    next_touch_check: float = 0.0                                 # time.monotonic()
    announced: bool = False                                       # "replicating ..." logged


def _raw_fp(raw: bytes) -> fmt.Fprint:
    return fmt.fingerprint(raw, fmt.DIRECTORY_KEY)


class Copier:
    """Copies one spool directory into one store.

    `store` is a `verneuil_fuse.store.Store`.  `rate`/`burst`: request pacing
    (token bucket; rate 0 disables it).  `workers`: parallel chunk uploads.
    `db_workers`: databases handled at once.
    `lock_timeout`: how long to wait for a database's `copier.lock` before
    uploading anyway (as Verneuil).  `poll_interval`: idle wait of `run`.
    `touch_interval`: how often the chunks of live manifests are touched.
    """

    def __init__(self, spool_dir: str, store, *, rate: Optional[float] = DEFAULT_RATE,
                 burst: int = DEFAULT_BURST, workers: int = 4, db_workers: int = 4,
                 lock_timeout: float = 5.0,
                 poll_interval: float = 0.2, touch_interval: float = DAY,
                 recent_capacity: int = 1 << 16, backoff: Optional[Backoff] = None,
                 verify_chunks: bool = True, create_spool: bool = False,
                 stop_event: Optional[threading.Event] = None,
                 cleanup_interval: float = 60.0, max_db_size: int = fmt.MAX_REPLICATED_DB_SIZE):
        self.spool_dir = os.path.abspath(spool_dir)
        self.max_db_size = max_db_size
        self._stopped_said: set[str] = set()  # databases whose refusal was logged
        sp.check_spool(self.spool_dir, create=create_spool)
        self.store = store
        self.bucket = TokenBucket(rate, burst)
        self.backoff = backoff or Backoff()
        self.lock_timeout = lock_timeout
        self.poll_interval = poll_interval
        self.touch_interval = touch_interval
        self.verify_chunks = verify_chunks
        self.recent = RecentSet(recent_capacity)
        self.stats = CopierStats()
        self.stop_event = stop_event or threading.Event()
        self.wake_event = threading.Event()
        self.cleanup_interval = cleanup_interval
        self.workers = workers
        self.db_workers = db_workers
        self._pool = DaemonPool(workers)
        # Databases are handled in parallel too (their chunk uploads share
        # `_pool`, whose tasks never wait on other tasks: no deadlock).
        self._db_pool = DaemonPool(db_workers, name="copier-db")
        # Readers of the chunk files uploaded on the store's engine
        # (`_upload_chunks_async`); their tasks wait only on the engine.
        self._prepare_pool = DaemonPool(PREPARE_THREADS, name="copier-prepare")
        self._states: dict[str, _DbState] = {}
        self._stats_lock = threading.Lock()
        self._touch_queue: list[tuple[str, str]] = []  # (chunk name, database) to touch
        self._touch_warned: set[str] = set()  # databases with a missing chunk this patrol
        self._next_cleanup = 0.0
        self._deadline: Optional[float] = None  # set by flush(timeout)
        # The packed layout's path (None: Verneuil's, an object per chunk).
        self.packer = Packer(self) if getattr(store, "layout", "chunks") == "packed" else None

    # -- plumbing -----------------------------------------------------------

    def close(self) -> None:
        self._pool.close()
        self._db_pool.close()
        self._prepare_pool.close()

    def stats_snapshot(self) -> dict:
        """`stats` as a dict, read under the lock the workers count under."""
        with self._stats_lock:
            return self.stats.snapshot()

    def _count(self, **kw) -> None:
        with self._stats_lock:
            for k, v in kw.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def _request(self, fn: Callable, what: str):
        """One store request: paced, retried while transient."""
        def attempt():
            deadline = self._deadline
            if (deadline is not None and time.monotonic() >= deadline) or \
                    not self.bucket.acquire(1, self.stop_event, deadline):
                # flush(timeout): no new request once it is over, nor one
                # whose token would come after it (what was uploaded stays
                # uploaded; the rest is still in the spool).
                raise TimeoutError("gave up at the deadline with uploads still pending in %s"
                                   % self.spool_dir)
            self._count(requests=1)
            return fn()
        return retry(attempt, transient=(TransientError,), backoff=self.backoff,
                     stop=self.stop_event, what=what, deadline=self._deadline)

    def _state(self, db: sp.DbDir) -> _DbState:
        st = self._states.get(db.path)
        if st is None:
            st = self._states[db.path] = _DbState()
        return st

    def _dead_letter(self, db: sp.DbDir, path: str, what: str) -> None:
        if sp.dead_letter(db.root, path, "%s.%s" % (db.name, what)):
            self._count(dead_letters=1)

    def _open_lock_file(self, db: sp.DbDir) -> int:
        """Open (creating) the database's lock file; something else under
        that name (a directory, a symlink, a FIFO) is moved aside first."""
        path = db.sub(sp.LOCK_FILE)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        for _ in range(2):
            try:
                fd = os.open(path, flags, 0o666)
            except (IsADirectoryError, OSError) as e:
                if isinstance(e, IsADirectoryError) or e.errno in (errno.ELOOP, errno.ENXIO):
                    self._dead_letter(db, path, "lock")
                    continue
                raise
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
            os.close(fd)
            self._dead_letter(db, path, "lock")
        raise OSError(errno.EEXIST, "cannot create a lock file", path)

    @contextlib.contextmanager
    def _db_lock(self, db: sp.DbDir) -> Iterator[bool]:
        """The database's advisory flock, waited for at most lock_timeout;
        yields whether it is held (on timeout we go on without, as Verneuil)."""
        fd = self._open_lock_file(db)
        try:
            deadline = time.monotonic() + self.lock_timeout
            delay = 0.001
            held = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        log.warning("%s: copier lock still busy after %.1fs; uploading anyway",
                                    db.path, self.lock_timeout)
                        break
                    if self.stop_event.wait(delay):
                        raise Stopped()
                    delay = min(delay * 2, 0.05)
            yield held
        finally:
            os.close(fd)  # releases the flock

    # -- chunks ---------------------------------------------------------------

    def _fetch_chunk(self, fp: fmt.Fprint) -> bytes:
        """A base chunk, for a staged manifest that names one."""
        blob = self._request(lambda: self.store.chunks.get(fp.name, max_bytes=fmt.base_chunk_blob_limit()),
                             "get base chunk")
        return fmt.decode_base_chunk(blob, fp)

    def _upload_chunk_file(self, db: sp.DbDir, dirpath: str, name: str) -> bool:
        """Upload one chunk file and unlink it; False if it was a bad copy of
        a chunk (moved aside: its snapshot lacks that chunk)."""
        got = self._chunk_blob(db, dirpath, name)
        if isinstance(got, bool):
            return got
        raw_len, blob = got
        self._request(lambda: self.store.chunks.put(name, blob), "put chunk")
        self._uploaded(dirpath, name, raw_len, len(blob))
        return True

    def _uploaded(self, dirpath: str, name: str, raw_len: int, sent_len: int) -> None:
        """A chunk file is in the store: remembered, counted, unlinked."""
        self.recent.add(name)
        self._count(chunks_uploaded=1, chunk_bytes_raw=raw_len, chunk_bytes_sent=sent_len)
        sp.unlink_quiet(os.path.join(dirpath, name))

    def _chunk_blob(self, db: sp.DbDir, dirpath: str, name: str) -> tuple[int, bytes] | bool:
        """One chunk file read and checked for upload: (its length, its zstd
        frame), or the outcome when there is nothing to send: True (a chunk
        sent recently, the zero chunk, or gone), False (a bad copy, moved
        aside)."""
        path = os.path.join(dirpath, name)
        try:
            fp = fmt.parse_chunk_name(name)
        except fmt.BadName:
            # Not a chunk at all, so no snapshot can miss it: just move it aside.
            self._dead_letter(db, path, "badname." + name)
            return True
        if name in self.recent or fp == fmt.ZERO_CHUNK_FPRINT:
            if sp.unlink_quiet(path):
                self._count(chunks_skipped=1)
            return True
        try:
            data = sp.read_regular(path, fmt.CHUNK_SIZE + 1)
        except FileNotFoundError:
            if os.path.islink(path):  # a dangling symlink: junk, not a chunk
                self._dead_letter(db, path, "dangling." + name)
                return False
            # Gone: another copier uploaded it, or the writer dropped it (GC,
            # or its link went to `ready`).  A file at `path` by now is a
            # copy the writer staged since: a live chunk, sent at the next
            # pass (until then `staging/chunks` is not empty).
            return True
        except IsADirectoryError:  # or a FIFO, socket, device (NotRegular)
            self._dead_letter(db, path, "dir." + name)
            return False
        if len(data) > fmt.CHUNK_SIZE or (
                self.verify_chunks and fmt.chunk_fingerprint(data) != fp):
            self._dead_letter(db, path, "mismatch." + name)
            return False
        return len(data), fmt.compress_chunk(data)

    def _upload_chunk_dir(self, db: sp.DbDir, dirpath: str, meta_dir: str) -> int:
        """Upload every chunk file in `dirpath` (their manifest is in
        `meta_dir`); the number of bad files."""
        names = sp.listdir_or_empty(dirpath)
        if not names:
            return 0
        if self.packer is not None:
            name, order = _dir_manifest(meta_dir, self.max_db_size)
            if name is None:
                return 0  # no manifest yet: packs are named after it
            return self.packer.pack_chunk_dir(db, dirpath, name, order)
        names, bad = self._upload_chunks_async(db, dirpath, names)
        results = self._pool.map(lambda n: self._upload_chunk_file(db, dirpath, n), names)
        first_error = None
        for ok, value in results:
            if not ok:
                if first_error is None or isinstance(first_error, Stopped):
                    first_error = value
            elif value is False:
                bad += 1
        if first_error is not None:
            raise first_error
        return bad

    def _upload_chunks_async(self, db: sp.DbDir, dirpath: str, names: list[str]) -> tuple[list[str], int]:
        """Upload the chunk files `names` on the store's HTTP engine
        (`put_async`: many PUTs in flight, no thread waiting on each) when
        it has one and uploads are unpaced, as for a first sync; a few
        threads read, check and compress the files meanwhile. Returns the
        number of bad files (moved aside) and the names left to
        `_upload_chunk_file` (which paces, retries, creates a missing bucket
        and says why a request failed): every name without an engine, else
        those whose turn came at a deadline or a stop, or whose PUT failed."""
        put_async = getattr(self.store.chunks, "put_async", None)
        if put_async is None or self.bucket.rate or len(names) < 2:
            return names, 0
        in_flight = InFlight(ASYNC_PUTS_IN_FLIGHT)
        failed: list[str] = []

        def send(name: str) -> bool | None:
            """True: sent or nothing to send; False: a bad file, moved
            aside; None: left to `_upload_chunk_file`."""
            deadline = self._deadline
            if self.stop_event.is_set() or (deadline is not None and time.monotonic() >= deadline):
                return None
            got = self._chunk_blob(db, dirpath, name)
            if isinstance(got, bool):
                return got
            raw_len, blob = got

            def done(error: StoreError | None) -> None:
                if error is None:
                    self._uploaded(dirpath, name, raw_len, len(blob))
                else:
                    failed.append(name)
                in_flight.leave()

            in_flight.enter()
            try:
                started = put_async(name, blob, done)
            except BaseException:
                in_flight.leave()
                raise
            if not started:
                in_flight.leave()
                return None
            self._count(requests=1)
            return True

        try:
            results = self._prepare_pool.map(send, names)
        finally:
            in_flight.drain()
        left = [n for n, (ok, outcome) in zip(names, results) if not ok or outcome is None]
        bad = sum(1 for ok, outcome in results if ok and outcome is False)
        return left + failed, bad

    # -- manifests ------------------------------------------------------------

    def _validate(self, raw: bytes) -> fmt.Manifest:
        try:
            return fmt.decode_and_validate(raw, fetch_chunk=self._fetch_chunk, max_db_size=self.max_db_size)
        except fmt.ManifestError as e:
            raise (PastBound if e.rule == "size-limit" else BadSnapshot)(str(e)) from None

    def _past_bound(self, raw: bytes) -> bool:
        """Whether a manifest describes a database past `max_db_size`
        (checked before its chunks are sent; anything else it may be wrong
        with is `_validate`'s to say)."""
        try:
            fmt.decode_and_validate(raw, max_db_size=self.max_db_size)
        except fmt.ManifestError as e:
            return e.rule == "size-limit"
        return False

    def _stopped(self, db: sp.DbDir, why: str) -> None:
        """A manifest of `db` is past `max_db_size`: record since when in
        `copier.stopped` (once), and say it once per database."""
        record = json.dumps({"since": time.time(), "max_db_size": self.max_db_size, "reason": why})
        sp.write_new(db.sub(sp.STOPPED_FILE), record.encode())
        with self._stats_lock:
            first = db.name not in self._stopped_said
            self._stopped_said.add(db.name)
        if first:
            log.error("%s: NOT replicated from now on: %s (max_db_size %s; the store keeps its last copy; "
                      "`verneuilctl lag` shows it)", db.source() or db.path, why, fmt.format_size(self.max_db_size))

    def _replicates(self, db: sp.DbDir) -> None:
        """A manifest of `db` reached the store: no longer stopped."""
        if sp.unlink_quiet(db.sub(sp.STOPPED_FILE)):
            with self._stats_lock:
                self._stopped_said.discard(db.name)
            log.warning("%s: replicated again (back under max_db_size)", db.source() or db.path)

    def _upload_manifest(self, db: sp.DbDir, name: str, raw: bytes, m: fmt.Manifest) -> None:
        """Upload a manifest (with its chunks' places, in the packed layout:
        Unplaced if some have none)."""
        if self.packer is not None:
            m = self.packer.upload_manifest(db, name, raw, m)
        else:
            blob = fmt.compress_manifest(raw)
            self._request(lambda: self.store.manifests.put(name, blob), "put manifest")
        self._state(db).last_raw[name] = _raw_fp(raw)
        self._replicates(db)
        self._count(manifests_uploaded=1)
        self.stats.last_upload = time.time()
        state = self._state(db)
        if not state.announced:
            state.announced = True
            log.info("replicating %s", db.source() or db.path)
            log.debug("%s: manifest %s", db.source() or db.path, name)
        log.debug("uploaded manifest %s (%d bytes, %d chunks)", name, m.len, len(m.chunks))
        self._maybe_schedule_touch(db, m)
        if self.packer is not None:
            self.packer.collect(db, name)

    def _store_has(self, name: str, raw: bytes) -> bool:
        """Whether the store's current manifest `name` holds exactly `raw`."""
        try:
            blob = self._request(lambda: self.store.manifests.get(name), "get manifest")
        except NotFound:
            return False
        if blob == raw:
            return True
        if self.packer is not None:
            return self.packer.store_copy(blob) == raw
        if blob.startswith(fmt.ZSTD_MAGIC):
            import zstandard
            try:
                with zstandard.ZstdDecompressor().stream_reader(blob) as r:
                    return r.read(len(raw) + 1) == raw
            except zstandard.ZstdError:
                return False
        return False

    # -- touching live chunks -------------------------------------------------

    def _maybe_schedule_touch(self, db: sp.DbDir, m: fmt.Manifest) -> None:
        """About once per touch_interval per database (shared by every copier
        through the mtime of `copier.touched`), queue the manifest's chunks
        for a touch.  A database first seen in this boot root needs none:
        every chunk of it went through this spool, and was put just now."""
        path = db.sub(sp.TOUCHED_FILE)
        try:
            age = time.time() - os.stat(path).st_mtime
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError, FileNotFoundError):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return
        if age < self.touch_interval:
            return
        os.utime(path)  # claim this round before doing it
        # Chunk 0 is never uploaded; other bundled chunks (b-tree tops) are,
        # and a later manifest may name them without bundling them.  In the
        # packed layout the objects are the packs holding them.
        names = set(fmt.stored_objects(m))
        log.info("touching %d objects of %s", len(names), db.path)
        label = db.source() or db.path
        with self._stats_lock:
            self._touch_warned.discard(label)  # a new patrol: warn again if chunks are missing
        self._touch_queue.extend((name, label) for name in sorted(names))

    def _check_idle_touch(self, db: sp.DbDir) -> None:
        """A database that stops changing gets no manifest upload, but its
        chunks stay live: every minute or so, look at `copier.touched`, and
        when a touch is due, touch the chunks of the staged manifest (the
        store holds it: this is only called when nothing is pending)."""
        state = self._state(db)
        now = time.monotonic()
        if now < state.next_touch_check:
            return
        state.next_touch_check = now + min(60.0, self.touch_interval / 4)
        try:
            age = time.time() - os.stat(db.sub(sp.TOUCHED_FILE)).st_mtime
        except FileNotFoundError:
            return  # created at the first upload of this boot root
        if age < self.touch_interval:
            return
        meta_dir = db.sub(sp.STAGING, sp.META)
        for name in sp.listdir_or_empty(meta_dir):
            try:
                raw = sp.read_regular(os.path.join(meta_dir, name))
                m = self._validate(raw)
            except (OSError, BadSnapshot):
                continue
            if self.packer is not None:  # the places the store's copy gives
                m = self.packer.ledger(db, name).last
                if m is None:
                    continue
            self._maybe_schedule_touch(db, m)

    def _touch_one(self, item: tuple[str, str]) -> None:
        name, label = item
        if name in self.recent:
            return
        try:
            self._request(lambda: self.store.chunks.touch(name), "touch chunk")
            self._count(touches=1)
        except NotFound:
            self._count(touch_missing=1)
            with self._stats_lock:  # one warning per database and patrol
                first = label not in self._touch_warned
                self._touch_warned.add(label)
            if first:
                log.warning("%s: live chunk %s is missing from the store (lost or expired; "
                            "said once per database and touch round, stats.touch_missing "
                            "counts them all): `verneuilctl repair --store STORE %s` uploads "
                            "them again from the database file", label, name, label)
            else:
                log.debug("%s: live chunk %s is missing from the store", label, name)

    def touch_some(self, limit: int = 64) -> int:
        """Touch up to `limit` queued chunks; how many are left."""
        batch, self._touch_queue = self._touch_queue[:limit], self._touch_queue[limit:]
        results = self._pool.map(self._touch_one, batch)
        failed = [(item, value) for (ok, value), item in zip(results, batch) if not ok]
        if failed:
            self._touch_queue.extend(item for item, _ in failed)  # retried next pass
            raise failed[0][1]
        return len(self._touch_queue)

    # -- ready / consuming ------------------------------------------------------

    def _take_ready(self, db: sp.DbDir) -> bool:
        """Rename a non-empty `ready` to `consuming`; True if there is now a
        `consuming` to work on (ours, or another copier's we can help)."""
        ready = db.sub(sp.READY)
        err = sp.rmdir_quiet(ready)  # footnote 7: an empty ready just goes
        if err is None:
            return False
        if err == errno.ENOTDIR:
            self._dead_letter(db, ready, "ready-file")
            return False
        if not sp.is_enotempty(err):
            raise OSError(err, os.strerror(err), ready)
        consuming = db.sub(sp.CONSUMING)
        for _ in range(2):
            try:
                os.rename(ready, consuming)
                return True
            except FileNotFoundError:
                return os.path.isdir(consuming)
            except OSError as e:
                if sp.is_enotempty(e.errno):
                    return True  # a `consuming` exists: finish that one first
                not_ours = os.path.islink(consuming) or (
                    os.path.lexists(consuming) and not os.path.isdir(consuming))
                if e.errno != errno.ENOTDIR or not not_ours:
                    raise
                # `consuming` is a file or a symlink: not ours, moved aside.
                self._dead_letter(db, consuming, "consuming-file")
        return os.path.isdir(consuming)

    def _consume(self, db: sp.DbDir) -> bool:
        """Finish `consuming`; True if there was anything to do."""
        cons = db.sub(sp.CONSUMING)
        if os.path.islink(cons):  # never followed: what it points to is not ours
            self._dead_letter(db, cons, "consuming-file")
            return True
        try:
            entries = os.listdir(cons)
        except FileNotFoundError:
            return False
        except NotADirectoryError:
            self._dead_letter(db, cons, "consuming-file")
            return True
        busy = False
        for name in entries:
            path = os.path.join(cons, name)
            if not sp.UUID_RE.match(name):
                self._dead_letter(db, path, "consuming." + name)
                continue
            try:
                # O_NOFOLLOW: a symlink (dangling or not) is junk, never a snapshot.
                fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # another copier finished it
            except NotADirectoryError:
                self._dead_letter(db, path, "consuming." + name)
                continue
            try:
                # The consumer of a snapshot holds a flock on its directory: a
                # live one is left alone, a dead one's snapshot is taken over.
                lock_fd = os.open("/proc/self/fd/%d" % fd, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    try:
                        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        busy = True
                        continue
                    self._consume_snapshot(db, fd, name)
                    sp.rmdir_quiet(path)  # uuids are never reused: this is ours
                finally:
                    os.close(lock_fd)
            except FileNotFoundError:
                continue
            finally:
                os.close(fd)
        if busy:
            return False
        sp.rmdir_quiet(cons)
        return True

    def _consume_snapshot(self, db: sp.DbDir, fd: int, label: str) -> None:
        base = "/proc/self/fd/%d" % fd
        for entry in sp.listdir_or_empty(base):
            if entry not in (sp.CHUNKS, sp.META):
                self._dead_letter(db, os.path.join(base, entry), "snapshot.%s.%s" % (label, entry))
        chunks_dir = os.path.join(base, sp.CHUNKS)
        meta_dir = os.path.join(base, sp.META)
        if self._snapshot_past_bound(meta_dir):
            shutil.rmtree(chunks_dir, ignore_errors=True)  # never sent: its manifest is refused below
        bad = self._upload_chunk_dir(db, chunks_dir, meta_dir)
        err = sp.rmdir_quiet(chunks_dir)
        if err == errno.ENOTDIR:
            self._dead_letter(db, chunks_dir, "snapshot.%s.chunks" % label)
        elif err is not None:
            for leftover in sp.listdir_or_empty(chunks_dir):
                self._dead_letter(db, os.path.join(chunks_dir, leftover), "leftover." + leftover)
                bad += 1
            sp.rmdir_quiet(chunks_dir)
        names = sp.listdir_or_empty(meta_dir)
        if names:
            if self.packer is not None and not bad:
                for name in names:
                    self._prepare_upload(db, os.path.join(meta_dir, name), name)
            with self._db_lock(db):
                for name in names:
                    self._upload_consumed_manifest(db, meta_dir, name, bad)
        if sp.rmdir_quiet(meta_dir) == errno.ENOTDIR:
            self._dead_letter(db, meta_dir, "snapshot.%s.meta" % label)

    def _snapshot_past_bound(self, meta_dir: str) -> bool:
        """Whether a snapshot's manifest describes a database past
        `max_db_size` (then its chunks are not sent)."""
        for name in sp.listdir_or_empty(meta_dir):
            try:
                raw = sp.read_regular(os.path.join(meta_dir, name))
            except OSError:
                continue
            if self._past_bound(raw):
                return True
        return False

    def _upload_consumed_manifest(self, db: sp.DbDir, meta_dir: str, name: str, bad: int) -> None:
        path = os.path.join(meta_dir, name)
        if fmt.parse_manifest_name(name) is None:
            self._dead_letter(db, path, "badname.manifest")
            return
        try:
            raw = sp.read_regular(path)
        except FileNotFoundError:
            if os.path.islink(path):  # a dangling symlink
                self._dead_letter(db, path, "dangling.manifest")
            return  # uploaded by another copier
        except IsADirectoryError:  # or a FIFO, socket, device (NotRegular)
            self._dead_letter(db, path, "dir.manifest")
            return
        if bad:
            log.error("%s: %d bad chunk files in its snapshot; manifest %s not uploaded",
                      db.path, bad, name)
            self._dead_letter(db, path, "manifest-with-bad-chunks")
            return
        try:
            m = self._validate(raw)
            self._upload_manifest(db, name, raw, m)
        except PastBound as e:
            self._stopped(db, str(e))
            self._dead_letter(db, path, "too-large.manifest")
            return
        except (BadSnapshot, Unplaced) as e:
            log.error("%s: %s; moved aside", path, e)
            self._dead_letter(db, path, "invalid.manifest")
            return
        sp.unlink_quiet(path)

    def _prepare_upload(self, db: sp.DbDir, path: str, name: str) -> None:
        """Packed layout, before a manifest's upload and outside the lock:
        compaction (`Packer.prepare`); a manifest that cannot be read is
        left to the upload, which says why."""
        try:
            m = self._validate(sp.read_regular(path))
        except (OSError, BadSnapshot):
            return
        self.packer.prepare(db, name, m)

    # -- staging ----------------------------------------------------------------

    def _staged_chunks_pending(self, db: sp.DbDir) -> bool:
        return bool(sp.listdir_or_empty(db.sub(sp.STAGING, sp.CHUNKS)))

    def _ready_or_consuming(self, db: sp.DbDir) -> bool:
        return (sp.rmdir_quiet(db.sub(sp.READY)) is not None
                or os.path.lexists(db.sub(sp.CONSUMING)))

    def _sync_staging(self, db: sp.DbDir) -> bool:
        """Upload staged chunks, then the staged manifest if the seqlock check
        passes.  True if anything was done."""
        did = False
        chunks_dir = db.sub(sp.STAGING, sp.CHUNKS)
        if sp.listdir_or_empty(chunks_dir):
            bad = self._upload_chunk_dir(db, chunks_dir, db.sub(sp.STAGING, sp.META))
            did = True
        else:
            bad = 0
        meta_dir = db.sub(sp.STAGING, sp.META)
        for name in sp.listdir_or_empty(meta_dir):
            if fmt.parse_manifest_name(name) is None:
                self._dead_letter(db, os.path.join(meta_dir, name), "staging.badname")
                continue
            did |= self._sync_staged_manifest(db, meta_dir, name, bad)
        return did

    def _sync_staged_manifest(self, db: sp.DbDir, meta_dir: str, name: str, bad: int) -> bool:
        path = os.path.join(meta_dir, name)
        state = self._state(db)
        try:
            ident0 = sp.identity_of_path(path)
        except FileNotFoundError:
            return False
        if state.staged_done.get(name) == ident0 or state.staged_bad.get(name) == ident0:
            return False  # unchanged since we uploaded (or refused) it
        if bad or self._staged_chunks_pending(db) or self._ready_or_consuming(db):
            return False  # not now: chunks in flight (a later pass will see it)
        if self.packer is not None:
            self._prepare_upload(db, path, name)
        with self._db_lock(db):
            # 1. identity of what we read (the file is immutable once published)
            try:
                fd = sp.open_regular(path)
            except FileNotFoundError:
                # A dangling symlink is not the writer's; a file that is
                # there by now is the writer's first manifest (next pass).
                if os.path.islink(path):
                    self._dead_letter(db, path, "staging.dangling")
                return False
            except IsADirectoryError:  # a directory or FIFO is not the writer's
                self._dead_letter(db, path, "staging.notfile")
                return False
            try:
                ident = sp.identity_of_fd(fd)
                with os.fdopen(os.dup(fd), "rb") as f:
                    raw = f.read()
                if state.staged_done.get(name) == ident:
                    return False
                # 2. staging/chunks empty; 3. no ready (nor consuming, whose
                # manifest is older and would be uploaded after ours)
                if self._staged_chunks_pending(db) or self._ready_or_consuming(db):
                    return False
                # 4. identity unchanged.  The descriptor stays open until
                # then: the inode cannot be freed and its number reused by a
                # later manifest (whose identity could then match ours).
                try:
                    if sp.identity_of_path(path) != ident:
                        return False
                except FileNotFoundError:
                    return False
            finally:
                os.close(fd)
            digest = _raw_fp(raw)
            known = state.last_raw.get(name)
            if known == digest or (known is None and self._store_has(name, raw)):
                # Already there (uploaded from `ready`, or by an earlier copier).
                state.staged_done[name] = ident
                state.last_raw[name] = digest
                self._count(manifests_skipped=1)
                return False
            try:
                m = self._validate(raw)
                self._upload_manifest(db, name, raw, m)
            except PastBound as e:
                self._stopped(db, str(e))
                state.staged_bad[name] = ident
                return False
            except (BadSnapshot, Unplaced) as e:
                log.error("staged manifest %s is not uploaded: %s", path, e)
                state.staged_bad[name] = ident
                return False
            state.staged_done[name] = ident
            if self.packer is not None:
                self.packer.after_staged_upload(db, name, ident.ctime_ns)
            return True

    # -- passes -----------------------------------------------------------------

    def db_pending(self, db: sp.DbDir) -> bool:
        """Whether `db` still has something to upload, as far as we know."""
        if os.path.lexists(db.sub(sp.CONSUMING)):
            return True
        if sp.listdir_or_empty(db.sub(sp.READY)):
            return True
        if self._staged_chunks_pending(db):
            return True
        state = self._state(db)
        meta_dir = db.sub(sp.STAGING, sp.META)
        for name in sp.listdir_or_empty(meta_dir):
            try:
                ident = sp.identity_of_path(os.path.join(meta_dir, name))
            except FileNotFoundError:
                continue
            if ident not in (state.staged_done.get(name), state.staged_bad.get(name)):
                return True
        return False

    def _check_store(self, db: sp.DbDir) -> None:
        """Record in the database's directory which chunk store it is shipped
        to (the first copier to get there writes `copier.store`), and refuse
        to ship it anywhere else: chunks leave the spool once uploaded, so a
        second store would get manifests naming chunks it never received.
        Read at every pass (one small file): the directory may have been
        removed and made again meanwhile."""
        mine = self.store.chunks.identity()
        path = db.sub(sp.STORE_FILE)
        for _ in range(3):
            if os.path.islink(path):  # not ours, never followed
                self._dead_letter(db, path, "store")
            try:
                recorded = sp.read_regular(path, 4096).decode("utf-8", "replace")
                break
            except FileNotFoundError:
                if sp.write_new(path, mine.encode()):
                    return
            except IsADirectoryError:  # a directory, FIFO...: not ours
                self._dead_letter(db, path, "store")
        else:
            raise OSError(errno.EAGAIN, "cannot record the database's store", path)
        if recorded != mine:
            raise OtherStore(
                "%s: this database's spool (%s) ships to %s, not %s: the chunks it sent there "
                "are no longer in the spool. To replicate it to %s, remove that directory "
                "(the VFS stages a full snapshot at the next commit; `verneuilctl sync DB` "
                "makes one now) or give the writer another spool"
                % (db.source() or db.name, db.path, recorded, mine, mine))

    def sync_db(self, db: sp.DbDir) -> bool:
        """One pass over one database; True if work was done."""
        self._check_store(db)
        did = False
        if os.path.lexists(db.sub(sp.CONSUMING)):
            did |= self._consume(db)
        if self._take_ready(db):
            did |= self._consume(db)
        did |= self._sync_staging(db)
        return did

    def cleanup_boot_roots(self) -> int:
        """Delete the boot roots of earlier boots; how many were removed."""
        removed = 0
        for path in sp.boot_roots(self.spool_dir)[1]:
            log.info("removing the spool of an earlier boot: %s", path)
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        return removed

    def dbdirs(self) -> list[sp.DbDir]:
        """Database directories of this boot (recomputed on every pass)."""
        return [db for root in sp.boot_roots(self.spool_dir)[0] for db in sp.list_dbdirs(root)]

    def _pass_db(self, db: sp.DbDir) -> bool:
        """sync_db, then whether `db` is still pending (touching idle ones)."""
        try:
            self.sync_db(db)
            if self.db_pending(db):
                return True
            self._check_idle_touch(db)
            return False
        except FileNotFoundError:
            if not os.path.isdir(db.path):
                return False  # the database directory went away
            raise
        except (StoreError, OSError) as e:
            log.debug("pass over %s failed: %s", db.path, e)
            raise

    def run_once(self, only: Optional[Callable[[sp.DbDir], bool]] = None) -> bool:
        """One pass over every database (or those `only` accepts).  Returns
        whether anything is still pending.  Store errors propagate after the
        whole pass (the first one), so one broken database does not starve
        the others."""
        now = time.monotonic()
        if now >= self._next_cleanup:
            self._next_cleanup = now + self.cleanup_interval
            self.cleanup_boot_roots()
        self._count(passes=1)
        dbs = [db for db in self.dbdirs() if only is None or only(db)]
        pending = False
        first_error: Optional[BaseException] = None
        for ok, value in self._db_pool.map(self._pass_db, dbs):
            if ok:
                pending |= value
                continue
            if isinstance(value, Stopped):
                raise value
            if not isinstance(value, (StoreError, OSError)):
                raise value
            pending = True
            self._count(errors=1)
            self.stats.last_error = "%s: %s" % (type(value).__name__, value)
            if first_error is None:
                first_error = value
        if self._touch_queue and first_error is None:
            try:
                self.touch_some()
            except StoreError as e:
                first_error = e
        if first_error is not None:
            raise first_error
        return pending

    def flush(self, timeout: Optional[float] = 60.0,
              only: Optional[Callable[[sp.DbDir], bool]] = None) -> None:
        """Pass until nothing is pending.  Transient errors are retried until
        `timeout` (None: forever); then, and for any other store error, the
        last error is raised.  TimeoutError if writers keep the spool busy
        past the timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._deadline = deadline
        try:
            self._flush(deadline, timeout, only)
        finally:
            self._deadline = None

    def _flush(self, deadline, timeout, only) -> None:
        failures = 0
        while True:
            try:
                if not self.run_once(only):
                    return
                failures = 0
                delay = 0.01
            except TransientError:
                failures += 1
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                delay = self.backoff.delay(failures)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("spool %s still has pending snapshots after %.0fs"
                                   % (self.spool_dir, timeout))
            if self.stop_event.wait(delay):
                raise Stopped()

    def run(self) -> None:
        """Copy until stop_event is set.  Never raises a store error: they
        are logged and retried with backoff (capped at a few seconds, so the
        store catches up soon after an outage ends)."""
        failures = 0
        log.info("copier started: spool %s -> %s (%s requests/s, burst %d, %d workers)", self.spool_dir,
                 self.store.url, "%g" % self.bucket.rate if self.bucket.rate else "unpaced", self.bucket.burst, self.workers)
        try:
            while not self.stop_event.is_set():
                try:
                    pending = self.run_once()
                    failures = 0
                    wait = 0.0 if pending else self.poll_interval
                except Stopped:
                    break
                except Exception as e:  # keep going whatever happens
                    failures += 1
                    self._count(errors=1)
                    self.stats.last_error = "%s: %s" % (type(e).__name__, e)
                    cap = 2.0 if isinstance(e, (TransientError, OSError)) else 10.0
                    wait = random.uniform(0.5, 1.0) * min(cap, 0.1 * 2 ** failures)
                    if failures == 1 or failures % 20 == 0:
                        log.warning("copier pass failed (%d in a row): %s", failures, e)
                    else:
                        log.debug("copier pass failed (%d in a row): %s", failures, e)
                if wait > 0:
                    self.wake_event.wait(wait)
                    self.wake_event.clear()
        finally:
            log.info("copier stopped: %s", self.stats.summary())

    def stop(self) -> None:
        self.stop_event.set()
        self.wake_event.set()

    def wake(self) -> None:
        self.wake_event.set()


def _dir_manifest(meta_dir: str, max_db_size: int) -> tuple[Optional[str], Optional[fmt.Manifest]]:
    """The manifest of a snapshot's (or staging's) `meta` directory: its
    name and, when it decodes, the manifest (None, None: there is none)."""
    for name in sorted(sp.listdir_or_empty(meta_dir)):
        if fmt.parse_manifest_name(name) is None:
            continue
        try:
            return name, fmt.decode_and_validate(sp.read_regular(os.path.join(meta_dir, name)),
                                                 max_db_size=max_db_size)
        except (OSError, fmt.ManifestError):
            return name, None
    return None, None
