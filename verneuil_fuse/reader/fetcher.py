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

Two ways a flight runs. On a store whose backend gives its chunks' URLs
and signing (S3's `direct_gets`) a GET costs the trio thread no task and no
Event: `flights.EnginePath` queues flights for their slots, starts them on
the chunk engine in C (`chunk_engine.ChunkEngine`) many per submission,
which decodes, verifies and writes them to the disk cache on its own
thread, outside the GIL, and hands their answers back in batches (one
wake-up of trio per batch) to `engine_answered`; a read request waits for
all its chunks on one Event (`_Waiter`). Anything else runs in a task
(`_fly`): a chunk the disk cache may hold, a directory store's GETs in
threads, hydration, the retries of a GET that failed on the engine, and a
chunk of a packed store (docs/FORMAT.md, "Packed layout"), whose flight
carries its `ChunkSource` (a byte range of a pack, given by the replica)
and is read by `store.read_chunk` with a range GET, verified and cached
like any chunk (one range GET per chunk: runs of adjacent chunks in one GET
are for the engine path to do).
"""
from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

import trio

from verneuil_fuse.format import (
    DEFAULT_MAX_DB_SIZE,
    ChunkError,
    ChunkSource,
    Fprint,
    base_chunk_blob_limit,
    chunk_name,
    decode_and_validate,
    decode_base_chunk,
    manifest_blob_limit,
)
from verneuil_fuse.reader.cache import CacheSlot, ChunkCache, MemoryLRU
from verneuil_fuse.reader.flights import DONE, TASK, EnginePath, Flight, store_chunk
from verneuil_fuse.reader.throttle import AdaptiveLimit, is_congestion
from verneuil_fuse.store import NotFound, StoreError, TooLarge, read_chunk
from verneuil_fuse.store.retry import Backoff, retry, retry_async

log = logging.getLogger(__name__)

T = TypeVar("T")

# GETs in flight at once on the chunk engine (S3), where a GET in flight
# holds no thread: a cold scan keeps about 3/4 of them busy with prefetches,
# and the store's latency (20-26 ms per request on the nginx rig) then
# bounds it: 256 scanned at 371-383 MB/s and 0.21-0.22 ms of CPU per GET at
# 1 GiB against 220-261 MB/s and 0.24-0.32 ms with 128 (docs/BENCHMARKS.md).
DEFAULT_CONCURRENCY = 256
# ... and on a store whose reads run in worker threads (a directory store),
# one thread each: 128 measured the same as 64 there.
DEFAULT_THREAD_CONCURRENCY = 128
# Hydration takes the disk cache's places for this many chunks at a time
# (1 MiB), back to back, so that the kernel's largest read requests find
# them in one run even while a second database hydrates alongside.
HYDRATE_BLOCK = 16

_RESERVE = object()  # `Fetcher._start`: take the chunk's place in the disk cache now

# Disk cache reads that may block (not in the page cache) and writes at
# once: enough to keep a local disk's queue busy on 2 cores.
CACHE_THREADS = 8
# Blocking metadata calls at once (listings, manifest GETs and decodes):
# a poll or a few lookups, not a scan's worth.
META_THREADS = 4
# Conditional manifest reads at once (`get_manifest_if_changed`, the follow
# loop's checks of open databases): threads of their own, so that a pass
# over many databases never holds up a lookup's manifest GET; 4 keep a
# pass of 64 checks of 30 ms each within half a second.
CHECK_THREADS = 4
# Retries of a GET wait up to ``backoff`` seconds, then up to twice as long
# ... ("full jitter": a random time below that bound, so that the GETs a
# store refused together do not come back together; the deadline bounds
# them) ...
DEFAULT_BACKOFF = 0.05
# ... but never more than this between two attempts.
BACKOFF_CAP = 2.0
DEFAULT_RETRIES = 4
# Prefetches under way at once, waiting for a slot included: past this, a
# hint is dropped (the readahead asks again at the next read).
DEFAULT_MAX_PREFETCH_FLIGHTS = 512
# The in-memory LRU of chunks (`MemoryLRU`): 64 MiB, a thousand chunks.
DEFAULT_MEM_CACHE_BYTES = 64 << 20

# The fetcher's counters (`Fetcher.stats`, /.verneuil/stats).
STAT_NAMES = (
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
    "prefetch_throttled",  # prefetch hints dropped while the store throttles
)

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


# What one GET attempt may fail with (`Fetcher._get_once`).
_GET_FAILURES = (ChunkError, StoreError, OSError)


def _worth_retrying(error: BaseException) -> bool:
    """A failed GET worth another attempt: the transport, a store's answer
    (a 404 included: a chunk listed by a manifest just written may be on its
    way), a blob that failed verification; not an object over its size
    bound, which is the same object next time."""
    return isinstance(error, _GET_FAILURES) and not isinstance(error, TooLarge)


def _get_and_decode(backend: Any, source: ChunkSource, fp: Fprint) -> tuple[int, bytes]:
    """GET (a whole chunk object, or a range of a pack) and verify one chunk
    in a worker thread: (blob size, bytes)."""
    return read_chunk(backend, source, fp)


def _source_of(sources: Any, k: int) -> ChunkSource | None:
    """The k-th of ``sources`` (a list parallel to the fingerprints a
    replica passes), or None (Verneuil's layout: a chunk object)."""
    return None if sources is None else sources[k]


class FetchError(Exception):
    """A chunk could not be obtained (after retries, or before the deadline):
    the read must fail."""


class _Waiter:
    """A read request waiting for ``left`` flights: one trio Event for all."""

    __slots__ = ("left", "event")

    def __init__(self, left: int):
        self.left = left
        self.event = trio.Event()


@dataclass
class HydrateProgress:
    """How far one eager hydration went (`Fetcher.hydrate`)."""

    chunks: int = 0  # chunks it had to fetch (the others were cached)
    done: int = 0  # of which fetched (or found cached meanwhile)
    failed: int = 0  # of which could not be fetched
    error: str | None = None  # the first failure


class Fetcher:
    """Verified chunks for replicas, manifests for the catalog: from memory,
    the disk cache or the store (see the module's docstring)."""

    def __init__(
        self,
        store: Any,
        cache: ChunkCache | None = None,
        *,
        concurrency: int | None = None,
        prefetch_concurrency: int | None = None,
        mem_cache_bytes: int = DEFAULT_MEM_CACHE_BYTES,
        retries: int = DEFAULT_RETRIES,
        timeout: float = DEFAULT_ATTEMPT_TIMEOUT,
        deadline: float = DEFAULT_DEADLINE,
        backoff: float = DEFAULT_BACKOFF,
        max_prefetch_flights: int = DEFAULT_MAX_PREFETCH_FLIGHTS,
        max_db_size: int = DEFAULT_MAX_DB_SIZE,
    ):
        self.store = store
        self.cache = cache
        self.mem = MemoryLRU(mem_cache_bytes)
        self.retries = retries
        self.timeout = timeout
        self.deadline = deadline
        self.backoff = backoff
        self.max_prefetch_flights = max_prefetch_flights
        self.max_db_size = max_db_size
        self.manifest_limit = manifest_blob_limit(max_db_size)
        self._init_limiters(concurrency, prefetch_concurrency)
        self._init_flights()
        self._init_health()
        self._nursery: trio.Nursery | None = None
        self._writes: trio.Nursery | None = None
        self.stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)

    def _init_limiters(self, concurrency: int | None, prefetch_concurrency: int | None) -> None:
        if concurrency is None:
            threads = not callable(getattr(self.store.chunks, "direct_gets", None))
            concurrency = DEFAULT_THREAD_CONCURRENCY if threads else DEFAULT_CONCURRENCY
        # Store I/O (GET + decode in one thread hop), its size adapting to the
        # store's throttling (`throttle.AdaptiveLimit`).
        self.io_limiter = trio.CapacityLimiter(concurrency)
        self.limit = AdaptiveLimit(self.io_limiter)
        # Prefetches hold one of these while they fetch: demand keeps the rest.
        if prefetch_concurrency is None:
            prefetch_concurrency = max(1, concurrency * 3 // 4)
        self.prefetch_slots = trio.CapacityLimiter(max(1, min(prefetch_concurrency, concurrency)))
        # Threads, counting abandoned (timed-out) ones, so they stay bounded too.
        self.thread_limiter = trio.CapacityLimiter(concurrency * 2)
        self.cache_limiter = trio.CapacityLimiter(CACHE_THREADS)
        self.meta_limiter = trio.CapacityLimiter(META_THREADS)
        self.check_limiter = trio.CapacityLimiter(CHECK_THREADS)

    def _init_flights(self) -> None:
        self._inflight: dict[Fprint, Flight] = {}
        self._prefetch_flights = 0
        self._prefetched_unused: set[Fprint] = set()
        # Chunks recently fetched for reads: fingerprint -> (expiry, bytes).
        self._held: OrderedDict[Fprint, tuple[float, bytes]] = OrderedDict()
        self._to_advise: list[Fprint] = []  # for `_advise_loop`
        self._advising = False
        self._to_write: list[tuple[Fprint, bytes, CacheSlot | None]] = []  # for `_write_loop`
        self._writing = False
        # Chunk GETs on the chunk engine, many per submission, where the
        # backend gives their URLs (`flights.EnginePath`).
        self._engine = EnginePath(self, self.store.chunks, self.io_limiter.total_tokens)

    def _init_health(self) -> None:
        # Chunks given up on: fingerprint -> (trio time, the error).
        self._failed: dict[Fprint, tuple[float, FetchError]] = {}
        # Whether the store answers: False from a give-up for want of an
        # answer until the next GET that succeeds.
        self.reachable = True
        self.unreachable_since = 0.0  # time.time()
        self.last_store_error: str | None = None

    def _retry_schedule(self) -> Backoff:
        """The waits between a GET's attempts (`store.retry`)."""
        return Backoff(base=self.backoff, cap=BACKOFF_CAP, attempts=self.retries + 1)

    # ------------------------------------------------------------------ setup
    def bind(self, nursery: trio.Nursery, writes: trio.Nursery | None = None) -> None:
        """Flights run in this nursery, not in the tasks that asked for them;
        disk cache writes in ``writes`` if given, a nursery that may outlive
        the flights' so that chunks already downloaded are still stored
        (the mount lets them finish, for a bounded time, at unmount)."""
        self._nursery = nursery
        self._writes = writes if writes is not None else nursery
        self._engine.bind(nursery)

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

    async def get_manifest_if_changed(self, key: str, tag: str | None):
        """`Backend.get_if_changed` of a manifest (a `Tagged` blob, or None
        while the key holds the version `tag` names), bounded as
        `get_manifest_blob`, in a thread behind `CHECK_THREADS`."""
        call = functools.partial(self.store.manifests.get_if_changed, key, tag, max_bytes=self.manifest_limit)
        try:
            return await trio.to_thread.run_sync(call, limiter=self.check_limiter, abandon_on_cancel=True)
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
        return retry(call, backoff=self._retry_schedule(), what="store request")

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
        if cache is not None and fp not in self._inflight:
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

    async def get_waiting(self, fp: Fprint, source: ChunkSource | None = None) -> bytes:
        """A demand read for a chunk `get_nowait` did not have: join or start
        its flight (disk cache in a thread, else the store). ``source``:
        where the chunk is in a packed store (`format.chunk_source`); None:
        its own chunk object."""
        got = self._join(fp, source)
        if not isinstance(got, Flight):
            return got
        self._engine.pump()
        await self._wait([got])
        return self._result(got)

    def _join(self, fp: Fprint, source: ChunkSource | None = None) -> bytes | Flight:
        """A demand read's chunk: its bytes if they arrived meanwhile, else
        its flight, joined (a prefetch's is promoted) or started (not
        submitted: `EnginePath.pump`). Raises FetchError for a chunk given up on less
        than `FAILED_CHUNK_TTL` ago."""
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
                self._promote(flight)
            return flight
        failed = self._failed.get(fp)
        if failed is not None:
            if trio.current_time() - failed[0] < FAILED_CHUNK_TTL:
                self.stats["failed_fast"] += 1
                raise failed[1]
            del self._failed[fp]
        return self._start(fp, prefetch=False, source=source)

    def _promote(self, flight: Flight) -> None:
        """A demand read joined a prefetch: it no longer waits for a
        prefetch slot (demand keeps the store's capacity for itself)."""
        flight.promoted = True
        self.stats["prefetch_hits"] += 1
        if flight.wait_scope is not None:
            flight.wait_scope.cancel()
        self._engine.promote(flight)  # if queued behind prefetches: with demand now

    async def _wait(self, flights: list[Flight]) -> None:
        """Until every flight of ``flights`` is done (one Event for all)."""
        left = [f for f in flights if f.state is not DONE]
        if not left:
            return
        waiter = _Waiter(len(left))
        for flight in left:
            if flight.waiters is None:
                flight.waiters = [waiter]
            else:
                flight.waiters.append(waiter)
        await waiter.event.wait()

    def _result(self, flight: Flight) -> bytes:
        """The bytes of a flight done, or its error as FetchError."""
        if flight.error is not None:
            raise FetchError(str(flight.error)) from flight.error
        assert flight.data is not None
        self._used(flight.fp)
        return flight.data

    async def read_into(self, fps: list[Fprint], dests: list[memoryview],
                        sources: list[ChunkSource] | None = None) -> None:
        """Fill ``dests[k]`` (a writable view of the chunk's length) with the
        verified bytes of ``fps[k]``, for the chunks of one read request;
        ``sources[k]``, when given, is where the chunk is in a packed store.

        Chunks in the disk cache are read straight into the destinations, in
        as few system calls as their places in the segments allow, in this
        thread: a request of several chunks is the kernel's readahead of a
        sequential read, whose chunks the prefetcher's advice (or the
        kernel's readahead of the segment files) has usually brought into the
        page cache already, and a blocking read here costs less than a hop to
        a worker thread for the others (docs/READER.md, Prefetch). Chunks in
        memory are copied; the others (not cached, under way, damaged) are
        joined or started as flights, all waited for at once.
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
            elif cache is not None and fp not in self._inflight and cache.has_indexed(fp):
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
        stats["requests"] -= len(missing)  # `_join` counts them
        await self._read_missing(fps, dests, missing, sources)

    async def _read_missing(self, fps: list[Fprint], dests: list[memoryview], missing: list[int],
                            sources: list[ChunkSource] | None = None) -> None:
        """`read_into` for the chunks ``missing`` (positions): flights joined
        or started, one wait for all, then the bytes copied; the first error,
        once all are done."""
        errors: list[FetchError] = []
        waiting: list[tuple[int, Flight]] = []
        for k in missing:
            try:
                got = self._join(fps[k], _source_of(sources, k))
            except FetchError as e:
                errors.append(e)
                continue
            if isinstance(got, Flight):
                waiting.append((k, got))
            else:
                self._fill(fps[k], dests[k], got, errors)
        if waiting:
            self._engine.pump()
            await self._wait([flight for _, flight in waiting])
            for k, flight in waiting:
                try:
                    data = self._result(flight)
                except FetchError as e:
                    errors.append(e)
                    continue
                self._fill(fps[k], dests[k], data, errors)
        if errors:
            raise errors[0]

    @staticmethod
    def _fill(fp: Fprint, dest: memoryview, data: bytes, errors: list[FetchError]) -> None:
        """Copy a chunk's bytes into its destination, or note an error if it
        has another length than the request needs."""
        if len(data) != len(dest):
            errors.append(FetchError("chunk %s has %d bytes, not %d" % (chunk_name(fp), len(data), len(dest))))
        else:
            dest[:] = data

    def prefetch(self, fps: Iterable[Fprint], *, fetch: bool = True, advise: bool = True,
                 sources: list[ChunkSource] | None = None) -> int:
        """Start fetching chunks in the background, skipping those in memory
        or under way; for chunks in the disk cache, ask the kernel to read
        them into its page cache instead (no GET, no thread per chunk).
        ``fetch=False`` only advises the cached chunks, ``advise=False`` only
        fetches the others; ``sources`` as for `read_into`. Returns how many
        flights (GETs) were started."""
        started = 0
        to_advise: list[Fprint] = []
        cache = self.cache
        paused = fetch and self.limit.paused  # the store throttles: its GETs go to demand reads
        for k, fp in enumerate(fps):
            if fp in self.mem or fp in self._inflight:
                if fetch:
                    self.stats["prefetch_requested"] += 1
                    self.stats["prefetch_skipped"] += 1
                continue
            if cache is not None and cache.has_indexed(fp):
                if advise:
                    to_advise.append(fp)
                continue
            if not fetch:
                continue
            self.stats["prefetch_requested"] += 1
            if paused:
                self.stats["prefetch_throttled"] += 1
                continue
            if self._prefetch_flights >= self.max_prefetch_flights:
                self.stats["prefetch_dropped"] += 1
                continue
            self._start(fp, prefetch=True, source=_source_of(sources, k))
            started += 1
        self.stats["prefetch_started"] += started
        if started:
            self._engine.pump()
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

    # ---------------------------------------------------------------- flights
    def _start(self, fp: Fprint, prefetch: bool, hydrate: bool = False, slot: Any = _RESERVE,
               source: ChunkSource | None = None) -> Flight:
        """Start the flight of one chunk; ``slot``: its place in the disk
        cache, taken here unless given; ``source``: where the chunk is in a
        packed store (None: its own chunk object). A GET the chunk engine can
        make (a whole chunk object) is queued for `EnginePath.pump` (the
        caller calls it once its flights are started); anything else runs in
        a task (`_fly`): a range of a pack too, read by `read_chunk`."""
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
        ranged = source is not None and source.ranged
        if hydrate or ranged or not self._engine.available or (cache is not None and cache.might_have(fp)):
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
        flight.state = DONE
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

    async def _download(self, fp: Fprint, flight: Flight, *, failed: int = 0,
                        last: BaseException | None = None) -> bytes:
        """GET and verify one chunk: attempts of at most ``timeout`` seconds,
        with backoff, until one succeeds, ``retries`` retries are spent or
        ``deadline`` seconds have passed (queueing for a GET slot included);
        then FetchError. ``failed``: attempts already made on the engine path
        (whose deadline started then), ``last`` the error of the last."""
        name = chunk_name(fp)
        source = flight.source if flight.source is not None else ChunkSource(name)
        if not failed:
            flight.deadline = trio.current_time() + self.deadline
        attempts = failed

        async def attempt() -> bytes:
            nonlocal attempts, last
            attempts += 1
            try:
                return await self._get_once(fp, name, attempts, source)
            except _GET_FAILURES as e:
                last = e
                raise

        async def sleep(delay: float) -> None:
            self.stats["retries"] += 1
            if last is not None and is_congestion(last):
                try:
                    await self.limit.hold(delay)  # a throttled GET's wait takes a GET's place
                finally:
                    self._engine.pump()  # the place given back may let a queued flight go
            else:
                await trio.sleep(delay)

        with trio.move_on_at(flight.deadline) as deadline:
            try:
                return await retry_async(attempt, backoff=self._retry_schedule(), sleep=sleep,
                                         transient=_worth_retrying, failed=failed)
            except _GET_FAILURES:
                pass
        if deadline.cancelled_caught:
            last = TimeoutError("no answer from the store within the %.0fs deadline (last: %s)"
                                % (self.deadline, last or "none"))
        raise self._gave_up(name, attempts, last)

    async def _get_once(self, fp: Fprint, name: str, attempt: int, source: ChunkSource) -> bytes:
        """One attempt of `_download`, counted: on the chunk engine if there
        is an engine path and ``source`` is a whole chunk object (its request
        has ``timeout`` as its own bound), else in a worker thread abandoned
        after ``timeout``. Raises one of `_GET_FAILURES` (a timeout as
        TimeoutError)."""
        backend = self.store.chunks
        start = time.monotonic()
        try:
            try:  # a free one costs no trip through the scheduler
                self.io_limiter.acquire_nowait()
            except trio.WouldBlock:
                await self.io_limiter.acquire()
            try:
                self.stats["gets"] += 1
                answer = None if source.ranged else await self._engine.get_one(fp)
                if answer is None:
                    with trio.fail_after(self.timeout):
                        answer = await trio.to_thread.run_sync(_get_and_decode, backend, source, fp,
                                                               abandon_on_cancel=True, limiter=self.thread_limiter)
            finally:
                self.io_limiter.release()
                self._engine.pump()  # flights queued for the engine may go now
        except trio.TooSlowError:
            error: BaseException = TimeoutError("GET %s timed out after %.1fs" % (name, self.timeout))
        except _GET_FAILURES as e:
            error = e
        else:
            size, data = answer
            self.limit.answered(None)
            self.stats["get_bytes"] += size
            log.debug("GET %s: %d bytes in %.3fs", name, size, time.monotonic() - start)
            self._store_answered()
            return data
        self.limit.answered(error)
        self._count_get_error(name, error, attempt, time.monotonic() - start)
        raise error

    def _count_get_error(self, name: str, error: BaseException, attempt: int, took: float) -> None:
        """Count (and log at debug level) one failed GET attempt."""
        if isinstance(error, ChunkError):
            self.stats["corrupt"] += 1
        elif isinstance(error, TooLarge):
            self.stats["too_large"] += 1
        self.stats["get_errors"] += 1
        if not isinstance(error, TooLarge):
            log.debug("GET %s failed (attempt %d, %.3fs): %s", name, attempt, took, error)

    def _gave_up(self, name: str, attempts: int, last: BaseException | None) -> FetchError:
        """Count and log the failure of a chunk's fetch: the FetchError to
        raise. A failure for want of an answer marks the store unreachable."""
        self.stats["failed"] += 1
        if isinstance(last, (TimeoutError, OSError)) or (
            isinstance(last, StoreError) and not isinstance(last, (NotFound, TooLarge))
        ):
            self._store_unanswered(last)
        log.error("giving up on chunk %s after %d attempts: %s", name, attempts, last)
        text = str(last)
        return FetchError(text if name in text else "chunk %s: %s" % (name, text))

    # --------------------------------------- the engine path's owner (`flights`)
    def engine_answered(self, flight: Flight, result: bytes | BaseException, size: int, cached: bool) -> None:
        """`FlightOwner`, in trio: a GET of the engine path answered (its
        slots given back). Bytes finish the flight; an error worth a retry
        hands it to a task (`_fly`), any other (or the last) fails it."""
        name = chunk_name(flight.fp)
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
        self._count_get_error(name, result, 1, 0.0)
        if _worth_retrying(result) and self.retries > 0 and trio.current_time() < flight.deadline:
            flight.state = TASK
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
        self._fail(flight, self._gave_up(chunk_name(flight.fp), 0, error))
        self._finish(flight)

    def run_in_task(self, flight: Flight) -> None:
        """`FlightOwner`: the engine cannot take the flight: a task runs it."""
        flight.state = TASK
        assert self._nursery is not None
        self._nursery.start_soon(self._fly, flight, False)

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
    def cache_capacity(self) -> int | None:
        """Bytes the disk cache can hold (its ``cache_size``, or less when its
        disk is smaller), or None without a disk cache."""
        return self.cache.capacity if self.cache is not None else None

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
        keeper = getattr(self.store.chunks, "credentials", None)
        if keeper is not None:
            out["store"]["credentials"] = keeper.describe()
        out["engine_path"] = self._engine.available
        out["throttle"] = self.limit.describe()
        if self.cache is not None:
            out["disk_cache"] = self.cache.describe()
        return out

