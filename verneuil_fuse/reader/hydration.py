"""Eager hydration (mount option ``hydrate``): every chunk of a database's
newest version fetched into the disk cache in the background.

- `FetcherHydration.hydrate` (the fetcher's part): the chunks of one
  version, through the fetcher's flights, a few at a time, each block of
  `HYDRATE_BLOCK` chunks taking its places in the disk cache back to back;
- `CatalogHydration` (the catalog's part): which databases, when
  (`HYDRATE_AT_ONCE` at a time; one that could not fetch every chunk again
  after `HYDRATE_RETRY_SECONDS`), and their progress in the stats.

Tested by tests/test_reader_fetcher.py (test_hydrate) and
tests/test_reader_catalog.py (test_hydrate_fills_the_disk_cache,
test_hydrate_takes_databases_a_few_at_a_time,
test_hydrate_warns_once_when_the_databases_exceed_the_cache).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Iterable

import trio

from verneuil_fuse.format import ChunkSource, Fprint
from verneuil_fuse.reader.flights import Flight
from verneuil_fuse.reader.replica import Replica
from verneuil_fuse.reader.store_gets import FetchError

log = logging.getLogger(__name__)

# Hydration takes the disk cache's places for this many chunks at a time
# (1 MiB), back to back, so that the kernel's largest read requests find
# them in one run even while a second database hydrates alongside.
HYDRATE_BLOCK = 16


@dataclass
class HydrateProgress:
    """How far one eager hydration went (`Fetcher.hydrate`)."""

    chunks: int = 0  # chunks it had to fetch (the others were cached)
    done: int = 0  # of which fetched (or found cached meanwhile)
    failed: int = 0  # of which could not be fetched
    error: str | None = None  # the first failure


class FetcherHydration:
    """The hydration of `fetcher.Fetcher` (see the module's docstring)."""

    async def hydrate(self, fps: Iterable[Fprint], parallel: int | None = None,
                      progress: HydrateProgress | None = None,
                      sources: list[ChunkSource] | None = None) -> int:
        """Make sure every chunk is in the disk cache (eager hydration),
        counting in ``progress`` as it goes; ``sources`` as for `read_into`.
        Returns the number of chunks that were fetched or checked; raises
        FetchError, once all were tried, if some could not be fetched."""
        progress = progress if progress is not None else HydrateProgress()
        parallel = parallel or self.prefetch_slots.total_tokens
        sem = trio.Semaphore(parallel)
        fps = list(fps)
        where = dict(zip(fps, sources)) if sources is not None else {}
        todo = [fp for fp in dict.fromkeys(fps)
                if fp not in self.mem and not (self.cache is not None and self.cache.has_indexed(fp))]
        progress.chunks = len(todo)

        async def one(flight: Flight) -> None:
            try:
                await self._wait([flight])
                if flight.error is None:
                    progress.done += 1
                else:
                    progress.failed += 1
                    if progress.error is None:
                        progress.error = str(flight.error)
            finally:
                sem.release()

        cache = self.cache
        async with trio.open_nursery() as nursery:
            for at in range(0, len(todo), HYDRATE_BLOCK):
                block = todo[at : at + HYDRATE_BLOCK]
                # The block's places in the disk cache, back to back in file
                # order, before the other database hydrating meanwhile takes
                # the next ones (its flights start as slots free up).
                slots = cache.reserve_many(len(block)) if cache is not None else [None] * len(block)
                try:
                    for k, fp in enumerate(block):
                        await sem.acquire()
                        slot, slots[k] = slots[k], None
                        flight = self._inflight.get(fp)
                        if flight is None and not (cache is not None and cache.has_indexed(fp)):
                            flight = self._start(fp, prefetch=True, hydrate=True, slot=slot,
                                                 source=where.get(fp))
                        elif slot is not None:
                            slot.abandon()
                        if flight is None:  # cached meanwhile
                            progress.done += 1
                            sem.release()
                        else:
                            nursery.start_soon(one, flight)
                finally:  # cancelled: give back the places not used
                    for slot in slots:
                        if slot is not None:
                            slot.abandon()
        if progress.failed:
            raise FetchError("%d of %d chunks could not be fetched (%s)"
                             % (progress.failed, progress.chunks, progress.error))
        return len(todo)


# An eager hydration that could not fetch every chunk (a store outage, a
# missing chunk) is started again at the first poll this many seconds after
# it ended: the database does not stay half-hydrated until its next version,
# and a store that is down is not asked for every chunk at every poll.
HYDRATE_RETRY_SECONDS = 60.0
# Databases hydrated at the same time; the others wait their turn ("queued").
# Each one keeps `prefetch_concurrency` GETs busy already: more at once would
# only queue flights ahead of the readahead of the files being read (whose
# prefetches are dropped past the fetcher's bound on prefetch flights).
HYDRATE_AT_ONCE = 2


@dataclass
class _Hydration:
    """The eager hydration of one database (its newest version)."""

    version: str
    progress: HydrateProgress = field(default_factory=HydrateProgress)
    state: str = "queued"  # queued, running, done, incomplete
    finished_at: float = 0.0
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    def describe(self) -> dict:
        p = self.progress
        out = {"state": self.state, "version": self.version, "chunks": p.chunks, "fetched": p.done,
               "failed": p.failed}
        if p.error is not None:
            out["error"] = p.error
        return out


class CatalogHydration:
    """The hydration schedule of `catalog.Catalog` (see the module's
    docstring): which databases, when, and how far each went."""

    def _start_hydration(self, key: str) -> None:
        """Hydrate database ``key`` in the background, unless under way (a
        hydration under way goes on with the newest version when it ends)."""
        h = self._hydrations.get(key)
        if h is not None and h.state in ("queued", "running"):
            return
        assert self._nursery is not None
        self._hydrations[key] = h = _Hydration("")
        self._nursery.start_soon(self._hydrate, key, h)

    async def _hydrate(self, key: str, h: _Hydration) -> None:
        with h.scope:  # cancelled when the database leaves the store
            async with self._hydrate_slots:
                while True:
                    entry = self.entries.get(key)
                    if entry is None:
                        return
                    h.state = "running"
                    start = time.monotonic()
                    version = ""
                    try:
                        replica = await self.decoded(entry)
                        if not isinstance(replica, Replica):
                            return
                        h.version = version = replica.version
                        fps, sources = replica.all_remote_chunks()
                        n = await self.fetcher.hydrate(fps, progress=h.progress, sources=sources)
                        h.state = "done"
                        log.info("hydrated %s: %d chunks in %.1fs", replica.path, n, time.monotonic() - start)
                    except Exception as e:  # noqa: BLE001 - hydration is best effort
                        h.state = "incomplete"
                        log.warning("hydration of %s is incomplete: %s (tried again in %.0fs)",
                                    os.path.join(entry.parent.path, entry.name), e, HYDRATE_RETRY_SECONDS)
                    h.finished_at = self.clock()
                    entry = self.entries.get(key)
                    if (entry is None or entry.current is None or entry.current.version == version
                            or self._hydrations.get(key) is not h):
                        return
                    # A newer version arrived meanwhile: it is hydrated next.
                    h = self._hydrations[key] = _Hydration(entry.current.version, scope=h.scope)

    def _after_poll_hydration(self) -> None:
        """Once per poll: start again the hydrations left incomplete long
        enough ago; warn (once) when the databases exceed the disk cache."""
        now = self.clock()
        for key, h in list(self._hydrations.items()):
            if h.state == "incomplete" and now - h.finished_at >= HYDRATE_RETRY_SECONDS and key in self.entries:
                self._start_hydration(key)
        capacity = self.fetcher.cache_capacity()
        if capacity is not None and not self._warned_cache_size:
            total = self.known_bytes()
            if total > capacity:
                self._warned_cache_size = True
                log.warning("hydration: the databases (%.1f MiB) do not fit in the disk cache (%.1f MiB: cache_size, "
                            "or less if its disk is smaller): it will evict chunks it hydrated",
                            total / (1 << 20), capacity / (1 << 20))
