"""The catalog's manifest reads, outside a poll: a database known by name
read at its first lookup (from the manifest cache when it holds the listed
blob), a blob the follow loop read (`offer`), a name not in the tree looked
up in the store directly, and the versions parked past ``decoded_limit``
decoded again (`Stale` when the store no longer serves them).

Tested by tests/test_reader_catalog.py (test_manifests_read_on_lookup_and_parked_past_the_bound,
test_parked_version_gone_from_the_store_is_stale, test_unlisted_database_is_found_by_name)
and tests/test_mount_local_state.py (the manifest cache).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import trio

from verneuil_fuse.format import ManifestError
from verneuil_fuse.reader.manifests import Cached
from verneuil_fuse.reader.replica import Replica
from verneuil_fuse.reader.store_gets import FetchError
from verneuil_fuse.reader.tree import CONTROL_DIR, SETTLE_SECONDS, DbEntry, Directory, Parked, Stale
from verneuil_fuse.reader.paths import key_of
from verneuil_fuse.store import NotFound, StoreError, TooLarge

log = logging.getLogger(__name__)

# Names SQLite looks for beside a database at every transaction (hot journal
# and WAL checks): never looked up in the store by name, since a writer never
# replicates them and each lookup would be a GET.
SQLITE_SIDE_FILES = ("-journal", "-wal", "-shm")
# Names remembered as absent from the store between two polls: beyond this
# many (a scan of a directory for many random names), all are forgotten at
# once, so the set stays small.
ABSENT_NAMES_MAX = 10_000
# The listed mtime of a database found by name before any listing showed it:
# no real mtime, so the next listing counts as a change (one more GET).
UNLISTED_MTIME = -1.0


class ManifestLoads:
    """The manifest reads of `catalog.Catalog` outside a poll, and its
    decoded versions parked and unparked (see the module's docstring)."""

    def _keep_decoded(self, replica: Replica) -> None:
        self._decoded[replica.inode] = replica
        self._decoded.move_to_end(replica.inode)
        self._trim()

    def _trim(self) -> None:
        """Park the least recently used decoded versions that no handle has
        open, down to ``decoded_limit`` (open ones stay, whatever the bound)."""
        if len(self._decoded) <= self.decoded_limit:
            return
        for inode in list(self._decoded):
            if len(self._decoded) <= self.decoded_limit:
                break
            replica = self._decoded[inode]
            if replica.opens > 0:
                continue
            del self._decoded[inode]
            if self.inodes.get(inode) is not replica:
                continue
            parked = Parked.of(replica)
            self.inodes[inode] = parked
            entry = self.entries.get(replica.key)
            if entry is not None and entry.current is replica:
                entry.current = parked
            self.counts["parks"] += 1

    async def _unpark(self, parked: Parked) -> None:
        """Decode a parked version again (from the manifest cache, else the
        store); Stale when neither has that version any more."""
        self.counts["unparks"] += 1
        cached = await self._cache_get(parked.key)
        manifest = None
        if cached is not None and cached.version == parked.version:
            manifest = await self._decode_cached(parked.key, parked.path, cached.blob)
        if manifest is None:
            try:
                blob = await self._fetch_blob(parked.key)
                manifest = await self.fetcher.decode_manifest(blob)
            except (ManifestError, TooLarge, NotFound) as e:
                raise Stale("%s: version %s is gone (%s)" % (parked.path, parked.version[:16], e)) from None
        if manifest.contents_fprint.hex() != parked.version:
            self.counts["stale"] += 1
            raise Stale("%s: version %s is no longer in the store" % (parked.path, parked.version[:16]))
        if self.inodes.get(parked.inode) is not parked:
            return  # forgotten meanwhile
        replica = Replica(key=parked.key, path=parked.path, manifest=manifest, fetcher=self.fetcher,
                          inode=parked.inode, mtime_ns=parked.mtime_ns, prefetch=self.prefetch)
        replica.lookups, replica.reads = parked.lookups, parked.reads
        replica.read_bytes, replica.preloaded = parked.read_bytes, parked.preloaded
        self.inodes[parked.inode] = replica
        entry = self.entries.get(parked.key)
        if entry is not None and entry.current is parked:
            entry.current = replica
        self._keep_decoded(replica)

    async def _load_entry(self, entry: DbEntry) -> bool:
        """Read and decode the manifest of ``entry`` (known by name only),
        from the manifest cache when it holds the listed blob; install it as
        the entry's newest version. False when it is not valid."""
        self.counts["loads"] += 1
        path = os.path.join(entry.parent.path, entry.name)
        cached = await self._cache_get(entry.key)
        manifest = None
        blob = None
        fetched_at = 0.0
        if (cached is not None and (cached.size, cached.mtime) == (entry.size, entry.listed_mtime)
                and cached.fetched_at - cached.mtime >= SETTLE_SECONDS):
            manifest = await self._decode_cached(entry.key, path, cached.blob)
            if manifest is not None:
                blob, fetched_at = cached.blob, cached.fetched_at
        try:
            if manifest is None:
                blob = await self._fetch_blob(entry.key)
                fetched_at = self.clock()
                manifest = await self.fetcher.decode_manifest(blob)
        except NotFound:
            log.info("database %s is gone from the store", path)
            self._remove(entry.key)
            return False
        except (ManifestError, TooLarge) as e:
            self.poll_errors += 1
            if not (isinstance(e, ManifestError) and e.rule == "base-chunk"):
                self._bad[entry.key] = (entry.size, entry.listed_mtime, fetched_at or self.clock())
            log.warning("cannot load manifest %s: %s", entry.key, e)
            self._remove(entry.key)
            return False
        if self.entries.get(entry.key) is not entry:
            return False
        await self._cache_put(entry, fetched_at, manifest, blob)
        self._install(entry, manifest, fetched_at)
        return True

    async def offer(self, entry: DbEntry, blob: bytes, fetched_at: float) -> bool:
        """A manifest blob of ``entry`` read outside a poll (the follow
        loop's checks): installed through the same path as a poll's, a new
        version unless it equals the current one. False when it does not
        decode (logged, counted; the next poll decides about the entry) or
        the entry left the tree meanwhile."""
        try:
            manifest = await self.fetcher.decode_manifest(blob)
        except (ManifestError, TooLarge) as e:
            self.poll_errors += 1
            log.warning("cannot load manifest %s: %s", entry.key, e)
            return False
        if self.entries.get(entry.key) is not entry:
            return False
        await self._cache_put(entry, fetched_at, manifest, blob)
        if self.entries.get(entry.key) is not entry:
            return False
        self._install(entry, manifest, fetched_at)
        return True

    async def _fetch_blob(self, key: str) -> bytes:
        try:
            return await self.fetcher.get_manifest_blob(key)
        except (NotFound, TooLarge):
            raise
        except StoreError as e:
            raise FetchError("manifest %s: %s" % (key, e)) from None

    async def _decode_cached(self, key: str, path: str, blob: bytes) -> Any:
        """The manifest a blob of the manifest cache decodes to; None when
        it does not (a damaged local copy, never the store's answer): the
        entry is dropped and logged, and the caller asks the store."""
        try:
            return await self.fetcher.decode_manifest(blob)
        except (ManifestError, TooLarge) as e:
            self.counts["cache_dropped"] += 1
            log.warning("manifest cache: the copy of %s does not decode (%s): dropped, read from the store",
                        path, e)
            assert self.manifest_cache is not None
            await trio.to_thread.run_sync(self.manifest_cache.drop, key)
            return None

    async def _cache_get(self, key: str) -> Cached | None:
        if self.manifest_cache is None:
            return None
        return await trio.to_thread.run_sync(self.manifest_cache.get, key)

    async def _cache_put(self, entry: DbEntry, fetched_at: float, manifest, blob: bytes) -> None:
        if self.manifest_cache is None:
            return
        record = Cached(entry.size, entry.listed_mtime, fetched_at, manifest.contents_fprint.hex(), bytes(blob))
        await trio.to_thread.run_sync(self.manifest_cache.put, entry.key, record)

    async def _lookup_unlisted(self, parent: Directory, name: str) -> DbEntry | None:
        """A database not in the tree, looked up by its manifest name (one
        GET): found, it joins the tree at once. Only in a host's directories,
        not for SQLite's own side files (a writer never replicates them,
        and a reader asks for them at every transaction), and once per name
        between two polls. A name with an ``@`` is looked up too, before
        it may be read as a past state (a real database always wins): a
        store failure then raises FetchError rather than let the past
        state of another database answer."""
        parts = []
        node: Directory | None = parent
        while node is not None and node.parent is not None:
            parts.append(node.name)
            node = node.parent
        parts.reverse()
        if (parts and parts[0] == CONTROL_DIR) or name.endswith(SQLITE_SIDE_FILES):
            return None
        parts = self.subdir + parts
        if not parts:
            return None
        path = "/" + "/".join(parts[1:] + [name])
        key = key_of(parts[0], parts[1:] + [name])
        if key is None or key in self._absent or key in self.entries or key in self._bad:
            return None
        if len(self._absent) >= ABSENT_NAMES_MAX:
            self._absent.clear()
        self.counts["direct_lookups"] += 1
        try:
            blob = await self._fetch_blob(key)
        except NotFound:
            self._absent.add(key)
            return None
        except TooLarge as e:
            self._bad[key] = (-1, UNLISTED_MTIME, self.clock())
            log.warning("cannot load manifest %s: %s", key, e)
            return None
        except FetchError as e:
            log.warning("lookup of %s in the store: %s", path, e)
            if "@" in name:
                raise
            return None
        entry = self._add(key, len(blob), UNLISTED_MTIME)
        if entry is None:
            return None
        self.counts["direct_found"] += 1
        self._found_while_listing.add(key)
        log.info("new database %s (found by name)", os.path.join(parent.path, name))
        try:
            manifest = await self.fetcher.decode_manifest(blob)
        except (ManifestError, TooLarge) as e:
            self._bad[key] = (entry.size, entry.listed_mtime, self.clock())
            log.warning("cannot load manifest %s: %s", key, e)
            self._remove(key)
            return None
        self._install(entry, manifest, self.clock())
        return entry
