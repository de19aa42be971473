"""A hostile or damaged store never takes a mount down (docs/GUARANTEES.md).

One real mount of a directory store that holds, beside good databases, every
kind of hostile object a writer of the store could plant: times past what
the kernel can hold, a zstd manifest declaring 25 million chunks, a zstd bomb,
a 6 GB object as a manifest, a chunk of a valid frame plus 6 GB of trailing
bytes, a chunk list that contradicts the length, a length no chunk list can
match, and two thousand tiny manifests; and in the packed layout, a pack cut
short, a chunk's range that holds another chunk, and a layout past its
bounds. The mount must start in its usual time, read the good databases
(of both layouts) byte-exact, skip or fail (EREMOTEIO, never a short read)
each hostile one, and stay under its memory bound throughout.

Big objects are sparse files: the test costs little disk.
"""
from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import time

import pytest
import zstandard

from support.replicas import HOST, Mount, fuse_unavailable, make_db, publish, wait_for
from verneuil_fuse.format import (
    CHUNK_SIZE,
    MAX_PACK_BYTES,
    ZERO_CHUNK_FPRINT,
    chunk_source,
    compress_chunk,
    compress_manifest,
    encode_manifest,
    manifest_name,
    manifest_pb2,
    snapshot_of,
)
from verneuil_fuse.format.umash import CHUNK_KEY, DIRECTORY_KEY, HEADER_KEY, fingerprint
from verneuil_fuse.reader.tree import SETTLE_SECONDS
from verneuil_fuse.store import open_store

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(300)]
if fuse_unavailable():
    pytestmark.append(pytest.mark.skip(reason=fuse_unavailable()))

# The mount's peak resident memory through the whole test, with the default
# cache settings (docs/READER.md, "Bounds").
PEAK_RSS_BOUND = 300 << 20
# A mount of a few good databases starts in well under this (the poll of the
# 2,000 tiny manifests included).
START_BOUND_S = 60.0
BIG = 6 << 30  # the size of the oversized (sparse) objects


def _words_manifest(path_key_store, key: str, n_chunks: int, length: int, *, chunk_pair: bytes,
                    header: bytes = bytes(100)) -> None:
    """Store a zstd manifest of `n_chunks` identical chunk entries (the pair
    of little-endian words `chunk_pair`) with a correct contents_fprint, built
    as raw protobuf bytes so that the test never holds a Python list of
    millions of words."""
    words = chunk_pair * n_chunks
    top = manifest_pb2.Manifest()
    v1 = top.v1
    v1.header_fprint.major, v1.header_fprint.minor = fingerprint(header, HEADER_KEY)
    v1.contents_fprint.major, v1.contents_fprint.minor = fingerprint(words, DIRECTORY_KEY)
    v1.len = length
    v1.generated_by = b"hostile"
    # ManifestV1 is field 1 of Manifest: re-frame it with the packed field 15.
    inner = top.v1.SerializeToString() + _varint(15 << 3 | 2) + _varint(len(words)) + words
    raw = _varint(1 << 3 | 2) + _varint(len(inner)) + inner
    cctx = zstandard.ZstdCompressor(level=3)
    path_key_store.manifests.put(key, cctx.compress(raw))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _fp_words(fp) -> bytes:
    return fp.major.to_bytes(8, "little") + fp.minor.to_bytes(8, "little")


def _peak_rss(pid: int) -> int:
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM for pid %d" % pid)


class Hostile:
    """The store, the good databases' bytes, and where each hostile entry is."""

    def __init__(self, root: str):
        self.root = root
        self.store = open_store("file://%s/store" % root)
        self.good: dict[str, bytes] = {}
        self.skipped: list[str] = []  # manifest keys the mount must skip

    def path_of(self, backend, key: str) -> str:
        return os.path.join(backend.root, key)

    def add_good(self, name: str, rows: int, packed: int = 0, **kw) -> None:
        src = os.path.join(self.root, name)
        make_db(src, rows, seed=rows, **kw)
        data = open(src, "rb").read()
        publish(self.store, data, "/good/" + name, packed=packed)
        self.good["/%s/good/%s" % (HOST, name)] = data

    def add_skipped(self, name: str) -> str:
        key = manifest_name("/bad/" + name, HOST)
        self.skipped.append(key)
        return key


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hostile"))
    h = Hostile(root)
    h.add_good("a.db", 3000)
    h.add_good("b.db", 800, page_size=65536, payload=3000)
    h.add_good("c-packed.db", 2500, packed=256 << 10)

    # 1. Times the kernel cannot hold: shown with the listed mtime instead.
    for name, ctime, ctime_ns in (("future.db", 2**63 - 1, 2**31 - 1), ("past.db", -(2**63), -(2**31))):
        data = os.urandom(2 * CHUNK_SIZE)
        pub = publish(h.store, data, "/times/" + name)
        m = pub.manifest
        m.ctime, m.ctime_ns = ctime, ctime_ns
        h.store.manifests.put(pub.key, compress_manifest(encode_manifest(m)))
        h.good["/%s/times/%s" % (HOST, name)] = data

    # 2. A 90 KB zstd manifest that declares 25 million zero chunks (1.5 TiB).
    n = 25_000_000
    _words_manifest(h.store, h.add_skipped("bomb.db"), n, n * CHUNK_SIZE,
                    chunk_pair=_fp_words(ZERO_CHUNK_FPRINT))
    # 3. A database one chunk over the default max_db_size (64 GiB).
    n = (64 << 30) // CHUNK_SIZE + 1
    _words_manifest(h.store, h.add_skipped("over.db"), n, n * CHUNK_SIZE,
                    chunk_pair=_fp_words(ZERO_CHUNK_FPRINT))
    # 4. A zstd bomb: a frame of 1 GiB of zeros (about 40 KB).
    cctx = zstandard.ZstdCompressor(level=3)
    co = cctx.compressobj()
    zeros = bytes(16 << 20)
    frame = b"".join(co.compress(zeros) for _ in range(64)) + co.flush()
    h.store.manifests.put(h.add_skipped("zstdbomb.db"), frame)
    # 5. A 6 GB object as a manifest (sparse).
    key = h.add_skipped("huge-object.db")
    h.store.manifests.put(key, b"\0")
    os.truncate(h.path_of(h.store.manifests, key), BIG)
    # 6. A length no chunk list of the manifest can match.
    data = os.urandom(CHUNK_SIZE)
    m, _ = snapshot_of(data)
    m.len = 2**64 - 1
    h.store.manifests.put(h.add_skipped("huge-len.db"), compress_manifest(encode_manifest(m)))

    # 7. A chunk of a valid zstd frame plus 6 GB of trailing bytes.
    data = os.urandom(3 * CHUNK_SIZE)
    pub = publish(h.store, data, "/bad/trailing.db")
    fp = pub.manifest.chunks[1]
    path = h.path_of(h.store.chunks, fp.name)
    with open(path, "wb") as f:
        f.write(compress_chunk(data[CHUNK_SIZE:2 * CHUNK_SIZE]))
    os.truncate(path, BIG)
    h.trailing = ("/%s/bad/trailing.db" % HOST, data)

    # 8. A chunk list that contradicts the length: chunk 1 names a 16 KiB chunk.
    data = os.urandom(3 * CHUNK_SIZE)
    m, chunks = snapshot_of(data)
    small = os.urandom(16 << 10)
    small_fp = fingerprint(small, CHUNK_KEY)
    h.store.chunks.put(small_fp.name, compress_chunk(small))
    for fp, raw in chunks.items():
        h.store.chunks.put(fp.name, compress_chunk(raw))
    lying = list(m.chunks)
    lying[1] = small_fp
    m.chunks = lying
    from verneuil_fuse.format import contents_fprint_of
    m.contents_fprint = contents_fprint_of(lying)
    h.store.manifests.put(manifest_name("/bad/lying.db", HOST), compress_manifest(encode_manifest(m)))
    h.lying = ("/%s/bad/lying.db" % HOST, data)

    # 9. The packed layout, one chunk per pack: chunk 1's pack cut short
    # before its end; chunk 1's range holding chunk 2's blob; and a layout
    # placing chunk 1 past the largest pack a reader accepts (skipped).
    h.packed_bad = []
    for name in ("cut-pack.db", "wrong-range.db", "past-bound.db"):
        data = os.urandom(3 * CHUNK_SIZE)
        pub = publish(h.store, data, "/bad/" + name, packed=1)
        one, two = chunk_source(pub.manifest, 1), chunk_source(pub.manifest, 2)
        m = pub.manifest
        if name == "cut-pack.db":
            h.store.chunks.put(one.key, h.store.chunks.get(one.key)[:one.end - 1])
            h.packed_bad.append(("/%s/bad/%s" % (HOST, name), data))
            continue
        at = 3  # chunk 1's three words: pack, offset, length
        if name == "wrong-range.db":
            m.layout.locations[at:at + 3] = m.layout.locations[2 * at:2 * at + 3]
            h.packed_bad.append(("/%s/bad/%s" % (HOST, name), data))
            key = pub.key
        else:
            m.layout.locations[at + 1] = MAX_PACK_BYTES - 10
            key = h.add_skipped(name)
        h.store.manifests.put(key, compress_manifest(encode_manifest(m)))
        assert two.key != one.key

    # 10. Two thousand tiny manifests: 1,500 that are not manifests at all,
    # 500 valid one-chunk databases.
    for i in range(1500):
        h.store.manifests.put(manifest_name("/junk/%04d.db" % i, HOST), os.urandom(12))
    tiny = b"SQLite format 3\0" + bytes(500)
    tm, _ = snapshot_of(tiny)
    blob = compress_manifest(encode_manifest(tm))
    for i in range(500):
        h.store.manifests.put(manifest_name("/tiny/%03d.db" % i, HOST), blob)

    h.written_at = time.time()
    log_path = os.path.join(root, "mount.log")
    h.mount = Mount(h.store.url, os.path.join(root, "mnt"),
                    "cache_dir=%s,refresh=2,log_level=info,log_file=%s" % (os.path.join(root, "cache"), log_path))
    start = time.monotonic()
    h.mount.start(timeout=START_BOUND_S)
    h.start_s = time.monotonic() - start
    h.pid = h.mount.stats()["mount"]["pid"]
    h.log_path = log_path
    try:
        yield h
    finally:
        h.mount.stop()
        h.store.close()


def test_mount_starts_in_time_and_serves_the_good_databases(hostile):
    h = hostile
    print("mount of the hostile store ready in %.1fs" % h.start_s)
    assert h.start_s < START_BOUND_S
    for where, data in h.good.items():
        with open(h.mount.path(where), "rb") as f:
            assert f.read() == data, where
    for where in ("/%s/good/a.db" % HOST, "/%s/good/b.db" % HOST):
        out = subprocess.run(["sqlite3", "-readonly", "file:%s?immutable=1" % h.mount.path(where),
                              "SELECT count(*), sum(length(v)) FROM t"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        con = sqlite3.connect(":memory:")
        con.deserialize(h.good[where])
        want = con.execute("SELECT count(*), sum(length(v)) FROM t").fetchone()
        assert out.stdout.strip() == "%d|%d" % want


def stat_every_listed_file(h) -> set[str]:
    """What `ls -l` does in every directory: list, then stat each name (which
    reads its manifest). Returns the names whose manifest turned out not to
    be valid (listed by name, then ENOENT)."""
    gone = set()
    for d in ("times", "good", "bad", "junk", "tiny"):
        top = h.mount.path(HOST, d)
        if not os.path.isdir(top):
            continue
        for name in os.listdir(top):
            try:
                os.stat(os.path.join(top, name))
            except FileNotFoundError:
                gone.add("/%s/%s" % (d, name))
    return gone


def test_times_out_of_range_are_clamped_and_ls_works(hostile):
    h = hostile
    gone = stat_every_listed_file(h)
    # Only the hostile manifests and the junk, read at their first stat,
    # turn out not to be databases.
    skipped_paths = {"/bad/" + k.rsplit("%2F", 1)[-1] for k in h.skipped}
    assert {g for g in gone if not g.startswith("/junk/")} <= skipped_paths
    out = subprocess.run(["ls", "-l", h.mount.path(HOST, "times")], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    now = time.time()
    for name in ("future.db", "past.db"):
        st = os.stat(h.mount.path(HOST, "times", name))
        # The listed mtime of the manifest blob, not the manifest's ctime.
        assert now - 3600 < st.st_mtime < now + 60, (name, st.st_mtime)
    assert h.mount.stats()["mount"]["handler_errors"] == 0


def test_hostile_manifests_are_skipped_with_a_log_line(hostile):
    h = hostile
    # Once every blob is older than the catalog's settling time (a blob read
    # while it may still change within its mtime's second is read again at
    # its next lookup), every name is looked up, which reads its manifest.
    time.sleep(max(0.0, h.written_at + SETTLE_SECONDS + 1 - time.time()))
    polls = h.mount.stats()["refresh"]["polls"]
    wait_for(lambda: h.mount.stats()["refresh"]["polls"] >= polls + 1, 20, "a poll past the settling time")
    stat_every_listed_file(h)
    stats = h.mount.stats()
    bad = set(stats["refresh"]["bad_manifests"])
    for key in h.skipped:
        assert key in bad, key
        assert key in open(h.log_path).read(), key
    for name in ("bomb.db", "over.db", "zstdbomb.db", "huge-object.db", "huge-len.db", "past-bound.db"):
        assert not os.path.exists(h.mount.path(HOST, "bad", name)), name
    assert len(os.listdir(h.mount.path(HOST, "tiny"))) == 500
    assert not os.path.exists(h.mount.path(HOST, "junk"))
    assert stats["fetch"]["too_large"] >= 1  # the 6 GB object was never read
    # No poll fetches any manifest again, the hostile ones included, and
    # they stay out of the tree.
    gets = h.mount.stats()["fetch"]["manifest_gets"]
    polls = h.mount.stats()["refresh"]["polls"]
    wait_for(lambda: h.mount.stats()["refresh"]["polls"] >= polls + 2, 20, "two more polls")
    assert h.mount.stats()["fetch"]["manifest_gets"] == gets
    assert not os.path.exists(h.mount.path(HOST, "junk"))
    assert not os.path.exists(h.mount.path(HOST, "bad", "bomb.db"))


def test_oversized_chunk_and_lying_chunk_list_are_errors_not_short_reads(hostile):
    h = hostile
    for where, data in [h.trailing, h.lying] + h.packed_bad:
        fd = os.open(h.mount.path(where), os.O_RDONLY)
        try:
            assert os.fstat(fd).st_size == len(data)
            assert os.pread(fd, CHUNK_SIZE, 0) == data[:CHUNK_SIZE]  # bundled chunk 0
            start = time.monotonic()
            with pytest.raises(OSError) as err:
                os.pread(fd, CHUNK_SIZE, CHUNK_SIZE)
            assert err.value.errno == errno.EREMOTEIO, where
            assert time.monotonic() - start < 20  # refused by size or length, not a 30 s deadline
            assert os.pread(fd, CHUNK_SIZE, 2 * CHUNK_SIZE) == data[2 * CHUNK_SIZE:]
        finally:
            os.close(fd)
    log = open(h.log_path).read()
    assert "where the manifest's length needs" in log


def test_peak_memory_stays_bounded_and_the_mount_lives(hostile):
    """Runs last in this module: the peak covers every test above."""
    h = hostile
    stats = h.mount.stats()
    assert stats["mount"]["handler_errors"] == 0
    peak = _peak_rss(h.pid)
    print("hostile store: mount peak RSS %.0f MiB (bound %d MiB)" % (peak / (1 << 20), PEAK_RSS_BOUND >> 20))
    assert peak < PEAK_RSS_BOUND
    assert "Traceback" not in open(h.log_path).read()
