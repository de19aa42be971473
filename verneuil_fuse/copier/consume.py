"""The copier's consumption of `ready` snapshots (docs/SPOOL.md): `ready`
renamed to `consuming`, each snapshot in it pinned with an O_PATH
descriptor and flocked (a live consumer's is left alone, a dead one's taken
over), its chunks uploaded (none for a database past `max_db_size`) before
its manifest, which is uploaded under the database's lock; anything that is
not the writer's moved to the dead letters.

Tested by tests/test_copier_unit.py (test_ready_then_staging_round_trip,
test_leftover_consuming_is_finished_and_busy_one_left,
test_a_consuming_that_is_not_a_directory_is_moved_aside,
test_unexpected_files_are_dead_lettered) and tests/test_copier_bound.py.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil

from verneuil_fuse import format as fmt
from verneuil_fuse.copier import spool as sp
from verneuil_fuse.copier.packer import Unplaced
from verneuil_fuse.copier.refusals import BadSnapshot, PastBound

log = logging.getLogger(__name__)


class SnapshotConsumer:
    """The consumption of `ready` by `copier.Copier` (see the module's docstring)."""

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
