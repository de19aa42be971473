"""A database's advisory lock in the spool (`copier.lock`, as Verneuil's):
taken around every manifest upload, so that a manifest upload never
overtakes a newer one from this host; waited for at most ``lock_timeout``,
then the upload goes on without it (as Verneuil). Something else under the
lock file's name is moved aside to the dead letters.

Tested by tests/test_copier_unit.py (test_manifest_lock_serialises_uploads).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from typing import Iterator

from verneuil_fuse.copier import spool as sp
from verneuil_fuse.copier.pacing import Stopped

log = logging.getLogger(__name__)


class DbLocks:
    """The database locks of `copier.Copier` (see the module's docstring)."""

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
