"""Chunk fetching for the reader: single-flight, verified, cached, prefetched.

The fetcher (this module and its parts) makes the reader's blocking calls
(boto3 or the local store, the disk cache, zstd), each in a worker thread
behind a ``trio.CapacityLimiter``, so pyfuse3's request tasks never block.

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
and signing (S3's `direct_gets`) or their files' paths (a directory
store's `direct_files`) a read costs the trio thread no task and no Event:
`flights.EnginePath` queues flights for their slots, starts them on the
chunk engine in C (`chunk_engine.ChunkEngine`) many per submission, which
reads, decodes, verifies and writes them to the disk cache on its own
threads, outside the GIL, and hands their answers back in batches (one
wake-up of trio per batch) to `engine_answered`; a read request waits for
all its chunks on one Event (`_Waiter`). A chunk of a packed store
(docs/FORMAT.md, "Packed layout") carries its `ChunkSource` (a byte range
of a pack, given by the replica): the flights of adjacent blobs started
together go as one range request. Anything else runs in a task (`_fly`):
a chunk the disk cache may hold, hydration, the retries of a read that
failed on the engine (a pack's chunk: one range read in a thread), and
every read of a backend that gives neither.

`Fetcher` is the read path (memory, disk cache, flights joined or started,
prefetch; `span`: the chunks of one read as one view of the run buffer a
range read of a pack decoded them into) and its settings and stats; each of its other jobs is a part of
its own, in its own module: `manifest_source` (manifests for the catalog),
`flight_runs` (a flight from start to end, the engine path's answers),
`store_gets` (a chunk's GETs, retries and deadline, the store's health),
`landing` (memory, held chunks, the disk cache's writes) and `hydration`.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Iterable

import trio

from verneuil_fuse.format import CHUNK_SIZE, DEFAULT_MAX_DB_SIZE, ChunkSource, Fprint
from verneuil_fuse.reader.cache import CacheSlot, ChunkCache, MemoryLRU, RunBufferCounts
from verneuil_fuse.reader.chunk_engine import address
from verneuil_fuse.reader.flight_runs import FlightRuns
from verneuil_fuse.reader.flights import DONE, EnginePath, Flight
from verneuil_fuse.reader.hydration import FetcherHydration
from verneuil_fuse.reader.landing import Landing
from verneuil_fuse.reader.manifest_source import ManifestSource
from verneuil_fuse.reader.store_gets import FetchError, StoreGets
from verneuil_fuse.reader.throttle import AdaptiveLimit
from verneuil_fuse.store import Reads

log = logging.getLogger(__name__)


# GETs in flight at once on the chunk engine (S3), where a GET in flight
# holds no thread: a cold scan keeps about 3/4 of them busy with prefetches,
# and the store's latency (20-26 ms per request on the nginx rig) then
# bounds it: 256 scanned at 371-383 MB/s and 0.21-0.22 ms of CPU per GET at
# 1 GiB against 220-261 MB/s and 0.24-0.32 ms with 128 (docs/BENCHMARKS.md).
DEFAULT_CONCURRENCY = 256
# ... and on a store whose reads run in worker threads (a directory store:
# the chunk engine's, or one each where there is no engine path): 128
# measured the same as 64 there.
DEFAULT_THREAD_CONCURRENCY = 128
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
# them), at most `store_gets.BACKOFF_CAP`.
DEFAULT_BACKOFF = 0.05
DEFAULT_RETRIES = 4
# Prefetches under way at once, waiting for a slot included: past this, a
# hint is dropped (a chunk the sequential readahead does not ask for again:
# its read waits for a GET). A third more than the largest readahead window
# (768), so that a scan's window and the runs still landing behind it fit:
# a cold scan of a packed store drops none (with 512 for a window of 512, it
# dropped 1,100 of its 15,000 prefetches).
DEFAULT_MAX_PREFETCH_FLIGHTS = 1024
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
    "disk_hits_inline",  # served from the page cache without a thread
    "prefetch_dropped",  # too many prefetches under way
    "prefetch_fetched",  # downloaded by a prefetch
    "prefetch_hits",  # demand served by a prefetched chunk
    "manifest_gets",
    "lists",
    "too_large",  # objects larger than their bound, never read
    "failed_fast",  # demand reads answered from a recent give-up
    "prefetch_throttled",  # prefetch hints dropped while the store throttles
    "spans",  # read requests of several chunks answered with a view of their run buffer (`span`)
)

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


def _source_of(sources: Any, k: int) -> ChunkSource | None:
    """The k-th of ``sources`` (a list parallel to the fingerprints a
    replica passes), or None (Verneuil's layout: a chunk object)."""
    return None if sources is None else sources[k]


class _Waiter:
    """A read request waiting for ``left`` flights: one trio Event for all."""

    __slots__ = ("left", "event")

    def __init__(self, left: int):
        self.left = left
        self.event = trio.Event()


class Fetcher(ManifestSource, StoreGets, FlightRuns, Landing, FetcherHydration):
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
        self.cache = cache
        self.mem = MemoryLRU(mem_cache_bytes)
        self.retries = retries
        self.timeout = timeout
        self.deadline = deadline
        self.backoff = backoff
        self.max_prefetch_flights = max_prefetch_flights
        self.max_db_size = max_db_size
        self.reads = Reads(store, max_db_size=max_db_size)
        self.capabilities = store.chunks.capabilities()
        self._init_limiters(concurrency, prefetch_concurrency)
        self._init_flights()
        self._init_health()
        self._nursery: trio.Nursery | None = None
        self._writes: trio.Nursery | None = None
        self.stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)

    def _init_limiters(self, concurrency: int | None, prefetch_concurrency: int | None) -> None:
        if concurrency is None:
            threads = self.capabilities.direct is None
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
        self._held: OrderedDict[Fprint, tuple[float, bytes | memoryview]] = OrderedDict()
        self._held_bases = RunBufferCounts()  # the run buffers the held chunks keep alive
        self._to_write: list[tuple[Fprint, bytes, CacheSlot | None]] = []  # for `_write_loop`
        self._writing = False
        # Chunk GETs on the chunk engine, many per submission, where the
        # backend gives their URLs (`flights.EnginePath`).
        self._engine = EnginePath(self, self.capabilities.direct, self.io_limiter.total_tokens,
                                  self.capabilities.files)

    # ------------------------------------------------------------------ setup
    def bind(self, nursery: trio.Nursery, writes: trio.Nursery | None = None) -> None:
        """Flights run in this nursery, not in the tasks that asked for them;
        disk cache writes in ``writes`` if given, a nursery that may outlive
        the flights' so that chunks already downloaded are still stored
        (the mount lets them finish, for a bounded time, at unmount)."""
        self._nursery = nursery
        self._writes = writes if writes is not None else nursery
        self._engine.bind(nursery)

    # ------------------------------------------------------------------ reads
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

    def span(self, fps: list[Fprint], last_length: int) -> memoryview | None:
        """The bytes of chunks ``fps`` in a row (each a chunk's size, the
        last ``last_length``) as one view, when all are in memory, decoded
        one after another into one run buffer (`chunk_engine.RUN_BUFFER_PARTS`):
        a read request answered without a copy. None otherwise (the caller
        copies them into a reply of its own)."""
        first = self._memory(fps[0], False)  # a read in file order: the LRU's order kept (`MemoryLRU.peek`)
        if type(first) is not memoryview:
            return None
        base = first.obj
        origin = address(base)
        start = address(first) - origin
        at = start + len(first)
        n = len(fps)
        if len(first) != (CHUNK_SIZE if n > 1 else last_length):
            return None
        for k in range(1, n):
            data = self._memory(fps[k], False)
            if (type(data) is not memoryview or data.obj is not base
                    or len(data) != (CHUNK_SIZE if k < n - 1 else last_length)
                    or address(data) - origin != at):
                return None
            at += len(data)
        stats = self.stats
        stats["requests"] += n
        stats["mem_hits"] += n
        stats["spans"] += 1
        if self._prefetched_unused:
            for fp in fps:
                self._used(fp)
        return memoryview(base)[start:at]

    async def span_after_flights(self, fps: list[Fprint], last_length: int) -> memoryview | None:
        """`span`, once the flights under way of the chunks of ``fps`` not
        in memory are done (a scan's read that caught up with its
        readahead: the runs it waits for land in memory); None at once when
        one of them is neither in memory nor under way."""
        flights: list[Flight] = []
        inflight = self._inflight
        for fp in fps:
            if self._memory(fp, False) is None:
                flight = inflight.get(fp)
                if flight is None:
                    return None
                flights.append(flight)
        if not flights:
            return None
        self.stats["joins"] += len(flights)
        for flight in flights:
            if flight.prefetch and not flight.promoted:
                self._promote(flight)
        self._engine.pump()
        await self._wait(flights)
        return self.span(fps, last_length)

    async def read_into(self, fps: list[Fprint], dests: list[memoryview],
                        sources: list[ChunkSource] | None = None) -> None:
        """Fill ``dests[k]`` (a writable view of the chunk's length) with the
        verified bytes of ``fps[k]``, for the chunks of one read request;
        ``sources[k]``, when given, is where the chunk is in a packed store.

        Chunks in the disk cache are read straight into the destinations, in
        as few system calls as their places in the segments allow, in this
        thread: a request of several chunks is the kernel's readahead of a
        sequential read, whose chunks the kernel's readahead of the segment
        files has usually brought into the page cache already, and a blocking read here costs less than a hop to
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
            data = self._memory(fp, False)  # as `span`: a read of several chunks is a read in file order
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
            errors.append(FetchError("chunk %s has %d bytes, not %d" % (fp.name, len(data), len(dest))))
        else:
            dest[:] = data

    def prefetch(self, fps: Iterable[Fprint], *, sources: list[ChunkSource] | None = None) -> int:
        """Start fetching chunks in the background, skipping those in memory,
        under way or in the disk cache (the kernel's readahead of the
        cache's files brings those in); ``sources`` as for `read_into`.
        Returns how many flights (GETs) were started."""
        stats = self.stats
        cache = self.cache
        mem, inflight = self.mem, self._inflight
        paused = self.limit.paused  # the store throttles: its GETs go to demand reads
        room = self.max_prefetch_flights - self._prefetch_flights
        todo: dict[Fprint, int] = {}  # what to start, once each, in order
        for k, fp in enumerate(fps):
            if fp in mem or fp in inflight or fp in todo:
                stats["prefetch_requested"] += 1
                stats["prefetch_skipped"] += 1
                continue
            if cache is not None and cache.has_indexed(fp):
                continue
            stats["prefetch_requested"] += 1
            if paused:
                stats["prefetch_throttled"] += 1
                continue
            if len(todo) >= room:
                stats["prefetch_dropped"] += 1
                continue
            todo[fp] = k
        if not todo:
            return 0
        # Their places in the disk cache, in file order, under one lock.
        slots = cache.reserve_many(len(todo)) if cache is not None else [None] * len(todo)
        for (fp, k), slot in zip(todo.items(), slots):
            self._start(fp, prefetch=True, slot=slot, source=_source_of(sources, k))
        stats["prefetch_started"] += len(todo)
        self._engine.pump()
        return len(todo)

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
        keeper = self.capabilities.credentials
        if keeper is not None:
            out["store"]["credentials"] = keeper.describe()
        out["engine_path"] = self._engine.available
        out["throttle"] = self.limit.describe()
        if self.cache is not None:
            out["disk_cache"] = self.cache.describe()
        return out

