"""The fetcher's flights from start to end: one per chunk under way
(single-flight), queued for the chunk engine (`flights.EnginePath`) or run
in a task (`_fly`: a prefetch slot, the disk cache, else the store);
the engine path's answers (`flights.FlightOwner`); a flight given up on
answers demand reads from that failure for `fetcher.FAILED_CHUNK_TTL`;
a flight done gives back its unused place in the disk cache and wakes its
waiters.

Tested by tests/test_reader_fetcher.py (test_single_flight,
test_engine_path_batches_gets_without_a_task_per_chunk,
test_engine_path_demand_joins_a_queued_prefetch,
test_engine_path_queued_demand_fails_at_its_deadline,
test_engine_path_refused_runs_flights_in_tasks).
"""
from __future__ import annotations

from typing import Any

import trio

from verneuil_fuse.format import ChunkSource, Fprint
from verneuil_fuse.reader.flights import Flight
from verneuil_fuse.reader.store_gets import _GET_FAILURES, FetchError, _worth_retrying


_RESERVE = object()  # `FlightRuns._start`: take the chunk's place in the disk cache now


class FlightRuns:
    """The flights of `fetcher.Fetcher` (see the module's docstring)."""

    def _start(self, fp: Fprint, prefetch: bool, hydrate: bool = False, slot: Any = _RESERVE,
               source: ChunkSource | None = None) -> Flight:
        """Start the flight of one chunk; ``slot``: its place in the disk
        cache, taken here unless given; ``source``: where the chunk is in a
        packed store (None: its own chunk object). A GET the chunk engine can
        make is queued for `EnginePath.pump` (the caller calls it once its
        flights are started; a pack's adjacent chunks go as one range read);
        anything else runs in a task (`_fly`)."""
        if self._nursery is None:
            raise RuntimeError("Fetcher.bind(nursery) was not called")
        # The chunk's place in the disk cache is taken now, in the order
        # fetches start (a sequential read's are in file order), not when
        # its bytes arrive, in whatever order the GETs end; not for a chunk
        # the cache has (a read of it that had to wait for the disk).
        cache = self.cache
        if slot is _RESERVE:
            slot = cache.reserve() if cache is not None and not cache.has_indexed(fp) else None
        flight = Flight(fp, prefetch, slot, source)
        self._inflight[fp] = flight
        if prefetch:
            self._prefetch_flights += 1
        # A prefetch's chunk is not in the index (`prefetch` skips those), and
        # it does not wait for a rescan of the cache directory for chunks
        # other processes stored: a rescan is due every second, and the
        # prefetches of a scan would take a thread and a GET of their own
        # each while one is; a demand read looks (`might_have`).
        if hydrate or not self._engine.available or (
                cache is not None and not prefetch and cache.might_have(fp)):
            self._nursery.start_soon(self._fly, flight, hydrate)
        else:
            self._engine.queue(flight)
        return flight

    async def _fly(self, flight: Flight, hydrate: bool, first_error: BaseException | None = None) -> None:
        """A flight in a task: a prefetch slot first (a prefetch), then the
        disk cache or the store; ``first_error``: its first GET failed on the
        engine path, this is its retries."""
        fp = flight.fp
        slot = False
        try:
            if flight.prefetch and not flight.promoted:
                try:  # a free slot costs no trip through the scheduler
                    self.prefetch_slots.acquire_on_behalf_of_nowait(flight)
                    slot = True
                except trio.WouldBlock:
                    with trio.CancelScope() as flight.wait_scope:
                        await self.prefetch_slots.acquire_on_behalf_of(flight)
                        slot = True
                    flight.wait_scope = None
            if first_error is None:
                flight.data = await self._load(fp, flight, hydrate)
            else:
                data = await self._download(fp, flight, failed=1, last=first_error)
                flight.data = self._landed(flight, data, hydrate)
        except FetchError as e:
            self._fail(flight, e)
        except BaseException as e:  # noqa: BLE001 - reported to every waiter
            flight.error = e
            if not isinstance(e, Exception):
                raise
        finally:
            if slot:
                self.prefetch_slots.release_on_behalf_of(flight)
            self._finish(flight)

    def _fail(self, flight: Flight, error: FetchError) -> None:
        """A flight given up on: its waiters get ``error``, and so do demand
        reads of the chunk for `FAILED_CHUNK_TTL`."""
        flight.error = error
        if len(self._failed) >= self.max_prefetch_flights:
            self._failed.clear()  # a bound, not a policy: entries live seconds
        self._failed[flight.fp] = (trio.current_time(), error)

    def _finish(self, flight: Flight) -> None:
        """A flight is over (bytes or error): give back its place in the
        disk cache if unused, and wake its waiters."""
        flight.finish()
        if flight.slot is not None:  # not handed to the bytes' writer
            flight.slot.abandon()
            flight.slot = None
        if flight.prefetch:
            self._prefetch_flights -= 1
        del self._inflight[flight.fp]
        if flight.waiters is not None:
            for waiter in flight.waiters:
                waiter.left -= 1
                if not waiter.left:
                    waiter.event.set()

    async def _load(self, fp: Fprint, flight: Flight, hydrate: bool) -> bytes:
        if self.cache is not None and self.cache.might_have(fp):
            cache = self.cache
            if hydrate:
                if await trio.to_thread.run_sync(cache.has_blocking, fp, limiter=self.cache_limiter):
                    if not flight.promoted:  # nobody waits for the bytes
                        return b""
            data = await trio.to_thread.run_sync(cache.get, fp, limiter=self.cache_limiter)
            if data is not None:
                self.stats["disk_hits"] += 1
                self.mem.put(fp, data)
                if not flight.prefetch or flight.promoted:
                    self._hold(fp, data)
                return data
        data = await self._download(fp, flight)
        return self._landed(flight, data, hydrate)

    def engine_answered(self, flight: Flight, result: bytes | BaseException, size: int, cached: bool) -> None:
        """`FlightOwner`, in trio: a GET of the engine path answered (its
        slots given back). Bytes finish the flight; an error worth a retry
        hands it to a task (`_fly`), any other (or the last) fails it."""
        if not flight.rides:  # a request's answer counts once, not once per chunk it carried
            self.limit.answered(result if isinstance(result, BaseException) else None)
        if not isinstance(result, BaseException):
            self.stats["get_bytes"] += size
            self._store_answered()
            flight.data = self._landed(flight, result, False, cached)
            self._finish(flight)
            return
        if not isinstance(result, _GET_FAILURES):  # a bug: reported to every waiter, as in a task
            flight.error = result
            self._finish(flight)
            return
        name = flight.fp.name
        self._count_get_error(name, result, 1, 0.0)
        if _worth_retrying(result) and self.retries > 0 and trio.current_time() < flight.deadline:
            flight.to_task()
            assert self._nursery is not None
            self._nursery.start_soon(self._fly, flight, False, result)
            return
        else:
            self._fail(flight, self._gave_up(name, 1, result))
        self._finish(flight)

    def queue_expired(self, flight: Flight) -> None:
        """`FlightOwner`: a demand flight waited for a GET slot until its
        deadline (a store that holds every slot without answering): failed."""
        error = TimeoutError("no answer from the store within the %.0fs deadline (last: none)" % self.deadline)
        self._fail(flight, self._gave_up(flight.fp.name, 0, error))
        self._finish(flight)

    def run_in_task(self, flight: Flight) -> None:
        """`FlightOwner`: the engine cannot take the flight: a task runs it."""
        flight.to_task()
        assert self._nursery is not None
        self._nursery.start_soon(self._fly, flight, False)
