"""Store faults: copiers, restore and the mount behind a fault-injecting proxy.

Every test puts `faultproxy.FaultProxy` between the product and moto's S3
server and checks the promises of docs/GUARANTEES.md:

- copiers survive 500/503/SlowDown, dropped connections (requests and
  responses), truncated and corrupted bodies, stalls and hangs; the store
  never holds a wrong blob (every stored chunk decodes against its name,
  every manifest version validates and restores to a real commit), and it
  converges to the last commit once the faults stop;
- retries are bounded: against a store that always fails, one pass makes a
  bounded number of HTTP requests and `flush` gives up at its deadline;
- `verneuilctl restore` writes the right file or none;
- mount reads return the right bytes or EREMOTEIO, never wrong bytes, a chunk that
  always fails costs a bounded number of GETs, and everything reads right
  (new versions too) once the faults stop.

Verification reads go straight to moto (`s3_server.admin` / `moto_endpoint`),
never through the proxy.
"""
from __future__ import annotations

import errno
import os
import random
import sqlite3
import time

import pytest

from support.faultproxy import KINDS, FaultProxy
from support.replicas import HOST, Mount, fuse_unavailable, make_db, publish, wait_for
from support.copier_support import Writer, counter_of, vfs_available
from verneuil_fuse.reader.polling import BAD_RETRY_S
from verneuil_fuse import format as fmt
from verneuil_fuse.reader.fetcher import FAILED_CHUNK_TTL
from verneuil_fuse.reader.landing import HOLD_SECONDS
from verneuil_fuse.copier import Backoff, Copier, start_background
from verneuil_fuse.store import StoreError, TransientError, open_store

pytestmark = [pytest.mark.s3, pytest.mark.timeout(240),
              pytest.mark.skipif(not vfs_available(), reason="writer_vfs is not built")]

WRITER_KIND = "vfs"  # the real writer (test_copier_e2e also runs the Python reference one)


class FaultEnv:
    """Fresh buckets on the session's moto server, a proxy in front, and two
    stores: `store` (through the proxy, short timeouts) and `direct`, both
    of `layout`."""

    def __init__(self, s3_server, tmp_path, *, read_timeout=1.0, max_attempts=3, stall=1.5,
                 layout="chunks"):
        self.server = s3_server
        self.admin = s3_server.admin
        self.layout = layout
        self.chunk_bucket = s3_server.new_bucket("chunks")
        self.manifest_bucket = s3_server.new_bucket("manifests", versioned=True)
        self.proxy = FaultProxy(s3_server.moto_endpoint, stall=stall)
        params = {"layout": layout} if layout != "chunks" else {}
        self.direct_url = s3_server.url(self.chunk_bucket, self.manifest_bucket, **params).replace(
            s3_server.endpoint, s3_server.moto_endpoint)
        self.url = self.direct_url.replace(s3_server.moto_endpoint, self.proxy.endpoint)
        self.store = open_store(self.url, read_timeout=read_timeout, connect_timeout=1.0,
                                max_attempts=max_attempts)
        self.direct = open_store(self.direct_url)
        self.spool = str(tmp_path / "spool")
        os.makedirs(self.spool)
        self.tmp = str(tmp_path)

    def direct_manifest(self, path: str, hostname: str = HOST) -> fmt.Manifest:
        """The current manifest of `hostname:path`, read straight from moto."""
        from verneuil_fuse.readback import fetch_manifest
        return fetch_manifest(self.direct, fmt.manifest_name(path, hostname))

    def close(self):
        self.proxy.close()
        self.store.close()
        self.direct.close()


# Store layouts the copier, restore and mount fault tests run in: Verneuil's
# and the packed one (docs/FORMAT.md, "Packed layout").
LAYOUTS = ["chunks", "packed"]


@pytest.fixture
def fenv(s3_server, tmp_path, request):
    if not s3_server.running:
        s3_server.start()
    e = FaultEnv(s3_server, tmp_path, layout=getattr(request, "param", "chunks"))
    try:
        yield e
    finally:
        e.close()


# ----------------------------------------------------------------- store checks

def list_chunk_keys(admin, bucket: str) -> list[str]:
    keys, token = [], None
    while True:
        kw = {"Bucket": bucket}
        if token:
            kw["ContinuationToken"] = token
        page = admin.list_objects_v2(**kw)
        keys += [o["Key"] for o in page.get("Contents", ())]
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated"):
            return keys


def list_manifest_versions(admin, bucket: str) -> list[tuple[str, str, object]]:
    """(key, version id, last modified) of every manifest version, oldest first per key."""
    out, kw = [], {"Bucket": bucket}
    while True:
        page = admin.list_object_versions(**kw)
        out += [(v["Key"], v["VersionId"], v["LastModified"]) for v in page.get("Versions", ())]
        if not page.get("IsTruncated"):
            break
        kw = {"Bucket": bucket, "KeyMarker": page["NextKeyMarker"],
              "VersionIdMarker": page["NextVersionIdMarker"]}
    # S3 lists the versions of one key newest first.
    return list(reversed(out))


class BucketView:
    """Verified, cached chunk reads straight from moto (restores many
    versions), in either layout: a chunk object, or its range of a pack."""

    def __init__(self, admin, chunk_bucket: str):
        self.admin = admin
        self.bucket = chunk_bucket
        self.cache: dict[fmt.Fprint, bytes] = {}

    def chunk(self, fp: fmt.Fprint, source: fmt.ChunkSource | None = None) -> bytes:
        if fp == fmt.ZERO_CHUNK_FPRINT:
            return bytes(fmt.CHUNK_SIZE)
        if fp not in self.cache:
            source = source or fmt.ChunkSource(fp.name)
            extra = {"Range": "bytes=%d-%d" % (source.start, source.end - 1)} if source.ranged else {}
            blob = self.admin.get_object(Bucket=self.bucket, Key=source.key, **extra)["Body"].read()
            self.cache[fp] = fmt.decode_chunk(blob, fp)
        return self.cache[fp]

    def restore(self, m: fmt.Manifest) -> bytes:
        out = bytearray()
        for i, fp in enumerate(m.chunks):
            data = m.bundled[i] if i in m.bundled else self.chunk(fp, fmt.chunk_source(m, i))
            out += data[: m.chunk_length(i)] if fp == fmt.ZERO_CHUNK_FPRINT else data
        assert len(out) == m.len
        return bytes(out)


def verify_store(admin, chunk_bucket: str, manifest_bucket: str):
    """Nothing wrong is stored: every chunk blob decodes against its name,
    every manifest version validates and every chunk it names is there.
    Returns [(key, version id, restored bytes)] oldest first, and the view."""
    view = BucketView(admin, chunk_bucket)
    for key in list_chunk_keys(admin, chunk_bucket):
        packed = fmt.parse_pack_key(key)
        if packed is not None:  # a pack is named after its bytes
            pack = admin.get_object(Bucket=chunk_bucket, Key=key)["Body"].read()
            assert fmt.fingerprint(pack) == packed[1], key
            continue
        fp = fmt.parse_chunk_name(key)  # else only chunk names in the chunk bucket
        view.chunk(fp)                  # ChunkError if the bytes are wrong
    restored = []
    for key, vid, _ in list_manifest_versions(admin, manifest_bucket):
        assert fmt.parse_manifest_name(key) is not None, key
        blob = admin.get_object(Bucket=manifest_bucket, Key=key, VersionId=vid)["Body"].read()
        m = fmt.decode_and_validate(blob, fetch_chunk=view.chunk)
        restored.append((key, vid, view.restore(m)))
    return restored, view


ALL_FAULTS = [k for k in KINDS]


# ----------------------------------------------------------------------- copier

@pytest.mark.parametrize("fenv", LAYOUTS, indirect=True)
def test_copier_converges_through_faults(fenv):
    """Writes go on while a third of all requests fail in every way the proxy
    knows; afterwards every stored object is right, and once the faults stop
    the store reaches the last commit."""
    w = Writer(WRITER_KIND, fenv.spool, os.path.join(fenv.tmp, "app.db"), payload=20000)
    # Unpaced, chunk PUTs go on the store's engine first; those that fail
    # are put again through the copier's retries.
    on_engine = {"stored": 0, "failed": 0}
    put_async = fenv.store.chunks.put_async

    def counted(key, data, done):
        def answer(error):
            on_engine["failed" if error is not None else "stored"] += 1
            done(error)
        return put_async(key, data, answer)

    fenv.store.chunks.put_async = counted
    fenv.proxy.set_faults(0.3, ALL_FAULTS, seed=11)
    bg = start_background(fenv.spool, fenv.store, rate=0, poll_interval=0.05,
                          backoff=Backoff(base=0.02, cap=0.5, attempts=6))
    try:
        rng = random.Random(3)
        for _ in range(40):
            n = w.bump()
            time.sleep(rng.uniform(0, 0.08))
        time.sleep(2.0)  # more passes under fire
        faulted = fenv.proxy.count(faulted=True)
        fenv.proxy.clear()
        assert wait_for(lambda: _store_counter(fenv) == n, 40, "the store to reach commit %d" % n,
                        interval=0.2)
    finally:
        bg.stop()
        fenv.proxy.clear()
    stats = bg.stats
    total = fenv.proxy.count()
    # The faults really happened (the packed layout sends one PUT for many
    # chunks: a few dozen requests in all, so fewer of them fail).
    assert faulted >= (10 if fenv.layout == "chunks" else 5), faulted
    if fenv.layout == "chunks":
        assert on_engine["stored"] > 0 and on_engine["failed"] > 0, on_engine
    else:  # packs go through the copier's retries, one PUT each
        assert stats.packs_uploaded > 0 and stats.chunks_uploaded > stats.packs_uploaded, stats
    # Retries are bounded: botocore makes at most 3 attempts per copier request.
    assert total <= 3 * stats.requests + 5, (total, stats.requests)
    # Nothing wrong stored: every blob verifies, every version is a real commit.
    restored, _ = verify_store(fenv.admin, fenv.chunk_bucket, fenv.manifest_bucket)
    assert restored, "no manifest stored"
    counters = [counter_of(data, fenv.tmp) for key, _, data in restored if key == w.name]
    assert counters and counters[-1] == n
    assert counters == sorted(counters), counters
    print("faults: %d requests (%d faulted), %d copier requests, %d versions"
          % (total, faulted, stats.requests, len(counters)))
    w.close()


def _store_counter(fenv):
    try:
        restored, _ = _latest(fenv)
    except Exception:  # noqa: BLE001 - not there yet
        return None
    return counter_of(restored, fenv.tmp) if restored else None


def _latest(fenv):
    from verneuil_fuse.readback import fetch_manifest, restore_bytes
    names = [o.key for o in fenv.direct.manifests.list()]
    if not names:
        return None, None
    m = fetch_manifest(fenv.direct, names[0])
    return restore_bytes(fenv.direct, m), m


@pytest.mark.parametrize("fenv", LAYOUTS, indirect=True)
def test_copier_retries_are_bounded(fenv):
    """Against a store that always fails, one pass makes a bounded number of
    requests and raises; flush gives up at its deadline; a hung store costs
    bounded time; once the store is back, one flush completes the upload."""
    w = Writer(WRITER_KIND, fenv.spool, os.path.join(fenv.tmp, "app.db"), payload=30000)
    for _ in range(10):
        w.bump()
    db_chunks = -(-len(w.data()) // fmt.CHUNK_SIZE)
    backoff = Backoff(base=0.01, cap=0.05, attempts=6)
    c = Copier(fenv.spool, fenv.store, rate=0, backoff=backoff, lock_timeout=1)
    try:
        fenv.proxy.set_faults(1.0, ["503", "slowdown", "500"], seed=1)
        start = time.monotonic()
        with pytest.raises(TransientError):
            c.run_once()
        # Each object: one PUT on the engine (unpaced chunks), then at most
        # 6 copier attempts x 3 botocore attempts.
        objects = db_chunks + 1
        assert fenv.proxy.count() <= (1 + 6 * 3) * objects, (fenv.proxy.count(), objects)
        assert c.stats.requests <= (1 + 6) * objects
        assert time.monotonic() - start < 30
        fenv.proxy.reset_counts()
        start = time.monotonic()
        with pytest.raises((TransientError, TimeoutError)):
            c.flush(timeout=2.0)
        elapsed = time.monotonic() - start
        assert elapsed < 10, elapsed
        # A hung store: every request waits for the read timeout (1 s), and
        # still the pass ends in bounded time.
        fenv.proxy.set_faults(1.0, ["hang"], seed=2)
        hung = Copier(fenv.spool, open_store(fenv.url, read_timeout=0.5, max_attempts=1),
                      rate=0, backoff=Backoff(base=0.01, cap=0.05, attempts=2), workers=8)
        start = time.monotonic()
        with pytest.raises(TransientError):
            hung.run_once()
        assert time.monotonic() - start < 20
        hung.store.close()
        hung.close()
        assert not list(fenv.direct.manifests.list())  # nothing landed
        fenv.proxy.clear()
        c.flush(timeout=30)
        data, _ = _latest(fenv)
        assert data == w.data()
        verify_store(fenv.admin, fenv.chunk_bucket, fenv.manifest_bucket)
    finally:
        fenv.proxy.clear()
        c.close()
        w.close()


@pytest.mark.parametrize("fenv", LAYOUTS, indirect=True)
def test_restore_writes_the_right_file_or_none(fenv):
    """`verneuilctl restore` through truncated/corrupted/dropped answers:
    exit 0 with the exact bytes, or a failure with no file written."""
    from verneuil_fuse import cli

    src = os.path.join(fenv.tmp, "src.db")
    make_db(src, 3000, seed=5)
    data = open(src, "rb").read()
    # Raw chunks (readers accept both): a corrupted body keeps its length,
    # so only the fingerprint check can notice.  Packed: range reads of packs.
    pub = publish(fenv.direct, data, "/data/src.db", compress=False, packed=_pack_size(fenv))
    outcomes = {"ok": 0, "failed": 0}
    for i in range(12):
        fenv.proxy.set_faults(0.25, ["short_body", "corrupt", "cut_body", "500", "reset"], seed=i)
        out = os.path.join(fenv.tmp, "out%d.db" % i)
        code = cli.main(["-q", "restore", "--store", fenv.url, "-m", pub.key, "-o", out])
        if code == 0:
            assert open(out, "rb").read() == data
            outcomes["ok"] += 1
        else:
            assert code == 1
            assert not os.path.exists(out)
            assert not [n for n in os.listdir(fenv.tmp) if n.startswith(".out%d" % i)]
            outcomes["failed"] += 1
    fenv.proxy.clear()
    assert outcomes["ok"] >= 1, outcomes
    print("restore under faults:", outcomes)


def _pack_size(fenv) -> int:
    """`publish`'s `packed`: 0 in Verneuil's layout; packs of 256 KiB in the
    packed one (a few per database, so that reads cross packs)."""
    return 256 << 10 if fenv.layout == "packed" else 0


# ------------------------------------------------------------------------ mount

fuse_skip = pytest.mark.skipif(bool(fuse_unavailable()), reason=str(fuse_unavailable()))


def _fresh_pread(fd: int, size: int, off: int) -> bytes:
    """pread that goes to the filesystem (drops the page cache first)."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return os.pread(fd, size, off)


@fuse_skip
@pytest.mark.fuse
@pytest.mark.slow
@pytest.mark.parametrize("fenv", LAYOUTS, indirect=True)
def test_mount_right_bytes_or_eio_and_converges(fenv):
    """Random reads under every fault: right bytes or EREMOTEIO, never wrong bytes;
    a chunk that always fails costs a bounded number of GETs; after the
    faults stop every byte reads right and a version published meanwhile
    shows up."""
    sources = {}
    for name, rows, seed in (("a.db", 4000, 1), ("b.db", 2500, 2)):
        src = os.path.join(fenv.tmp, name)
        make_db(src, rows, seed=seed)
        data = open(src, "rb").read()
        publish(fenv.direct, data, "/data/" + name, packed=_pack_size(fenv))
        sources["/%s/data/%s" % (HOST, name)] = data
    retries = 2
    log_path = os.path.join(fenv.tmp, "mount.log")
    m = Mount(fenv.url, os.path.join(fenv.tmp, "mnt"),
              "cache_size=0,mem_cache=0,readahead=off,btree_prefetch=off,refresh=0.5,"
              "retries=%d,timeout=2,log_level=info,log_file=%s" % (retries, log_path))
    m.start()
    try:
        fds = {w: os.open(m.path(w), os.O_RDONLY) for w in sources}
        # 1. Random reads under random faults: first mostly wrong bodies
        # (answered 200: only verification notices; often enough that some
        # reads exhaust their retries), then every kind, stalls included.
        fenv.proxy.set_faults(0.7, ["short_body", "corrupt", "cut_body"], seed=5,
                              match=lambda r: r.method == "GET")
        rng = random.Random(9)
        ok = eio = partial = 0
        start = time.monotonic()
        mixed = False
        seconds = 10 if fenv.layout == "chunks" else 5  # the packed variant: shorter, for CI
        while time.monotonic() < start + seconds:
            if not mixed and time.monotonic() > start + 0.4 * seconds:
                mixed = True
                fenv.proxy.set_faults(0.35, ALL_FAULTS, seed=7, match=lambda r: r.method == "GET")
            w = rng.choice(list(sources))
            data = sources[w]
            off = rng.randrange(fmt.CHUNK_SIZE, len(data))
            size = rng.choice((100, 4096, 65536, 150000))
            try:
                got = _fresh_pread(fds[w], size, off)
            except OSError as e:
                assert e.errno == errno.EREMOTEIO, e
                eio += 1
                continue
            want = data[off:off + size]
            if len(got) < len(want) and got == want[:len(got)]:
                # A later page failed: the kernel returns what it read
                # before it (a short read, as POSIX allows), right bytes.
                partial += 1
                continue
            if got != want:
                diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
                raise AssertionError("wrong bytes at %s [%d, +%d): got %d bytes, first difference at %s"
                                     % (w, off, size, len(got), diff))
            ok += 1
        faulted = fenv.proxy.count(faulted=True)
        assert faulted >= 10 and ok >= 10 and eio >= 1, (faulted, ok, eio)
        # 2. A chunk that always fails: EREMOTEIO after a bounded number of GETs.
        fenv.proxy.clear()
        w = "/%s/data/a.db" % HOST
        fp = fmt.snapshot_of(sources[w])[0].chunks[3]
        # Its object: a chunk object, or its pack (no other read asks for it).
        key = fmt.chunk_source(fenv.direct_manifest("/data/a.db"), 3).key
        fenv.proxy.reset_counts()
        fenv.proxy.set_faults(1.0, ["503", "reset", "short_body"], seed=1,
                              match=lambda r: key in r.key)
        # A chunk read in part 1 is no longer held in memory, and one given
        # up on there no longer fails at once without a GET.
        time.sleep(max(HOLD_SECONDS, FAILED_CHUNK_TTL) + 0.5)
        start = time.monotonic()
        log_offset = os.path.getsize(log_path)
        with pytest.raises(OSError) as err:
            _fresh_pread(fds[w], 4096, 3 * fmt.CHUNK_SIZE + 10)
        assert err.value.errno == errno.EREMOTEIO
        gets = fenv.proxy.count(method="GET", path_contains=key)
        # The kernel may retry a failed read once (readahead, then the page
        # itself): each FUSE read gives up after retries+1 fetcher attempts
        # of at most 2 botocore attempts each.
        def log_tail():
            with open(log_path) as f:
                f.seek(log_offset)
                return f.read()

        give_ups = wait_for(lambda: log_tail().count("giving up on chunk %s" % fp.name),
                            5, "the give-up log line")
        assert give_ups <= 2, give_ups
        assert 1 <= gets <= (retries + 1) * 2 * give_ups, (gets, give_ups)
        assert time.monotonic() - start < 20
        # 3. A new version published while the store misbehaves.
        fenv.proxy.set_faults(0.5, ALL_FAULTS, seed=6)
        new = os.urandom(3 * fmt.CHUNK_SIZE + 100)
        publish(fenv.direct, new, "/data/b.db", packed=_pack_size(fenv))
        sources["/%s/data/b.db" % HOST] = new
        time.sleep(2)
        # 4. Faults stop: everything converges.
        fenv.proxy.clear()

        def sees_new():
            try:
                with open(m.path(HOST, "data", "b.db"), "rb") as f:
                    return f.read() == new
            except OSError:
                return False

        wait_for(sees_new, 30, "the new version of b.db")
        # A listing or a manifest damaged on the way may have taken a
        # database out of the tree for a while (polling.BAD_RETRY_S).
        wait_for(lambda: all(os.path.exists(m.path(w)) for w in sources), 2 * BAD_RETRY_S + 10,
                 "every database back in the tree")
        time.sleep(FAILED_CHUNK_TTL)  # chunks given up on are tried again after this
        for w, data in sources.items():
            with open(m.path(w), "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                assert f.read() == data, w
        for fd in fds.values():
            os.close(fd)
        assert "Traceback" not in open(log_path).read()
        print("mount under faults: %d right reads, %d short reads, %d EIO, %d faulted requests"
              % (ok, partial, eio, faulted))
    finally:
        fenv.proxy.clear()
        m.stop()


def _blob_db(path: str, rows: int, seed: int) -> None:
    """64 KiB pages (one page per chunk) and large blobs (overflow chains)."""
    rng = random.Random(seed)
    con = sqlite3.connect(path)
    con.execute("PRAGMA page_size=65536")
    con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, n INTEGER, b BLOB)")
    con.executemany("INSERT INTO t VALUES (?, ?, ?)",
                    [(i, rng.randrange(1000), rng.randbytes(rng.choice((300, 5000, 90000, 400000))))
                     for i in range(rows)])
    con.commit()
    con.close()


_QUERIES = (
    "SELECT count(*), sum(n), sum(length(b)) FROM t",
    "SELECT id, n, length(b), hex(substr(b, -16)) FROM t WHERE id = ?",
    "SELECT sum(length(b)), max(hex(substr(b, 1000, 8))) FROM t WHERE id BETWEEN ? AND ? + 10",
)


# How long SQLite queries the mount in each fault phase of the test below:
# some 50 queries each, enough for both right results and I/O errors.
PHASE_S = 4.0

@fuse_skip
@pytest.mark.fuse
@pytest.mark.slow
def test_sqlite_on_a_failing_store_gets_right_results_or_io_errors(fenv):
    """SQLite on the mount while the store fails, then stops answering: every
    query gives the source's result or "disk I/O error", never "malformed"
    and never a wrong result (a short read SQLite would zero-fill)."""
    src = os.path.join(fenv.tmp, "blobs.db")
    _blob_db(src, 120, seed=3)
    data = open(src, "rb").read()
    publish(fenv.direct, data, "/data/blobs.db")
    con = sqlite3.connect(src)
    rng = random.Random(11)
    plan = []
    for _ in range(400):
        q = rng.choice(_QUERIES)
        args = (rng.randrange(120),) if "?" in q else ()
        args = args * q.count("?")
        plan.append((q, args, con.execute(q, args).fetchall()))
    con.close()
    log_path = os.path.join(fenv.tmp, "mount.log")
    m = Mount(fenv.url, os.path.join(fenv.tmp, "mnt"),
              "cache_size=0,mem_cache=0,refresh=60,retries=1,timeout=1,deadline=2,"
              "log_level=info,log_file=%s" % log_path)
    m.start()
    path = m.path(HOST, "data", "blobs.db")
    uri = "file:%s?immutable=1" % path
    counts = {"right": 0, "io": 0}
    try:
        phases = [(0.25, ["500", "corrupt", "cut_body", "short_body", "reset"]), (0.3, ["hang"]), (1.0, ["hang"])]
        for at, (rate, kinds) in enumerate(phases):
            fenv.proxy.set_faults(rate, kinds, seed=at, match=lambda r: r.method == "GET")
            start = time.monotonic()
            while time.monotonic() < start + PHASE_S:
                q, args, want = plan[rng.randrange(len(plan))]
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # reads reach the mount
                os.close(fd)
                db = sqlite3.connect(uri, uri=True)
                try:
                    got = db.execute(q, args).fetchall()
                except sqlite3.OperationalError as e:
                    assert "disk I/O error" in str(e), e
                    counts["io"] += 1
                    continue
                finally:
                    db.close()
                assert got == want, (q, args)
                counts["right"] += 1
        stats = m.stats()
        assert stats["fetch"]["store"]["reachable"] is False
        assert "unreachable or failing" in open(log_path).read()
        fenv.proxy.clear()
        time.sleep(FAILED_CHUNK_TTL)  # chunks given up on are tried again after this
        db = sqlite3.connect(uri, uri=True)
        for q, args, want in plan[:50]:
            assert db.execute(q, args).fetchall() == want
        db.close()
        assert m.stats()["fetch"]["store"]["reachable"] is True
        print("sqlite on a failing store: %(right)d right results, %(io)d I/O errors" % counts)
        assert counts["right"] >= 5 and counts["io"] >= 3, counts
    finally:
        fenv.proxy.clear()
        m.stop()
