"""Past states of databases on the mount: ``<database>@<time>`` resolved on
lookup to a pinned replica of the version current at that time.

`PastStates.resolve(key, path, at_ns)` lists the versions of the manifest
`key` in the store (`Backend.list_versions`), finds the newest, in the
store's order, whose time is at or before `at_ns` (`history.newest_at_async`:
the newest version first, then back through the history, several manifest
GETs + decodes at a time, each version's time read once) and returns a
`Replica` of it: its bytes never change, and it reads through the mount's one
`Fetcher`, so it shares the chunk cache (memory and disk) with the live file.
The same version gets the same replica (and inode) for as long as the kernel
or an open handle holds it (`forget` is called when the catalog drops it).

Caches, all bounded: each version's time by (key, version id) (a version
never changes), and each database's version listing for `LISTING_TTL`
seconds (the lookups of one `sqlite3` open share one listing), or until the
catalog installs a new live version of it, whichever comes first.

Errors: no version that old (or a chosen version whose manifest cannot be
read) is None, which the mount answers ENOENT; a store that fails or does not
answer within the fetcher's deadline is `FetchError` (EREMOTEIO).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Callable

import trio

from verneuil_fuse.reader.fetcher import FetchError, Fetcher
from verneuil_fuse.format import ManifestError
from verneuil_fuse.history import format_time, newest_at_async, version_time_ns
from verneuil_fuse.reader.replica import PrefetchConfig, Replica
from verneuil_fuse.store import NotFound, StoreError, TooLarge

log = logging.getLogger(__name__)

# Seconds a database's version listing is reused: opening a database makes
# several lookups of the same name within milliseconds (stat, open, the
# journal's name), and a new version is at least one copier poll away.
LISTING_TTL = 2.0
# Databases whose listing is kept (LRU): one entry per database recently
# looked up at a past time.
LISTINGS_KEPT = 256
# Version times kept (LRU): 24 bytes of key each, so 64 Ki entries are a few
# MiB, enough for the binary searches of many databases with long histories.
TIMES_KEPT = 65536


class PastStates:
    """The past states looked up on one mount (see the module docstring)."""

    def __init__(self, fetcher: Fetcher, alloc_inode: Callable[[], int], *,
                 prefetch: PrefetchConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.fetcher = fetcher
        self.alloc_inode = alloc_inode
        self.prefetch = prefetch
        self.clock = clock
        self._listings: OrderedDict[str, tuple[float, str, list]] = OrderedDict()
        self._times: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._replicas: dict[tuple[str, str], Replica] = {}
        self.lookups = 0
        self.manifest_reads = 0

    def forget(self, replica: Replica) -> None:
        """The catalog dropped `replica` (no lookup, no open handle left)."""
        for ident, held in list(self._replicas.items()):
            if held is replica:
                del self._replicas[ident]

    async def _listing(self, key: str, live: str) -> list:
        """VersionInfo of every version of `key`, oldest first; `live` names
        the catalog's live version (a listing made before it is stale)."""
        now = self.clock()
        cached = self._listings.get(key)
        if cached is not None and now - cached[0] < LISTING_TTL and cached[1] == live:
            self._listings.move_to_end(key)
            return cached[2]
        infos = await self.fetcher.manifest_versions(key)
        self._listings[key] = (now, live, infos)
        while len(self._listings) > LISTINGS_KEPT:
            self._listings.popitem(last=False)
        return infos

    async def _load(self, key: str, info) -> tuple[int, Any]:
        """(time in ns, decoded manifest or None when unreadable) of one version."""
        self.manifest_reads += 1
        try:
            blob = await self.fetcher.get_manifest_version(key, info.version_id)
            manifest = await self.fetcher.decode_manifest(blob)
        except (ManifestError, TooLarge, NotFound) as e:
            log.warning("version %s of %s is unreadable: %s", info.version_id, key, e)
            manifest = None
        t, _ = version_time_ns(manifest, info.mtime)
        self._times[(key, info.version_id)] = t
        while len(self._times) > TIMES_KEPT:
            self._times.popitem(last=False)
        return t, manifest

    async def resolve(self, key: str, path: str, at_ns: int, live: str = "") -> Replica | None:
        """The replica of `key` as it was at `at_ns` (None: no such version);
        `path` is the name looked up, for logs; `live` the version the
        catalog serves as the live file."""
        self.lookups += 1
        try:
            with trio.fail_after(self.fetcher.deadline):
                return await self._resolve(key, path, at_ns, live)
        except trio.TooSlowError:
            raise FetchError("%s: no answer from the store within %.0fs" % (path, self.fetcher.deadline)) from None
        except StoreError as e:
            raise FetchError("%s: %s" % (path, e)) from None

    async def _resolve(self, key: str, path: str, at_ns: int, live: str) -> Replica | None:
        infos = await self._listing(key, live)
        manifests: dict[int, Any] = {}

        async def times_of(indices: list[int]) -> list[int]:
            times: dict[int, int] = {}

            async def one(index: int) -> None:
                cached = self._times.get((key, infos[index].version_id))
                if cached is not None:
                    times[index] = cached
                else:
                    times[index], manifests[index] = await self._load(key, infos[index])

            async with trio.open_nursery() as nursery:
                for index in indices:
                    nursery.start_soon(one, index)
            return [times[index] for index in indices]

        index = await newest_at_async(len(infos), at_ns, times_of)
        if index is None:
            log.info("%s: no version as old as %s", path, format_time(at_ns))
            return None
        info = infos[index]
        ident = (key, info.version_id)
        held = self._replicas.get(ident)
        if held is not None:
            return held
        manifest = manifests.get(index)
        if manifest is None:  # its time was cached, or it is unreadable
            t, manifest = await self._load(key, info)
            if manifest is None:
                return None
        held = self._replicas.get(ident)  # another lookup may have made it meanwhile
        if held is not None:
            return held
        t, _ = version_time_ns(manifest, info.mtime)
        replica = Replica(key=key, path=path, manifest=manifest, fetcher=self.fetcher,
                          inode=self.alloc_inode(), mtime_ns=t, prefetch=self.prefetch)
        self._replicas[ident] = replica
        log.info("%s: version %s from %s (%d bytes)", path, info.version_id, format_time(t), replica.size)
        return replica


def split_name(name: str) -> tuple[str, str] | None:
    """(database name, time text) of a past-state name ``<db>@<time>``, or
    None.  The last ``@`` splits (times hold none; database names may)."""
    base, at, when = name.rpartition("@")
    if not at or not base or not when:
        return None
    return base, when

