"""Chunk flights, and the engine path that sends their GETs to the reader's
chunk path in C in batches.

A `Flight` is one chunk's fetch, shared by every read of it: the fetcher
(`fetcher.Fetcher`) keeps one per fingerprint under way (single-flight) and
decides what its outcome means (bytes kept and handed to its readers, a
retry in a task, a failure).

`EnginePath` carries the flights whose GET goes to the chunk engine
(`chunk_engine.ChunkEngine`, on a store whose backend gives its URLs and
signing: S3's `direct_gets`) without a task or an Event per chunk:

- flights queue for a GET slot (demand first, then prefetches, in the order
  they started, each also waiting for a prefetch slot), and `pump` starts
  all those the slots let go now in one submission;
- on the engine's thread, in C, each answer is decoded, its full
  fingerprint checked, and the chunk written into its place in the disk
  cache (the flight's `CacheSlot`);
- trio wakes once per batch of answers (`_drain`), records the cache writes
  (`CacheSlot.written`), gives the flights' slots back, hands each answer to
  the fetcher (`FlightOwner.engine_answered`) and pumps again;
- a demand flight still queued at its deadline (a store that holds every
  slot without answering) is handed back as expired (`queue_expired`);
- a backend that gives no engine path (a client that cannot sign SigV4,
  a bucket that answers from another region) turns the path off, and its
  flights, the queued ones included, run in tasks (`run_in_task`); one that
  has no credentials at the moment (a refresh failing or under way:
  `direct_gets` raises a StoreError) fails the GETs of that submission
  with it, retried as any failed GET, and the path stays: it serves again
  as soon as the credentials are back.

`get_one` is the same path for one GET a task waits for (a retry), without
a cache write: the task's own writer stores the bytes.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Protocol

import trio

from verneuil_fuse.format import MAX_CHUNK_BLOB_BYTES, ChunkSource, Fprint, chunk_mismatch
from verneuil_fuse.reader.cache import CacheSlot, ChunkCache
from verneuil_fuse.reader.chunk_engine import ChunkEngine, Outcome
from verneuil_fuse.store import DirectReads, StoreError

log = logging.getLogger(__name__)

# The shortest time limit given to a GET sent with little of its deadline
# left: enough for one round trip to a store far away.
MIN_ATTEMPT_TIMEOUT = 0.5
# Requests of the chunk engine past the fetcher's GET slots: a retry's GET
# abandoned at its deadline keeps its request until the engine ends it (its
# own time limit), and these keep the batches going meanwhile.
SPARE_REQUESTS = 16

# Where a flight is (`Flight.state`).
QUEUED = "queued"  # waiting for a GET slot, to go to the chunk engine (`EnginePath.pump`)
ENGINE = "engine"  # its GET is on the chunk engine; its answer comes back through `EnginePath`
TASK = "task"  # a trio task runs it (`FlightRuns._fly`): disk cache, threads, retries, hydration
DONE = "done"


class Flight:
    """One chunk's fetch, shared by every read of it (single-flight). Its
    waiters are the fetcher's `_Waiter` objects, one per read request however
    many of its chunks it waits for, told when the flight is done
    (`FlightRuns._finish`). Its ``state`` is written in this module only."""

    __slots__ = ("fp", "state", "data", "error", "prefetch", "promoted", "slot", "waiters", "wait_scope",
                 "deadline", "holds_prefetch_slot", "source")

    def __init__(self, fp: Fprint, prefetch: bool, slot: CacheSlot | None = None,
                 source: ChunkSource | None = None):
        self.fp = fp
        self.source = source  # a packed store's `format.ChunkSource`; None: the chunk's own object
        self.state = TASK
        self.slot = slot  # where the disk cache will put the bytes (`ChunkCache.reserve`)
        self.data: bytes | None = None
        self.error: BaseException | None = None
        self.prefetch = prefetch
        self.promoted = False  # a prefetch a demand read joined
        self.waiters: list[Any] | None = None  # the fetcher's `_Waiter`s
        self.wait_scope: trio.CancelScope | None = None  # a task's wait for a prefetch slot
        self.deadline = 0.0  # trio time; set when the deadline starts
        self.holds_prefetch_slot = False  # on the engine path

    def to_task(self) -> None:
        """A trio task runs it from now on (`FlightRuns._fly`)."""
        self.state = TASK

    def finish(self) -> None:
        """Its bytes or its error are in (`FlightRuns._finish`)."""
        self.state = DONE


def store_chunk(cache: ChunkCache, fp: Fprint, data: bytes, slot: CacheSlot | None) -> None:
    """Write a verified chunk to the disk cache, in its slot if it has one
    (blocking: a worker thread's call). A cache that
    cannot be written is not fatal: logged, the slot given back."""
    try:
        if slot is not None:
            slot.write(fp, data)
        else:
            cache.put(fp, data)
    except Exception:  # noqa: BLE001 - reads go on from the store
        log.exception("cannot write chunk %s to the cache", fp.name)
    finally:
        if slot is not None:
            slot.abandon()  # if `write` failed


class FlightOwner(Protocol):
    """What `EnginePath` needs of the fetcher whose flights it carries."""

    stats: dict[str, int]  # "gets" counts the GETs sent
    io_limiter: trio.CapacityLimiter  # a GET slot per GET in flight
    prefetch_slots: trio.CapacityLimiter  # and a prefetch slot per prefetch
    timeout: float  # one GET's time limit
    deadline: float  # a flight's, from its start (a prefetch's: from its slots)

    def engine_answered(self, flight: Flight, result: bytes | BaseException, size: int, cached: bool) -> None:
        """In trio: the GET of ``flight`` answered (its slots are given
        back): its verified bytes and the blob's size, or the error;
        ``cached``: the disk cache's write of the bytes is taken care of."""

    def queue_expired(self, flight: Flight) -> None:
        """In trio: a demand flight's deadline passed before a GET slot."""

    def run_in_task(self, flight: Flight) -> None:
        """The engine cannot take ``flight`` (it holds no slot): run it in a
        task."""


class _OneGet:
    """`EnginePath.get_one`'s wait for its answer."""

    __slots__ = ("event", "outcome")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.outcome: Outcome | None = None


class EnginePath:
    """The flights queued for, or on, the chunk engine (see the module's
    docstring). ``backend``: the chunks backend's direct reads, whose
    `direct_gets` gives the URLs and signing (None: no engine path);
    ``requests``: the engine's GETs in flight at most (the fetcher's GET
    slots)."""

    def __init__(self, owner: FlightOwner, backend: DirectReads | None, requests: int):
        self._owner = owner
        self._backend = backend
        self._off = backend is None  # no engine path (or turned off)
        self._requests = requests + SPARE_REQUESTS
        self._engine: ChunkEngine | None = None  # made at the first GET, ended with the nursery
        self.queued_demand: deque[Flight] = deque()
        self.queued_prefetch: deque[Flight] = deque()
        self._watching = False  # `_watch_queue` runs
        self._nursery: trio.Nursery | None = None

    def bind(self, nursery: trio.Nursery) -> None:
        """The engine's answers and the deadline watch are taken care of in
        ``nursery``; its end stops the engine."""
        self._nursery = nursery

    @property
    def available(self) -> bool:
        return not self._off

    def queue(self, flight: Flight) -> None:
        """Queue a flight for a GET slot (the caller calls `pump` once its
        flights are queued). A demand flight's deadline starts now, a
        prefetch's when it gets its slots."""
        flight.state = QUEUED
        if flight.prefetch:
            self.queued_prefetch.append(flight)
        else:
            flight.deadline = trio.current_time() + self._owner.deadline
            self.queued_demand.append(flight)

    def promote(self, flight: Flight) -> None:
        """A demand read joined a prefetch: if still queued, it queues with
        demand now (its deadline starting), no longer for a prefetch slot."""
        if flight.state is QUEUED:
            flight.deadline = trio.current_time() + self._owner.deadline
            self.queued_demand.append(flight)

    # -------------------------------------------------------------- sending
    def _room(self) -> int:
        """GETs the engine can start now."""
        return self._engine.free if self._engine is not None else self._requests

    def pump(self) -> None:
        """Start the queued flights that a GET slot (and a prefetch slot, for
        a prefetch) lets go now on the chunk engine, all in one submission:
        demand first, then prefetches in the order they started. No task,
        no Event per chunk: the answers come back in batches (`_drain`)."""
        io = self._owner.io_limiter
        batch: list[Flight] = []
        room = self._room()
        demand = self.queued_demand
        while demand and len(batch) < room:
            flight = demand[0]
            if flight.state is not QUEUED:
                demand.popleft()  # promoted, and sent from the prefetch queue meanwhile; or expired
                continue
            try:
                io.acquire_on_behalf_of_nowait(flight)
            except trio.WouldBlock:
                break
            demand.popleft()
            flight.state = ENGINE  # not sent again from the prefetch queue
            batch.append(flight)
        else:
            self._pump_prefetches(batch, room)
        if batch:
            self._submit(batch)
        if demand and not self._watching:
            self._watching = True
            assert self._nursery is not None
            self._nursery.start_soon(self._watch_queue)

    def _pump_prefetches(self, batch: list[Flight], room: int) -> None:
        owner = self._owner
        io, slots = owner.io_limiter, owner.prefetch_slots
        queue = self.queued_prefetch
        now = trio.current_time()
        while queue and len(batch) < room:
            flight = queue[0]
            if flight.state is not QUEUED:
                queue.popleft()
                continue
            if not flight.promoted:
                try:
                    slots.acquire_on_behalf_of_nowait(flight)
                except trio.WouldBlock:
                    return
            try:
                io.acquire_on_behalf_of_nowait(flight)
            except trio.WouldBlock:
                if not flight.promoted:
                    slots.release_on_behalf_of(flight)
                return
            queue.popleft()
            flight.state = ENGINE
            flight.holds_prefetch_slot = not flight.promoted
            if not flight.promoted:
                flight.deadline = now + owner.deadline  # a prefetch's deadline starts with its slot
            batch.append(flight)

    def _ready(self) -> tuple[ChunkEngine, Any] | None:
        """The engine, set up to send the backend's GETs as they are to be
        sent now, and the backend's `direct_gets`; None: no engine path
        (turned off here). A StoreError: none of them can be sent now (no
        credentials at the moment), the path stays."""
        gets = None if self._off else self._backend.direct_gets()
        if gets is not None and self._engine is None:
            try:
                self._engine = ChunkEngine(self._requests, MAX_CHUNK_BLOB_BYTES)
            except OSError as e:
                log.warning("no chunk engine (%s): chunk GETs run in threads", e)
                gets = None
            else:
                assert self._nursery is not None
                self._nursery.start_soon(self._drain, self._engine)
        if gets is None:
            self._turn_off()
            return None
        assert self._engine is not None
        self._engine.set_auth(gets.headers, gets.sigv4, gets.connect_timeout, gets.idle_timeout)
        return self._engine, gets

    def _submit(self, batch: list[Flight]) -> None:
        """One engine submission for the flights of ``batch`` (each holds a
        GET slot); without an engine path the flights go to tasks, those
        still queued too."""
        owner = self._owner
        try:
            ready = self._ready()
        except StoreError as e:  # no credentials now: these GETs fail (and are retried)
            for flight in batch:
                self._release_slots(flight)
                owner.engine_answered(flight, e, 0, False)
            return
        if ready is not None:
            engine, gets = ready
            now = trio.current_time()
            timeout = owner.timeout
            try:
                engine.start((f, gets.url(f.fp.name), f.fp,
                              f.slot.target(f.fp) if f.slot is not None else None,
                              min(timeout, max(f.deadline - now, MIN_ATTEMPT_TIMEOUT))) for f in batch)
            except (OSError, ValueError) as e:  # a URL it cannot send, an engine closing
                log.warning("the chunk engine takes no GET (%s): chunk GETs run in threads", e)
                self._turn_off()
            else:
                owner.stats["gets"] += len(batch)
                return
        for flight in batch:
            self._release_slots(flight)
            owner.run_in_task(flight)

    def _turn_off(self) -> None:
        """No engine path from now on: the queued flights run in tasks."""
        if not self._off:
            log.debug("no engine path for chunk GETs: they run in threads")
        self._off = True
        for queue in (self.queued_demand, self.queued_prefetch):
            while queue:
                flight = queue.popleft()
                if flight.state is QUEUED:  # not twice: a promoted prefetch is in both queues
                    self._owner.run_in_task(flight)

    def _release_slots(self, flight: Flight) -> None:
        self._owner.io_limiter.release_on_behalf_of(flight)
        if flight.holds_prefetch_slot:
            flight.holds_prefetch_slot = False
            self._owner.prefetch_slots.release_on_behalf_of(flight)

    async def _watch_queue(self) -> None:
        """While demand flights wait for a GET slot: hand back as expired
        those whose deadline passes before they get one (a store that holds
        every slot without answering)."""
        try:
            while self.queued_demand:
                now = trio.current_time()
                queued = [f for f in self.queued_demand if f.state is QUEUED]
                if not queued:
                    self.queued_demand.clear()
                    break
                soonest = min(f.deadline for f in queued)
                if soonest > now:
                    await trio.sleep_until(soonest)
                    continue
                for flight in queued:
                    if flight.deadline <= now:
                        self._owner.queue_expired(flight)
        finally:
            self._watching = False

    # ------------------------------------------------------------ answers
    async def _drain(self, engine: ChunkEngine) -> None:
        """The engine's answers, a batch per wake-up, to their flights (and
        `get_one`'s waits), until the nursery ends; then the engine stops,
        and the cache slots of GETs it did not end are given back."""
        try:
            while True:
                for token, outcome in await engine.answers():
                    if isinstance(token, Flight):
                        self._answered(token, outcome)
                    else:
                        token.outcome = outcome
                        token.event.set()
                self.pump()
        finally:
            if self._engine is engine:
                self._engine = None
            engine.close()
            for token in engine.in_flight():
                if isinstance(token, Flight) and token.slot is not None:
                    token.slot.abandon()
                    token.slot = None

    def _answered(self, flight: Flight, outcome: Outcome) -> None:
        """In trio: an answer of the engine path, to the flight's owner (a
        bucket in another region: the path off, the flight in a task)."""
        self._release_slots(flight)
        result = self._result(flight.fp, outcome)
        if result is None:
            self._owner.run_in_task(flight)
            return
        cached = False
        if outcome.data is not None and flight.slot is not None:
            cached = flight.slot.written(flight.fp, len(outcome.data), outcome.written, outcome.write_errno)
        self._owner.engine_answered(flight, result, outcome.size, cached)

    def _result(self, fp: Fprint, outcome: Outcome) -> bytes | BaseException | None:
        """The chunk's bytes, or the error the outcome means; None: the
        backend turned the engine path off (`direct_get_error`)."""
        if outcome.data is not None:
            return outcome.data
        if outcome.mismatch:
            return chunk_mismatch(fp)
        assert outcome.failure is not None
        error = self._backend.direct_get_error(fp.name, outcome.failure, MAX_CHUNK_BLOB_BYTES)
        if error is None:
            self._turn_off()
        return error

    async def get_one(self, fp: Fprint) -> tuple[int, bytes] | None:
        """GET and verify one chunk on the chunk engine, if there is an
        engine path: no thread per request. Its bytes and the blob's size;
        None: no engine path, use a thread. A cancelled wait drops the
        answer (there is no cache write to give back)."""
        if self._off or self._room() == 0:
            return None
        ready = self._ready()
        if ready is None:
            return None
        engine, gets = ready
        wait = _OneGet()
        try:
            engine.start([(wait, gets.url(fp.name), fp, None, self._owner.timeout)])
        except (OSError, ValueError):
            return None  # a thread, then
        await wait.event.wait()
        assert wait.outcome is not None
        result = self._result(fp, wait.outcome)
        if result is None:
            return None
        if isinstance(result, BaseException):
            raise result
        return wait.outcome.size, result
