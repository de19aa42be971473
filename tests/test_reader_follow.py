"""Followers (reader/follow.py) through the FUSE operations, without FUSE:
which inode a lookup hands out, when an open is refused (ESTALE), when a
handle moves to a new version and when the page cache is dropped (the
attribute invalidations and mtimes the kernel would get). The kernel's side
of it (the retry after ESTALE, the drop at a new mtime) is checked on real
mounts in test_mount_follow.py."""
from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import pyfuse3
import pytest
import trio

from support.replicas import publish
from verneuil_fuse.format import CHUNK_SIZE
from verneuil_fuse.fs import VerneuilFS
from verneuil_fuse.reader.catalog import Catalog
from verneuil_fuse.reader.fetcher import Fetcher
from verneuil_fuse.reader.follow import RESERVE_SECONDS, Follower, Followers


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ctx(tid: int):
    return SimpleNamespace(pid=tid, uid=0, gid=0, umask=0)


def run(store, fn):
    async def main():
        fetcher = Fetcher(store, None, concurrency=8)
        async with trio.open_nursery() as nursery:
            fetcher.bind(nursery)
            catalog = Catalog(fetcher)
            catalog.bind(nursery)
            await catalog.refresh(raise_errors=True)
            clock = Clock()
            followers = Followers(catalog, clock=clock)
            fs = VerneuilFS(catalog, entry_timeout=1.0, followers=followers)
            invalidated: list[int] = []
            followers.invalidate_attrs = invalidated.append
            await fn(SimpleNamespace(fs=fs, catalog=catalog, followers=followers, clock=clock,
                                     invalidated=invalidated, dir=(await catalog.lookup(1, "h")).inode))
            nursery.cancel_scope.cancel()

    trio.run(main)


async def estale(coro) -> bool:
    try:
        await coro
    except pyfuse3.FUSEError as e:
        return e.errno == errno.ESTALE
    return False


def test_lookups_hand_out_followers_one_per_open_handle(local_store, monkeypatch):
    monkeypatch.setattr(pyfuse3, "notify_store", lambda *a: None)
    publish(local_store, os.urandom(2 * CHUNK_SIZE), "/a.db", hostname="h")

    async def go(t):
        fs, followers = t.fs, t.followers
        f1 = t.catalog.get((await fs.lookup(t.dir, b"a.db", ctx(1))).st_ino)
        assert isinstance(f1, Follower) and f1.size == 2 * CHUNK_SIZE
        assert (await fs.lookup(t.dir, b"a.db", ctx(1))).st_ino == f1.inode
        # A plain lookup keeps nothing for its thread: a stat in one thread
        # and an open in another (Spark's driver, then a task) share the
        # follower and its page cache.
        assert (await fs.lookup(t.dir, b"a.db", ctx(2))).st_ino == f1.inode
        fh2 = (await fs.open(f1.inode, os.O_RDONLY, ctx(2))).fh
        assert await estale(fs.open(f1.inode, os.O_RDONLY, ctx(1)))  # a handle is open on it
        f2 = t.catalog.get((await fs.lookup(t.dir, b"a.db", ctx(1))).st_ino)  # the kernel's retry ...
        assert f2 is not f1
        assert await estale(fs.open(f2.inode, os.O_RDONLY, ctx(6)))  # ... gets one kept for thread 1
        t.clock.now += 0.1
        fh1 = (await fs.open(f2.inode, os.O_RDONLY, ctx(1))).fh
        # A plain lookup while every follower is taken: the most recently
        # opened one with a handle (a program that opens for each query
        # finds it free again); the kernel's retry after an ESTALE gets a
        # new one it can open.
        assert (await fs.lookup(t.dir, b"a.db", ctx(3))).st_ino == f2.inode
        assert await estale(fs.open(f2.inode, os.O_RDONLY, ctx(3)))
        f3 = t.catalog.get((await fs.lookup(t.dir, b"a.db", ctx(3))).st_ino)
        assert f3 not in (f1, f2)
        await fs.release((await fs.open(f3.inode, os.O_RDONLY, ctx(3))).fh)
        await fs.release(fh1)
        t.clock.now += 0.1
        await fs.release(fh2)
        t.clock.now += RESERVE_SECONDS + 1  # every reservation expired
        # The most recently used free follower: its page cache is the hot one.
        assert (await fs.lookup(t.dir, b"a.db", ctx(4))).st_ino == f1.inode
        await fs.release((await fs.open(f1.inode, os.O_RDONLY, ctx(5))).fh)  # any thread may open it
        await fs.forget([(f2.inode, 2), (f3.inode, 1)])  # f2: the retry's lookup and thread 3's
        assert t.catalog.get(f2.inode) is None and t.catalog.get(f3.inode) is None
        assert followers.stats()["followers"] == 1 and followers.counts["estale"] == 3

    run(local_store, go)


def test_a_handle_moves_at_offset_0_after_a_transaction_start(local_store, monkeypatch):
    stored = []
    monkeypatch.setattr(pyfuse3, "notify_store", lambda inode, off, data: stored.append((inode, off)))
    old = os.urandom(3 * CHUNK_SIZE)
    publish(local_store, old, "/a.db", hostname="h")

    async def go(t):
        fs, followers = t.fs, t.followers
        f = t.catalog.get((await fs.lookup(t.dir, b"a.db", ctx(1))).st_ino)
        fh = (await fs.open(f.inode, os.O_RDONLY, ctx(1))).fh
        assert stored == [(f.inode, 0)]  # chunk 0 stored once for this generation
        assert await estale(fs.open(f.inode, os.O_RDONLY, ctx(2)))
        free = t.catalog.get((await fs.lookup(t.dir, b"a.db", ctx(2))).st_ino)  # the retry's
        assert free is not f
        mtime = (await fs.getattr(f.inode)).st_mtime_ns
        new = os.urandom(4 * CHUNK_SIZE)
        publish(local_store, new, "/a.db", hostname="h")
        await t.catalog.refresh()
        # The free follower moved (its attributes asked again); the one with
        # a handle keeps its version, its page cache untouched.
        assert t.invalidated == [free.inode]
        assert (await fs.getattr(free.inode)).st_size == len(new)
        assert (await fs.getattr(f.inode)).st_size == len(old)
        assert bytes(await fs.read(fh, 0, CHUNK_SIZE)) == old[:CHUNK_SIZE]  # no transaction start
        # A transaction start: the cache may hold pages of the old version,
        # so it is dropped first (a new mtime at the next getattr) ...
        with pytest.raises(pyfuse3.FUSEError):
            await fs.lookup(t.dir, b"a.db-journal", ctx(1))
        assert t.invalidated[-1] == f.inode
        attrs = await fs.getattr(f.inode)
        assert attrs.st_mtime_ns > mtime and attrs.st_size == len(old)
        # ... and the read of offset 0 that follows moves the handle.
        assert bytes(await fs.read(fh, 0, CHUNK_SIZE)) == new[:CHUNK_SIZE]
        assert bytes(await fs.read(fh, 3 * CHUNK_SIZE, CHUNK_SIZE)) == new[3 * CHUNK_SIZE:]
        assert followers.counts["switches"] == 1 and t.invalidated[-1] == f.inode
        after = await fs.getattr(f.inode)  # the pages read before the move are dropped
        assert after.st_size == len(new) and after.st_mtime_ns > attrs.st_mtime_ns
        # Dirty: a read since the drop leaves the next offset-0 read where it is.
        newer = os.urandom(4 * CHUNK_SIZE)
        publish(local_store, newer, "/a.db", hostname="h")
        await t.catalog.refresh()
        with pytest.raises(pyfuse3.FUSEError):
            await fs.lookup(t.dir, b"a.db-journal", ctx(1))
        await fs.getattr(f.inode)
        assert bytes(await fs.read(fh, CHUNK_SIZE, 10)) == new[CHUNK_SIZE:CHUNK_SIZE + 10]
        assert bytes(await fs.read(fh, 0, 10)) == new[:10]
        # Past the arming (no transaction start): stays too, clean or not.
        t.clock.now += 5
        await fs.getattr(f.inode)
        assert bytes(await fs.read(fh, 0, 10)) == new[:10]
        with pytest.raises(pyfuse3.FUSEError):
            await fs.lookup(t.dir, b"a.db-journal", ctx(1))
        await fs.getattr(f.inode)
        assert bytes(await fs.read(fh, 0, 10)) == newer[:10]
        stats = t.catalog.stats()["databases"]["/h/a.db"]
        assert stats["handles"] == 1 and stats["handles_behind"] == 0
        await fs.release(fh)
        assert t.catalog.stats()["databases"]["/h/a.db"]["handles"] == 0
        assert t.catalog.lag["switched"].count == 2 and t.catalog.lag["visible"].count == 2

    run(local_store, go)


def test_the_follow_loop_checks_databases_in_use(local_store):
    """`Watch`: a database opened is checked each pass, whole the first
    time, then with its tag (unchanged: nothing read); a new version is
    installed; a manifest that does not decode is logged, never a reason
    to take the database out of the tree; a database never opened is not
    checked."""
    from verneuil_fuse.format import manifest_name
    from verneuil_fuse.reader.watch import Watch

    publish(local_store, os.urandom(CHUNK_SIZE), "/a.db", hostname="h")
    publish(local_store, os.urandom(CHUNK_SIZE), "/b.db", hostname="h")

    async def go(t):
        watch = Watch(t.catalog)
        a = t.catalog.entries[manifest_name("/a.db", "h")]
        replica = await t.catalog.decoded(a)
        t.catalog.opened(replica)
        t.catalog.released(replica)
        await watch.check_once()
        await watch.check_once()
        assert (watch.watched, watch.counts["bodies"], watch.counts["not_modified"]) == (1, 1, 1)
        new = os.urandom(2 * CHUNK_SIZE)
        publish(local_store, new, "/a.db", hostname="h")
        await watch.check_once()
        assert watch.counts["new_versions"] == 1 and a.current.size == len(new)
        a.current = None  # as a listing that changed leaves a database it had parked
        local_store.manifests.put(a.key, b"not a manifest")
        await watch.check_once()
        assert t.catalog.entries.get(a.key) is a and t.catalog.poll_errors == 1
        assert watch.stats(t.followers)["checks"] == 4

    run(local_store, go)
