"""The disk chunk cache (segment files): persistence, verification, crash
leftovers, the size bound, and several processes sharing one directory."""
from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import subprocess
import threading
import time

import pytest

from verneuil_fuse.reader import cache as cache_mod
from verneuil_fuse.reader import segments as segments_mod
from verneuil_fuse.reader.cache import RECORD, ChunkCache, encode_record
from verneuil_fuse.format import CHUNK_SIZE, fingerprint


def chunks(n: int, seed: int = 0, size: int = CHUNK_SIZE):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        data = rng.randbytes(size)
        out.append((fingerprint(data), data))
    return out


def segdir(d) -> str:
    return os.path.join(str(d), cache_mod.FORMAT_DIR)


def files(d, suffix):
    return sorted(n for n in os.listdir(segdir(d)) if n.endswith(suffix))


def segments(d) -> list[bytes]:
    """The bytes of every segment file, oldest first."""
    out = []
    for name in files(d, ".seg"):
        with open(os.path.join(segdir(d), name), "rb") as f:
            out.append(f.read())
    return out


def test_put_get_and_persistence(tmp_path):
    items = chunks(20) + chunks(3, seed=1, size=1000)
    c = ChunkCache(str(tmp_path), 1 << 30)
    assert c.get(items[0][0]) is None and not c.has_blocking(items[0][0])
    for fp, data in items:
        c.put(fp, data)
        c.put(fp, data)  # a second put of the same chunk is a no-op
    assert all(c.get(fp) == data for fp, data in items)
    assert len(c) == len(items)
    assert c.volume() == sum(len(d) for _, d in items) + len(items) * RECORD.size
    c.close()
    # A remount: the index is rebuilt from the .idx files; same bytes.
    d = ChunkCache(str(tmp_path), 1 << 30)
    assert len(d) == len(items) and all(d.get(fp) == data for fp, data in items)
    assert len(files(tmp_path, ".seg")) == 1
    d.close()


def test_a_new_segments_first_target_makes_its_files(tmp_path):
    """The chunk engine writes a chunk where `CacheSlot.target` says; a new
    segment's first target makes its files (not its first write, which for
    a scan comes after hundreds of targets were asked for), and the chunk
    written there joins the index."""
    c = ChunkCache(str(tmp_path), 1 << 26)
    (fp, data), = chunks(1)
    slot = c.reserve()
    assert files(tmp_path, ".seg") == []  # a segment is only named at its reserve
    target = slot.target(fp)
    assert target is not None and len(files(tmp_path, ".seg")) == 1 and len(files(tmp_path, ".idx")) == 1
    fd, idx_fd, off = target
    os.pwrite(fd, data, off)
    os.write(idx_fd, encode_record(fp, off, len(data)))
    assert slot.written(fp, len(data), True, 0)
    assert c.get(fp) == data
    c.close()


def test_damaged_bytes_are_a_miss_never_served(tmp_path):
    (fp, data), (fp2, data2) = chunks(2)
    c = ChunkCache(str(tmp_path), 1 << 30)
    c.put(fp, data)
    c.put(fp2, data2)
    c.close()
    seg = os.path.join(segdir(tmp_path), files(tmp_path, ".seg")[0])
    with open(seg, "r+b") as f:  # flip one byte of the first chunk
        f.seek(1234)
        b = f.read(1)
        f.seek(1234)
        f.write(bytes([b[0] ^ 1]))
    d = ChunkCache(str(tmp_path), 1 << 30)
    assert d.get(fp) is None and d.stats["corrupt"] == 1
    assert not d.has_blocking(fp)  # dropped from the index
    assert d.get(fp2) == data2
    d.put(fp, data)  # refetched bytes are appended and served
    assert d.get(fp) == data
    d.close()
    e = ChunkCache(str(tmp_path), 1 << 30)  # the later record wins on replay
    assert e.get(fp) == data
    e.close()


def test_read_into_reads_back_to_back_chunks_with_one_call(tmp_path, monkeypatch):
    """`read_into` fills the caller's buffers with verified bytes: chunks
    stored back to back are read by one preadv, a damaged chunk inside such a
    run is dropped alone, a chunk not cached or of another length is left
    alone. The preadv stand-in only counts calls (the reads are real)."""
    items = chunks(8, seed=5) + chunks(1, seed=6, size=1000)
    c = ChunkCache(str(tmp_path), 1 << 30)
    for fp, data in items:
        c.put(fp, data)
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off, flags=0: calls.append(len(bufs)) or real(fd, bufs, off, flags))

    def read(order, nowait=False, sizes=None):
        bufs = [bytearray(len(items[i][1]) if sizes is None else sizes[k]) for k, i in enumerate(order)]
        ok = c.read_into([items[i][0] for i in order], [memoryview(b) for b in bufs], nowait=nowait)
        return ok, bufs

    # In file order: one call for all nine chunks (the short one included).
    ok, bufs = read(range(9))
    assert ok == [True] * 9 and [bytes(b) for b in bufs] == [d for _, d in items] and calls == [9]
    # Out of order: one call per run of neighbours in the segment; same bytes.
    calls.clear()
    ok, bufs = read([0, 6, 2, 1, 7, 3])
    assert ok == [True] * 6 and calls == [4, 2]
    assert [bytes(b) for b in bufs] == [items[i][1] for i in (0, 6, 2, 1, 7, 3)]
    # The same chunk twice in one request (two equal chunks of a file).
    ok, bufs = read([4, 4, 5])
    assert ok == [True] * 3 and [bytes(b) for b in bufs] == [items[4][1], items[4][1], items[5][1]]
    # Without waiting (the bytes were just written: in the page cache), or
    # left for a blocking read: never other bytes.
    ok, bufs = read(range(8), nowait=True)
    assert all(bytes(b) == items[i][1] for i, b in enumerate(bufs) if ok[i])
    # A destination of another length, or a chunk the cache does not hold.
    other = chunks(1, seed=7)[0][0]
    bufs = [bytearray(100), bytearray(CHUNK_SIZE)]
    assert c.read_into([items[0][0], other], [memoryview(b) for b in bufs]) == [False, False]
    assert bufs == [bytearray(100), bytearray(CHUNK_SIZE)]
    # A damaged chunk in the middle of a run: dropped and logged, not served.
    c.close()
    seg = os.path.join(segdir(tmp_path), files(tmp_path, ".seg")[0])
    with open(seg, "r+b") as f:
        f.seek(3 * CHUNK_SIZE + 77)
        b = f.read(1)
        f.seek(3 * CHUNK_SIZE + 77)
        f.write(bytes([b[0] ^ 0x40]))
    c = ChunkCache(str(tmp_path), 1 << 30)
    calls.clear()
    ok, bufs = read(range(8))
    assert ok == [True] * 3 + [False] + [True] * 4 and calls == [8]
    assert [bytes(b) for k, b in enumerate(bufs) if k != 3] == [d for k, (_, d) in enumerate(items[:8]) if k != 3]
    assert c.stats["corrupt"] == 1 and not c.has_blocking(items[3][0])
    c.close()


def test_crash_leftovers_are_skipped(tmp_path):
    items = chunks(4)
    c = ChunkCache(str(tmp_path), 1 << 30)
    for fp, data in items[:3]:
        c.put(fp, data)
    c.close()
    idx = os.path.join(segdir(tmp_path), files(tmp_path, ".idx")[0])
    seg = idx[: -len(".idx")] + ".seg"
    with open(idx, "ab") as f:
        f.write(bytes(RECORD.size))  # a zero-filled record (delayed allocation)
        # A well-formed record whose bytes never reached the disk ...
        f.write(encode_record(items[3][0], os.path.getsize(seg), CHUNK_SIZE))
        # ... one pointing inside the segment at the wrong bytes ...
        f.write(encode_record(items[3][0], 0, CHUNK_SIZE))
        f.write(encode_record(items[0][0], 7, 100)[:-1] + b"\x00")  # a bad check word
        f.write(b"\x01" * 10)  # and a torn tail
    d = ChunkCache(str(tmp_path), 1 << 30)
    assert all(d.get(fp) == data for fp, data in items[:3])
    assert d.get(items[3][0]) is None  # the wrong bytes failed the fingerprint
    d.put(*items[3])
    assert d.get(items[3][0]) == items[3][1]
    d.close()


def test_size_bound_evicts_oldest_segments(tmp_path):
    limit = 4 << 20  # 4 MiB: segments of 1 MiB (the minimum)
    c = ChunkCache(str(tmp_path), limit)
    assert c.segment_bytes == cache_mod.MIN_SEGMENT_BYTES
    items = chunks(200)  # 12.5 MiB
    for i, (fp, data) in enumerate(items):
        c.put(fp, data)
        assert c.volume() <= limit, i
        on_disk = sum(os.path.getsize(os.path.join(segdir(tmp_path), n)) for n in os.listdir(segdir(tmp_path)))
        assert on_disk <= limit, i
    # The newest chunks are kept, the oldest were evicted whole segments at a time.
    assert c.get(items[-1][0]) == items[-1][1]
    assert c.get(items[0][0]) is None
    kept = [i for i, (fp, _) in enumerate(items) if c.has_blocking(fp)]
    assert kept == list(range(kept[0], len(items))) and len(kept) >= 40
    assert c.stats["evicted_segments"] > 0
    c.close()
    d = ChunkCache(str(tmp_path), limit)
    assert len(d) == len(kept)
    d.close()
    # Reopening with a smaller limit trims at once.
    e = ChunkCache(str(tmp_path), 2 << 20)
    assert e.volume() <= 2 << 20 and 0 < len(e) < len(kept)
    e.close()


def test_two_processes_share_one_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(segments_mod, "RESCAN_INTERVAL_S", 0.0)
    a = ChunkCache(str(tmp_path), 1 << 30)
    b = ChunkCache(str(tmp_path), 1 << 30)
    items = chunks(6)
    for fp, data in items[:3]:
        a.put(fp, data)
    for fp, data in items[3:]:
        b.put(fp, data)
    # Each appends to its own segment and reads the other's.
    assert len(files(tmp_path, ".seg")) == 2
    assert all(a.get(fp) == data and b.get(fp) == data for fp, data in items)
    # b's segment is deleted (as another process's eviction would): a drops it.
    (b_seg,) = [s.name for s in b._segments.values() if s.own]
    for suffix in (".seg", ".idx"):
        os.unlink(os.path.join(segdir(tmp_path), b_seg + suffix))
    # Until a miss rescans the directory, a still serves the (verified) bytes
    # from its open descriptor; the first miss drops the segment.
    assert a.get(chunks(1, seed=8)[0][0]) is None
    assert a.get(items[4][0]) is None and a.get(items[0][0]) == items[0][1]
    # b notices its active segment is gone and starts a new one.
    extra = chunks(1, seed=9)[0]
    assert b.get(extra[0]) is None  # a miss: b rescans
    assert b.get(items[4][0]) is None
    b.put(*extra)
    assert a.get(extra[0]) == extra[1]
    a.close()
    b.close()


def test_concurrent_puts_and_gets(tmp_path):
    c = ChunkCache(str(tmp_path), 8 << 20)
    items = chunks(300, seed=3)
    errors = []

    def worker(k):
        try:
            for fp, data in items[k::4]:
                c.put(fp, data)
                got = c.get(fp)
                if got is not None and got != data:
                    errors.append("wrong bytes")
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert c.volume() <= 8 << 20
    hits = [fp for fp, data in items if c.get(fp) == data]
    assert len(hits) == len(c) > 50
    c.close()


def test_unusable_directory_is_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError):
        ChunkCache(str(blocker), 1 << 20)


@pytest.fixture
def small_fs(tmp_path):
    """A real 4 MiB file system (tmpfs): the disk is smaller than cache_size."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "fs"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path) -> str:
    """Fill the file system at ``path`` with one file, as another program would."""
    filler = os.path.join(str(path), "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (65536, 4096):  # to the last page
            try:
                while True:
                    os.write(fd, b"x" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def test_the_disk_bounds_the_cache_and_keeps_its_reserve_free(small_fs, caplog, monkeypatch):
    monkeypatch.setattr(segments_mod, "WRITE_PAUSE_S", 0.3)
    # A file system that gives no blocks ahead: a segment started before
    # another program filled the disk then fails its next write (with them,
    # test_a_segments_blocks_are_given_ahead_and_back, it writes on).
    monkeypatch.setattr(segments_mod, "_preallocate", lambda fd, size: None)
    reserve = int(4 * (1 << 20) * cache_mod.FREE_RESERVE_FRACTION)
    with caplog.at_level(logging.WARNING, logger="verneuil_fuse.reader.cache"):
        c = ChunkCache(str(small_fs), 1 << 30)
    assert "the disk bounds the cache" in caplog.text
    assert c.segment_bytes == cache_mod.MIN_SEGMENT_BYTES
    items = chunks(200)  # 12.5 MiB through a 4 MiB disk
    for i, (fp, data) in enumerate(items):
        c.put(fp, data)
        assert free_bytes(small_fs) >= reserve - RECORD.size * 16, i
    # No write failed: the oldest segments made room first.
    assert c.stats["write_pauses"] == 0 and c.stats["evicted_segments"] > 0
    assert c.get(items[-1][0]) == items[-1][1] and c.get(items[0][0]) is None
    kept = [i for i, (fp, _) in enumerate(items) if c.has_blocking(fp)]
    assert kept == list(range(kept[0], len(items))) and len(kept) >= 16

    # Another program fills the disk after a segment was started: the write
    # fails, one warning, no exception, nothing wrong is served.
    caplog.clear()
    filler = fill(small_fs)
    more = chunks(40, seed=5)
    with caplog.at_level(logging.WARNING, logger="verneuil_fuse.reader.cache"):
        for fp, data in more:
            c.put(fp, data)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert "not caching new chunks" in warnings[0].getMessage()
    assert c.stats["write_pauses"] == 1 and c.stats["puts_skipped"] >= len(more) - 2
    for fp, data in more + items:
        got = c.get(fp)
        assert got is None or got == data
    assert c.describe()["writes_paused"] is True

    # Past the pause, the disk still full: the cache deletes its oldest
    # segments until a new one fits with the reserve free, and goes on.
    time.sleep(0.35)
    held = c.volume()
    one = chunks(1, seed=6)[0]
    c.put(*one)
    assert c.get(one[0]) == one[1] and c.stats["write_pauses"] == 1
    assert c.volume() < held and free_bytes(small_fs) >= reserve - RECORD.size * 16
    assert c.describe()["writes_paused"] is False
    os.unlink(filler)
    c.close()


def test_slots_of_fetches_under_way_are_counted_against_the_disk(small_fs):
    """Slots reserved for fetches still under way are bytes promised to the
    disk that statvfs does not show yet: a new segment starts only if the
    disk can take it *and* them, so the reserve stays free once every fetch
    has landed, whatever order they land in."""
    reserve = int(4 * (1 << 20) * cache_mod.FREE_RESERVE_FRACTION)
    c = ChunkCache(str(small_fs), 1 << 30)  # 1 MiB segments on a 4 MiB disk
    items = chunks(300, seed=27)
    rng = random.Random(28)
    landed = 0
    while landed < len(items):
        # A window of fetches starts (slots in order), then they land
        # shuffled, the last of each window only after the next starts.
        batch = items[landed : landed + 24]
        slots = [c.reserve() for _ in batch]
        order = list(range(len(batch)))
        rng.shuffle(order)
        for k in order:
            slots[k].write(*batch[k])
            assert free_bytes(small_fs) >= reserve - RECORD.size * 16, landed + k
        landed += len(batch)
    assert c.stats["write_pauses"] == 0 and c.stats["evicted_segments"] > 0
    assert c.describe()["bytes"] <= c.capacity
    kept = [fp for fp, data in items if c.get(fp) == data]
    assert len(kept) >= 32 and c.get(items[-1][0]) == items[-1][1]
    c.close()


def test_a_cache_on_a_disk_already_past_its_reserve_gives_space_back(small_fs, caplog):
    c = ChunkCache(str(small_fs), 1 << 30)
    for fp, data in chunks(40):  # 2.5 MiB
        c.put(fp, data)
    assert len(c) == 40
    c.close()
    filler = fill(small_fs)
    # At the next start the cache deletes its oldest segments until the
    # reserve is free again: here one segment of 16 chunks does it.
    d = ChunkCache(str(small_fs), 1 << 30)
    reserve = int(4 * (1 << 20) * cache_mod.FREE_RESERVE_FRACTION)
    assert free_bytes(small_fs) >= reserve and 0 < len(d) < 40
    d.close()
    # A cache with nothing to give back on a disk full past the reserve: a
    # pause, no file made, no exception.
    fill(small_fs)
    empty = small_fs / "other"
    e = ChunkCache(str(empty), 1 << 30)
    with caplog.at_level(logging.WARNING, logger="verneuil_fuse.reader.cache"):
        e.put(*chunks(1, seed=2)[0])
    assert "no room left on its file system" in caplog.text
    assert e.stats["puts_skipped"] == 1 and files(empty, ".seg") == []
    e.close()
    os.unlink(filler)


def test_a_removed_cache_directory_is_made_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(segments_mod, "RESCAN_INTERVAL_S", 0.0)
    c = ChunkCache(str(tmp_path), 1 << 30)
    first, second = chunks(2)
    c.put(*first)
    shutil.rmtree(segdir(tmp_path))  # a cleaner of /var/cache, say
    # The open segment still serves what it holds until a miss rescans;
    # then the next chunk goes to a new segment in a new directory.
    with caplog.at_level(logging.WARNING, logger="verneuil_fuse.reader.cache"):
        assert c.get(chunks(1, seed=4)[0][0]) is None
        assert c.get(first[0]) is None
    assert [r.getMessage() for r in caplog.records] == [
        "cache directory %s was removed: making it again" % segdir(tmp_path)]
    c.put(*second)
    assert c.get(second[0]) == second[1] and c.stats["write_pauses"] == 0
    assert len(files(tmp_path, ".seg")) == 1
    c.close()
    assert ChunkCache(str(tmp_path), 1 << 30).get(second[0]) == second[1]


def test_reserved_slots_lay_chunks_out_in_the_order_fetches_started(tmp_path):
    """Chunks whose fetches started in file order land back to back in that
    order, whatever order their bytes arrive in (here reversed, from several
    threads), so that a later read request of them is one run of the
    segment; reserving does no I/O (a segment's files appear at its first
    write)."""
    items = chunks(12, seed=20) + chunks(1, seed=21, size=1000)
    fps = [fp for fp, _ in items]
    lengths = [len(d) for _, d in items]
    whole = b"".join(d for _, d in items)
    c = ChunkCache(str(tmp_path), 1 << 30)
    slots = [c.reserve() for _ in items]
    assert all(slots) and files(tmp_path, ".seg") == []
    threads = [threading.Thread(target=slot.write, args=(fp, data))
               for (fp, data), slot in reversed(list(zip(items, slots)))]
    for t in threads:
        t.start()
        time.sleep(0.002)  # let each write go before the next starts
    for t in threads:
        t.join(10)
    assert len(files(tmp_path, ".seg")) == 1 and c.stats["puts"] == 13
    assert segments(tmp_path) == [whole]
    bufs = [bytearray(n) for n in lengths]
    assert c.read_into(fps, [memoryview(b) for b in bufs]) == [True] * 13 and b"".join(bufs) == whole
    # The short last chunk's slot was the segment's end: it shrank to fit.
    assert c.describe()["bytes"] == len(whole) + 13 * RECORD.size
    # The layout is what another process (or the next mount) finds.
    c.close()
    d = ChunkCache(str(tmp_path), 1 << 30)
    assert [d.get(fp) for fp in fps] == [data for _, data in items]
    d.close()


def test_slots_given_back_fetches_that_failed_and_segments_that_fill(tmp_path, monkeypatch):
    """A slot whose fetch failed is given back: a hole if others follow it
    (never indexed, never served), the segment's end again if it was the
    last. Slots past the end of a full segment open the next one; a segment
    that went meanwhile (evicted) makes its slots' chunks plain appends."""
    c = ChunkCache(str(tmp_path), 16 << 20)  # 1 MiB segments: 16 chunks each
    assert c.segment_bytes == 1 << 20
    items = chunks(40, seed=23)
    fps = [fp for fp, _ in items]
    slots = [c.reserve() for _ in items]
    slots[5].abandon()
    slots[5].abandon()  # idempotent
    for k in reversed(range(40)):
        if k != 5:
            slots[k].write(*items[k])
    assert c.stats["unused_slots"] == 1 and len(files(tmp_path, ".seg")) == 3
    assert c.get(fps[5]) is None and not c.has_indexed(fps[5])

    def body(a, b):
        return b"".join(d for _, d in items[a:b])

    hole = bytes(CHUNK_SIZE)  # never written: reads as zeros, takes no disk blocks
    assert segments(tmp_path) == [body(0, 5) + hole + body(6, 16), body(16, 32), body(32, 40)]
    # The last slot given back: the segment ends where it did.
    before = c.describe()["bytes"]
    c.reserve().abandon()
    assert c.describe()["bytes"] == before
    # A slot whose segment another process evicts before the bytes come:
    # the chunk is appended to a new segment instead.
    late = chunks(2, seed=24)
    slot = c.reserve()
    other = ChunkCache(str(tmp_path), 1 << 20)  # at most one segment: every other goes
    other.put(*late[1])
    assert len(files(tmp_path, ".seg")) == 1
    monkeypatch.setattr(segments_mod, "RESCAN_INTERVAL_S", 0.0)
    assert c.get(chunks(1, seed=25)[0][0]) is None  # a miss: c rescans ...
    assert not c.has_indexed(fps[0])  # ... and drops its segments, gone
    slot.write(*late[0])
    assert c.get(late[0][0]) == late[0][1] and c.get(late[1][0]) == late[1][1]
    assert len(files(tmp_path, ".seg")) == 2
    other.close()
    c.close()


def test_a_damaged_chunk_in_a_run_is_dropped_alone(tmp_path):
    """A byte flipped on disk inside a run of chunks read with one system
    call: that chunk is a miss, dropped from the index (logged); the chunks
    around it in the same read are served."""
    items = chunks(6, seed=26)
    fps = [fp for fp, _ in items]
    c = ChunkCache(str(tmp_path), 1 << 30)
    for fp, data in items:
        c.reserve().write(fp, data)
    seg = os.path.join(segdir(tmp_path), files(tmp_path, ".seg")[0])
    with open(seg, "r+b") as f:  # another writer than the cache: a bad disk, a stray tool
        f.seek(2 * CHUNK_SIZE + 5)
        b = f.read(1)
        f.seek(2 * CHUNK_SIZE + 5)
        f.write(bytes([b[0] ^ 0x01]))
    bufs = [bytearray(CHUNK_SIZE) for _ in items]
    assert c.read_into(fps, [memoryview(b) for b in bufs]) == [True, True, False, True, True, True]
    assert [bytes(b) for k, b in enumerate(bufs) if k != 2] == [d for k, (_, d) in enumerate(items) if k != 2]
    assert c.stats["corrupt"] == 1 and not c.has_indexed(fps[2])
    c.close()


def test_manifest_cache_keeps_the_disk_reserve(small_fs):
    """The manifest cache shares cache_dir's disk with the chunk cache and
    stops short of the same reserve: with the disk filled to just past the
    reserve by another file, a blob is not kept (counted as skipped) and
    reads answer "not cached"; once room is back, it is kept and read."""
    from verneuil_fuse.reader.segments import disk_room
    from verneuil_fuse.reader.manifests import WRITE_SLACK_BYTES, Cached, ManifestCache

    mc = ManifestCache(str(small_fs), "store")
    entry = Cached(size=3, mtime=1.0, fetched_at=2.0, version="ab", blob=os.urandom(64 << 10))
    filler = small_fs / "filler"
    with open(filler, "wb") as f:
        f.write(bytes(max(0, disk_room(str(small_fs)) - WRITE_SLACK_BYTES)))
    try:
        assert disk_room(str(small_fs)) < len(entry.blob) + WRITE_SLACK_BYTES
        mc.put("k", entry)
        assert mc.get("k") is None and mc.stats()["skipped"] == 1
        assert disk_room(str(small_fs)) > 0  # the reserve is still free
        filler.unlink()
        mc.put("k", entry)
        assert mc.get("k") == entry and mc.stats()["skipped"] == 1
    finally:
        mc.close()


def test_memory_lru_counts_a_run_buffer_once_while_any_of_its_chunks_is_held():
    """Chunks that are views of one run buffer (`chunk_engine.RUN_BUFFER_PARTS`)
    keep all of it alive: the memory LRU counts the buffer, once, while any
    of them is held, and evicts until what it holds fits."""
    from verneuil_fuse.reader.cache import MemoryLRU

    run_a = bytes(8 * CHUNK_SIZE)
    run_b = bytes(8 * CHUNK_SIZE)
    lru = MemoryLRU(12 * CHUNK_SIZE)
    views = [memoryview(run_a)[k * CHUNK_SIZE:(k + 1) * CHUNK_SIZE] for k in range(8)]
    for k, view in enumerate(views):
        lru.put(fingerprint(b"a%d" % k), view)
    assert lru.size == 8 * CHUNK_SIZE and len(lru._items) == 8
    lru.put(fingerprint(b"small"), b"x" * 1000)
    assert lru.size == 8 * CHUNK_SIZE + 1000
    lru.put(fingerprint(b"a3"), views[3])  # the same chunk again: no second count
    assert lru.size == 8 * CHUNK_SIZE + 1000
    # A second buffer does not fit beside the first: entries go, oldest
    # first, until the first buffer's last chunk (a3, used again) has gone,
    # which is when its memory is free.
    lru.put(fingerprint(b"b0"), memoryview(run_b)[:CHUNK_SIZE])
    assert lru.size == 8 * CHUNK_SIZE
    assert lru.get(fingerprint(b"a0")) is None and lru.get(fingerprint(b"a3")) is None
    assert lru.get(fingerprint(b"small")) is None
    assert bytes(lru.get(fingerprint(b"b0"))) == bytes(CHUNK_SIZE)
    assert list(lru._bases.values()) == [1]
    # A buffer larger than the whole LRU is not kept at all.
    huge = bytes(13 * CHUNK_SIZE)
    lru.put(fingerprint(b"h"), memoryview(huge)[:10])
    assert lru.get(fingerprint(b"h")) is None and lru.size == 8 * CHUNK_SIZE


def test_a_segments_blocks_are_given_ahead_and_back(small_fs):
    """A segment of ours gets its disk blocks when it is made (its size
    still says what it holds), so that a program filling the disk meanwhile
    does not fail its writes; the blocks past what it holds are given back
    when its files are closed."""
    c = ChunkCache(str(small_fs), 1 << 30)
    fp, data = chunks(1)[0]
    c.put(fp, data)
    seg = c._active
    st = os.fstat(seg.fd)
    assert st.st_size == len(data) and st.st_blocks * 512 >= c.segment_bytes
    filler = fill(small_fs)
    try:
        more = chunks(4, seed=3)
        for f2, d2 in more:
            c.put(f2, d2)
        assert c.stats["write_pauses"] == 0
        assert all(c.get(f2) == d2 for f2, d2 in more)
    finally:
        os.unlink(filler)
    path = seg.seg_path
    c.close()
    st = os.stat(path)
    assert st.st_size == 5 * len(data) and st.st_blocks * 512 < st.st_size + (64 << 10)


def test_memory_lru_peek_leaves_the_order_as_it_is():
    """`peek` (a read in file order) does not make a chunk the most recently
    used: the chunks read ahead and not read yet, older, stay, and those
    read go first; `get` does make it so."""
    from verneuil_fuse.reader.cache import MemoryLRU

    lru = MemoryLRU(3 * 1000)
    a, b, c, d = (fingerprint(x) for x in (b"a", b"b", b"c", b"d"))
    for fp in (a, b, c):
        lru.put(fp, b"x" * 1000)
    assert lru.peek(a) == b"x" * 1000  # read by a scan: a goes first all the same
    lru.put(d, b"y" * 1000)
    assert lru.peek(a) is None and lru.peek(b) is not None
    assert lru.get(b) is not None  # read again at random: b stays, c goes
    lru.put(a, b"z" * 1000)
    assert lru.peek(c) is None and lru.peek(b) is not None and lru.peek(d) is not None
