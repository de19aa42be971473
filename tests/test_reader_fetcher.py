"""Fetcher: single-flight, verification, retries, cache, prefetch (no FUSE)."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import trio

from support.replicas import publish
from verneuil_fuse.reader.cache import FORMAT_DIR, ChunkCache
from verneuil_fuse.reader.fetcher import FetchError, Fetcher
from verneuil_fuse.format import CHUNK_SIZE, compress_chunk, fingerprint
from verneuil_fuse.store import NO_CAPABILITIES, Capabilities, DirectGets, NotFound, TransientError


def wrapped_attr(inner, name):
    """A wrapped backend's attribute, but for its direct reads: the chunk
    engine would read the directory store's files itself, past the
    wrapper's faults."""
    if name == "direct_files":
        raise AttributeError(name)
    if name == "capabilities":
        return lambda: NO_CAPABILITIES
    return getattr(inner, name)


class Faulty:
    """Wraps a Backend: counts GETs, can delay them or fail them."""

    def __init__(self, inner):
        self.inner = inner
        self.gets: list[str] = []
        self.delay = 0.0
        self.fail: dict[str, list] = {}  # key -> exceptions (or b"bytes") to use first
        self.lock = threading.Lock()

    def get(self, key, max_bytes=None):
        with self.lock:
            self.gets.append(key)
            todo = self.fail.get(key)
            action = todo.pop(0) if todo else None
        if self.delay:
            time.sleep(self.delay)
        if isinstance(action, BaseException):
            raise action
        if isinstance(action, (int, float)):
            time.sleep(action)
        if isinstance(action, bytes):
            return action
        return self.inner.get(key, max_bytes)

    def __getattr__(self, name):
        return wrapped_attr(self.inner, name)


class FaultyStore:
    def __init__(self, store):
        self.chunks = Faulty(store.chunks)
        self.manifests = store.manifests
        self.url = store.url


@pytest.fixture
def chunks(local_store):
    data = os.urandom(65536 * 6)
    pub = publish(local_store, data, "/db/x.db")
    fps = [fp for i, fp in enumerate(pub.manifest.chunks) if i > 0]
    return FaultyStore(local_store), fps, pub


def run(fetcher, fn):
    """`fn()` with the fetcher bound as the mount binds it: flights cancelled
    at the end, disk cache writes of chunks already fetched let finish."""
    async def main():
        async with trio.open_nursery() as writes:
            async with trio.open_nursery() as nursery:
                fetcher.bind(nursery, writes)
                result = await fn()
                nursery.cancel_scope.cancel()
            writes.cancel_scope.deadline = trio.current_time() + 10
        return result

    return trio.run(main)


def test_single_flight(chunks):
    store, fps, pub = chunks
    store.chunks.delay = 0.05
    f = Fetcher(store, None, concurrency=8)

    async def go():
        results = []

        async def one():
            results.append(await f.get(fps[0]))

        async with trio.open_nursery() as n:
            for _ in range(20):
                n.start_soon(one)
        return results

    results = run(f, go)
    assert len(results) == 20 and all(r == pub.chunks[fps[0]] for r in results)
    assert store.chunks.gets == [fps[0].name]
    assert f.stats["joins"] == 19


def test_retries_then_success_and_timeouts(chunks):
    store, fps, pub = chunks
    store.chunks.fail[fps[0].name] = [TransientError("503"), NotFound("not yet")]
    store.chunks.fail[fps[1].name] = [5.0]  # a GET that hangs: abandoned after the timeout
    f = Fetcher(store, None, retries=3, timeout=0.3, backoff=0.01)

    async def go():
        return await f.get(fps[0]), await f.get(fps[1])

    start = time.monotonic()
    a, b = run(f, go)
    assert a == pub.chunks[fps[0]] and b == pub.chunks[fps[1]]
    assert time.monotonic() - start < 3
    assert f.stats["retries"] == 3 and f.stats["failed"] == 0


def test_corrupt_or_missing_chunk_is_an_error_never_bytes(chunks, tmp_path):
    store, fps, pub = chunks
    other = pub.chunks[fps[1]]
    # Wrong bytes (raw and zstd), every time: never served.
    store.chunks.fail[fps[0].name] = [other, compress_chunk(other), b"\x28\xb5\x2f\xfdjunk"]
    store.chunks.fail[fps[2].name] = [NotFound("gone")] * 3
    cache = ChunkCache(str(tmp_path / "cache"), 1 << 26)
    f = Fetcher(store, cache, retries=2, backoff=0.001)

    async def go():
        errors = []
        for fp in (fps[0], fps[2]):
            try:
                await f.get(fp)
            except FetchError as e:
                errors.append(str(e))
        return errors

    errors = run(f, go)
    assert len(errors) == 2 and fps[0].name in errors[0]
    assert f.stats["corrupt"] == 3 and f.stats["failed"] == 2
    assert cache.get(fps[0]) is None and cache.get(fps[2]) is None


def test_disk_cache_is_verified_and_shared(chunks, tmp_path):
    store, fps, pub = chunks
    cache_dir = str(tmp_path / "cache")
    f = Fetcher(store, ChunkCache(cache_dir, 1 << 26))

    async def get_and_wait():
        await f.get(fps[0])
        with trio.fail_after(10):  # the cache write runs in the background
            while not f.cache.has_blocking(fps[0]):
                await trio.sleep(0.01)

    run(f, get_and_wait)
    # A new fetcher (a remount) finds it on disk: no GET.
    store.chunks.gets.clear()
    g = Fetcher(store, ChunkCache(cache_dir, 1 << 26))
    assert run(g, lambda: g.get(fps[0])) == pub.chunks[fps[0]]
    assert store.chunks.gets == [] and g.stats["disk_hits"] == 1
    # A damaged cache entry is dropped and refetched, never served.
    seg_dir = os.path.join(cache_dir, "segments-v1")
    for name in os.listdir(seg_dir):
        if name.endswith(".seg"):
            with open(os.path.join(seg_dir, name), "r+b") as seg:
                seg.write(b"x" * 100)
    h = Fetcher(store, ChunkCache(cache_dir, 1 << 26))
    assert run(h, lambda: h.get(fps[0])) == pub.chunks[fps[0]]
    assert store.chunks.gets == [fps[0].name]
    assert fingerprint(pub.chunks[fps[0]]) == fps[0]


def test_prefetch_skips_and_hits(chunks):
    store, fps, pub = chunks
    store.chunks.delay = 0.02
    f = Fetcher(store, None, concurrency=4)

    async def go():
        assert f.prefetch(fps[:3]) == 3
        assert f.prefetch(fps[:3]) == 0  # under way: not again
        data = await f.get(fps[0])  # joins the prefetch
        await trio.sleep(0.2)
        assert f.prefetch(fps[:3]) == 0  # cached: not again
        await f.get(fps[1])
        return data

    assert run(f, go) == pub.chunks[fps[0]]
    assert sorted(store.chunks.gets) == sorted(fp.name for fp in fps[:3])
    assert f.stats["prefetch_hits"] == 2
    assert f.snapshot()["prefetch_waste"] == 1


def test_demand_is_not_starved_by_prefetch(chunks):
    store, fps, pub = chunks
    store.chunks.delay = 0.2
    f = Fetcher(store, None, concurrency=4, prefetch_concurrency=2)

    async def go():
        f.prefetch(fps[:4])
        return await f.get(fps[4])

    assert run(f, go) == pub.chunks[fps[4]]
    # Two prefetches run at a time (each GET takes 0.2 s): the demand GET
    # starts among the first three, not queued behind the four prefetches.
    assert fps[4].name in store.chunks.gets[:3], store.chunks.gets


def test_hydrate(chunks, tmp_path):
    store, fps, pub = chunks
    f = Fetcher(store, ChunkCache(str(tmp_path / "c"), 1 << 26))

    async def go():
        n = await f.hydrate(fps)
        with trio.fail_after(10):  # the cache writes run in the background
            while not all(f.cache.has_blocking(fp) for fp in fps):
                await trio.sleep(0.01)
        return n

    assert run(f, go) == len(set(fps))
    cache = ChunkCache(str(tmp_path / "c"))
    assert all(cache.get(fp) == pub.chunks[fp] for fp in fps)


def test_prefetch_skips_chunks_in_the_disk_cache(chunks, tmp_path):
    """Prefetching chunks already in the disk cache makes no GET and starts
    no flight (the kernel's readahead of the cache's files brings them in);
    a demand read then finds them in the cache."""
    store, fps, pub = chunks
    cache_dir = str(tmp_path / "c")
    f = Fetcher(store, ChunkCache(cache_dir, 1 << 26))
    assert run(f, lambda: f.hydrate(fps)) == len(fps)
    store.chunks.gets.clear()
    g = Fetcher(store, ChunkCache(cache_dir, 1 << 26))

    async def go():
        assert g.prefetch(fps) == 0 and not g._inflight
        return [await g.get(fp) for fp in fps]

    assert run(g, go) == [pub.chunks[fp] for fp in fps]
    assert store.chunks.gets == [] and g.stats["prefetch_started"] == 0
    assert g.stats["disk_hits"] == len(fps)


def test_read_into_takes_each_chunk_from_where_it_is(chunks, tmp_path):
    """One read request's chunks: from memory, straight from the disk cache
    (no GET, no memory copy kept), from the store when not cached; a chunk
    that cannot be had fails the whole request, never with other bytes."""
    store, fps, pub = chunks
    cache = ChunkCache(str(tmp_path / "c"), 1 << 26)
    for fp in fps[1:3]:
        cache.put(fp, pub.chunks[fp])
    f = Fetcher(store, cache)
    f.mem.put(fps[0], pub.chunks[fps[0]])
    want = fps[:4]
    bufs = [bytearray(len(pub.chunks[fp])) for fp in want]

    async def go():
        await f.read_into(want, [memoryview(b) for b in bufs])

    run(f, go)
    assert [bytes(b) for b in bufs] == [pub.chunks[fp] for fp in want]
    assert store.chunks.gets == [fps[3].name]
    assert f.stats["mem_hits"] == 1 and f.stats["disk_hits"] == 2 and f.stats["requests"] == 4
    assert fps[1] not in f.mem and fps[3] in f.mem
    # A chunk that fails verification in the store: FetchError for the request.
    store.chunks.fail[fps[4].name] = [compress_chunk(b"x" * 100)] * 5
    bufs = [bytearray(len(pub.chunks[fp])) for fp in fps[1:5]]

    async def failing():
        with pytest.raises(FetchError):
            await f.read_into(fps[1:5], [memoryview(b) for b in bufs])
        return True

    assert run(f, failing)
    assert f.stats["corrupt"] == 5 and bufs[3] == bytearray(len(pub.chunks[fps[4]]))


def test_prefetched_chunks_land_in_the_order_fetches_started(chunks, tmp_path):
    """GETs that end in the reverse order of a sequential prefetch still
    leave its chunks back to back in file order in the disk cache, so that a
    later read of them is one run of the segment (no GET); a GET that fails
    gives its place back, and the chunks around it are still served."""
    store, fps, pub = chunks
    for k, fp in enumerate(fps):  # the first started ends last
        store.chunks.fail[fp.name] = [0.04 * (len(fps) - k)]
    store.chunks.fail[fps[2].name] = [NotFound("gone")] * 5 + [0.01]
    f = Fetcher(store, ChunkCache(str(tmp_path / "c"), 1 << 26), retries=0)

    async def prefetch_and_wait():
        f.prefetch(fps)
        with trio.fail_after(20):  # flights, then their cache writes
            while f._inflight or len(f.cache) < len(fps) - 1:
                await trio.sleep(0.01)

    run(f, prefetch_and_wait)
    assert f.stats["failed"] == 1 and f.cache.stats["unused_slots"] == 1
    segdir = tmp_path / "c" / FORMAT_DIR
    (seg,) = [p for p in segdir.iterdir() if p.suffix == ".seg"]
    hole = bytes(len(pub.chunks[fps[2]]))  # chunk 2's slot, never written
    assert seg.read_bytes() == b"".join(pub.chunks[fp] if k != 2 else hole for k, fp in enumerate(fps))
    gets = len(store.chunks.gets)
    bufs = [bytearray(len(pub.chunks[fp])) for k, fp in enumerate(fps) if k != 2]
    wanted = [fp for k, fp in enumerate(fps) if k != 2]

    async def read_back():
        await f.read_into(wanted, [memoryview(b) for b in bufs])

    run(f, read_back)
    assert [bytes(b) for b in bufs] == [pub.chunks[fp] for fp in wanted]
    assert len(store.chunks.gets) == gets


def test_engine_path_batches_gets_without_a_task_per_chunk(s3_store, tmp_path):
    """On a store with an HTTP engine (S3), flights are queued and sent to
    the engine in batches, their answers handed back to trio in batches: no
    task per chunk. Bytes are verified, land in the disk cache in order, a
    missing chunk is retried (in a task) and then fails, never wrong bytes."""
    data = os.urandom(65536 * 40)
    pub = publish(s3_store, data, "/db/engine.db")
    fps = [fp for i, fp in enumerate(pub.manifest.chunks) if i > 0]
    cache = ChunkCache(str(tmp_path / "c"), 1 << 26)
    f = Fetcher(s3_store, cache, concurrency=8, prefetch_concurrency=6, retries=1, backoff=0.01)
    assert f._engine.available
    spawned = []

    async def go():
        real = f._nursery.start_soon
        f._nursery.start_soon = lambda fn, *a: spawned.append(fn.__name__) or real(fn, *a)
        assert f.prefetch(fps[:20]) == 20
        assert len(f._engine.queued_prefetch) == 14  # 6 prefetch slots: 6 sent at once, the rest queued
        bufs = [bytearray(len(pub.chunks[fp])) for fp in fps]
        await f.read_into(fps, [memoryview(b) for b in bufs])
        return bufs

    bufs = run(f, go)
    assert [bytes(b) for b in bufs] == [pub.chunks[fp] for fp in fps]
    assert f.stats["gets"] == len(fps) and f.stats["store_fetches"] == len(fps) and f.stats["failed"] == 0
    assert "_fly" not in spawned and f.stats["prefetch_hits"] > 0
    assert not f._inflight and not f._engine.queued_demand and not f._engine.queued_prefetch
    # A chunk the store lost: one retry (in a task), then an error; its
    # neighbours are served.
    s3_store.chunks.delete(fps[0].name)
    g = Fetcher(s3_store, None, concurrency=8, retries=1, backoff=0.01)

    async def lost():
        with pytest.raises(FetchError):
            await g.read_into(fps[:3], [memoryview(bytearray(len(pub.chunks[fp]))) for fp in fps[:3]])
        return await g.get(fps[1])

    assert run(g, lost) == pub.chunks[fps[1]]
    assert g.stats["failed"] == 1 and g.stats["retries"] == 1 and g.stats["get_errors"] == 2


def test_engine_path_demand_joins_a_queued_prefetch(s3_store):
    """A demand read of a chunk whose prefetch still waits for a prefetch
    slot promotes it: sent at once, once, with the demand."""
    data = os.urandom(65536 * 12)
    pub = publish(s3_store, data, "/db/promote.db")
    fps = [fp for i, fp in enumerate(pub.manifest.chunks) if i > 0]
    f = Fetcher(s3_store, None, concurrency=4, prefetch_concurrency=2)

    async def go():
        f.prefetch(fps)
        assert len(f._engine.queued_prefetch) == len(fps) - 2
        # The last prefetches, queued, joined by demand reads (with a new chunk).
        bufs = [bytearray(len(pub.chunks[fp])) for fp in fps[-3:]]
        await f.read_into(fps[-3:], [memoryview(b) for b in bufs])
        assert [bytes(b) for b in bufs] == [pub.chunks[fp] for fp in fps[-3:]]
        for fp in fps:
            assert await f.get(fp) == pub.chunks[fp]

    run(f, go)
    assert f.stats["gets"] == len(fps) and f.stats["prefetch_hits"] >= 3


class SilentEngine:
    """A chunks backend whose engine path GETs from a server that takes
    every connection and never answers (a listening socket nobody
    accepts on)."""

    def __init__(self, inner):
        self.inner = inner
        self.sent: list[str] = []
        self.failures: list = []
        self.server = socket.create_server(("127.0.0.1", 0), backlog=64)

    def capabilities(self):
        return Capabilities(direct=self)

    def direct_gets(self):
        port = self.server.getsockname()[1]
        return DirectGets(lambda key: self.sent.append(key) or "http://127.0.0.1:%d/b/%s" % (port, key),
                          [], None, 1.0, 15.0)

    def direct_get_error(self, key, failure, max_bytes):
        self.failures.append(failure)
        return TransientError("GET %s: %s" % (key, failure), key=key)

    def __getattr__(self, name):
        return wrapped_attr(self.inner, name)


def test_engine_path_queued_demand_fails_at_its_deadline(chunks):
    """A demand read queued behind GETs that never answer fails with an
    error at its deadline, never waits longer; nothing is sent for it. The
    GET that holds the slot ends at its own time limit."""
    store, fps, pub = chunks
    store.chunks = SilentEngine(store.chunks.inner)
    f = Fetcher(store, None, concurrency=1, deadline=0.3, retries=0)

    async def go():
        f.prefetch(fps[:1])  # holds the only GET slot until its time limit
        start = trio.current_time()
        with pytest.raises(FetchError, match="deadline"):
            await f.get(fps[1])
        took = trio.current_time() - start
        with trio.fail_after(5):
            while f._inflight:
                await trio.sleep(0.05)
        return took

    try:
        took = run(f, go)
    finally:
        store.chunks.server.close()
    assert 0.25 <= took < 2 and store.chunks.sent == [fps[0].name]
    assert f.stats["failed"] == 2 and not f._engine.queued_demand and fps[1] not in f._inflight
    assert [type(e) for e in store.chunks.failures] == [TimeoutError]


class RefusingEngine:
    """A chunks backend whose engine path turns out to be off: it gives no
    URLs (`direct_gets` says None)."""

    def __init__(self, inner):
        self.inner = inner
        self.asked = 0

    def capabilities(self):
        return Capabilities(direct=self)

    def direct_gets(self):
        self.asked += 1
        return None

    def __getattr__(self, name):
        return wrapped_attr(self.inner, name)


def test_engine_path_refused_runs_flights_in_tasks(chunks, tmp_path):
    """An engine that takes no GET turns the engine path off: the flights
    it refused give back their slots and run in tasks (threads), demand and
    prefetch alike, and every later one starts in a task."""
    store, fps, pub = chunks
    store.chunks = RefusingEngine(store.chunks.inner)
    f = Fetcher(store, ChunkCache(str(tmp_path / "c"), 1 << 26), concurrency=4, prefetch_concurrency=2)
    assert f._engine.available

    async def go():
        assert f.prefetch(fps[:3]) == 3
        bufs = [bytearray(len(pub.chunks[fp])) for fp in fps[2:]]
        await f.read_into(fps[2:], [memoryview(b) for b in bufs])
        assert not f._engine.available
        return bufs, [await f.get(fp) for fp in fps]

    bufs, got = run(f, go)
    assert [bytes(b) for b in bufs] == [pub.chunks[fp] for fp in fps[2:]]
    assert got == [pub.chunks[fp] for fp in fps]
    assert store.chunks.asked == 1  # the first submission, then no more
    assert f.io_limiter.borrowed_tokens == 0 and f.prefetch_slots.borrowed_tokens == 0
    assert f.stats["failed"] == 0 and not f._inflight


class LongUrls(RefusingEngine):
    """A chunks backend whose engine path gives URLs longer than the chunk
    engine sends."""

    def direct_gets(self):
        self.asked += 1
        return DirectGets(lambda key: "http://127.0.0.1:9/" + "k" * 3000 + key, [], None, 1.0, 15.0)


def test_engine_path_that_cannot_send_runs_flights_in_tasks(chunks):
    """GETs the chunk engine refuses to start turn the engine path off: the
    flights give back their slots and run in tasks, and are served."""
    store, fps, pub = chunks
    store.chunks = LongUrls(store.chunks.inner)
    f = Fetcher(store, None, concurrency=4, prefetch_concurrency=2)

    async def go():
        assert f.prefetch(fps[:3]) == 3
        return [await f.get(fp) for fp in fps]

    assert run(f, go) == [pub.chunks[fp] for fp in fps]
    assert not f._engine.available and store.chunks.asked == 1 and f.stats["failed"] == 0
    assert f.io_limiter.borrowed_tokens == 0 and f.prefetch_slots.borrowed_tokens == 0


@pytest.mark.parametrize("packed", [0, 4 << 20], ids=["chunks", "packed"])
def test_engine_path_reads_a_directory_store_by_files_and_runs(local_store, tmp_path, packed, monkeypatch):
    """On a directory store the flights go to the chunk engine's file reads
    (no task per chunk), a packed store's adjacent chunks one request per
    run; a truncated or damaged chunk file, or a cut pack, fails the reads
    of its chunks, never wrong bytes, and its neighbours are served."""
    from verneuil_fuse.format import chunk_source
    from verneuil_fuse.reader import flights

    monkeypatch.setattr(flights, "RUN_BYTES", 1 << 20)  # runs of 1 MiB: several in 40 chunks

    data = os.urandom(65536 * 40)
    pub = publish(local_store, data, "/db/files.db", packed=packed)
    m = pub.manifest
    indices = list(range(1, len(m.chunks)))
    fps = [m.chunks[i] for i in indices]
    sources = [chunk_source(m, i) for i in indices]
    f = Fetcher(local_store, ChunkCache(str(tmp_path / "c"), 1 << 26), retries=1, backoff=0.01)
    spawned = []

    async def go():
        real = f._nursery.start_soon
        f._nursery.start_soon = lambda fn, *a: spawned.append(fn.__name__) or real(fn, *a)
        f.prefetch(fps, sources=sources)
        bufs = [bytearray(65536) for _ in fps]
        await f.read_into(fps, [memoryview(b) for b in bufs], sources)
        return bufs

    assert f._engine.available
    assert [bytes(b) for b in run(f, go)] == [pub.chunks[fp] for fp in fps]
    assert "_fly" not in spawned and f.stats["store_fetches"] == len(fps) and f.stats["failed"] == 0
    # One request per chunk file, or per run of up to RUN_BYTES of a pack.
    assert f.stats["gets"] == (len(fps) if not packed else 3), f.stats["gets"]
    # Damage: chunk 3's blob truncated, chunk 5's overwritten (a chunk
    # file each, or the pack cut inside chunk 3's blob, which fails every
    # chunk from there on).
    path = local_store.chunks.direct_files()
    if packed:
        os.truncate(path(sources[2].key), sources[2].start + 100)
        bad = set(range(2, len(fps)))
    else:
        os.truncate(path(fps[2].name), 100)
        with open(path(fps[4].name), "r+b") as out:
            out.write(b"\0" * 64)
        bad = {2, 4}
    g = Fetcher(local_store, None, retries=1, backoff=0.01)

    async def damaged():
        got = {}
        for k in range(6):
            try:
                got[k] = await g.get_waiting(fps[k], sources[k])
            except FetchError:
                got[k] = None
        return got

    got = run(g, damaged)
    assert {k for k, v in got.items() if v is None} == bad & set(range(6))
    assert all(got[k] == pub.chunks[fps[k]] for k in got if k not in bad)
    assert g.stats["failed"] == len(bad & set(range(6))) and g.stats["corrupt"] >= 1


def test_a_run_of_a_pack_takes_one_get_slot(s3_store, monkeypatch):
    """A GET slot stands for a request, not a chunk: with one slot, 30
    chunks whose blobs lie end to end in a pack still go as two range GETs
    (runs of at most 1 MiB of blobs here), not one after the other a chunk
    at a time; and every slot is given back."""
    from verneuil_fuse.format import chunk_source
    from verneuil_fuse.reader import flights

    monkeypatch.setattr(flights, "RUN_BYTES", 1 << 20)

    pub = publish(s3_store, os.urandom(65536 * 31), "/db/oneslot.db", packed=4 << 20)
    m = pub.manifest
    fps = list(m.chunks[1:])
    sources = [chunk_source(m, i) for i in range(1, len(m.chunks))]
    f = Fetcher(s3_store, None, concurrency=1)
    in_flight = []

    async def go():
        assert f.prefetch(fps, sources=sources) == len(fps)
        in_flight.append(f.io_limiter.borrowed_tokens)
        bufs = [bytearray(65536) for _ in fps]
        await f.read_into(fps, [memoryview(b) for b in bufs], sources)
        return bufs

    assert [bytes(b) for b in run(f, go)] == [pub.chunks[fp] for fp in fps]
    assert in_flight == [1]  # the first run holds the one slot; the second waits for it
    assert f.stats["store_fetches"] == len(fps) and f.stats["gets"] == 2, f.stats["gets"]
    assert f.io_limiter.borrowed_tokens == 0 and f.prefetch_slots.borrowed_tokens == 0


def test_prefetches_do_not_wait_for_a_cache_rescan(s3_store, tmp_path, monkeypatch):
    """A rescan of the disk cache's directory (chunks other processes
    stored) is due every second; a scan's prefetches do not wait for one:
    they go to the chunk engine by runs, not a thread and a GET each."""
    from verneuil_fuse.format import chunk_source
    from verneuil_fuse.reader import segments as segments_mod

    monkeypatch.setattr(segments_mod, "RESCAN_INTERVAL_S", 0.0)  # always due
    pub = publish(s3_store, os.urandom(65536 * 16), "/db/rescan.db", packed=4 << 20)
    m = pub.manifest
    fps = list(m.chunks[1:])
    sources = [chunk_source(m, i) for i in range(1, len(m.chunks))]
    f = Fetcher(s3_store, ChunkCache(str(tmp_path / "cache"), 1 << 26))

    async def go():
        assert f.prefetch(fps, sources=sources) == len(fps)
        bufs = [bytearray(65536) for _ in fps]
        await f.read_into(fps, [memoryview(b) for b in bufs], sources)
        return bufs

    assert [bytes(b) for b in run(f, go)] == [pub.chunks[fp] for fp in fps]
    assert f.stats["store_fetches"] == len(fps) and f.stats["gets"] == 1, f.stats["gets"]


@pytest.mark.parametrize("where", ["s3", "local"])
def test_readahead_top_ups_of_a_pack_join_their_runs(where, request, monkeypatch):
    """A readahead that tops its window up two chunks at a time, while
    requests are in flight, still reads a pack in S3 by runs of about 1 MiB,
    not a request per top-up; the last run goes once nothing else is in
    flight. From a directory store the top-ups go at once (a read there is
    a pread, not worth waiting for)."""
    from verneuil_fuse.format import chunk_source
    from verneuil_fuse.reader import flights

    store = request.getfixturevalue(where + "_store")
    monkeypatch.setattr(flights, "RUN_WAIT", 60.0)  # however slow the machine: every top-up in time
    monkeypatch.setattr(flights, "RUN_BYTES", 1 << 20)  # runs of 1 MiB: several in 40 chunks
    pub = publish(store, os.urandom(65536 * 40), "/db/topups.db", packed=4 << 20)
    m = pub.manifest
    fps = list(m.chunks[1:])
    sources = [chunk_source(m, i) for i in range(1, len(m.chunks))]
    f = Fetcher(store, None)

    async def go():
        for k in range(0, len(fps), 2):  # no checkpoint between: no answer taken meanwhile
            f.prefetch(fps[k:k + 2], sources=sources[k:k + 2])
        bufs = [bytearray(65536) for _ in fps]
        await f.read_into(fps, [memoryview(b) for b in bufs], sources)
        return bufs

    assert [bytes(b) for b in run(f, go)] == [pub.chunks[fp] for fp in fps]
    runs = 4 if where == "s3" else (len(fps) + 1) // 2  # 2 chunks, then runs of 15, 15 and 7; else each top-up
    assert f.stats["store_fetches"] == len(fps) and f.stats["gets"] == runs, f.stats["gets"]


def test_a_run_of_a_pack_is_served_as_one_view_of_its_buffer(local_store, monkeypatch):
    """The chunks of a run of a pack are decoded one after another into one
    buffer: a span of them in memory is one view of it, no copy
    (`Fetcher.span`); a span across two runs, or whose last chunk has another
    length than asked, is not. The memory LRU counts each run buffer once,
    and a buffer is decoded into again, or let go, only once nothing refers
    to it."""
    from verneuil_fuse.format import chunk_source
    from verneuil_fuse.reader import chunk_engine, flights

    monkeypatch.setattr(flights, "RUN_BYTES", 1 << 20)  # runs of 16 chunks (raw blobs)
    monkeypatch.setattr(chunk_engine, "RUN_BUFFER_STEP", 8)
    data = os.urandom(65536 * 34)
    pub = publish(local_store, data, "/db/runs.db", packed=4 << 20, compress=False)
    m = pub.manifest
    first, second = list(range(1, 17)), list(range(17, 33))
    f = Fetcher(local_store, None, retries=1, backoff=0.01)

    async def fetch(indices, span):
        f.prefetch([m.chunks[i] for i in indices], sources=[chunk_source(m, i) for i in indices])
        return await f.span_after_flights([m.chunks[i] for i in span], CHUNK_SIZE)

    async def go():
        # Across the two runs: no one view (the caller copies), once both are in.
        assert await fetch(first + second, first + second) is None
        assert f.stats["gets"] == 2  # two runs of 16 chunks
        whole = f.span(m.chunks[1:11], CHUNK_SIZE)
        assert whole is not None and whole == data[65536:65536 * 11]
        base = whole.obj
        assert type(base) is bytes and len(base) == 16 * CHUNK_SIZE  # the first run's buffer
        again = f.span(m.chunks[4:17], CHUNK_SIZE)
        assert again.obj is base and again == data[65536 * 4:65536 * 17]
        assert f.span(m.chunks[11:21], CHUNK_SIZE) is None  # across two runs
        assert f.span(m.chunks[4:6], 100) is None  # a last chunk of another length than asked
        assert f.stats["spans"] == 2
        # The LRU holds 32 chunks of two buffers of 16: it counts the buffers.
        assert f.mem.size == 2 * 16 * CHUNK_SIZE
        pool = f._engine._engine.run_buffers
        assert pool.made == 2 and pool.reused == 0
        # A view kept (a reply being sent) keeps its buffer; dropped from
        # the LRU and from the held chunks, the other one is free again: the
        # next run is decoded into it, and serves its own bytes.
        f.mem = type(f.mem)(f.mem.capacity)
        f._held.clear()
        f._held_bases.clear()
        del again, base
        later = await fetch(second, second)
        assert pool.made == 2 and pool.reused == 1  # the second run's buffer; the first one is still kept
        assert later == data[65536 * 17:65536 * 33] and whole == data[65536:65536 * 11]
        # With no request under way, the free buffers are let go, never one
        # a chunk or a reply still refers to.
        pool.let_go()
        assert len(pool._pool) == 2
        f.mem = type(f.mem)(f.mem.capacity)
        f._held.clear()
        f._held_bases.clear()
        del whole, later
        pool.let_go()
        assert pool._pool == []

    run(f, go)


def test_held_chunks_keep_few_run_buffers_alive(local_store):
    """A chunk held for a read (`landing.HOLD_SECONDS`) that is a view of a
    run buffer stays a view while the held chunks keep at most
    `HOLD_RUN_BUFFERS` buffers alive, and is held as a copy beyond; letting
    held chunks go lets their buffers go."""
    from verneuil_fuse.reader.landing import HOLD_CHUNKS, HOLD_RUN_BUFFERS

    f = Fetcher(local_store, None)
    runs = [os.urandom(2 * CHUNK_SIZE) for _ in range(HOLD_RUN_BUFFERS + 2)]

    async def go():
        for k, buf in enumerate(runs):
            for half in range(2):
                f._hold(fingerprint(b"%d-%d" % (k, half)), memoryview(buf)[half * CHUNK_SIZE:(half + 1) * CHUNK_SIZE])
        held = [f._memory(fingerprint(b"%d-%d" % (k, half))) for k in range(len(runs)) for half in range(2)]
        assert [type(d) for d in held] == [memoryview] * (2 * HOLD_RUN_BUFFERS) + [bytes] * 4
        assert [bytes(d) for d in held] == [buf[h * CHUNK_SIZE:(h + 1) * CHUNK_SIZE] for buf in runs for h in range(2)]
        assert len(f._held_bases) == HOLD_RUN_BUFFERS
        for k in range(HOLD_CHUNKS):  # newer chunks push the held views out
            f._hold(fingerprint(b"new-%d" % k), b"x")
        assert f._held_bases == {} and len(f._held) == HOLD_CHUNKS

    trio.run(go)
