"""Prefetch policies (reader/prefetch.py) and a replica's prefetch hints,
no FUSE: a `Replica` of a published manifest reads through a `Fetcher`."""
from __future__ import annotations

import os

import trio

from support.replicas import make_db, publish
from verneuil_fuse.format import CHUNK_SIZE
from verneuil_fuse.reader.cache import ChunkCache
from verneuil_fuse.reader.fetcher import Fetcher
from verneuil_fuse.reader.prefetch import BtreeReadahead, Cursor, PrefetchConfig, SequentialReadahead
from verneuil_fuse.reader.replica import Replica


def replica_of(pub, fetcher: Fetcher, config: PrefetchConfig | None = None) -> Replica:
    return Replica(key=pub.key, path="/x.db", manifest=pub.manifest, fetcher=fetcher, inode=2, mtime_ns=0,
                   prefetch=config)


def run(fetcher: Fetcher, fn):
    """`fn()` with the fetcher bound; its flights cancelled at the end."""
    async def main():
        async with trio.open_nursery() as nursery:
            fetcher.bind(nursery)
            result = await fn()
            nursery.cancel_scope.cancel()
        return result

    return trio.run(main)


def _scan_db(tmp_path, store):
    path = str(tmp_path / "scan.db")
    make_db(path, 6000, payload=300)
    data = open(path, "rb").read()
    return publish(store, data, "/scan.db")


# -- the policies alone ------------------------------------------------------

def test_sequential_readahead_opens_after_two_chunks_in_order_and_resets_on_a_jump():
    policy = SequentialReadahead(PrefetchConfig(readahead_initial=2, readahead_max=8), nchunks=100)
    cursor = Cursor()
    windows = []
    for chunk in range(6):  # one read per chunk, in order
        hints: list[int] = []
        off = chunk * CHUNK_SIZE
        policy.hint(cursor, off, off + CHUNK_SIZE, chunk, chunk, hints)
        windows.append(hints)
    # Chunk 0 is the first read, chunk 1 the first in order; from chunk 2
    # on, the window doubles (2, 4, 8) and each read hands on only chunks
    # not handed on before.
    assert windows[:2] == [[], []]
    assert windows[2] == [3, 4] and windows[3] == [5, 6, 7] and windows[4] == list(range(8, 13))
    assert windows[5] == [13]
    hints = []
    policy.hint(cursor, 50 * CHUNK_SIZE, 51 * CHUNK_SIZE, 50, 50, hints)  # a jump: nothing, windows reset
    assert not hints and cursor.window == 0 and cursor.ahead == -1
    # The file's end bounds the window.
    end = SequentialReadahead(PrefetchConfig(readahead_initial=8), nchunks=4)
    cursor = Cursor()
    got: list[int] = []
    for chunk in range(3):
        end.hint(cursor, chunk * CHUNK_SIZE, (chunk + 1) * CHUNK_SIZE, chunk, chunk, got)
    assert got == [3]


def test_btree_readahead_needs_a_header_and_the_option():
    pub_header = b"SQLite format 3\x00" + bytes((16, 0)) + bytes(82)  # page size 4096
    assert BtreeReadahead.for_replica(PrefetchConfig(), pub_header, 1 << 20).page_size == 4096
    assert BtreeReadahead.for_replica(PrefetchConfig(btree=False), pub_header, 1 << 20) is None
    assert BtreeReadahead.for_replica(PrefetchConfig(), b"not sqlite" * 20, 1 << 20) is None
    assert BtreeReadahead.for_replica(PrefetchConfig(), None, 1 << 20) is None


# -- a replica's hints ---------------------------------------------------------

def test_sequential_readahead(tmp_path, local_store):
    pub = _scan_db(tmp_path, local_store)
    fetcher = Fetcher(local_store, None, concurrency=8)
    r = replica_of(pub, fetcher, PrefetchConfig(btree=False))

    async def go():
        cursor = Cursor()
        for off in range(0, r.size, 128 * 1024):
            assert await r.read(off, 128 * 1024, cursor) == pub.data[off:off + 128 * 1024]
        return fetcher.snapshot()

    stats = run(fetcher, go)
    assert stats["prefetch_hits"] > 0.7 * stats["store_fetches"]
    assert stats["store_fetches"] == len(pub.chunks)  # nothing fetched twice


def test_cached_chunks_are_left_to_the_kernel(tmp_path, local_store):
    """A sequential read over a replica whose first 30 of 40 chunks are in
    the disk cache: the cached chunks are read in the loop's thread, neither
    fetched nor hinted to a thread; GETs of the others stay within
    ``readahead_max`` ahead of the read."""
    pub = publish(local_store, os.urandom(40 * CHUNK_SIZE), "/ra.db")
    index = {fp: i for i, fp in enumerate(pub.manifest.chunks)}
    cache = ChunkCache(str(tmp_path / "cache"), 1 << 30)
    for i, fp in enumerate(pub.manifest.chunks[:30]):
        cache.put(fp, pub.data[i * CHUNK_SIZE : (i + 1) * CHUNK_SIZE])
    hints: list[tuple[int, int]] = []
    fetcher = Fetcher(local_store, cache)
    real = fetcher.prefetch
    last = [0]

    def prefetch(fps, **kw):
        fps = list(fps)
        hints.extend((last[0], index[fp]) for fp in fps)
        return real(fps, **kw)

    fetcher.prefetch = prefetch
    r = replica_of(pub, fetcher, PrefetchConfig(btree=False, readahead_max=4))

    async def go():
        cursor = Cursor()
        for off in range(0, r.size, 2 * CHUNK_SIZE):
            last[0] = (off + 2 * CHUNK_SIZE - 1) // CHUNK_SIZE
            assert await r.read(off, 2 * CHUNK_SIZE, cursor) == pub.data[off : off + 2 * CHUNK_SIZE]
        return fetcher.stats

    stats = run(fetcher, go)
    assert hints and all(i <= last + 4 for last, i in hints)
    assert stats["gets"] == 10
    # The 29 cached chunks (chunk 0 is in the manifest), and those fetched
    # here that a later request found in the disk cache already.
    assert stats["disk_hits_inline"] == stats["disk_hits"] >= 29


def test_btree_prefetch_follows_a_scan_not_a_point_query(tmp_path, local_store):
    pub = _scan_db(tmp_path, local_store)
    fetcher = Fetcher(local_store, None, concurrency=8)
    r = replica_of(pub, fetcher)

    async def go():
        bt = r._btree
        ps = bt.page_size
        # Learn every interior page (as reads of them would).
        for i in range(r.nchunks):
            await r.read(i * CHUNK_SIZE, 1)
        parent = max(bt.children, key=lambda p: len(bt.children[p]))
        kids = bt.children[parent]
        assert len(kids) > 8
        # A point query: one child. No prefetch.
        before = fetcher.stats["prefetch_requested"]
        await r.read((kids[3] - 1) * ps, ps, Cursor())
        assert fetcher.stats["prefetch_requested"] == before
        # A scan: consecutive children, read in key order -> the next ones are asked for.
        await r.read((kids[4] - 1) * ps, ps, Cursor())
        assert fetcher.stats["prefetch_requested"] > before
        return True

    assert run(fetcher, go)


def test_a_long_run_in_file_order_is_not_parsed_for_the_btree_readahead(tmp_path, local_store):
    """Reads of a handle in file order parse their chunks for the b-tree
    readahead until the sequential readahead's window is at its largest;
    then the sequential readahead names every chunk ahead, and the chunks
    are not parsed (a cold scan's CPU), unless read again outside such a run."""
    pub = _scan_db(tmp_path, local_store)
    fetcher = Fetcher(local_store, None, concurrency=8)
    r = replica_of(pub, fetcher, PrefetchConfig(readahead_max=4))
    assert r.nchunks >= 12

    async def go():
        bt = r._btree
        cursor = Cursor()
        for i in range(1, r.nchunks - 1, 2):  # two chunks a read, as the kernel's readahead asks
            await r.read(i * CHUNK_SIZE, 2 * CHUNK_SIZE, cursor)
        early = {1, 2, 3, 4}  # before the window reached readahead_max
        assert early <= bt.parsed
        late = set(range(9, r.nchunks - 1))
        assert not late & bt.parsed
        await r.read(9 * CHUNK_SIZE, 2 * CHUNK_SIZE, Cursor())  # a read outside the run
        assert {9, 10} <= bt.parsed
        return True

    assert run(fetcher, go)
