"""Chunk fetching for the reader: single-flight, verified, cached, prefetched.

This is the one module of the reader that calls ``trio.to_thread``; every
blocking call (boto3 or the local store, the disk cache, zstd) runs in a worker
thread behind a ``trio.CapacityLimiter``, so pyfuse3's request tasks never
block.

Where a chunk comes from, in order: the in-memory LRU, a flight already under
way for the same fingerprint (single-flight: concurrent requests make one
fetch), the local disk cache (re-verified), then the store (GET, then
``decode_chunk`` checks the full 128-bit fingerprint; bounded retries with
backoff, a per-attempt timeout and a deadline for the whole fetch, then
``FetchError``). Every object is read with a bound on its size: a chunk at
most ``MAX_CHUNK_BLOB_BYTES``, a manifest at most what a database of
``max_db_size`` bytes needs. A chunk given up on is answered from that
failure for ``FAILED_CHUNK_TTL`` seconds (the kernel asks again at once for a
read that failed), and the store is reported unreachable, in the log and the
stats, from a give-up for want of an answer until the next GET that
succeeds. Bundled chunks and the
zero chunk never get here: replicas serve them directly. A flight takes its
chunk's place in the disk cache when it starts (`ChunkCache.reserve`), so
that chunks fetched in file order are stored in file order, whatever order
their GETs end in, and a later read request of them is one run of the
segment (`read_into`).

Prefetches use the same flights, but wait for one of a smaller number of
prefetch slots, so demand reads always find store capacity; a demand read
that joins a prefetch still waiting for its slot promotes it at once.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

import trio

from verneuil_fuse.reader.cache import ChunkCache, MemoryLRU
from verneuil_fuse.format import (
    DEFAULT_MAX_DB_SIZE,
    MAX_CHUNK_BLOB_BYTES,
    ChunkError,
    Fprint,
    base_chunk_blob_limit,
    chunk_name,
    decode_and_validate,
    decode_base_chunk,
    decode_chunk,
    manifest_blob_limit,
)
from verneuil_fuse.store import NotFound, StoreError, TooLarge, TransientError

log = logging.getLogger(__name__)

T = TypeVar("T")

# GETs in flight at once: on the store's HTTP engine (S3) a GET in flight
# holds no thread, and 64 of them hide 20 ms of latency per request at
# ~3,000 chunks/s; a directory store's reads run in threads, as many.
DEFAULT_CONCURRENCY = 64
# Hydration takes the disk cache's places for this many chunks at a time
# (1 MiB), back to back, so that the kernel's largest read requests find
# them in one run even while a second database hydrates alongside.
HYDRATE_BLOCK = 16

_RESERVE = object()  # `Fetcher._start`: take the chunk's place in the disk cache now

# A chunk fetched for a read stays in memory at least this long and among the
# last `HOLD_CHUNKS` so fetched, whatever `mem_cache` says: the kernel may
# split one read of a program into several requests for the same chunk (page
# by page, after a failed readahead), and each must find the bytes the first
# one got, or the program gets a short read. A SQLite page never straddles two
# chunks, so it is then read whole or not at all. Milliseconds separate such
# requests; 2 s and 64 chunks (4 MiB) leave a wide margin at a small cost.
HOLD_SECONDS = 2.0
HOLD_CHUNKS = 64
# Default longest wait for one chunk, retries included, before the read fails:
# long enough for a few retries of a slow GET, short enough that a program
# reading through the mount sees an I/O error, not a hang, when the store is
# unreachable.
DEFAULT_DEADLINE = 30.0
# Default time limit of one GET attempt: a third of the deadline, so that a
# request lost in a black hole still leaves time for two more attempts.
DEFAULT_ATTEMPT_TIMEOUT = 10.0
# A chunk given up on fails again at once for this long: the kernel retries a
# failed read straight away (its readahead, then the page itself), which
# would otherwise wait a second deadline; a read a few seconds later tries
# the store again.
FAILED_CHUNK_TTL = 5.0


class FetchError(Exception):
    """A chunk could not be obtained (after retries, or before the deadline):
    the read must fail."""


class _Flight:
    __slots__ = ("event", "data", "error", "prefetch", "wait_scope", "promoted", "slot")

    def __init__(self, prefetch: bool, slot: Any = None):
        self.event = trio.Event()
        self.slot = slot  # where the disk cache will put the bytes (`ChunkCache.reserve`)
        self.data: bytes | None = None
        self.error: BaseException | None = None
        self.prefetch = prefetch
        self.wait_scope: trio.CancelScope | None = None
        self.promoted = False


@dataclass
class HydrateProgress:
    """How far one eager hydration went (`Fetcher.hydrate`)."""

    chunks: int = 0  # chunks it had to fetch (the others were cached)
    done: int = 0  # of which fetched (or found cached meanwhile)
    failed: int = 0  # of which could not be fetched
    error: str | None = None  # the first failure


class Fetcher:
    def __init__(
        self,
        store: Any,
        cache: ChunkCache | None = None,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        prefetch_concurrency: int | None = None,
        mem_cache_bytes: int = 64 << 20,
        retries: int = 4,
        timeout: float = DEFAULT_ATTEMPT_TIMEOUT,
        deadline: float = DEFAULT_DEADLINE,
        backoff: float = 0.05,
        max_prefetch_flights: int = 512,
        max_db_size: int = DEFAULT_MAX_DB_SIZE,
    ):
        self.store = store
        self.cache = cache
        self.mem = MemoryLRU(mem_cache_bytes)
        self.retries = retries
        self.timeout = timeout
        self.deadline = deadline
        self.max_db_size = max_db_size
        self.manifest_limit = manifest_blob_limit(max_db_size)
        # Chunks recently fetched for reads: fingerprint -> (expiry, bytes).
        self._held: OrderedDict[Fprint, tuple[float, bytes]] = OrderedDict()
        # Chunks given up on: fingerprint -> (trio time, the error).
        self._failed: dict[Fprint, tuple[float, FetchError]] = {}
        # Whether the store answers: False from a give-up for want of an
        # answer until the next GET that succeeds.
        self.reachable = True
        self.unreachable_since = 0.0  # time.time()
        self.last_store_error: str | None = None
        self.backoff = backoff
        self.max_prefetch_flights = max_prefetch_flights
        # Store I/O (GET + decode in one thread hop).
        self.io_limiter = trio.CapacityLimiter(concurrency)
        # Prefetches hold one of these while they fetch: demand keeps the rest.
        if prefetch_concurrency is None:
            prefetch_concurrency = max(1, concurrency * 3 // 4)
        self.prefetch_slots = trio.CapacityLimiter(max(1, min(prefetch_concurrency, concurrency)))
        # Threads, counting abandoned (timed-out) ones, so they stay bounded too.
        self.thread_limiter = trio.CapacityLimiter(concurrency * 2)
        # Disk cache reads that may block (not in the page cache) and writes.
        # 8: enough to keep a local disk's queue busy on 2 cores.
        self.cache_limiter = trio.CapacityLimiter(8)
        self.meta_limiter = trio.CapacityLimiter(4)
        self._inflight: dict[Fprint, _Flight] = {}
        self._prefetch_flights = 0
        self._prefetched_unused: set[Fprint] = set()
        self._to_advise: list[Fprint] = []  # for `_advise_loop`
        self._advising = False
        self._to_write: list = []  # (fp, bytes, slot) for `_write_loop`
        self._writing = False
        self._arrivals: list[trio.Event] = []  # engine answers for `_set_arrived`
        self._arrivals_lock = threading.Lock()
        self._nursery: trio.Nursery | None = None
        self._writes: trio.Nursery | None = None
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "requests",  # demand chunk requests
                "mem_hits",
                "disk_hits",
                "joins",  # demand requests that joined a flight under way
                "store_fetches",  # chunks downloaded (demand + prefetch)
                "gets",  # GET requests sent, retries included
                "get_bytes",
                "get_errors",
                "retries",
                "corrupt",  # blobs that failed verification
                "failed",  # chunks given up on (EIO)
                "prefetch_requested",
                "prefetch_started",
                "prefetch_skipped",  # in memory or under way
                "prefetch_advised",  # in the disk cache: kernel readahead asked
                "disk_hits_inline",  # served from the page cache without a thread
                "prefetch_dropped",  # too many prefetches under way
                "prefetch_fetched",  # downloaded by a prefetch
                "prefetch_hits",  # demand served by a prefetched chunk
                "manifest_gets",
                "lists",
                "too_large",  # objects larger than their bound, never read
                "failed_fast",  # demand reads answered from a recent give-up
            ),
            0,
        )

    # ------------------------------------------------------------------ setup
    def bind(self, nursery: trio.Nursery, writes: trio.Nursery | None = None) -> None:
        """Flights run in this nursery, not in the tasks that asked for them;
        disk cache writes in ``writes`` if given, a nursery that may outlive
        the flights' so that chunks already downloaded are still stored
        (the mount lets them finish, for a bounded time, at unmount)."""
        self._nursery = nursery
        self._writes = writes if writes is not None else nursery
        self._token = trio.lowlevel.current_trio_token()

    # ----------------------------------------------------------- blocking calls
    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking call (store listing, manifest GET) in a worker thread.
        Cancelling abandons the call (it only reads; its result is dropped),
        so that Ctrl-C, SIGTERM or umount do not wait for a slow store."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.meta_limiter, abandon_on_cancel=True)

    async def list_manifests(self) -> list:
        self.stats["lists"] += 1
        return await self.run_blocking(lambda: list(self.store.manifests.list("")))

    async def get_manifest_blob(self, key: str) -> bytes:
        """A manifest blob, at most `manifest_limit` bytes (else TooLarge,
        without reading it)."""
        self.stats["manifest_gets"] += 1
        try:
            return await self.run_blocking(
                functools.partial(self.store.manifests.get, key, max_bytes=self.manifest_limit))
        except TooLarge:
            self.stats["too_large"] += 1
            raise

    async def decode_manifest(self, blob: bytes):
        """``decode_and_validate`` in a thread, bounded by ``max_db_size``; a
        base chunk comes through ``get`` (verified, cached, single-flight)."""

        def fetch_chunk(fp: Fprint) -> bytes:
            # Only a base chunk comes here: as long as the chunk list it
            # encodes (docs/FORMAT.md), so larger than a chunk object may be.
            # Read once per decode, not cached, a few attempts.
            blob = self._store_retrying(lambda: self.store.chunks.get(
                chunk_name(fp), max_bytes=base_chunk_blob_limit(self.max_db_size)))
            return decode_base_chunk(blob, fp, self.max_db_size)

        return await self.run_blocking(
            functools.partial(decode_and_validate, blob, fetch_chunk, max_db_size=self.max_db_size))

    def _store_retrying(self, call: Callable[[], T]) -> T:
        """`call()` (a store request, in a worker thread) with the fetcher's
        retries and backoff for transient failures."""
        for attempt in range(self.retries + 1):
            try:
                return call()
            except TransientError:
                if attempt == self.retries:
                    raise
                time.sleep(min(self.backoff * (2 ** attempt), 2.0))
        raise AssertionError("not reached")

    # ------------------------------------------------------------------ reads
    def _memory(self, fp: Fprint) -> bytes | None:
        """The chunk from the in-memory LRU, or held since a recent read."""
        data = self.mem.get(fp)
        if data is None and self._held:
            held = self._held.get(fp)
            if held is not None:
                if held[0] >= trio.current_time():
                    return held[1]
                del self._held[fp]
        return data

    def _hold(self, fp: Fprint, data: bytes) -> None:
        """Keep a chunk fetched for a read (see `HOLD_SECONDS`)."""
        held = self._held
        held[fp] = (trio.current_time() + HOLD_SECONDS, data)
        held.move_to_end(fp)
        while len(held) > HOLD_CHUNKS:
            held.popitem(last=False)

    def _used(self, fp: Fprint) -> None:
        if fp in self._prefetched_unused:
            self._prefetched_unused.discard(fp)
            self.stats["prefetch_hits"] += 1

    def _ready(self, fp: Fprint) -> bytes | None:
        """Bytes that need no waiting: in memory, or in the disk cache *and*
        the kernel's page cache (a non-blocking read, see `ChunkCache.get_nowait`)."""
        data = self._memory(fp)
        if data is not None:
            self.stats["mem_hits"] += 1
            return data
        cache = self.cache
        if cache is not None and fp not in self._inflight and cache.has(fp):
            data = cache.get_nowait(fp)
            if data is not None:
                self.stats["disk_hits"] += 1
                self.stats["disk_hits_inline"] += 1
                self.mem.put(fp, data)
                return data
        return None

    def get_nowait(self, fp: Fprint) -> bytes | None:
        """A demand read that never waits: the bytes, or None when `get`
        must be awaited."""
        data = self._ready(fp)
        if data is not None:
            self.stats["requests"] += 1
            self._used(fp)
        return data

    async def get(self, fp: Fprint) -> bytes:
        """The verified bytes of one chunk (demand read)."""
        data = self.get_nowait(fp)
        return data if data is not None else await self.get_waiting(fp)

    async def get_waiting(self, fp: Fprint) -> bytes:
        """A demand read for a chunk `get_nowait` did not have: join or start
        its flight (disk cache in a thread, else the store)."""
        self.stats["requests"] += 1
        data = self._memory(fp)  # it may have arrived since
        if data is not None:
            self.stats["mem_hits"] += 1
            self._used(fp)
            return data
        flight = self._inflight.get(fp)
        if flight is not None:
            self.stats["joins"] += 1
            if flight.prefetch and not flight.promoted:
                flight.promoted = True
                self.stats["prefetch_hits"] += 1
                if flight.wait_scope is not None:
                    flight.wait_scope.cancel()
        else:
            failed = self._failed.get(fp)
            if failed is not None:
                if trio.current_time() - failed[0] < FAILED_CHUNK_TTL:
                    self.stats["failed_fast"] += 1
                    raise failed[1]
                del self._failed[fp]
            flight = self._start(fp, prefetch=False)
        await flight.event.wait()
        if flight.error is not None:
            raise FetchError(str(flight.error)) from flight.error
        assert flight.data is not None
        self._used(fp)
        return flight.data

    async def read_into(self, fps: list[Fprint], dests: list[memoryview]) -> None:
        """Fill ``dests[k]`` (a writable view of the chunk's length) with the
        verified bytes of ``fps[k]``, for the chunks of one read request.

        Chunks in the disk cache are read straight into the destinations, in
        as few system calls as their places in the segments allow, in this
        thread: a request of several chunks is the kernel's readahead of a
        sequential read, whose chunks the prefetcher's advice (or the
        kernel's readahead of the segment files) has usually brought into the
        page cache already, and a blocking read here costs less than a hop to
        a worker thread for the others (docs/READER.md, Prefetch). Chunks in
        memory are copied; the others (not cached, under way, damaged) go
        through `get_waiting`, in parallel.
        Disk hits are not kept in memory: the kernel's page cache keeps the
        segment's pages. Raises FetchError if one chunk cannot be obtained."""
        n = len(fps)
        cache = self.cache
        stats = self.stats
        done = [False] * n
        disk: list[int] = []
        for k, fp in enumerate(fps):
            data = self._memory(fp)
            if data is not None:
                dests[k][:] = data
                done[k] = True
                stats["mem_hits"] += 1
            elif cache is not None and fp not in self._inflight and cache.has(fp):
                disk.append(k)
        if disk:
            ok = cache.read_into([fps[k] for k in disk], [dests[k] for k in disk])
            for k, hit in zip(disk, ok):
                done[k] = hit
            inline = sum(ok)
            stats["disk_hits"] += inline
            stats["disk_hits_inline"] += inline
        stats["requests"] += n
        for k in range(n):
            if done[k]:
                self._used(fps[k])
        missing = [k for k in range(n) if not done[k]]
        if not missing:
            return
        stats["requests"] -= len(missing)  # get_waiting counts them
        errors: list[FetchError] = []

        async def one(k: int) -> None:
            try:
                data = await self.get_waiting(fps[k])
            except FetchError as e:
                errors.append(e)
                return
            if len(data) != len(dests[k]):
                name = chunk_name(fps[k])
                errors.append(FetchError("chunk %s has %d bytes, not %d" % (name, len(data), len(dests[k]))))
                return
            dests[k][:] = data

        if len(missing) == 1:
            await one(missing[0])
        else:
            async with trio.open_nursery() as nursery:
                for k in missing:
                    nursery.start_soon(one, k)
        if errors:
            raise errors[0]

    def prefetch(self, fps: Iterable[Fprint], *, fetch: bool = True, advise: bool = True) -> int:
        """Start fetching chunks in the background, skipping those in memory
        or under way; for chunks in the disk cache, ask the kernel to read
        them into its page cache instead (no GET, no thread per chunk).
        ``fetch=False`` only advises the cached chunks, ``advise=False`` only
        fetches the others. Returns how many flights (GETs) were started."""
        started = 0
        to_advise: list[Fprint] = []
        cache = self.cache
        for fp in fps:
            if fp in self.mem or fp in self._inflight:
                if fetch:
                    self.stats["prefetch_requested"] += 1
                    self.stats["prefetch_skipped"] += 1
                continue
            if cache is not None and cache.has(fp):
                if advise:
                    to_advise.append(fp)
                continue
            if not fetch:
                continue
            self.stats["prefetch_requested"] += 1
            if self._prefetch_flights >= self.max_prefetch_flights:
                self.stats["prefetch_dropped"] += 1
                continue
            self._start(fp, prefetch=True)
            started += 1
        self.stats["prefetch_started"] += started
        if to_advise:
            self.stats["prefetch_requested"] += len(to_advise)
            self.stats["prefetch_advised"] += len(to_advise)
            self._to_advise.extend(to_advise)
            if not self._advising:
                assert self._nursery is not None
                self._advising = True
                self._nursery.start_soon(self._advise_loop)
        return started

    async def _advise_loop(self) -> None:
        """Chunks already in the disk cache: have the kernel read them ahead,
        so demand finds them in its page cache. fadvise may block on the disk,
        so it runs in a thread, one hop at a time for every chunk queued
        meanwhile: a hop per read request cost the trio thread more in thread
        handoffs than it saved (a warm read ran about 30 % slower)."""
        assert self.cache is not None
        try:
            while self._to_advise:
                fps, self._to_advise = self._to_advise, []
                try:
                    await trio.to_thread.run_sync(self.cache.advise, fps, limiter=self.cache_limiter)
                except Exception:  # noqa: BLE001 - a hint
                    log.debug("cannot advise the cache", exc_info=True)
        finally:
            self._advising = False

    async def hydrate(self, fps: Iterable[Fprint], parallel: int | None = None,
                      progress: HydrateProgress | None = None) -> int:
        """Make sure every chunk is in the disk cache (eager hydration),
        counting in ``progress`` as it goes. Returns the number of chunks
        that were fetched or checked; raises FetchError, once all were tried,
        if some could not be fetched."""
        progress = progress if progress is not None else HydrateProgress()
        parallel = parallel or self.prefetch_slots.total_tokens
        sem = trio.Semaphore(parallel)
        todo = [fp for fp in dict.fromkeys(fps)
                if fp not in self.mem and not (self.cache is not None and self.cache.has(fp))]
        progress.chunks = len(todo)

        async def one(flight: _Flight) -> None:
            try:
                await flight.event.wait()
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
                        if flight is None and not (cache is not None and cache.has(fp)):
                            flight = self._start(fp, prefetch=True, hydrate=True, slot=slot)
                        elif cache is not None:
                            cache.release(slot)
                        if flight is None:  # cached meanwhile
                            progress.done += 1
                            sem.release()
                        else:
                            nursery.start_soon(one, flight)
                finally:  # cancelled: give back the places not used
                    if cache is not None:
                        for slot in slots:
                            cache.release(slot)
        if progress.failed:
            raise FetchError("%d of %d chunks could not be fetched (%s)"
                             % (progress.failed, progress.chunks, progress.error))
        return len(todo)

    # ---------------------------------------------------------------- flights
    def _start(self, fp: Fprint, prefetch: bool, hydrate: bool = False, slot: Any = _RESERVE) -> _Flight:
        if self._nursery is None:
            raise RuntimeError("Fetcher.bind(nursery) was not called")
        # The chunk's place in the disk cache is taken now, in the order
        # fetches start (a sequential read's are in file order), not when
        # its bytes arrive, in whatever order the GETs end; not for a chunk
        # the cache has (a read of it that had to wait for the disk).
        cache = self.cache
        if slot is _RESERVE:
            slot = cache.reserve() if cache is not None and not cache.has(fp) else None
        flight = _Flight(prefetch, slot)
        self._inflight[fp] = flight
        if prefetch:
            self._prefetch_flights += 1
        self._nursery.start_soon(self._fly, fp, flight, hydrate)
        return flight

    async def _fly(self, fp: Fprint, flight: _Flight, hydrate: bool) -> None:
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
            flight.data = await self._load(fp, flight, hydrate)
        except FetchError as e:
            flight.error = e
            if len(self._failed) >= self.max_prefetch_flights:
                self._failed.clear()  # a bound, not a policy: entries live seconds
            self._failed[fp] = (trio.current_time(), e)
        except BaseException as e:  # noqa: BLE001 - reported to every waiter
            flight.error = e
            if not isinstance(e, Exception):
                raise
        finally:
            if slot:
                self.prefetch_slots.release_on_behalf_of(flight)
            if flight.slot is not None and self.cache is not None:  # not handed to `_cache_put`
                self.cache.release(flight.slot)
            if flight.prefetch:
                self._prefetch_flights -= 1
            del self._inflight[fp]
            flight.event.set()

    async def _load(self, fp: Fprint, flight: _Flight, hydrate: bool) -> bytes:
        if self.cache is not None and self.cache.might_have(fp):
            cache = self.cache
            if hydrate:
                if await trio.to_thread.run_sync(cache.contains, fp, limiter=self.cache_limiter):
                    if not flight.promoted:  # nobody waits for the bytes
                        return b""
            data = await trio.to_thread.run_sync(cache.get, fp, limiter=self.cache_limiter)
            if data is not None:
                self.stats["disk_hits"] += 1
                self.mem.put(fp, data)
                if not flight.prefetch or flight.promoted:
                    self._hold(fp, data)
                return data
        data, cached = await self._download(fp, flight.slot if self.cache is not None else None)
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

    def _cache_put(self, fp: Fprint, data: bytes, slot: Any = None) -> None:
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
                try:
                    cache.put(fp, data, slot)
                except Exception:  # noqa: BLE001 - a cache that cannot be written is not fatal
                    log.exception("cannot write chunk %s to the cache", chunk_name(fp))
                finally:
                    cache.release(slot)  # if `put` failed

        batch: list = []
        try:
            while self._to_write:
                batch, self._to_write = self._to_write, []
                await trio.to_thread.run_sync(write, batch, limiter=self.cache_limiter)
                batch = []
        finally:
            self._writing = False
            for _fp, _data, slot in batch + self._to_write:  # cancelled before the thread took them
                cache.release(slot)
            self._to_write = []

    async def _download(self, fp: Fprint, slot: Any = None) -> tuple[bytes, bool]:
        """GET and verify one chunk: attempts of at most ``timeout`` seconds,
        with backoff, until one succeeds, ``retries`` retries are spent or
        ``deadline`` seconds have passed (queueing for a GET slot included);
        then FetchError. Returns the bytes and whether the disk cache write
        is taken care of (the engine path writes them in `slot` itself)."""
        name = chunk_name(fp)
        backend = self.store.chunks

        def get_and_decode() -> tuple[int, bytes]:
            blob = backend.get(name, max_bytes=MAX_CHUNK_BLOB_BYTES)
            return len(blob), decode_chunk(blob, fp)

        async def attempt_once() -> tuple[int, bytes, bool]:
            # The engine's request has `timeout` as its own bound; a thread's
            # is abandoned after it.
            answer = await self._get_async(backend, name, fp, slot)
            if answer is not None:
                return answer[0], answer[1], True
            with trio.fail_after(self.timeout):
                size, data = await trio.to_thread.run_sync(get_and_decode, abandon_on_cancel=True,
                                                           limiter=self.thread_limiter)
            return size, data, False

        last: BaseException | None = None
        attempts = 0
        with trio.move_on_after(self.deadline) as deadline:
            for attempt in range(self.retries + 1):
                if attempt:
                    self.stats["retries"] += 1
                    await trio.sleep(min(self.backoff * (2 ** (attempt - 1)), 2.0))
                start = time.monotonic()
                attempts += 1
                try:
                    try:  # a free one costs no trip through the scheduler
                        self.io_limiter.acquire_nowait()
                    except trio.WouldBlock:
                        await self.io_limiter.acquire()
                    try:
                        self.stats["gets"] += 1
                        size, data, cached = await attempt_once()
                    finally:
                        self.io_limiter.release()
                    self.stats["get_bytes"] += size
                    log.debug("GET %s: %d bytes in %.3fs", name, size, time.monotonic() - start)
                    self._store_answered()
                    return data, cached
                except trio.TooSlowError:
                    last = TimeoutError("GET %s timed out after %.1fs" % (name, self.timeout))
                except ChunkError as e:
                    self.stats["corrupt"] += 1
                    last = e
                except TooLarge as e:
                    self.stats["too_large"] += 1
                    self.stats["get_errors"] += 1
                    last = e
                    break  # the same object next time: not worth a retry
                except (StoreError, OSError) as e:
                    last = e
                self.stats["get_errors"] += 1
                log.debug(
                    "GET %s failed (attempt %d, %.3fs): %s", name, attempt + 1, time.monotonic() - start, last
                )
        if deadline.cancelled_caught:
            last = TimeoutError("no answer from the store within the %.0fs deadline (last: %s)"
                                % (self.deadline, last or "none"))
        self.stats["failed"] += 1
        if isinstance(last, (TimeoutError, OSError)) or (
            isinstance(last, StoreError) and not isinstance(last, (NotFound, TooLarge))
        ):
            self._store_unanswered(last)
        log.error("giving up on chunk %s after %d attempts: %s", name, attempts, last)
        text = str(last)
        raise FetchError(text if name in text else "chunk %s: %s" % (name, text))

    async def _get_async(self, backend: Any, name: str, fp: Fprint, slot: Any) -> tuple[int, bytes] | None:
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

        cache = self.cache

        def done(answer) -> None:  # on the engine's thread
            try:
                if isinstance(answer, BaseException):
                    box.append(answer)
                else:
                    box.append((len(answer), decode_chunk(answer, fp)))
            except BaseException as e:  # noqa: BLE001 - handed to the task
                box.append(e)
            self._arrived(ready)
            if cache is not None and isinstance(box[0], tuple):
                try:
                    cache.put(fp, box[0][1], slot)  # a slot given back meanwhile: appended
                except Exception:  # noqa: BLE001 - a cache that cannot be written is not fatal
                    log.exception("cannot write chunk %s to the cache", chunk_name(fp))

        if not get_async(name, MAX_CHUNK_BLOB_BYTES, done, timeout=self.timeout):
            return None
        await ready.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _arrived(self, ready: trio.Event) -> None:
        """From the engine's thread: set `ready` in trio. Answers that arrive
        while trio has not yet run the last hand-off join it, so a busy
        engine wakes trio once per batch, not once per chunk."""
        with self._arrivals_lock:
            self._arrivals.append(ready)
            if len(self._arrivals) > 1:
                return
        try:
            self._token.run_sync_soon(self._set_arrived)
        except trio.RunFinishedError:
            pass  # the mount is gone: nobody waits

    def _set_arrived(self) -> None:
        with self._arrivals_lock:
            arrivals, self._arrivals = self._arrivals, []
        for ready in arrivals:
            ready.set()

    def _store_answered(self) -> None:
        if not self.reachable:
            self.reachable = True
            self._failed.clear()  # given up on while the store failed: worth a new try
            log.warning("the store answers again (unreachable for %.0fs)", time.time() - self.unreachable_since)

    def _store_unanswered(self, error: BaseException) -> None:
        self.last_store_error = str(error)
        if self.reachable:
            self.reachable = False
            self.unreachable_since = time.time()
            log.warning("the store is unreachable or failing (%s): reads that need it fail with a remote "
                        "I/O error within %.0fs (mount option deadline)", error, self.deadline)

    # ------------------------------------------------------------------ stats
    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.stats)
        out["prefetch_waste"] = len(self._prefetched_unused)
        out["inflight"] = len(self._inflight)
        out["mem_cache_bytes"] = self.mem.size
        out["store"] = {
            "reachable": self.reachable,
            "unreachable_since": None if self.reachable else self.unreachable_since,
            "last_error": self.last_store_error,
            "deadline": self.deadline,
            "max_db_size": self.max_db_size,
        }
        if self.cache is not None:
            out["disk_cache"] = self.cache.describe()
        return out

