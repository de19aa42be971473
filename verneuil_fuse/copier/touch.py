"""The copier's touch patrol: the objects of live manifests (chunks, or
packs in the packed layout) touched about once per ``touch_interval`` per
database, shared by every copier through the mtime of `copier.touched`, so
that a store's expiry never takes a chunk a live manifest names; a
database that stops changing is patrolled from its staged manifest. A
missing object is said once per database and patrol.

Tested by tests/test_copier_unit.py (test_touch_about_once_a_day,
test_idle_database_chunks_are_touched).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time

from verneuil_fuse import format as fmt
from verneuil_fuse.copier import spool as sp
from verneuil_fuse.copier.refusals import BadSnapshot
from verneuil_fuse.store import NotFound

log = logging.getLogger(__name__)


class TouchPatrol:
    """The touch patrol of `copier.Copier` (see the module's docstring)."""

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
