"""Copiers: ship a spool (docs/SPOOL.md) to a blob store.  See docs/COPIER.md.

Public API:

- `Copier(spool_dir, store, **options)`: `.run_once()`, `.flush(timeout)`,
  `.run()` (until `.stop()`), `.stats`.
- `start_background(spool=None, store=None, **options) -> BackgroundCopier`:
  a copier on a daemon thread inside the current (writer) process; it never
  blocks commits.  `.stop(timeout)`, `.wake()`, `.flush(timeout)`, `.stats`;
  also a context manager.  `spool`/`store` default to VERNEUIL_CONFIG.
- `spool_status(spool_dir, store=None)`: per-database lag report.

What reads a store back (restore, versions, repair) is `verneuil_fuse.readback`.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

from verneuil_fuse.copier.copier import BadSnapshot, Copier, CopierStats, OtherStore
from verneuil_fuse.copier.pacing import DEFAULT_BURST, DEFAULT_RATE, Backoff, Stopped, TokenBucket
from verneuil_fuse.copier.spool import NotASpool
from verneuil_fuse.copier.status import spool_status

log = logging.getLogger(__name__)

__all__ = [
    "BackgroundCopier", "BadSnapshot", "Backoff", "Copier", "CopierStats", "OtherStore",
    "DEFAULT_BURST", "DEFAULT_RATE", "NotASpool",
    "Stopped", "TokenBucket", "spool_status", "start_background",
]


class BackgroundCopier:
    """A `Copier` running on a daemon thread (see `start_background`)."""

    def __init__(self, copier: Copier, owns_store: bool = False, options: Optional[dict] = None):
        self.copier = copier
        self._owns_store = owns_store
        self._options = dict(options or {})
        self.thread = threading.Thread(target=self._main, name="verneuil-copier", daemon=True)

    def _main(self) -> None:
        try:
            self.copier.run()
        except BaseException:  # never let the thread die noisily in a writer
            log.exception("background copier crashed")

    @property
    def stats(self) -> CopierStats:
        return self.copier.stats

    def wake(self) -> None:
        """Ask for a pass now (e.g. right after a commit)."""
        self.copier.wake()

    def flush(self, timeout: Optional[float] = 60.0) -> None:
        """Wait until everything spooled so far is in the store, by running
        passes in the calling thread with a second copier (copiers need no
        coordination, so this is safe alongside the background thread)."""
        options = dict(self._options, create_spool=False)
        helper = Copier(self.copier.spool_dir, self.copier.store, **options)
        try:
            helper.flush(timeout)
        finally:
            helper.close()

    def stop(self, timeout: Optional[float] = 10.0) -> bool:
        """Stop the thread; True if it ended within `timeout`."""
        self.copier.stop()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)
        alive = self.thread.is_alive()
        if not alive:
            self.copier.close()
            if self._owns_store:
                self.copier.store.close()
        return not alive

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def __enter__(self) -> "BackgroundCopier":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_background(spool: Optional[str] = None, store=None, **options) -> BackgroundCopier:
    """Start a copier thread for `spool` (default: the configuration's
    `replication_spooling_dir`) into `store` (a Store, or a spec for
    `open_store`; default VERNEUIL_CONFIG).  The spool is created if missing.
    Returns the handle; call `.stop()` to end it (it is a daemon thread, so
    it never holds up interpreter exit)."""
    from verneuil_fuse import config
    from verneuil_fuse.store import Store, open_store
    owns = False
    if not isinstance(store, Store):
        store = open_store(store)
        owns = True
    if spool is None:
        spool = config.spool_dir(None)
    options.setdefault("create_spool", True)
    handle = BackgroundCopier(Copier(spool, store, **options), owns_store=owns, options=options)
    handle.thread.start()
    return handle
