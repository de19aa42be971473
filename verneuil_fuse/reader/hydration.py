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

from dataclasses import dataclass
from typing import Iterable

import trio

from verneuil_fuse.format import ChunkSource, Fprint
from verneuil_fuse.reader.flights import Flight
from verneuil_fuse.reader.store_gets import FetchError


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
                slots = [cache.reserve() if cache is not None else None for _ in block]
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
