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

`Copier` owns the passes, the store's requests (paced, retried), the
manifests' uploads and the size bound; its other jobs are parts in modules
of their own: `consume` (step 2), `seqlock` (step 3), `chunk_uploads`,
`touch` (the touch patrol), `db_lock`; what it refuses is in `refusals`.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import random
import shutil
import threading
import time
from typing import Callable, Optional

from verneuil_fuse import format as fmt
from verneuil_fuse.store import LAYOUT_PACKED, Reads, StoreError, TransientError
from verneuil_fuse.copier import spool as sp
from verneuil_fuse.copier.chunk_uploads import PREPARE_THREADS, ChunkUploads
from verneuil_fuse.copier.consume import SnapshotConsumer
from verneuil_fuse.copier.db_lock import DbLocks
from verneuil_fuse.copier.packer import Packer
from verneuil_fuse.copier.pacing import (DEFAULT_BURST, DEFAULT_RATE, Backoff, RecentSet, Stopped,
                                         TokenBucket, retry)
from verneuil_fuse.copier.refusals import BadSnapshot, OtherStore, PastBound
from verneuil_fuse.copier.seqlock import StagingSync, _raw_fp
from verneuil_fuse.copier.touch import TouchPatrol
from verneuil_fuse.pool import DaemonPool

log = logging.getLogger(__name__)

DAY = 86400.0


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


class Copier(SnapshotConsumer, StagingSync, ChunkUploads, TouchPatrol, DbLocks):
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
        # The store's manifests and chunks read back (base chunks, the
        # store's current manifest), bounded by max_db_size, paced and retried.
        self.reads = Reads(store, max_db_size=max_db_size, request=self._request)
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
        self.packer = Packer(self) if store.layout == LAYOUT_PACKED else None

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


    # -- manifests ------------------------------------------------------------

    def _validate(self, raw: bytes) -> fmt.Manifest:
        try:
            return self.reads.decode(raw)
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
        """Whether the store's current manifest `name` is the staged `raw`."""
        return bool(self.reads.holds(name, raw))


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


