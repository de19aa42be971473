"""Chunk flights, and the engine path that sends their reads to the reader's
chunk path in C in batches.

A `Flight` is one chunk's fetch, shared by every read of it: the fetcher
(`fetcher.Fetcher`) keeps one per fingerprint under way (single-flight) and
decides what its outcome means (bytes kept and handed to its readers, a
retry in a task, a failure).

`EnginePath` carries the flights whose read goes to the chunk engine
(`chunk_engine.ChunkEngine`) without a task or an Event per chunk, on a
store whose backend gives its URLs and signing (S3's `direct_gets`: GETs
on the engine's thread) or its files' paths (a directory store's
`direct_files`: reads on the engine's `READ_WORKERS` threads):

- flights queue for a GET slot (demand first, then prefetches, in the order
  they started, each also waiting for a prefetch slot), and `pump` starts
  all those the slots let go now in one submission; a flight of a packed
  store's chunk whose blob follows, in one pack, the blob of the flight
  before it in the submission (what readahead and B-tree prefetch ask for
  together) rides in that flight's request without a slot of its own, a
  range of up to `RUN_BYTES` and `RUN_PARTS` chunks (`_Runs`):
  a slot is a request;
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

`get_one` is the same path for one GET a task waits for (a retry of a
chunk object), without a cache write: the task's own writer stores the
bytes.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable, NamedTuple, Protocol

import trio

from verneuil_fuse.format import (MAX_CHUNK_BLOB_BYTES, ChunkError, ChunkSource, Fprint,
                                  chunk_mismatch)
from verneuil_fuse.reader.cache import CacheSlot, ChunkCache
from verneuil_fuse.reader.chunk_engine import READ_WORKERS, ChunkEngine, Outcome, Part, Read
from verneuil_fuse.store import DirectFiles, DirectReads, StoreError

log = logging.getLogger(__name__)

# The shortest time limit given to a GET sent with little of its deadline
# left: enough for one round trip to a store far away.
MIN_ATTEMPT_TIMEOUT = 0.5
# Requests of the chunk engine past the fetcher's GET slots: a retry's GET
# abandoned at its deadline keeps its request until the engine ends it (its
# own time limit), and these keep the batches going meanwhile.
SPARE_REQUESTS = 16
# Bytes of blobs of one range request of a pack at most (a run of the
# mount's; `restore` reads by runs of `format.MAX_RUN_BYTES`): a cold scan
# of 951 MiB makes ~270 requests instead of ~900, and behind moto, whose
# CPU per request shares the two cores with the mount, it took 2.6 s
# instead of 3.7 (s3fs: 2.9-3.4 s); on the nginx rig, level (1.85-1.99 s).
# Each request of the engine holds a buffer of this size, its pages taken
# as used (a scan keeps ~8 busy: 32 MiB of readahead).
RUN_BYTES = 4 << 20
# Chunks of one request at most: the 64 that 4 MiB of incompressible
# blobs hold, and room for better-compressed ones (a run of many small
# blobs goes in more requests).
RUN_PARTS = 80
# Longest wait of a prefetch of a pack's chunk for the readahead's next
# chunks to join its run (`EnginePath._hold_back`): a scan's read requests,
# each topping the readahead window up, come a few ms apart.
RUN_WAIT = 0.02

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
                 "deadline", "holds_prefetch_slot", "rides", "source", "queued_at")

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
        # On the engine path: in the request of the flight before it (`_Runs`),
        # without a GET slot of its own; else the first of its request, with one.
        self.rides = False
        self.queued_at = 0.0  # trio time it queued for the engine (`EnginePath._hold_back`)

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
    cache: ChunkCache | None  # the disk cache the flights' slots are places of
    io_limiter: trio.CapacityLimiter  # a GET slot per request in flight (a run of a pack: one)
    prefetch_slots: trio.CapacityLimiter  # and a prefetch slot per prefetch request
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


class _Route(NamedTuple):
    """How the engine reaches the store's objects: ``where(key)`` is an
    object's URL, or its file's path when ``file``."""

    where: Callable[[str], str]
    file: bool


def _key(flight: Flight) -> str:
    return flight.source.key if flight.source is not None else flight.fp.name


class _OneGet:
    """`EnginePath.get_one`'s wait for its answer."""

    __slots__ = ("event", "outcome")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.outcome: Outcome | None = None


class _Runs:
    """The requests a batch of flights makes, as `EnginePath.pump` builds it:
    a flight whose blob follows the blob of the flight before it in the
    same pack rides in that flight's request (up to `RUN_PARTS` chunks and
    `RUN_BYTES` of blobs a request), so a GET slot stands for a request,
    not a chunk: a scan of a packed store keeps as many requests in flight
    as one of Verneuil's layout, each carrying a run of chunks."""

    __slots__ = ("room", "count", "start", "parts", "last", "first_start")

    def __init__(self, room: int):
        self.room = room  # requests the engine can take now
        self.count = 0  # requests in the batch
        self.start = 0  # where the batch's last request starts
        self.parts = 0  # its flights
        self.last: Flight | None = None
        self.first_start = 0  # its first blob's offset in its pack

    @property
    def full(self) -> bool:
        return self.count >= self.room

    def extended_by(self, flight: Flight) -> bool:
        """Whether ``flight`` rides in the batch's last request."""
        last = self.last
        if last is None or self.parts >= RUN_PARTS:
            return False
        source, before = flight.source, last.source
        return (source is not None and before is not None and source.ranged and before.ranged
                and source.key == before.key and source.start == before.end
                and source.end - self.first_start <= RUN_BYTES)

    def add(self, batch: list[Flight], flight: Flight, rides: bool) -> None:
        """``flight`` to the end of ``batch``, riding or starting a request."""
        flight.rides = rides
        if rides:
            self.parts += 1
        else:
            self.count += 1
            self.start = len(batch)
            self.parts = 1
            self.first_start = flight.source.start if flight.source is not None else 0
        self.last = flight
        batch.append(flight)


class EnginePath:
    """The flights queued for, or on, the chunk engine (see the module's
    docstring). ``backend``: the chunks backend's direct reads, whose
    `direct_gets` gives the URLs and signing, or else ``files``, a
    directory's, whose `direct_files` gives the files' paths (neither: no
    engine path); ``requests``: the engine's requests in flight at most
    (the fetcher's GET slots)."""

    def __init__(self, owner: FlightOwner, backend: DirectReads | None, requests: int,
                 files: DirectFiles | None = None):
        self._owner = owner
        self._files = backend is None and files is not None  # a directory store's files
        self._backend: Any = backend if backend is not None else files
        self._off = self._backend is None  # no engine path (or turned off)
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
        flight.queued_at = trio.current_time()
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
        runs = _Runs(self._room())
        demand = self.queued_demand
        while demand:
            flight = demand[0]
            if flight.state is not QUEUED:
                demand.popleft()  # promoted, and sent from the prefetch queue meanwhile; or expired
                continue
            rides = runs.extended_by(flight)
            if not rides:
                if runs.full:
                    break
                try:
                    io.acquire_on_behalf_of_nowait(flight)
                except trio.WouldBlock:
                    break
            demand.popleft()
            flight.state = ENGINE  # not sent again from the prefetch queue
            runs.add(batch, flight, rides)
        else:
            self._pump_prefetches(batch, runs)
            self._hold_back(batch, runs)
        if batch:
            self._submit(batch)
        if demand and not self._watching:
            self._watching = True
            assert self._nursery is not None
            self._nursery.start_soon(self._watch_queue)

    def _pump_prefetches(self, batch: list[Flight], runs: _Runs) -> None:
        owner = self._owner
        io, slots = owner.io_limiter, owner.prefetch_slots
        queue = self.queued_prefetch
        now = trio.current_time()
        while queue:
            flight = queue[0]
            if flight.state is not QUEUED:
                queue.popleft()
                continue
            rides = runs.extended_by(flight)
            if not rides:
                if runs.full:
                    return
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
            flight.holds_prefetch_slot = not rides and not flight.promoted
            if not flight.promoted:
                flight.deadline = now + owner.deadline  # a prefetch's deadline starts with its slot
            runs.add(batch, flight, rides)

    def _hold_back(self, batch: list[Flight], runs: _Runs) -> None:
        """The last run of ``batch``, when it is made of prefetches only and
        has room for more chunks, goes back to the head of its queue, its
        slots given back, while an answer is still to come (requests in
        flight, or others in ``batch``: `_drain` pumps again then), when the
        next chunk of the run waits in the queue (the slots an answer gives
        back would otherwise cut runs ever shorter), or for at most
        `RUN_WAIT` since they queued (the readahead tops its window up a read
        request at a time, and the chunks it adds next join their run): a
        scan costs about a request per `RUN_BYTES`. Not on a directory
        store: a read there costs a `pread`, not a round trip, and a run held
        back waits on answers that a local disk gives at once."""
        if self._files or not batch:
            return
        start = runs.start
        held = batch[start:]
        source = held[0].source
        if source is None or not source.ranged or any(f.promoted or not f.prefetch for f in held):
            return
        if len(held) >= RUN_PARTS or held[-1].source.end - source.start > RUN_BYTES - MAX_CHUNK_BLOB_BYTES:
            return
        in_flight = self._engine is not None and self._engine.free < self._requests
        if not in_flight and start == 0:
            return  # no answer to come: nothing would send them
        if not self._next_queued(held[-1].source) and trio.current_time() - held[0].queued_at >= RUN_WAIT:
            return
        del batch[start:]
        for flight in held:
            self._release_slots(flight)
            flight.state = QUEUED
            flight.rides = False
        self.queued_prefetch.extendleft(reversed(held))

    def _next_queued(self, source: ChunkSource) -> bool:
        """Whether the first prefetch still queued is the chunk whose blob
        follows ``source``'s in its pack."""
        for flight in self.queued_prefetch:
            if flight.state is QUEUED:
                after = flight.source
                return after is not None and after.key == source.key and after.start == source.end
        return False

    def _ready(self) -> tuple[ChunkEngine, _Route] | None:
        """The engine, set up to send the backend's requests as they are to
        be sent now, and how it reaches the objects; None: no engine path
        (turned off here). A StoreError: none of them can be sent now (no
        credentials at the moment), the path stays."""
        route = None
        gets = None
        if not self._off:
            if self._files:
                route = _Route(self._backend.direct_files(), True)
            else:
                gets = self._backend.direct_gets()
                route = None if gets is None else _Route(gets.url, False)
        if route is not None and self._engine is None:
            try:
                self._engine = ChunkEngine(self._requests, RUN_BYTES, max_parts=RUN_PARTS,
                                           workers=READ_WORKERS if route.file else 0)
            except OSError as e:
                log.warning("no chunk engine (%s): chunk reads run in threads", e)
                route = None
            else:
                assert self._nursery is not None
                self._nursery.start_soon(self._drain, self._engine)
        if route is None:
            self._turn_off()
            return None
        assert self._engine is not None
        if gets is not None:
            self._engine.set_auth(gets.headers, gets.sigv4, gets.connect_timeout, gets.idle_timeout)
        return self._engine, route

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
            engine, route = ready
            reads = self._reads(batch, route)
            try:
                engine.submit(reads)
            except (OSError, ValueError) as e:  # a URL it cannot send, an engine closing
                log.warning("the chunk engine takes no request (%s): chunk reads run in threads", e)
                self._turn_off()
            else:
                owner.stats["gets"] += len(reads)
                return
        for flight in batch:
            self._release_slots(flight)
            owner.run_in_task(flight)

    def _reads(self, batch: list[Flight], route: _Route) -> list[Read]:
        """The engine's requests for ``batch``: one per chunk object, and
        one per run of flights in a row whose blobs are adjacent in one pack
        (`_Runs`: what `pump` took a GET slot for), each request bounded by
        the shortest time its flights have left."""
        now = trio.current_time()
        timeout = self._owner.timeout
        cache = self._owner.cache
        if cache is not None:  # where each chunk goes in the disk cache, under one lock
            targets = cache.targets([f.slot for f in batch], [f.fp for f in batch])
        else:
            targets = [None] * len(batch)
        reads: list[Read] = []
        start = 0
        for k, flight in enumerate(batch):
            if k and not flight.rides:
                reads.append(self._run_read(route, batch[start:k], targets[start:k], now, timeout))
                start = k
        if batch:
            reads.append(self._run_read(route, batch[start:], targets[start:], now, timeout))
        return reads

    def _run_read(self, route: _Route, run: list[Flight], targets: list, now: float, timeout: float) -> Read:
        """One request for the flights of ``run`` (``targets``: their places
        in the disk cache): a chunk object, or a range of a pack (adjacent
        blobs)."""
        first = run[0]
        source = first.source
        if source is None or not source.ranged:
            return Read(route.where(_key(first)), (Part(first, first.fp, 0, None, targets[0]),),
                        timeout=self._attempt(first, now, timeout), file=route.file)
        start = source.start
        parts = tuple(Part(f, f.fp, f.source.start - start, f.source.end - start, target)
                      for f, target in zip(run, targets))
        deadline = min(f.deadline for f in run)
        return Read(route.where(source.key), parts, start, run[-1].source.end,
                    min(timeout, max(deadline - now, MIN_ATTEMPT_TIMEOUT)), route.file)

    @staticmethod
    def _attempt(flight: Flight, now: float, timeout: float) -> float:
        """A request's time limit for ``flight``: what its deadline leaves."""
        return min(timeout, max(flight.deadline - now, MIN_ATTEMPT_TIMEOUT))

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
        if not flight.rides:
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
                self._hand_out(await engine.answers())
                self.pump()
                if engine.idle:
                    engine.run_buffers.let_go()
        finally:
            if self._engine is engine:
                self._engine = None
            engine.close()
            for token in engine.in_flight():
                if isinstance(token, Flight) and token.slot is not None:
                    token.slot.abandon()
                    token.slot = None

    def _hand_out(self, answers: list[tuple[Any, Outcome]]) -> None:
        """A batch of answers to their flights and `get_one`'s waits (in a
        call of its own: nothing of the batch stays referred to while the
        next one is awaited, a run buffer's chunks included)."""
        for token, outcome in answers:
            if isinstance(token, Flight):
                self._answered(token, outcome)
            else:
                token.outcome = outcome
                token.event.set()

    def _answered(self, flight: Flight, outcome: Outcome) -> None:
        """In trio: an answer of the engine path, to the flight's owner (a
        bucket in another region: the path off, the flight in a task)."""
        self._release_slots(flight)
        result = self._result(flight.fp, _key(flight), outcome, flight.source)
        if result is None:
            self._owner.run_in_task(flight)
            return
        cached = False
        if outcome.data is not None and flight.slot is not None:
            cached = flight.slot.written(flight.fp, len(outcome.data), outcome.written, outcome.write_errno)
        self._owner.engine_answered(flight, result, outcome.size, cached)

    def _result(self, fp: Fprint, key: str, outcome: Outcome,
                source: ChunkSource | None = None) -> bytes | BaseException | None:
        """The chunk's bytes, or the error the outcome means (of object
        ``key``, at ``source``); None: the backend turned the engine path off
        (`direct_get_error`)."""
        if outcome.data is not None:
            return outcome.data
        if outcome.mismatch:
            return chunk_mismatch(fp)
        failure = outcome.failure
        assert failure is not None
        if isinstance(failure, ChunkError):  # a range cut short, other bytes than asked
            return failure
        bound = source.max_bytes if source is not None else MAX_CHUNK_BLOB_BYTES
        error = self._backend.direct_get_error(key, failure, bound)
        if error is None:
            self._turn_off()
        return error

    async def get_one(self, fp: Fprint) -> tuple[int, bytes] | None:
        """Read and verify one chunk object on the chunk engine, if there is
        an engine path: no thread per request. Its bytes and the blob's
        size; None: no engine path, use a thread. A cancelled wait drops the
        answer (there is no cache write to give back)."""
        if self._off or self._room() == 0:
            return None
        ready = self._ready()
        if ready is None:
            return None
        engine, route = ready
        wait = _OneGet()
        name = fp.name
        try:
            engine.submit([Read(route.where(name), (Part(wait, fp),), timeout=self._owner.timeout,
                                file=route.file)])
        except (OSError, ValueError):
            return None  # a thread, then
        await wait.event.wait()
        assert wait.outcome is not None
        result = self._result(fp, name, wait.outcome)
        if result is None:
            return None
        if isinstance(result, BaseException):
            raise result
        return wait.outcome.size, result
