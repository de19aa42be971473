"""Where the fetcher's chunks land: the in-memory LRU, the chunks held for
the reads that fetched them (`HOLD_SECONDS`; a chunk of a run buffer as a
view while they keep few such buffers alive), and the disk cache, written
in batches, one worker thread hop per batch, in the places the flights took
when they started (`cache.CacheSlot`).

Tested by tests/test_reader_fetcher.py (test_disk_cache_is_verified_and_shared,
test_prefetched_chunks_land_in_the_order_fetches_started,
test_held_chunks_keep_few_run_buffers_alive) and tests/test_faults.py (the
held chunks).
"""
from __future__ import annotations

import trio

from verneuil_fuse.format import Fprint
from verneuil_fuse.reader.cache import CacheSlot
from verneuil_fuse.reader.flights import Flight, store_chunk


# A chunk fetched for a read stays in memory at least this long and among the
# last `HOLD_CHUNKS` so fetched, whatever `mem_cache` says: the kernel may
# split one read of a program into several requests for the same chunk (page
# by page, after a failed readahead), and each must find the bytes the first
# one got, or the program gets a short read. A SQLite page never straddles two
# chunks, so it is then read whole or not at all. Milliseconds separate such
# requests; 2 s and 64 chunks (4 MiB) leave a wide margin at a small cost.
HOLD_SECONDS = 2.0
HOLD_CHUNKS = 64
# Run buffers (4-5 MiB each) the held chunks may keep alive: a read that
# waited for a run holds chunks of one or two, and a copy of each chunk
# beyond bounds what holding costs whatever the reads are.
HOLD_RUN_BUFFERS = 4


class Landing:
    """Where `fetcher.Fetcher`'s chunks land (see the module's docstring)."""

    def _memory(self, fp: Fprint, refresh: bool = True) -> bytes | None:
        """The chunk from the in-memory LRU (made its most recently used
        unless not ``refresh``), or held since a recent read."""
        data = self.mem.get(fp) if refresh else self.mem.peek(fp)
        if data is None and self._held:
            held = self._held.get(fp)
            if held is not None:
                if held[0] >= trio.current_time():
                    return held[1]
                del self._held[fp]
                self._unheld(held[1])
        return data

    def _hold(self, fp: Fprint, data: bytes | memoryview) -> None:
        """Keep a chunk fetched for a read (see `HOLD_SECONDS`). A chunk of
        a run buffer (`chunk_engine.RUN_BUFFER_PARTS`) is kept as it is
        while the held chunks keep at most `HOLD_RUN_BUFFERS` such buffers
        alive, as a copy beyond."""
        held, bases = self._held, self._held_bases
        if type(data) is memoryview:
            if not bases.holds(data) and len(bases) >= HOLD_RUN_BUFFERS:
                data = bytes(data)
            else:
                bases.add(data)
        old = held.pop(fp, None)
        if old is not None:
            self._unheld(old[1])
        held[fp] = (trio.current_time() + HOLD_SECONDS, data)
        while len(held) > HOLD_CHUNKS:
            self._unheld(held.popitem(last=False)[1][1])

    def _unheld(self, data: bytes | memoryview) -> None:
        """A held chunk let go: its run buffer counted once less."""
        if type(data) is memoryview:
            self._held_bases.remove(data)

    def _used(self, fp: Fprint) -> None:
        if fp in self._prefetched_unused:
            self._prefetched_unused.discard(fp)
            self.stats["prefetch_hits"] += 1

    def _landed(self, flight: Flight, data: bytes, hydrate: bool, cached: bool = False) -> bytes:
        """Downloaded bytes: counted, kept in memory (those a read waits
        for held, see `HOLD_SECONDS`), written to the disk cache unless
        ``cached`` (the chunk engine did)."""
        fp = flight.fp
        self.stats["store_fetches"] += 1
        if flight.prefetch and not flight.promoted:
            self.stats["prefetch_fetched"] += 1
            if not hydrate:
                self._prefetched_unused.add(fp)
        if not hydrate or flight.promoted:
            self.mem.put(fp, data)
        if not flight.prefetch or flight.promoted:
            self._hold(fp, data)
        if self.cache is not None:
            if not cached:
                self._cache_put(fp, data, flight.slot)
            flight.slot = None  # with the bytes' writer now
        return data

    def _cache_put(self, fp: Fprint, data: bytes, slot: CacheSlot | None = None) -> None:
        """Queue a chunk for the disk cache: `_write_loop` writes what has
        queued up in one thread hop, not a hop per chunk."""
        self._to_write.append((fp, data, slot))
        if not self._writing:
            assert self._writes is not None
            self._writing = True
            self._writes.start_soon(self._write_loop)

    async def _write_loop(self) -> None:
        """Write the queued chunks, a batch per thread hop, until none is
        left; a cancelled loop gives back the slots of what it did not write."""
        cache = self.cache
        assert cache is not None

        def write(batch: list) -> None:
            for fp, data, slot in batch:
                store_chunk(cache, fp, data, slot)

        batch: list = []
        try:
            while self._to_write:
                batch, self._to_write = self._to_write, []
                await trio.to_thread.run_sync(write, batch, limiter=self.cache_limiter)
                batch = []
        finally:
            self._writing = False
            for _fp, _data, slot in batch + self._to_write:  # cancelled before the thread took them
                if slot is not None:
                    slot.abandon()
            self._to_write = []
