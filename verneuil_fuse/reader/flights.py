"""Chunk flights, and the engine path that sends their GETs to the store's
HTTP engine in batches.

A `Flight` is one chunk's fetch, shared by every read of it: the fetcher
(`fetcher.Fetcher`) keeps one per fingerprint under way (single-flight) and
decides what its outcome means (bytes kept and handed to its readers, a
retry in a task, a failure).

`EnginePath` carries the flights whose GET goes to the store's HTTP engine
(S3, `store/curl.py`) without a task or an Event per chunk:

- flights queue for a GET slot (demand first, then prefetches, in the order
  they started, each also waiting for a prefetch slot), and `pump` sends all
  those the slots let go now in one submission (`S3Backend.get_async_batch`);
- on the engine's thread each answer is decoded, its full fingerprint
  checked (`decode_chunk`), queued for trio, and the chunk written into its
  place in the disk cache;
- trio is woken once per turn of the engine's loop for every answer queued
  meanwhile (`arrived`, `hand_over`), gives the flights' slots back, hands
  each answer to the fetcher (`FlightOwner.engine_answered`) and pumps again;
- a demand flight still queued at its deadline (a store that holds every
  slot without answering) is handed back as expired (`queue_expired`);
- an engine that takes no GET (its backend turned it off: a bucket in
  another region, no credentials for it) turns the path off, and its
  flights, the queued ones included, run in tasks (`run_in_task`).

`get_one` is the same hand-off for one GET a task waits for (a retry).
"""
from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from typing import Any, Callable, Protocol

import trio

from verneuil_fuse.format import MAX_CHUNK_BLOB_BYTES, Fprint, chunk_name, decode_chunk
from verneuil_fuse.reader.cache import CacheSlot, ChunkCache

log = logging.getLogger(__name__)

# The shortest time limit given to a GET sent with little of its deadline
# left: enough for one round trip to a store far away.
MIN_ATTEMPT_TIMEOUT = 0.5

# Where a flight is (`Flight.state`).
QUEUED = "queued"  # waiting for a GET slot, to go to the store's HTTP engine (`EnginePath.pump`)
ENGINE = "engine"  # its GET is on the engine; its answer comes back through `EnginePath`
TASK = "task"  # a trio task runs it (`Fetcher._fly`): disk cache, threads, retries, hydration
DONE = "done"


class Flight:
    """One chunk's fetch, shared by every read of it (single-flight). Its
    waiters are the fetcher's `_Waiter` objects, one per read request however
    many of its chunks it waits for, told when the flight is done
    (`Fetcher._finish`)."""

    __slots__ = ("fp", "state", "data", "error", "prefetch", "promoted", "slot", "waiters", "wait_scope",
                 "deadline", "holds_prefetch_slot")

    def __init__(self, fp: Fprint, prefetch: bool, slot: CacheSlot | None = None):
        self.fp = fp
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


def store_chunk(cache: ChunkCache, fp: Fprint, data: bytes, slot: CacheSlot | None) -> None:
    """Write a verified chunk to the disk cache, in its slot if it has one
    (blocking: a worker thread's or the HTTP engine's call). A cache that
    cannot be written is not fatal: logged, the slot given back."""
    try:
        if slot is not None:
            slot.write(fp, data)
        else:
            cache.put(fp, data)
    except Exception:  # noqa: BLE001 - reads go on from the store
        log.exception("cannot write chunk %s to the cache", chunk_name(fp))
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

    def engine_answered(self, flight: Flight, result: bytes | BaseException, size: int) -> None:
        """In trio: the GET of ``flight`` answered (its slots are given
        back): its verified bytes and the blob's size, or the error."""

    def queue_expired(self, flight: Flight) -> None:
        """In trio: a demand flight's deadline passed before a GET slot."""

    def run_in_task(self, flight: Flight) -> None:
        """The engine cannot take ``flight`` (it holds no slot): run it in a
        task."""


class EnginePath:
    """The flights queued for, or on, the store's HTTP engine (see the
    module's docstring). ``get_batch``: the chunk backend's
    `get_async_batch`, None for a store without an engine."""

    def __init__(self, owner: FlightOwner, get_batch: Callable | None, cache: ChunkCache | None):
        self._owner = owner
        self.get_batch = get_batch  # None: no engine path (or turned off)
        self._cache = cache
        self.queued_demand: deque[Flight] = deque()
        self.queued_prefetch: deque[Flight] = deque()
        self._watching = False  # `_watch_queue` runs
        self._arrivals: list = []  # engine answers (and Events) for `_set_arrived`
        self._handing_over = False  # `_set_arrived` is due in trio
        self._arrivals_lock = threading.Lock()
        self._nursery: trio.Nursery | None = None
        self._token: trio.lowlevel.TrioToken | None = None

    def bind(self, nursery: trio.Nursery) -> None:
        """The deadline watch runs in ``nursery``; answers wake this trio run."""
        self._nursery = nursery
        self._token = trio.lowlevel.current_trio_token()

    @property
    def available(self) -> bool:
        return self.get_batch is not None

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
    def pump(self) -> None:
        """Send the queued flights that a GET slot (and a prefetch slot, for
        a prefetch) lets go now to the store's HTTP engine, all in one
        submission: demand first, then prefetches in the order they
        started. No task, no Event per chunk: the answers come back in
        batches (`_set_arrived`)."""
        io = self._owner.io_limiter
        batch: list[Flight] = []
        demand = self.queued_demand
        while demand:
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
            self._pump_prefetches(batch)
        if batch:
            self._submit(batch)
        if demand and not self._watching:
            self._watching = True
            assert self._nursery is not None
            self._nursery.start_soon(self._watch_queue)

    def _pump_prefetches(self, batch: list[Flight]) -> None:
        owner = self._owner
        io, slots = owner.io_limiter, owner.prefetch_slots
        queue = self.queued_prefetch
        now = trio.current_time()
        while queue:
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

    def _submit(self, batch: list[Flight]) -> None:
        """One engine submission for the flights of ``batch`` (each holds a
        GET slot); an engine that cannot take them turns the engine path off
        and the flights go to tasks, those still queued too."""
        owner = self._owner
        now = trio.current_time()
        timeout = owner.timeout
        answer = self._answer
        items = [(chunk_name(f.fp), min(timeout, max(f.deadline - now, MIN_ATTEMPT_TIMEOUT)),
                  functools.partial(answer, f, f.slot)) for f in batch]
        assert self.get_batch is not None
        if self.get_batch(items, MAX_CHUNK_BLOB_BYTES, self.hand_over):
            owner.stats["gets"] += len(batch)
            return
        log.debug("no engine path for chunk GETs: they run in threads")
        self.get_batch = None
        for flight in batch:
            self._release_slots(flight)
            owner.run_in_task(flight)
        for queue in (self.queued_demand, self.queued_prefetch):
            while queue:
                flight = queue.popleft()
                if flight.state is QUEUED:  # not twice: a promoted prefetch is in both queues
                    owner.run_in_task(flight)

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
    def _answer(self, flight: Flight, slot: CacheSlot | None, answer: bytes | BaseException) -> None:
        """On the engine's thread: decode and verify the answer, queue it for
        trio (`hand_over` wakes trio once the engine's turn is over, for
        every answer of that turn), then write the chunk into its place in
        the disk cache (``slot``, read before the hand-off: trio owns the
        flight once it has the answer)."""
        size = 0
        result: bytes | BaseException = answer
        if not isinstance(answer, BaseException):
            size = len(answer)
            try:
                result = decode_chunk(answer, flight.fp)
            except BaseException as e:  # noqa: BLE001 - handed to trio
                result = e
        self.arrived((flight, result, size), wake=False)  # `hand_over` wakes trio
        if self._cache is not None and not isinstance(result, BaseException):
            store_chunk(self._cache, flight.fp, result, slot)

    def _answered(self, flight: Flight, result: bytes | BaseException, size: int) -> None:
        """In trio: an answer of the engine path, to the flight's owner."""
        self._release_slots(flight)
        self._owner.engine_answered(flight, result, size)

    async def get_one(self, backend: Any, name: str, fp: Fprint,
                      slot: CacheSlot | None) -> tuple[int, bytes] | None:
        """GET and verify one chunk on the store's HTTP engine, if it has one
        (`S3Backend.get_async`): no thread per request; the answer is
        decoded and verified on the engine's thread, which then wakes this
        task and, after that, writes the chunk to the disk cache in `slot`
        (its place, `ChunkCache.reserve`). None: no engine path, use a
        thread."""
        get_async = getattr(backend, "get_async", None)
        if get_async is None:
            return None
        box: list = []
        ready = trio.Event()
        cache = self._cache

        def done(answer) -> None:  # on the engine's thread
            try:
                if isinstance(answer, BaseException):
                    box.append(answer)
                else:
                    box.append((len(answer), decode_chunk(answer, fp)))
            except BaseException as e:  # noqa: BLE001 - handed to the task
                box.append(e)
            self.arrived(ready)
            if cache is not None and isinstance(box[0], tuple):
                store_chunk(cache, fp, box[0][1], slot)

        if not get_async(name, MAX_CHUNK_BLOB_BYTES, done, timeout=self._owner.timeout):
            return None
        await ready.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def arrived(self, item: trio.Event | tuple, wake: bool = True) -> None:
        """From the engine's thread: hand ``item`` (an Event to set, or an
        answer of the engine path) to trio. Items that arrive while trio has
        not yet run the last hand-off join it, so a busy engine wakes trio
        once per batch, not once per chunk; without ``wake``, `hand_over`
        wakes trio later."""
        with self._arrivals_lock:
            self._arrivals.append(item)
            if not wake or self._handing_over:
                return
            self._handing_over = True
        self._wake_trio()

    def hand_over(self) -> None:
        """From the engine's thread, at the end of a turn of its loop: wake
        trio for the answers queued by `arrived` meanwhile."""
        with self._arrivals_lock:
            if not self._arrivals or self._handing_over:
                return
            self._handing_over = True
        self._wake_trio()

    def _wake_trio(self) -> None:
        assert self._token is not None
        try:
            self._token.run_sync_soon(self._set_arrived)
        except trio.RunFinishedError:
            pass  # the mount is gone: nobody waits

    def _set_arrived(self) -> None:
        with self._arrivals_lock:
            arrivals, self._arrivals = self._arrivals, []
            self._handing_over = False
        for item in arrivals:
            if isinstance(item, tuple):
                self._answered(*item)
            else:
                item.set()
        self.pump()
