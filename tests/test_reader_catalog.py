"""Catalog (tree, versions, freshness) and Replica (reads, prefetch), no FUSE."""
from __future__ import annotations

import os
import random

import trio

from replicas import HOST, make_db, publish, publish_large_base
from verneuil_fuse.reader.catalog import Catalog, Directory, display_path
from verneuil_fuse.reader.fetcher import Fetcher
from verneuil_fuse.format import CHUNK_SIZE, manifest_name
from verneuil_fuse.reader.replica import Cursor, PrefetchConfig, Replica


def test_display_paths():
    assert display_path(manifest_name("/tmp/test.db", "test.com")) == ("test.com", ["tmp", "test.db"])
    assert display_path(manifest_name("/a//b/./c/../d.db", "h")) == ("h", ["a", "b", "c", "%2E%2E", "d.db"])
    assert display_path("not a manifest name") is None
    # Mangled names keep whole components at both ends and a stable mark.
    long_dir = "/srv/" + "/".join("directory%02d" % i for i in range(30))
    host, parts = display_path(manifest_name(long_dir + "/app/data.db", "web-1"))
    assert host == "web-1" and parts[0] == "srv" and parts[-2:] == ["app", "data.db"]
    assert any(p.startswith("\u2026") and p.endswith("\u2026") for p in parts)
    assert "/".join(parts) != "/".join(display_path(manifest_name(long_dir + "x/app/data.db", "web-1"))[1])
    # One very long file name.
    host, parts = display_path(manifest_name("/d/" + "n" * 300 + ".db", "h"))
    assert parts[0] == "d" and parts[-1].endswith("nnn.db") and len(parts) == 2


def run(store, fn, **kw):
    async def main():
        fetcher = Fetcher(store, None, concurrency=8)
        async with trio.open_nursery() as nursery:
            fetcher.bind(nursery)
            catalog = Catalog(fetcher, **kw)
            catalog.bind(nursery)
            result = await fn(catalog)
            nursery.cancel_scope.cancel()
        return result

    return trio.run(main)


def test_tree_versions_and_removal(local_store):
    a1 = publish(local_store, os.urandom(3 * CHUNK_SIZE + 5), "/var/db/a.db", hostname="h1")
    b = publish(local_store, os.urandom(100), "/var/db/b.db", hostname="h1")
    publish(local_store, os.urandom(200), "/x.db", hostname="h2")

    async def go(cat: Catalog):
        await cat.refresh(raise_errors=True)
        assert [n for n, _ in cat.listdir(1)] == [".verneuil", "h1", "h2"]
        var = cat.lookup(cat.lookup(cat.lookup(1, "h1").inode, "var").inode, "db")
        assert isinstance(var, Directory)
        assert [n for n, _ in cat.listdir(var.inode)] == ["a.db", "b.db"]
        r1 = cat.lookup(var.inode, "a.db")
        assert isinstance(r1, Replica) and r1.size == len(a1.data)
        assert await r1.read(0, 1 << 20) == a1.data
        cat.opened(r1)
        cat.remember(r1)
        # Same bytes uploaded again: same version, same inode.
        publish(local_store, a1.data, "/var/db/a.db", hostname="h1")
        await cat.refresh()
        assert cat.lookup(var.inode, "a.db") is r1
        # A new version: a new inode for lookups; the old one still reads old bytes.
        a2 = publish(local_store, os.urandom(2 * CHUNK_SIZE), "/var/db/a.db", hostname="h1")
        await cat.refresh()
        r2 = cat.lookup(var.inode, "a.db")
        assert r2 is not r1 and r2.inode != r1.inode and r2.size == len(a2.data)
        assert cat.get(r1.inode) is r1
        assert await r1.read(0, 1 << 20) == a1.data
        assert await r2.read(0, 1 << 20) == a2.data
        cat.released(r1)
        assert cat.get(r1.inode) is r1  # the kernel still remembers it
        cat.forget(r1.inode, 1)
        assert cat.get(r1.inode) is None
        # Removed from the store: gone from the tree, empty dirs pruned.
        local_store.manifests.delete(b.key)
        local_store.manifests.delete(a2.key)
        await cat.refresh()
        assert [n for n, _ in cat.listdir(1)] == [".verneuil", "h2"]
        assert cat.get(r2.inode) is None
        stats = cat.stats()
        assert set(stats["databases"]) == {"/h2/x.db"}
        assert stats["refresh"]["versions_seen"] == 4

    run(local_store, go)


def test_bad_manifest_is_skipped(local_store):
    """A manifest that does not decode is skipped, and not fetched (nor
    logged) again at every poll until its blob changes."""
    publish(local_store, os.urandom(100), "/ok.db")
    bad_key = manifest_name("/bad.db", "testhost")
    local_store.manifests.put(bad_key, b"garbage")
    # Older than the settling time (a blob written just now is fetched again).
    for name in os.listdir(local_store.manifests.root):
        path = os.path.join(local_store.manifests.root, name)
        os.utime(path, (os.stat(path).st_mtime - 60,) * 2)

    async def go(cat):
        await cat.refresh()
        names = [n for n, _ in cat.listdir(cat.lookup(1, "testhost").inode)]
        assert names == ["ok.db"] and cat.poll_errors == 1
        gets = cat.fetcher.stats["manifest_gets"]
        for _ in range(3):
            await cat.refresh()
        assert cat.fetcher.stats["manifest_gets"] == gets and cat.poll_errors == 1
        assert cat.stats()["refresh"]["bad_manifests"] == [bad_key]
        # Fixed in the store: fetched again and served.
        good = publish(local_store, os.urandom(300), "/bad.db")
        await cat.refresh()
        r = cat.lookup(cat.lookup(1, "testhost").inode, "bad.db")
        assert r is not None and await r.read(0, 1000) == good.data
        assert cat.stats()["refresh"]["bad_manifests"] == []

    run(local_store, go)


def test_reads_zero_chunks_and_eof(local_store):
    data = os.urandom(CHUNK_SIZE) + bytes(2 * CHUNK_SIZE) + os.urandom(1000)
    pub = publish(local_store, data, "/z.db")

    async def go(cat):
        await cat.refresh()
        r = next(e.current for e in cat.entries.values())
        rng = random.Random(1)
        for _ in range(300):
            off = rng.randrange(len(data) + 10)
            size = rng.randrange(1, 3 * CHUNK_SIZE)
            assert await r.read(off, size) == data[off:off + size]
        assert await r.read(len(data), 10) == b""
        assert cat.fetcher.stats["gets"] == 1  # chunk 0 bundled, zeros synthesised

    run(local_store, go)


def _scan_db(tmp_path, store):
    path = str(tmp_path / "scan.db")
    make_db(path, 6000, payload=300)
    data = open(path, "rb").read()
    return publish(store, data, "/scan.db")


def test_sequential_readahead(tmp_path, local_store):
    pub = _scan_db(tmp_path, local_store)

    async def go(cat):
        await cat.refresh()
        r = next(e.current for e in cat.entries.values())
        cursor = Cursor()
        for off in range(0, r.size, 128 * 1024):
            assert await r.read(off, 128 * 1024, cursor) == pub.data[off:off + 128 * 1024]
        return cat.fetcher.snapshot()

    stats = run(local_store, go, prefetch=PrefetchConfig(btree=False))
    assert stats["prefetch_hits"] > 0.7 * stats["store_fetches"]
    assert stats["store_fetches"] == len(pub.chunks)  # nothing fetched twice


def _sequential_read_hints(tmp_path, store, config: PrefetchConfig):
    """Read a 40-chunk replica in order, 2 chunks per request, with its
    first 30 chunks in the disk cache: (hints given to the fetcher as
    (last chunk read, chunk, fetch, advise), the fetcher's stats)."""
    from verneuil_fuse.reader.cache import ChunkCache

    pub = publish(store, os.urandom(40 * CHUNK_SIZE), "/ra.db")
    index = {fp: i for i, fp in enumerate(pub.manifest.chunks)}
    cache = ChunkCache(str(tmp_path / "cache"), 1 << 30)
    for i, fp in enumerate(pub.manifest.chunks[:30]):
        cache.put(fp, pub.data[i * CHUNK_SIZE : (i + 1) * CHUNK_SIZE])
    hints: list[tuple[int, int, bool, bool]] = []

    async def main():
        fetcher = Fetcher(store, cache)
        real = fetcher.prefetch
        last = [0]

        def prefetch(fps, fetch=True, advise=True):
            fps = list(fps)
            hints.extend((last[0], index[fp], fetch, advise) for fp in fps)
            return real(fps, fetch=fetch, advise=advise)

        fetcher.prefetch = prefetch
        async with trio.open_nursery() as nursery:
            fetcher.bind(nursery)
            cat = Catalog(fetcher, prefetch=config)
            cat.bind(nursery)
            await cat.refresh()
            r = next(e.current for e in cat.entries.values())
            cursor = Cursor()
            for off in range(0, r.size, 2 * CHUNK_SIZE):
                last[0] = (off + 2 * CHUNK_SIZE - 1) // CHUNK_SIZE
                assert await r.read(off, 2 * CHUNK_SIZE, cursor) == pub.data[off : off + 2 * CHUNK_SIZE]
            nursery.cancel_scope.cancel()
        return fetcher.stats

    return hints, trio.run(main)


def test_cached_chunks_left_to_the_kernel_with_cache_readahead_0(tmp_path, local_store):
    """With cache_readahead_max=0 chunks already in the disk cache are
    neither advised nor fetched ahead: a request's cached chunks are read in
    the loop's thread; GETs of the others stay within ``readahead_max``."""
    config = PrefetchConfig(btree=False, readahead_max=4, cache_readahead_max=0)
    hints, stats = _sequential_read_hints(tmp_path, local_store, config)
    assert hints and not any(advise for _, _, _, advise in hints)
    assert all(i <= last + 4 for last, i, _, _ in hints)
    assert stats["prefetch_advised"] == 0 and stats["gets"] == 10
    # The 29 cached chunks (chunk 0 is in the manifest), and those fetched
    # here that a later request found in the disk cache already.
    assert stats["disk_hits_inline"] == stats["disk_hits"] >= 29


def test_cache_readahead_runs_ahead_of_the_store_readahead(tmp_path, local_store):
    """With ``cache_readahead_max`` a sequential read advises chunks already
    in the disk cache up to that many ahead (no GET: a kernel readahead of the
    cache's files), while GETs of chunks not cached stay within
    ``readahead_max``."""
    config = PrefetchConfig(btree=False, readahead_max=4, cache_readahead_max=16)
    hints, stats = _sequential_read_hints(tmp_path, local_store, config)
    fetchable = [(last, i) for last, i, fetch, _ in hints if fetch]
    advisable = [(last, i) for last, i, _, advise in hints if advise]
    assert fetchable and all(i <= last + 4 for last, i in fetchable)
    assert all(i <= last + 16 for last, i in advisable)
    assert max(i - last for last, i in advisable) == 16  # the cache window opened fully
    assert {i for _, i in advisable} >= set(range(6, 30))  # every cached chunk ahead, once at least
    # Once the window is open, advised in steps of half a window or more (each
    # step is a thread hop), not a step per read; only the file's end cuts one.
    steps: dict[int, list[int]] = {}
    for last, i in advisable:
        steps.setdefault(last, []).append(i)
    opened = min(last for last, i in advisable if i - last == 16)
    later = [sorted(v) for last, v in steps.items() if last > opened]
    assert later and all(len(v) >= 8 or v[-1] == 39 for v in later), steps
    assert len(later) < len(range(opened + 2, 40, 2))  # fewer steps than reads
    assert stats["gets"] == 10 and stats["prefetch_started"] > 0  # the 10 chunks not cached


def test_btree_prefetch_follows_a_scan_not_a_point_query(tmp_path, local_store):
    pub = _scan_db(tmp_path, local_store)
    data = pub.data

    async def go(cat):
        await cat.refresh()
        r = next(e.current for e in cat.entries.values())
        bt = r._btree
        ps = bt.page_size
        # Learn every interior page (as reads of them would).
        for i in range(r.nchunks):
            await r.read(i * CHUNK_SIZE, 1)
        parent = max(bt.children, key=lambda p: len(bt.children[p]))
        kids = bt.children[parent]
        assert len(kids) > 8
        # A point query: one child. No prefetch.
        before = cat.fetcher.stats["prefetch_requested"]
        await r.read((kids[3] - 1) * ps, ps, Cursor())
        assert cat.fetcher.stats["prefetch_requested"] == before
        # A scan: consecutive children, read in key order -> the next ones are asked for.
        await r.read((kids[4] - 1) * ps, ps, Cursor())
        assert cat.fetcher.stats["prefetch_requested"] > before
        return True

    assert run(local_store, go)


def test_base_chunk_manifest(local_store):
    """A chunk list stored XOR-ed with a base chunk (docs/FORMAT.md) is read
    through the fetcher (verified, single-flight) while decoding."""
    import dataclasses
    from verneuil_fuse.format import compress_manifest, encode_manifest, fingerprint, snapshot_of

    data = os.urandom(5 * CHUNK_SIZE + 3)
    manifest, chunks = snapshot_of(data)
    for fp, raw in chunks.items():
        local_store.chunks.put(fp.name, raw)
    words = [w for fp in manifest.chunks for w in fp]
    base = os.urandom(8 * (len(words) - 2))  # shorter than the list: zero-padded
    base_fp = fingerprint(base)
    local_store.chunks.put(base_fp.name, base)
    stored = dataclasses.replace(manifest, base_chunks_fprint=base_fp)
    local_store.manifests.put(manifest_name("/based.db", "h"),
                              compress_manifest(encode_manifest(stored, base=base)))

    async def go(cat):
        await cat.refresh(raise_errors=True)
        r = next(e.current for e in cat.entries.values())
        assert r.manifest.chunks == manifest.chunks
        assert await r.read(0, len(data) + 1) == data

    run(local_store, go)


def test_hydrate_fills_the_disk_cache(local_store, tmp_path):
    """Hydration fetches every chunk of the newest version into the disk
    cache, says how far it went in the stats, ends `incomplete` when a chunk
    cannot be fetched and starts again HYDRATE_RETRY_SECONDS later; a new
    version is hydrated in its turn."""
    from verneuil_fuse.reader.cache import ChunkCache
    from verneuil_fuse.reader.catalog import HYDRATE_RETRY_SECONDS

    pub = publish(local_store, os.urandom(6 * CHUNK_SIZE), "/h.db")
    chunks = [fp for i, fp in enumerate(pub.manifest.chunks) if i > 0]  # chunk 0 is in the manifest
    missing = chunks[3]
    saved = local_store.chunks.get(missing.name)
    local_store.chunks.delete(missing.name)
    cache_dir = str(tmp_path / "cache")
    now = [1000.0]

    async def main():
        fetcher = Fetcher(local_store, ChunkCache(cache_dir, 1 << 26), retries=0)
        async with trio.open_nursery() as nursery:
            fetcher.bind(nursery)
            cat = Catalog(fetcher, hydrate=True, clock=lambda: now[0])
            cat.bind(nursery)

            async def state() -> dict:
                with trio.fail_after(10):
                    while True:
                        h = cat.stats()["databases"]["/%s/h.db" % HOST]["hydration"]
                        if h["state"] in ("done", "incomplete"):
                            return h
                        await trio.sleep(0.02)

            await cat.refresh()
            h = await state()
            assert (h["state"], h["chunks"], h["fetched"], h["failed"]) == ("incomplete", 5, 4, 1), h
            assert missing.name in h["error"]
            local_store.chunks.put(missing.name, saved)
            now[0] += HYDRATE_RETRY_SECONDS - 1
            await cat.refresh()  # too early: not tried again
            assert (await state())["state"] == "incomplete"
            now[0] += 1
            await cat.refresh()
            h = await state()
            assert (h["state"], h["chunks"], h["fetched"], h["failed"]) == ("done", 1, 1, 0), h
            assert all(fetcher.cache.contains(fp) for fp in chunks)
            gets = fetcher.stats["gets"]
            # A new version: only its new chunk is fetched.
            data = bytearray(pub.data)
            data[5 * CHUNK_SIZE + 7] ^= 1
            v2 = publish(local_store, bytes(data), "/h.db")
            now[0] += 10
            await cat.refresh()
            h = await state()
            assert (h["state"], h["chunks"], h["fetched"]) == ("done", 1, 1), h
            assert h["version"] == cat.stats()["databases"]["/%s/h.db" % HOST]["version"]
            assert fetcher.cache.contains(v2.manifest.chunks[5]) and fetcher.stats["gets"] == gets + 1
            nursery.cancel_scope.cancel()
        return fetcher.stats

    stats = trio.run(main)
    assert stats["gets"] == len(chunks) + 1 + 1  # the missing chunk failed once, then came


def test_hydrate_takes_databases_a_few_at_a_time(local_store, tmp_path):
    from verneuil_fuse.reader.cache import ChunkCache
    from verneuil_fuse.reader.catalog import HYDRATE_AT_ONCE

    for i in range(5):
        publish(local_store, os.urandom(2 * CHUNK_SIZE), "/d%d.db" % i)
    running = [0, 0]  # now, most

    async def main():
        fetcher = Fetcher(local_store, ChunkCache(str(tmp_path / "cache"), 1 << 26))
        real = fetcher.hydrate

        async def watched(fps, **kw):  # the real hydration, counted
            running[0] += 1
            running[1] = max(running)
            try:
                await trio.sleep(0.05)
                return await real(fps, **kw)
            finally:
                running[0] -= 1

        fetcher.hydrate = watched
        async with trio.open_nursery() as nursery:
            fetcher.bind(nursery)
            cat = Catalog(fetcher, hydrate=True)
            cat.bind(nursery)
            await cat.refresh()
            states = {d["hydration"]["state"] for d in cat.stats()["databases"].values()}
            assert "queued" in states, states
            with trio.fail_after(10):
                while {d["hydration"]["state"] for d in cat.stats()["databases"].values()} != {"done"}:
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
        return fetcher.stats

    stats = trio.run(main)
    assert running[1] == HYDRATE_AT_ONCE and stats["gets"] == 5


def test_hydrate_warns_once_when_the_databases_exceed_the_cache(local_store, tmp_path, caplog):
    from verneuil_fuse.reader.cache import ChunkCache

    for name in ("/a.db", "/b.db"):
        publish(local_store, os.urandom(3 * CHUNK_SIZE), name)

    async def main():
        fetcher = Fetcher(local_store, ChunkCache(str(tmp_path / "cache"), 4 * CHUNK_SIZE))
        async with trio.open_nursery() as nursery:
            fetcher.bind(nursery)
            cat = Catalog(fetcher, hydrate=True)
            cat.bind(nursery)
            await cat.refresh()
            await cat.refresh()
            nursery.cancel_scope.cancel()

    trio.run(main)
    warnings = [r.getMessage() for r in caplog.records if "do not fit in the disk cache" in r.getMessage()]
    assert len(warnings) == 1, warnings


def test_first_open_stores_bundled_chunks_in_the_page_cache(local_store, monkeypatch):
    """`VerneuilFS.open` hands the bundled chunks to the kernel once per
    version, and keeps opening files when the kernel refuses (a fault this
    kernel cannot be made to produce, hence the stand-in for
    `pyfuse3.notify_store`)."""
    import errno

    import pyfuse3

    from verneuil_fuse.fs import VerneuilFS

    a = publish(local_store, os.urandom(3 * CHUNK_SIZE), "/a.db", hostname="h", bundle=(2,))
    b = publish(local_store, os.urandom(CHUNK_SIZE // 2), "/b.db", hostname="h")
    stored = []

    def notify_store(inode, offset, data):
        if refuse:
            raise OSError(errno.ENOSYS, "not supported")
        stored.append((inode, offset, bytes(data)))

    monkeypatch.setattr(pyfuse3, "notify_store", notify_store)

    async def go(cat: Catalog):
        nonlocal refuse
        await cat.refresh(raise_errors=True)
        fs = VerneuilFS(cat)
        h = cat.lookup(1, "h").inode
        ra, rb = cat.lookup(h, "a.db"), cat.lookup(h, "b.db")
        fh1 = (await fs.open(ra.inode, os.O_RDONLY, None)).fh
        fh2 = (await fs.open(ra.inode, os.O_RDONLY, None)).fh
        await fs.release(fh1)
        await fs.release(fh2)
        await fs.open(ra.inode, os.O_RDONLY, None)
        # once, and only the bundled chunks (0, and 2 as a writer's b-tree top)
        assert stored == [(ra.inode, 0, a.data[:CHUNK_SIZE]),
                          (ra.inode, 2 * CHUNK_SIZE, a.data[2 * CHUNK_SIZE:])]
        assert ra.describe()["preloaded"] == 2 * CHUNK_SIZE
        refuse = True
        info = await fs.open(rb.inode, os.O_RDONLY, None)
        assert info.fh and not fs.preload and rb.preloaded == 0
        assert bytes(await rb.read(0, CHUNK_SIZE)) == b.data

    refuse = False
    run(local_store, go)


def test_base_chunk_as_long_as_a_large_list(local_store):
    """A base chunk over 64 KiB (a list of more than 4,096 chunks, a database
    over 256 MiB) is read with the bound of a chunk list, not of a chunk."""
    manifest, real, size = publish_large_base(local_store, "/large-based.db")

    async def go(cat):
        await cat.refresh(raise_errors=True)
        assert cat.stats()["refresh"]["bad_manifests"] == []
        r = next(e.current for e in cat.entries.values())
        assert r.size == size and list(r.manifest.chunks) == list(manifest.chunks)
        n = len(manifest.chunks)
        assert await r.read((n - 2) * CHUNK_SIZE, 2 * CHUNK_SIZE) == real[n - 2] + real[n - 1]
        assert await r.read(1000 * CHUNK_SIZE, 4096) == bytes(4096)

    run(local_store, go)
