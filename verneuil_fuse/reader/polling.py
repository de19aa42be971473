"""The catalog's polls: each lists the manifest bucket, adds the new
databases by name, reads again the manifests of the decoded ones whose
listing changed (or settled too recently: `tree.SETTLE_SECONDS`), forgets
the version of the others, removes what left the store, and reads every
manifest of a store small enough to keep them all decoded (see "Polling"
in `catalog`'s docstring).

Tested by tests/test_reader_catalog.py (test_tree_versions_and_removal,
test_bad_manifest_is_skipped, test_a_database_found_by_name_during_a_poll_stays).
"""
from __future__ import annotations

import logging
from typing import Any

import trio

from verneuil_fuse.format import ManifestError
from verneuil_fuse.reader.replica import Replica
from verneuil_fuse.reader.store_gets import FetchError
from verneuil_fuse.reader.tree import SETTLE_SECONDS, DbEntry
from verneuil_fuse.store import StoreError, TooLarge

log = logging.getLogger(__name__)

# Manifests read at once when a poll reads every one of a small store
# (`Catalog._read_all`): more than the fetcher's threads for manifests
# (META_THREADS), so that they never wait on this bound, few enough that a
# lookup's own manifest read queues behind at most this many.
READ_ALL_AT_ONCE = 8
# A listed manifest that did not decode is read again after this long, then
# after twice as long at each failure, up to BAD_RETRY_MAX_S, even if its
# listing did not change: an S3 answer carries no checksum of its body, so a
# body damaged on the way (cut, bytes flipped) looks like a damaged blob,
# and must not keep a good database out of the tree until a remount. A blob
# damaged in the store then costs one GET (and one log line) per 10 minutes.
BAD_RETRY_S = 10.0
BAD_RETRY_MAX_S = 600.0


class Polling:
    """The polls of `catalog.Catalog` (see the module's docstring)."""

    async def run(self) -> None:
        """Poll forever, every ``refresh_interval`` seconds."""
        while True:
            await trio.sleep(self.refresh_interval)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - keep serving what we have
                self.poll_errors += 1
                log.exception("refresh failed")

    async def refresh(self, raise_errors: bool = False) -> None:
        """One poll. A listing error is logged and counted, or raised (as a
        StoreError) with ``raise_errors`` (for the first poll at mount)."""
        self.polls += 1
        self._found_while_listing = set()
        try:
            infos = await self.fetcher.list_manifests()
        except StoreError as e:
            self.poll_errors += 1
            if raise_errors:
                raise
            log.warning("cannot list manifests: %s", e)
            return
        self.last_poll = self.clock()
        self._absent.clear()
        listed = set()
        added = 0
        todo = []
        for info in infos:
            key = info.key
            listed.add(key)
            entry = self.entries.get(key)
            if entry is None:
                bad = self._bad.get(key)
                if (bad is None or bad[:2] != (info.size, info.mtime) or bad[2] - info.mtime < SETTLE_SECONDS
                        or self._retry_bad(key, bad[2])):
                    self._bad.pop(key, None)
                    added += self._add(key, info.size, info.mtime) is not None
                continue
            if (entry.size == info.size and entry.listed_mtime == info.mtime
                    and (entry.current is None or entry.fetched_at - info.mtime >= SETTLE_SECONDS)):
                continue
            if isinstance(entry.current, Replica):
                todo.append((entry, info))
            else:
                self._relist(entry, info.size, info.mtime)
        if added:
            log.info("%d new database(s) in the store (%d in all)", added, len(self.entries))
        await self._reload(todo)
        for key in self.entries.keys() - listed - self._found_while_listing:
            self._remove(key)
        for key in self._bad.keys() - listed:
            del self._bad[key]
        for key in self._bad_tries.keys() - listed:
            del self._bad_tries[key]
        if len(self.entries) <= self.decoded_limit:
            await self._read_all()
        if self.hydrate and self._nursery is not None:
            self._after_poll_hydration()

    def _retry_bad(self, key: str, failed_at: float) -> bool:
        """Whether the manifest ``key``, which did not decode when read at
        ``failed_at``, is due to be read again (`BAD_RETRY_S`); counts the
        try."""
        tries = self._bad_tries.get(key, 0)
        if self.clock() - failed_at < min(BAD_RETRY_MAX_S, BAD_RETRY_S * 2 ** tries):
            return False
        self._bad_tries[key] = tries + 1
        return True

    async def _read_all(self) -> None:
        """A store whose databases all fit in ``decoded_limit``: read every
        manifest not read yet, now (in parallel, ``READ_ALL_AT_ONCE`` at a
        time), so that a first query costs no manifest GET, as a mount of
        such a store can keep them all decoded anyway."""
        todo = [e for e in self.entries.values() if e.current is None and e.inode not in self._loading]
        if not todo:
            return
        slots = trio.Semaphore(READ_ALL_AT_ONCE)

        async def read(entry: DbEntry) -> None:
            async with slots:
                try:
                    await self.materialize(entry)
                except FetchError as e:
                    self.poll_errors += 1
                    log.warning("cannot load manifest %s: %s", entry.key, e)

        async with trio.open_nursery() as nursery:
            for entry in todo:
                nursery.start_soon(read, entry)

    def _relist(self, entry: DbEntry, size: int, mtime: float) -> None:
        """The listing of a database not decoded changed: it forgets its
        version, read again at its next lookup under a new inode."""
        entry.size, entry.listed_mtime, entry.fetched_at = size, mtime, 0.0
        old = entry.current
        if old is None:
            return
        entry.current, entry.lookups = None, 0
        entry.inode = self._alloc()
        self.inodes[entry.inode] = entry
        self._maybe_drop(old)
        if self.on_invalidate is not None:
            self.on_invalidate(entry.parent.inode, entry.name)

    async def _reload(self, todo: list[tuple[DbEntry, Any]]) -> None:
        """Fetch again the manifests of decoded databases whose listing
        changed, in parallel; install the new versions."""
        results: dict[str, Any] = {}

        async def load(entry: DbEntry, info) -> None:
            fetched_at = self.clock()
            try:
                blob = await self.fetcher.get_manifest_blob(info.key)
                fetched_at = self.clock()
                manifest = await self.fetcher.decode_manifest(blob)
                results[info.key] = (entry, info, manifest, fetched_at, blob)
                self._bad.pop(info.key, None)
            except ManifestError as e:
                self.poll_errors += 1
                if e.rule == "base-chunk":  # its base chunk may be fetched next time
                    log.warning("cannot load manifest %s: %s", info.key, e)
                    return
                self._bad[info.key] = (info.size, info.mtime, fetched_at)
                log.warning("cannot load manifest %s: %s (read again when it changes, or later)", info.key, e)
            except TooLarge as e:
                self.poll_errors += 1
                self._bad[info.key] = (info.size, info.mtime, fetched_at)
                log.warning("cannot load manifest %s: %s (read again when it changes, or later)", info.key, e)
            except StoreError as e:
                self.poll_errors += 1
                log.warning("cannot load manifest %s: %s", info.key, e)
            except Exception:  # noqa: BLE001 - one bad manifest must not stop the poll
                self.poll_errors += 1
                log.exception("cannot load manifest %s", info.key)

        async with trio.open_nursery() as nursery:
            for entry, info in todo:
                nursery.start_soon(load, entry, info)
        for key in sorted(results):
            entry, info, manifest, fetched_at, blob = results[key]
            if self.entries.get(key) is not entry:
                continue
            if key in self._bad:
                self._remove(key)
                continue
            entry.size, entry.listed_mtime = info.size, info.mtime
            await self._cache_put(entry, fetched_at, manifest, blob)
            self._install(entry, manifest, fetched_at)
        for entry, info in todo:  # a reload that failed for good: out of the tree until it changes
            if info.key in self._bad and self.entries.get(info.key) is entry:
                self._remove(info.key)
