"""Catalog (tree, lazy manifests, versions, freshness, hydration) and Replica reads, no FUSE."""
from __future__ import annotations

import os
import random

import trio

from support.replicas import HOST, publish, publish_large_base
from verneuil_fuse.reader.catalog import Catalog
from verneuil_fuse.reader.tree import Directory
from verneuil_fuse.reader.paths import display_path
from verneuil_fuse.reader.fetcher import Fetcher
from verneuil_fuse.format import CHUNK_SIZE, manifest_name
from verneuil_fuse.reader.replica import Cursor, Replica
from verneuil_fuse.reader.replies import ReplyBuffers


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


async def first_replica(cat: Catalog) -> Replica:
    """The first database of the tree, its manifest read and decoded."""
    return await cat.decoded(next(iter(cat.entries.values())))


def _settled(store) -> None:
    """Every manifest blob older than the settling time (as a store that
    has not changed for a while)."""
    for name in os.listdir(store.manifests.root):
        path = os.path.join(store.manifests.root, name)
        if os.path.isfile(path):
            os.utime(path, (os.stat(path).st_mtime - 60,) * 2)


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
        var = await cat.lookup((await cat.lookup((await cat.lookup(1, "h1")).inode, "var")).inode, "db")
        assert isinstance(var, Directory)
        assert [n for n, _ in cat.listdir(var.inode)] == ["a.db", "b.db"]
        r1 = await cat.lookup(var.inode, "a.db")
        assert isinstance(r1, Replica) and r1.size == len(a1.data)
        assert await r1.read(0, 1 << 20) == a1.data
        cat.opened(r1)
        cat.remember(r1)
        # Same bytes uploaded again: same version, same inode.
        publish(local_store, a1.data, "/var/db/a.db", hostname="h1")
        await cat.refresh()
        assert await cat.lookup(var.inode, "a.db") is r1
        # A new version: a new inode for lookups; the old one still reads old bytes.
        a2 = publish(local_store, os.urandom(2 * CHUNK_SIZE), "/var/db/a.db", hostname="h1")
        await cat.refresh()
        r2 = await cat.lookup(var.inode, "a.db")
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
        # A store this small is read whole at each poll.
        stats = cat.stats()
        assert set(stats["databases"]) == {"/h2/x.db"} and stats["catalog"]["loads"] == 3
        assert stats["refresh"]["versions_seen"] == 4

    run(local_store, go)


def test_bad_manifest_is_skipped(local_store):
    """A manifest that does not decode is skipped, and not fetched (nor
    logged) again at every poll until its blob changes or its retry time
    passes (BAD_RETRY_S, doubling at each failure)."""
    import time

    from verneuil_fuse.reader.polling import BAD_RETRY_S

    now = [time.time()]
    publish(local_store, os.urandom(100), "/ok.db")
    bad_key = manifest_name("/bad.db", "testhost")
    local_store.manifests.put(bad_key, b"garbage")
    _settled(local_store)  # a blob written just now would be fetched again

    async def go(cat):
        await cat.refresh()
        top = (await cat.lookup(1, "testhost")).inode
        # Read at the poll (a small store), found invalid: out of the tree.
        assert await cat.lookup(top, "bad.db") is None
        names = [n for n, _ in cat.listdir(top)]
        assert names == ["ok.db"] and cat.poll_errors == 1
        gets = cat.fetcher.stats["manifest_gets"]
        for _ in range(3):
            await cat.refresh()
        assert cat.fetcher.stats["manifest_gets"] == gets and cat.poll_errors == 1
        assert cat.stats()["refresh"]["bad_manifests"] == [bad_key]
        # Its retry time passed: read again (still bad), then not before twice as long.
        for wait, fetched in ((BAD_RETRY_S, 1), (1.5 * BAD_RETRY_S, 0), (0.6 * BAD_RETRY_S, 1)):
            now[0] += wait
            await cat.refresh()
            assert cat.fetcher.stats["manifest_gets"] == gets + fetched, wait
            gets = cat.fetcher.stats["manifest_gets"]
        assert await cat.lookup(top, "bad.db") is None
        # Fixed in the store: fetched again and served.
        good = publish(local_store, os.urandom(300), "/bad.db")
        await cat.refresh()
        r = await cat.decoded(await cat.lookup(top, "bad.db"))
        assert r is not None and await r.read(0, 1000) == good.data
        assert cat.stats()["refresh"]["bad_manifests"] == []

    run(local_store, go, clock=lambda: now[0])


def test_reads_zero_chunks_and_eof(local_store):
    data = os.urandom(CHUNK_SIZE) + bytes(2 * CHUNK_SIZE) + os.urandom(1000)
    pub = publish(local_store, data, "/z.db")

    async def go(cat):
        await cat.refresh()
        r = await first_replica(cat)
        rng = random.Random(1)
        for _ in range(300):
            off = rng.randrange(len(data) + 10)
            size = rng.randrange(1, 3 * CHUNK_SIZE)
            assert await r.read(off, size) == data[off:off + size]
        assert await r.read(len(data), 10) == b""
        assert cat.fetcher.stats["gets"] == 1  # chunk 0 bundled, zeros synthesised

    run(local_store, go)


def test_reply_buffers_are_reused_only_when_free(local_store):
    """Replies of several chunks come from reused buffers (reader/replies.py):
    one still referred to (a read waiting, a reply kept) is never handed out
    again, and every byte of a reused one is written again, zero chunks
    included."""
    pool = ReplyBuffers(chunks=2, count=2)
    a = pool.take(100)
    kept = memoryview(a)[10:20]
    b = pool.take(100)
    assert b is not a and pool.made == 2 and pool.reused == 0
    del kept, a
    assert pool.take(100) is pool._pool[0] and pool.reused == 1  # no view of it is left
    assert len(pool.take(3 * CHUNK_SIZE)) == 3 * CHUNK_SIZE  # larger than a pooled buffer: its own
    assert len(pool._pool) == 2

    data = os.urandom(2 * CHUNK_SIZE) + bytes(2 * CHUNK_SIZE) + os.urandom(2 * CHUNK_SIZE) + bytes(100)
    publish(local_store, data, "/p.db")

    async def go(cat):
        await cat.refresh()
        r = await first_replica(cat)
        held = []
        for rnd in range(40):  # random data, then zeros, through the same few buffers
            off = (rnd * 7919) % (len(data) - 2 * CHUNK_SIZE)
            got = await r.read(off, 2 * CHUNK_SIZE)
            assert got == data[off:off + 2 * CHUNK_SIZE]
            if rnd % 5 == 0:
                held.append((off, got))  # replies still referred to keep their bytes
        for off, got in held:
            assert got == data[off:off + 2 * CHUNK_SIZE]
        assert r._replies.reused > 0

    run(local_store, go)


def test_reads_of_a_run_of_a_pack_are_views_of_its_buffer(local_store):
    """A packed replica's read of several chunks that one run brought in is
    answered with a view of the run's buffer (`Fetcher.span`), no copy; any
    other read (across two runs, with a zero chunk) is copied into a reply:
    the bytes are the file's either way, and stay so while replies are
    kept."""
    data = bytearray(os.urandom(40 * CHUNK_SIZE + 1234))
    data[9 * CHUNK_SIZE:10 * CHUNK_SIZE] = bytes(CHUNK_SIZE)  # a zero chunk, never fetched
    data = bytes(data)
    publish(local_store, data, "/runs.db", packed=4 << 20)

    async def go(cat):
        await cat.refresh()
        r = await first_replica(cat)
        cursor = Cursor()
        kept = []
        for off in range(0, len(data), 1 << 20):  # a scan's 1 MiB reads: views once the runs are in
            got = await r.read(off, 1 << 20, cursor)
            assert got == data[off:off + (1 << 20)]
            kept.append((off, got))
        for rnd in range(30):  # reads anywhere, of two or three chunks
            off = (rnd * 104729) % (len(data) - 3 * CHUNK_SIZE)
            got = await r.read(off, 2 * CHUNK_SIZE + rnd * 100)
            assert got == data[off:off + 2 * CHUNK_SIZE + rnd * 100]
            kept.append((off, got))
        for off, got in kept:
            assert got == data[off:off + len(got)]
        assert r.fetcher.stats["spans"] > 0
        assert any(isinstance(got, memoryview) and type(got.obj) is bytes for _, got in kept)

    run(local_store, go)


def test_a_packed_replicas_readahead_starts_with_a_run(local_store):
    """In a packed store the first sequential readahead window is a run of
    a pack (one range GET, as two chunks would be); in Verneuil's layout,
    where each chunk is a GET, it starts at the config's two chunks."""
    from verneuil_fuse.reader.replica import PACKED_READAHEAD_INITIAL

    publish(local_store, os.urandom(200 * CHUNK_SIZE), "/seq-packed.db", packed=16 << 20)
    publish(local_store, os.urandom(200 * CHUNK_SIZE), "/seq-chunks.db")

    async def go(cat):
        await cat.refresh()
        got = {}
        for entry in cat.entries.values():
            r = await cat.decoded(entry)
            cursor = Cursor()
            hints: list[int] = []
            for k in range(3):  # three reads in order: the readahead starts at the third
                r._sequential.hint(cursor, k * CHUNK_SIZE, (k + 1) * CHUNK_SIZE, k, k, hints)
            got[r.packed] = (r._sequential.initial, len(hints))
        return got

    got = run(local_store, go)
    assert PACKED_READAHEAD_INITIAL == 64
    assert got == {True: (64, 64), False: (2, 2)}


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
        r = await first_replica(cat)
        assert r.manifest.chunks == manifest.chunks
        assert await r.read(0, len(data) + 1) == data

    run(local_store, go)


def test_hydrate_fills_the_disk_cache(local_store, tmp_path):
    """Hydration fetches every chunk of the newest version into the disk
    cache, says how far it went in the stats, ends `incomplete` when a chunk
    cannot be fetched and starts again HYDRATE_RETRY_SECONDS later; a new
    version is hydrated in its turn."""
    from verneuil_fuse.reader.cache import ChunkCache
    from verneuil_fuse.reader.hydration import HYDRATE_RETRY_SECONDS

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
            assert all(fetcher.cache.has_blocking(fp) for fp in chunks)
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
            assert fetcher.cache.has_blocking(v2.manifest.chunks[5]) and fetcher.stats["gets"] == gets + 1
            nursery.cancel_scope.cancel()
        return fetcher.stats

    stats = trio.run(main)
    assert stats["gets"] == len(chunks) + 1 + 1  # the missing chunk failed once, then came


def test_hydrate_takes_databases_a_few_at_a_time(local_store, tmp_path):
    from verneuil_fuse.reader.cache import ChunkCache
    from verneuil_fuse.reader.hydration import HYDRATE_AT_ONCE

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
            with trio.fail_after(10):  # hydration reads the manifests, then the chunks
                while {d["hydration"]["state"] for d in cat.stats()["databases"].values()} - {"done", "incomplete"}:
                    await trio.sleep(0.02)
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
        fs = VerneuilFS(cat, entry_timeout=1.0)
        h = (await cat.lookup(1, "h")).inode
        ra, rb = await cat.lookup(h, "a.db"), await cat.lookup(h, "b.db")
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


def test_open_fetches_a_small_packed_database_whole(local_store, monkeypatch):
    """`VerneuilFS.open` of a database of at most `OPEN_FETCH_BYTES` in a
    packed store prefetches all of it (its run of a pack, before any READ);
    not a larger one, nor one in Verneuil's layout (a GET per chunk)."""
    import pyfuse3

    from verneuil_fuse.fs import VerneuilFS
    from verneuil_fuse.reader.replica import OPEN_FETCH_BYTES

    monkeypatch.setattr(pyfuse3, "notify_store", lambda *a: None)
    small = OPEN_FETCH_BYTES // CHUNK_SIZE
    dbs = {"small.db": publish(local_store, os.urandom(small * CHUNK_SIZE), "/small.db", hostname="h",
                               packed=4 << 20),
           "large.db": publish(local_store, os.urandom((small + 1) * CHUNK_SIZE), "/large.db", hostname="h",
                               packed=4 << 20),
           "chunks.db": publish(local_store, os.urandom(small * CHUNK_SIZE), "/chunks.db", hostname="h")}

    async def go(cat: Catalog):
        await cat.refresh(raise_errors=True)
        fs = VerneuilFS(cat, entry_timeout=1.0)
        h = (await cat.lookup(1, "h")).inode
        fetched = {}
        for name, pub in dbs.items():
            node = await cat.lookup(h, name)
            before = cat.fetcher.stats["store_fetches"]
            await fs.open(node.inode, os.O_RDONLY, None)
            with trio.move_on_after(0.5):  # the prefetch lands, if there is one
                while cat.fetcher.stats["store_fetches"] - before < small - 1:
                    await trio.sleep(0.01)
            fetched[name] = cat.fetcher.stats["store_fetches"] - before
            assert bytes(await node.read(0, len(pub.data))) == pub.data
        return fetched

    assert run(local_store, go) == {"small.db": small - 1, "large.db": 0, "chunks.db": 0}


def test_base_chunk_as_long_as_a_large_list(local_store):
    """A base chunk over 64 KiB (a list of more than 4,096 chunks, a database
    over 256 MiB) is read with the bound of a chunk list, not of a chunk."""
    manifest, real, size = publish_large_base(local_store, "/large-based.db")

    async def go(cat):
        await cat.refresh(raise_errors=True)
        assert cat.stats()["refresh"]["bad_manifests"] == []
        r = await first_replica(cat)
        assert r.size == size and list(r.manifest.chunks) == list(manifest.chunks)
        n = len(manifest.chunks)
        assert await r.read((n - 2) * CHUNK_SIZE, 2 * CHUNK_SIZE) == real[n - 2] + real[n - 1]
        assert await r.read(1000 * CHUNK_SIZE, 4096) == bytes(4096)

    run(local_store, go)


def test_manifests_read_on_lookup_and_parked_past_the_bound(local_store, tmp_path):
    """A poll reads names only; a lookup reads one manifest; past
    `decoded_limit` idle versions are parked and decoded again from the
    manifest cache without a GET; an open version is never parked."""
    from verneuil_fuse.reader.tree import Parked
    from verneuil_fuse.reader.manifests import ManifestCache

    pubs = [publish(local_store, os.urandom(CHUNK_SIZE + i), "/t/%d.db" % i) for i in range(5)]
    _settled(local_store)
    mc = ManifestCache(str(tmp_path / "cache"), "test-store")

    async def go(cat: Catalog):
        await cat.refresh(raise_errors=True)
        assert cat.fetcher.stats["manifest_gets"] == 0 and len(cat.entries) == 5
        t = (await cat.lookup((await cat.lookup(1, "testhost")).inode, "t")).inode
        first = await cat.lookup(t, "0.db")
        assert isinstance(first, Replica) and cat.fetcher.stats["manifest_gets"] == 1
        cat.opened(first)  # open: stays decoded whatever the bound
        for i in range(1, 5):
            r = await cat.lookup(t, "%d.db" % i)
            assert await r.read(0, 1 << 20) == pubs[i].data
        assert cat.stats()["catalog"]["decoded"] == 2
        assert cat.get(first.inode) is first
        parked = cat.get((await cat.lookup(t, "1.db")).inode)
        assert isinstance(parked, Parked) and parked.size == len(pubs[1].data)
        gets = cat.fetcher.stats["manifest_gets"]
        again = await cat.decoded(parked)
        assert isinstance(again, Replica) and again.inode == parked.inode
        assert await again.read(0, 1 << 20) == pubs[1].data
        assert cat.fetcher.stats["manifest_gets"] == gets and mc.hits >= 1
        # Unchanged store: a poll costs no GET.
        await cat.refresh()
        assert cat.fetcher.stats["manifest_gets"] == gets
        cat.released(first)
        assert cat.stats()["catalog"]["decoded"] == 2

    run(local_store, go, manifest_cache=mc, decoded_limit=2)
    mc.close()


def test_parked_version_gone_from_the_store_is_stale(local_store):
    """Without a manifest cache, a parked version is read again from the
    store; when the store moved on, it is Stale (ESTALE for the open)."""
    from verneuil_fuse.reader.tree import Parked, Stale

    publish(local_store, os.urandom(100), "/a.db")
    publish(local_store, os.urandom(100), "/b.db")
    _settled(local_store)

    async def go(cat: Catalog):
        await cat.refresh()
        h = (await cat.lookup(1, "testhost")).inode
        a = await cat.lookup(h, "a.db")
        await cat.lookup(h, "b.db")  # parks a
        parked = cat.get(a.inode)
        assert isinstance(parked, Parked)
        publish(local_store, os.urandom(200), "/a.db")  # no poll yet
        try:
            await cat.decoded(parked)
        except Stale:
            pass
        else:
            raise AssertionError("a version the store no longer has was served")
        assert cat.stats()["catalog"]["stale"] == 1
        await cat.refresh()
        new = await cat.decoded(await cat.lookup(h, "a.db"))
        assert new.size == 200 and new.inode != a.inode

    run(local_store, go, decoded_limit=1)


def test_unlisted_database_is_found_by_name(local_store):
    """A database published after the poll is found by its manifest name at
    lookup (one GET); an absent name costs one GET until the next poll;
    SQLite's side files are never looked up in the store."""
    publish(local_store, os.urandom(100), "/d/a.db")
    _settled(local_store)

    async def go(cat: Catalog):
        await cat.refresh()
        d = (await cat.lookup((await cat.lookup(1, "testhost")).inode, "d")).inode
        new = publish(local_store, os.urandom(300), "/d/new.db")
        r = await cat.decoded(await cat.lookup(d, "new.db"))
        assert await r.read(0, 1000) == new.data
        assert [n for n, _ in cat.listdir(d)] == ["a.db", "new.db"]
        gets = cat.fetcher.stats["manifest_gets"]
        assert await cat.lookup(d, "nope.db") is None
        assert await cat.lookup(d, "nope.db") is None
        assert await cat.lookup(d, "a.db-journal") is None
        assert cat.fetcher.stats["manifest_gets"] == gets + 1
        await cat.refresh()  # the poll lists new.db; nope.db may be asked again
        assert await cat.lookup(d, "nope.db") is None
        assert cat.fetcher.stats["manifest_gets"] == gets + 2 + 1  # + new.db's listing changed its mtime
        assert cat.stats()["catalog"]["direct_found"] == 1

    run(local_store, go)


def test_a_database_found_by_name_during_a_poll_stays(local_store):
    """A poll whose listing was taken before a database was published does
    not remove the database a lookup by name found meanwhile: the entry and
    its inode stay, with no "gone from the store" in between."""
    publish(local_store, os.urandom(100), "/d/a.db")
    _settled(local_store)

    async def go(cat: Catalog):
        await cat.refresh()
        d = (await cat.lookup((await cat.lookup(1, "testhost")).inode, "d")).inode
        list_manifests = cat.fetcher.list_manifests
        found = []

        async def listing_taken_before_the_publish():
            infos = await list_manifests()
            publish(local_store, os.urandom(300), "/d/new.db")
            found.append(await cat.lookup(d, "new.db"))
            return infos

        cat.fetcher.list_manifests = listing_taken_before_the_publish
        await cat.refresh()
        cat.fetcher.list_manifests = list_manifests
        assert found[0] is not None
        assert await cat.lookup(d, "new.db") is found[0]
        assert [n for n, _ in cat.listdir(d)] == ["a.db", "new.db"]
        await cat.refresh()  # a listing that shows it
        assert [n for n, _ in cat.listdir(d)] == ["a.db", "new.db"]

    run(local_store, go)
