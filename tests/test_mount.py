"""Real FUSE mounts: one mount per store kind (a directory, and S3 through
moto's server), many checks on each; each store holds databases in both
layouts (Verneuil's, and packed: docs/FORMAT.md, "Packed layout"), read
alike without being told.

Every wait is bounded; teardown always unmounts (`fusermount3 -u -z`) and
ends the process it started, by PID.
"""
from __future__ import annotations

import errno
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from support.replicas import (
    HOST,
    Mount,
    fuse_unavailable,
    is_mounted,
    make_db,
    pid_alive,
    publish,
    replicate,
    stop_pid,
    unmount,
    wait_for,
)
from verneuil_fuse.format import CHUNK_SIZE, manifest_name

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(180)]
if fuse_unavailable():
    pytestmark.append(pytest.mark.skip(reason=fuse_unavailable()))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Packs of the packed databases: 256 KiB, so that a database has a few.
PACK = 256 << 10


class Env:
    """The store, the sources published into it, and the mount."""

    def __init__(self, root, store):
        self.root = str(root)
        self.store = store
        self.url = store.url  # what the mount is given: file:///... or s3://...?endpoint=...
        self.sources: dict[str, bytes] = {}  # path in the mount -> bytes
        self.mount: Mount | None = None

    def add_db(self, name: str, rows: int, *, host: str = HOST, seed: int = 0, **kw) -> str:
        path = os.path.join(self.root, "src", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        make_db(path, rows, seed=seed, **kw)
        return self.add_bytes(open(path, "rb").read(), "/data/" + name, host=host)

    def add_written_db(self, name: str, rows: int, *, seed: int = 0, **kw) -> str:
        """A database replicated for real by the C VFS and a copier
        (replicas.replicate)."""
        path = os.path.realpath(os.path.join(self.root, "src", name))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        make_db(path, rows, seed=seed, **kw)
        where = replicate(self.store, path, os.path.join(self.root, "spool"), timeout=60)
        with open(path, "rb") as f:
            self.sources[where] = f.read()
        return where

    def add_bytes(self, data: bytes, path: str, *, host: str = HOST, compress: bool = True,
                  packed: int = 0) -> str:
        publish(self.store, data, path, hostname=host, compress=compress, packed=packed)
        where = "/%s%s" % (host, path)
        self.sources[where] = data
        return where


# The replicas whose chunk 2 is damaged in the store (`env`).
DAMAGED = ("corrupt.db", "truncated.db", "missing.db")


@pytest.fixture(scope="module", params=["local", "s3"])
def env(request, tmp_path_factory):
    """One mount per store kind: every test here runs against a directory
    store and an S3 store (moto's server)."""
    root = tmp_path_factory.mktemp("mount-" + request.param)
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        if not server.running:  # a previous test left an outage behind
            server.start()
        store = server.make_store()
    else:
        from verneuil_fuse.store import open_store

        store = open_store("file://%s/store" % root)
    e = Env(root, store)
    e.add_db("big.db", 12000, seed=1)
    e.add_db("small.db", 300, seed=2)
    e.add_db("seq.db", 8000, seed=3, payload=300)
    e.add_db("point.db", 60000, seed=4, payload=100)
    e.add_db("x.db", 2000, host="other-host", seed=5)
    e.add_db("v.db", 3000, seed=6)
    e.add_db("gone.db", 100, seed=7)
    e.add_bytes(os.urandom(3 * CHUNK_SIZE + 17), "/data/raw.db", compress=False)  # chunks stored raw
    make_db(os.path.join(root, "packed-src.db"), 12000, seed=9)
    e.add_bytes(open(os.path.join(root, "packed-src.db"), "rb").read(), "/data/packed.db", packed=PACK)
    # Damaged replicas: one chunk corrupted, one cut short, one missing
    # (damaged packs: tests/test_mount_hostile.py).
    for name in DAMAGED:
        data = os.urandom(5 * CHUNK_SIZE)
        where = e.add_bytes(b"SQLite format 3\x00" + data[16:], "/data/" + name)
        pub_fp = _chunk_fp(e, where, 2)
        if name == "corrupt.db":
            e.store.chunks.put(pub_fp.name, os.urandom(CHUNK_SIZE))
        elif name == "truncated.db":
            e.store.chunks.put(pub_fp.name, e.store.chunks.get(pub_fp.name)[:CHUNK_SIZE // 2])
        else:
            e.store.chunks.delete(pub_fp.name)
    e.mount = Mount.under(e.root, e.url, "refresh=0.5,retries=1,timeout=5,metrics_port=0")
    try:
        with e.mount:
            yield e
    finally:
        e.store.close()


def _chunk_fp(e: Env, where: str, index: int):
    from verneuil_fuse.format import snapshot_of

    m, _ = snapshot_of(e.sources[where])
    return m.chunks[index]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_tree_and_attributes(env):
    m = env.mount
    assert sorted(os.listdir(m.mountpoint)) == [".verneuil", "other-host", HOST]
    for where in (m.mountpoint, m.path(HOST, "data")):
        out = subprocess.run(["ls", "-a1", where], capture_output=True, text=True, timeout=30)
        assert out.stdout.split()[:2] == [".", ".."], out
    listing = os.listdir(m.path(HOST, "data"))
    assert sorted(listing) == sorted(p.rsplit("/", 1)[1] for p in env.sources if p.startswith("/" + HOST))
    assert os.listdir(m.path(HOST, "data")) == listing  # stable order
    assert os.listdir(m.path("other-host", "data")) == ["x.db"]
    for where, data in env.sources.items():
        st = os.stat(m.path(where))
        assert st.st_size == len(data)
        assert abs(st.st_mtime - time.time()) < 600
        assert st.st_mode & 0o777 == 0o444
    assert os.stat(m.path(HOST, "data")).st_mode & 0o777 == 0o555
    with pytest.raises(FileNotFoundError):
        os.stat(m.path(HOST, "data", "nope.db"))


def test_bytes_equal_source(env):
    for where in ("/%s/data/big.db" % HOST, "/%s/data/small.db" % HOST, "/other-host/data/x.db",
                  "/%s/data/raw.db" % HOST, "/%s/data/packed.db" % HOST):
        assert _read(env.mount.path(where)) == env.sources[where]


@pytest.mark.parametrize("name", ["big.db", "packed.db"])
def test_sqlite_shell_and_python(env, name):
    path = env.mount.path(HOST, "data", name)
    out = subprocess.run(
        ["sqlite3", "file:%s?mode=ro" % path, "PRAGMA integrity_check; SELECT count(*) FROM t;"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "12000"]
    for uri in ("file:%s?mode=ro" % path, "file:%s?immutable=1" % path):
        con = sqlite3.connect(uri, uri=True)
        try:
            assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            assert con.execute("SELECT count(*) FROM t WHERE k < '8'").fetchone()[0] > 0
        finally:
            con.close()


def test_read_only(env):
    path = env.mount.path(HOST, "data", "small.db")
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC):
        with pytest.raises(OSError) as err:
            os.close(os.open(path, flags))
        assert err.value.errno in (errno.EROFS, errno.EACCES)
    with pytest.raises(OSError) as err:
        os.mkdir(env.mount.path(HOST, "newdir"))
    assert err.value.errno in (errno.EROFS, errno.EACCES)
    with pytest.raises(OSError) as err:
        os.unlink(path)
    assert err.value.errno in (errno.EROFS, errno.EACCES)


def test_stats(env):
    # Read something first, so that this test does not depend on the others
    # having read through this mount before it.
    big = "/%s/data/big.db" % HOST
    assert _read(env.mount.path(*big.strip("/").split("/"))) == env.sources[big]
    stats = env.mount.stats()
    assert stats["mount"]["pid"] == env.mount.proc.pid
    assert stats["fetch"]["gets"] > 0
    db = stats["databases"]["/%s/data/big.db" % HOST]
    assert db["len"] == len(env.sources["/%s/data/big.db" % HOST]) and len(db["version"]) == 32
    for key in ("mem_hits", "disk_hits", "disk_hits_inline", "prefetch_hits", "prefetch_waste", "get_bytes"):
        assert key in stats["fetch"]
    disk = stats["fetch"]["disk_cache"]
    assert disk["chunks"] > 0 and 0 < disk["bytes"] <= disk["limit"] and disk["puts"] > 0


def test_metrics_follow_the_stats_and_prometheus(env):
    """/.verneuil/metrics and the metrics_port endpoint serve the same
    series, which Debian's `promtool check metrics` accepts; every number of
    /.verneuil/stats is a series or listed as left out (metrics.MOUNT_SERIES);
    a counter read between two scrapes lies between them; a database's series
    carry its writer's host and source path; its counters of reads and opens
    go on across a new version instead of starting again at 0."""
    from support.metrics_check import parse, promtool_check, promtool_missing, scrape, unlisted
    from verneuil_fuse import metrics

    url = env.mount.stats()["mount"]["metrics_url"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics"), url

    def from_file() -> dict:
        with open(env.mount.path(".verneuil", "metrics"), "rb") as f:
            return parse(f.read())

    # Compressible bytes, and removed at the end: the tests after this one
    # count the store's databases, and one keeps its caches on a 2 MiB disk.
    where = env.add_bytes(bytes(range(256)) * (2 * CHUNK_SIZE // 256) + b"x" * 100, "/data/counted.db")
    labels = (("host", HOST), ("path", "/data/counted.db"))
    for _ in range(3):
        assert _read(env.mount.path(where)) == env.sources[where]
    before = from_file()
    stats = env.mount.stats()
    after = parse(scrape(url))
    assert unlisted(stats, metrics.MOUNT_SERIES, ("databases",)) == []
    by_path = {s.path: s for s in metrics.MOUNT_SERIES}
    checked = 0
    for top, value in stats.items():
        for item, sub in (value.items() if top == "databases" else [(None, value)]):
            key = metrics.database_labels(sub["key"]) if item else {}
            for path, number in metrics.numeric_leaves(sub, (top,)):
                series = by_path[".".join(path)]
                if series.kind == metrics.LEFT_OUT or (series.kind == metrics.TIMESTAMP and not number):
                    continue
                sample = (series.name, tuple(sorted(key.items())))
                assert sample in before and sample in after, sample
                if series.kind == metrics.COUNTER:
                    assert before[sample][1] <= number <= after[sample][1], series.name
                checked += 1
    assert checked > 60
    assert before["verneuil_database_size_bytes", labels][1] == len(env.sources[where])
    assert before["verneuil_database_opens_total", labels][1] == 3
    assert after["verneuil_fetch_gets_total", ()][1] > 0
    info = [k for k in before if k[0] == "verneuil_mount_info"]
    assert len(info) == 1 and ("mountpoint", env.mount.mountpoint) in info[0][1], info
    assert ("pid", str(env.mount.proc.pid)) in info[0][1]
    if promtool_missing() is None:
        with open(env.mount.path(".verneuil", "metrics"), "rb") as f:
            promtool_check(f.read())
        promtool_check(scrape(url))

    # A new version: the database's counters go on from where they were.
    reads = after["verneuil_database_reads_total", labels][1]
    new = b"y" * (3 * CHUNK_SIZE)
    env.add_bytes(new, "/data/counted.db")
    try:
        wait_for(lambda: _read(env.mount.path(where)) == new, 20, "the new version")
        now = parse(scrape(url))
        d = env.mount.stats()["databases"]["/%s/data/counted.db" % HOST]
        assert now["verneuil_database_size_bytes", labels][1] == d["len"] == len(new)
        # The total holds the old version's reads and the new one's (d["reads"]).
        assert d["since_mount"]["reads"] >= reads + d["reads"] > reads
        assert now["verneuil_database_reads_total", labels][1] >= reads + 1
        assert now["verneuil_database_opens_total", labels][1] >= 4
    finally:
        env.store.manifests.delete(manifest_name("/data/counted.db", HOST))
        del env.sources[where]


def test_owner_permissions_and_a_subtree(env):
    """A second mount of the store with uid=, gid=, umask= and subdir=: its
    root is the host's /data directory (the other host's databases are not
    there), every entry belongs to uid/gid 1000 with the umask's bits taken
    away; user 1000 reads a database, user 1001 is refused; a database
    published after the last poll opens at once by its name in the subtree;
    the metrics still label databases by their host and source path."""
    import shutil
    import tempfile

    from support.metrics_check import parse

    top = tempfile.mkdtemp(prefix="verneuil-perm-")  # traversable by other users, unlike pytest's tmp
    os.chmod(top, 0o755)
    opts = "cache_dir=%s,allow_other,uid=1000,gid=1000,umask=027,subdir=/%s/data,refresh=0.5" % (
        os.path.join(env.root, "cache-sub"), HOST)
    try:
        with Mount(env.url, os.path.join(top, "mnt"), opts, log_path=os.path.join(env.root, "sub.log")) as m:
            ours = "/%s/data/" % HOST
            assert sorted(os.listdir(m.mountpoint)) == sorted(
                [".verneuil"] + [p[len(ours):] for p in env.sources if p.startswith(ours)])
            for path, mode in ((m.mountpoint, 0o550), (m.path("big.db"), 0o440)):
                st = os.stat(path)
                assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1000, 1000, mode), path
            big = env.sources[ours + "big.db"]
            reader = subprocess.run(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups",
                                     "cat", m.path("big.db")], capture_output=True, timeout=60)
            assert reader.returncode == 0 and reader.stdout == big, reader.stderr
            other = subprocess.run(["setpriv", "--reuid=1001", "--regid=1001", "--clear-groups",
                                    "cat", m.path("big.db")], capture_output=True, timeout=60)
            assert other.returncode != 0 and b"Permission denied" in other.stderr, other
            late = b"late" * (CHUNK_SIZE // 4) + b"!"
            where = env.add_bytes(late, "/data/late.db")
            try:
                assert _read(m.path("late.db")) == late  # before any poll lists it
            finally:
                env.store.manifests.delete(manifest_name("/data/late.db", HOST))
                del env.sources[where]
            with open(m.path(".verneuil", "metrics"), "rb") as f:
                series = parse(f.read())
            assert ("verneuil_database_size_bytes", (("host", HOST), ("path", "/data/big.db"))) in series
            assert not any(dict(k[1]).get("host") == "other-host" for k in series)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_open_handle_keeps_its_version(env):
    m = env.mount
    where = "/%s/data/v.db" % HOST
    old = env.sources[where]
    f = open(m.path(where), "rb")
    try:
        assert f.read(4096) == old[:4096]
        ino = os.fstat(f.fileno()).st_ino
        new = old[: 2 * CHUNK_SIZE] + os.urandom(len(old) - 2 * CHUNK_SIZE + CHUNK_SIZE)
        env.add_bytes(new, "/data/v.db")

        def sees_new():
            with open(m.path(where), "rb") as g:
                return os.fstat(g.fileno()).st_ino != ino and g.read() == new

        wait_for(sees_new, 20, "the new version")
        f.seek(0)
        assert f.read() == old  # every byte of the old version, none of the new
        assert os.fstat(f.fileno()).st_size == len(old)
    finally:
        f.close()
        env.sources[where] = new
    assert os.stat(m.path(where)).st_size == len(new)


def test_a_long_lived_connection_follows(env):
    """A Python sqlite3 connection (mode=ro) kept open sees each new version
    at its next query, within a second or so of its manifest landing: the
    follow loop checks the manifest of a database in use every 0.5 s with a
    conditional read (S3: a GET with If-None-Match, 304 while unchanged)."""
    import contextlib

    where = env.add_db("follow.db", 500, seed=21)
    path = env.mount.path(where)
    wait_for(lambda: os.path.exists(path), 20, "follow.db")
    with contextlib.closing(sqlite3.connect("file:%s?mode=ro" % path, uri=True)) as con:
        assert con.execute("SELECT count(*) FROM t").fetchone() == (500,)
        for rows in (700, 900):
            env.add_db("follow.db", rows, seed=rows)
            start = time.monotonic()
            wait_for(lambda: con.execute("SELECT count(*) FROM t").fetchone() == (rows,), 10, "%d rows" % rows)
            assert time.monotonic() - start < 5
        # (Who found each version, the follow loop or the 0.5 s poll, is a
        # race: tests/test_reader_follow.py counts the loop's finds.)
        follow = env.mount.stats()["follow"]
        assert follow["switches"] >= 2, follow
        wait_for(lambda: env.mount.stats()["follow"]["not_modified"] > follow["not_modified"], 10, "a 304")
    from prometheus_client.parser import text_string_to_metric_families

    with open(env.mount.path(".verneuil", "metrics")) as f:
        families = {fam.name: fam for fam in text_string_to_metric_families(f.read())}
    lag = families["verneuil_follow_lag_seconds"]
    assert lag.type == "histogram"
    counts = {s.labels["event"]: s.value for s in lag.samples if s.name.endswith("_count")}
    assert counts["switched"] >= 2 and counts["visible"] >= 2, counts


def test_removed_database_disappears(env):
    m = env.mount
    path = m.path(HOST, "data", "gone.db")
    assert os.path.exists(path)
    env.store.manifests.delete(manifest_name("/data/gone.db", HOST))
    del env.sources["/%s/data/gone.db" % HOST]
    wait_for(lambda: not os.path.exists(path), 20, "gone.db to disappear")
    assert "gone.db" not in os.listdir(m.path(HOST, "data"))


def test_hydrate_fills_the_cache_then_reads_need_no_get(env):
    """A second mount with `hydrate` and an empty cache: every database is
    fetched in the background (the damaged ones end `incomplete`, saying
    why); then whole files read back equal with no GET."""
    cache_dir = os.path.join(env.root, "hydrate-cache")
    log = os.path.join(env.root, "hydrate.log")
    with Mount(env.url, os.path.join(env.root, "mnt-hydrate"),
               "hydrate,cache_dir=%s,refresh=0.5,retries=0,timeout=5,log_file=%s" % (cache_dir, log)) as m:
        def settled():
            dbs = m.stats()["databases"]
            hs = {path: d.get("hydration") for path, d in dbs.items()}
            return hs if len(hs) == len(env.sources) and all(
                h is not None and h["state"] in ("done", "incomplete") for h in hs.values()) else None

        states = wait_for(settled, 60, "every database to be hydrated")
        for where, h in states.items():
            if where.endswith(tuple("/" + n for n in DAMAGED)):
                assert (h["state"], h["failed"]) == ("incomplete", 1), (where, h)
                assert _chunk_fp(env, where, 2).name in h["error"], h
            else:
                assert h["state"] == "done" and h["fetched"] == h["chunks"] and h["failed"] == 0, (where, h)
        assert "hydration of /%s/data/missing.db is incomplete" % HOST in open(log).read()
        gets = m.stats()["fetch"]["gets"]
        for where, data in env.sources.items():
            if not where.endswith(tuple("/" + n for n in DAMAGED)):
                assert _read(m.path(where)) == data, where
        fetch = m.stats()["fetch"]
        assert fetch["gets"] == gets


def test_chunks_downloaded_before_an_unmount_are_kept(env):
    """A database read whole on a mount with an empty cache, then at once an
    unmount: the disk cache writes still under way finish before the process
    ends (bounded by CACHE_DRAIN_S), so a new mount over that cache reads the
    database again without a GET."""
    where = env.add_db("drain.db", 60000, seed=11, payload=300)
    cache_dir = os.path.join(env.root, "drain-cache")
    options = "cache_dir=%s,refresh=0.5" % cache_dir
    with Mount(env.url, os.path.join(env.root, "mnt-drain"), options) as m:
        wait_for(lambda: os.path.exists(m.path(where)), 20, "drain.db")
        assert _read(m.path(where)) == env.sources[where]
        fetched = m.stats()["fetch"]["store_fetches"]
    assert fetched == -(-len(env.sources[where]) // CHUNK_SIZE) - 1  # all but the bundled chunk 0
    with Mount(env.url, os.path.join(env.root, "mnt-drain"), options) as m:
        wait_for(lambda: os.path.exists(m.path(where)), 20, "drain.db")
        assert _read(m.path(where)) == env.sources[where]
        fetch = m.stats()["fetch"]
        assert fetch["gets"] == 0 and fetch["disk_hits"] == fetched, fetch


def test_a_cache_on_a_disk_smaller_than_cache_size(env):
    """A second mount whose cache_dir is an 8 MiB file system (a real tmpfs),
    far below cache_size and below the ~40 MiB the test reads: every file
    reads back equal, the disk bounds the cache with its reserve kept free,
    one warning says so, and no line per chunk floods the log. (The
    manifests kept in the same cache_dir take their share of that disk: at
    2 MiB, once this module has added its larger databases, no 1 MiB segment
    fits beside them and the cache rightly stays paused.)"""
    fs = os.path.join(env.root, "tiny-fs")
    os.makedirs(fs, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", fs], check=True)
    try:
        log = os.path.join(env.root, "tiny.log")
        with Mount(env.url, os.path.join(env.root, "mnt-tiny"),
                   "cache_dir=%s,cache_size=1G,mem_cache=1M,log_file=%s" % (fs, log)) as m:
            for _ in range(2):
                for where, data in env.sources.items():
                    if not where.endswith(tuple("/" + n for n in DAMAGED)):
                        assert _read(m.path(where)) == data, where
            stats = m.stats()
            assert stats["mount"]["read_errors"] == 0
            disk = stats["fetch"]["disk_cache"]
            assert disk["puts"] > 0 and disk["evicted_segments"] > 0 and disk["bytes"] <= 8 << 20
            st = os.statvfs(fs)
            assert st.f_bavail * st.f_frsize >= 0.05 * (8 << 20) - 4096, (
                disk, stats["catalog"]["manifest_cache"],
                sorted((os.path.getsize(os.path.join(d, n)), os.path.join(d, n))
                       for d, _, names in os.walk(fs) for n in names)[-8:])
        text = open(log).read()
        assert "the disk bounds the cache" in text
        assert text.count("WARNING") <= 4, text  # the disk, mounted, unmounted, at most one pause
    finally:
        subprocess.run(["umount", "-l", fs], check=False)


@pytest.mark.parametrize("name", DAMAGED)
def test_bad_chunk_is_a_remote_io_error_never_wrong_bytes(env, name):
    where = "/%s/data/%s" % (HOST, name)
    data = env.sources[where]
    fd = os.open(env.mount.path(where), os.O_RDONLY)
    try:
        assert os.pread(fd, CHUNK_SIZE, CHUNK_SIZE) == data[CHUNK_SIZE : 2 * CHUNK_SIZE]
        with pytest.raises(OSError) as err:
            os.pread(fd, 4096, 2 * CHUNK_SIZE + 100)
        assert err.value.errno == errno.EREMOTEIO  # not EIO: SQLite reads EIO as corruption
        assert os.pread(fd, 4096, 3 * CHUNK_SIZE) == data[3 * CHUNK_SIZE : 3 * CHUNK_SIZE + 4096]
    finally:
        os.close(fd)
    assert "giving up on chunk" in open(os.path.join(env.root, "verneuil.log")).read()


def test_concurrent_random_reads(env):
    wheres = ["/%s/data/%s" % (HOST, n) for n in ("big.db", "small.db", "point.db", "seq.db", "packed.db")]
    wheres.append("/other-host/data/x.db")
    errors: list[str] = []
    counts = [0] * 16
    stop_at = time.monotonic() + 5.0

    def worker(i: int) -> None:
        rng = random.Random(i)
        fds = {w: os.open(env.mount.path(w), os.O_RDONLY) for w in wheres}
        try:
            while time.monotonic() < stop_at and not errors:
                w = rng.choice(wheres)
                data = env.sources[w]
                off = rng.randrange(len(data))
                size = rng.choice((1, 100, 4096, 65536, 200000))
                got = os.pread(fds[w], size, off)
                if got != data[off : off + size]:
                    errors.append("%s [%d, +%d): wrong bytes" % (w, off, size))
                counts[i] += 1
        except Exception as e:  # noqa: BLE001
            errors.append("%s: %r" % (w, e))
        finally:
            for fd in fds.values():
                os.close(fd)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert all(c > 0 for c in counts)


def test_sequential_read_prefetches(env):
    where = env.add_db("seq-cold.db", 8000, seed=8, payload=300)
    path = env.mount.path(where)
    wait_for(lambda: os.path.exists(path), 20, "seq-cold.db")
    before = env.mount.stats()["fetch"]
    with open(path, "rb", buffering=0) as f:
        # No kernel readahead (it would request every chunk itself, 1 MiB
        # ahead): the reads that reach the mount are exactly these.
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        got = b"".join(iter(lambda: f.read(1 << 18), b""))
    assert got == env.sources[where]
    after = env.mount.stats()["fetch"]
    nchunks = -(-len(got) // CHUNK_SIZE) - 1  # chunk 0 is bundled
    fetched = after["store_fetches"] - before["store_fetches"]
    hits = after["prefetch_hits"] - before["prefetch_hits"]
    assert fetched <= nchunks  # nothing fetched twice
    assert hits >= nchunks // 2, (hits, nchunks)


class _Page:
    """A b-tree page of a database image (a parser of the tests' own, from the
    file format, not the mount's): its kind, cells and right-most child."""

    def __init__(self, data: bytes, page: int):
        self.data = data
        page_size = int.from_bytes(data[16:18], "big") or 65536
        self.base = (page - 1) * page_size
        hdr = self.base + (100 if page == 1 else 0)
        self.kind = data[hdr]
        self.interior = self.kind in (0x02, 0x05)
        self.ncells = int.from_bytes(data[hdr + 3 : hdr + 5], "big")
        self.right = int.from_bytes(data[hdr + 8 : hdr + 12], "big") if self.interior else 0
        self._ptrs = hdr + (12 if self.interior else 8)

    def cell(self, i: int) -> int:
        """File offset of cell i."""
        return self.base + int.from_bytes(self.data[self._ptrs + 2 * i : self._ptrs + 2 * i + 2], "big")

    def left_child(self, i: int) -> int:
        cell = self.cell(i)
        return int.from_bytes(self.data[cell : cell + 4], "big")


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """SQLite's varint at ``pos``: (value, position after it)."""
    v = 0
    for _ in range(8):
        v, pos = (v << 7) | (data[pos] & 0x7F), pos + 1
        if data[pos - 1] < 0x80:
            return v, pos
    return (v << 8) | data[pos], pos + 1


def _rowid_path(data: bytes, root: int, rowid: int) -> list[int]:
    """The pages a lookup of ``rowid`` visits in a table b-tree."""
    path, page = [], root
    while True:
        path.append(page)
        p = _Page(data, page)
        if p.kind == 0x0D:  # table leaf
            return path
        assert p.kind == 0x05, (page, p.kind)  # table interior
        page = p.right
        for i in range(p.ncells):
            key, _ = _varint(data, p.cell(i) + 4)
            if rowid <= key:
                page = p.left_child(i)
                break


def test_cold_point_query_gets(env):
    """A point query on a cold replica costs one GET per b-tree page outside
    chunk 0 and nothing else (target: at most 4): chunk 0 is in the kernel's
    page cache from the first open, so neither SQLite's reads of the header
    and schema nor the readahead they would start reach the mount."""
    where = env.add_db("point-cold.db", 60000, seed=14, payload=100)  # chunks no other test read
    path = env.mount.path(where)
    wait_for(lambda: os.path.exists(path), 20, "point-cold.db")
    data = env.sources[where]
    with sqlite3.connect(":memory:") as mem:
        mem.deserialize(data)
        root = mem.execute("SELECT rootpage FROM sqlite_schema WHERE name = 't'").fetchone()[0]
    page_size = int.from_bytes(data[16:18], "big")
    pages = _rowid_path(data, root, 43210)
    chunks = {(p - 1) * page_size // CHUNK_SIZE for p in pages} - {0}
    assert len(pages) >= 3 and chunks, pages  # a lookup that needs the store

    before = env.mount.stats()
    con = sqlite3.connect("file:%s?mode=ro" % path, uri=True)
    try:
        row = con.execute("SELECT id, length(v) FROM t WHERE id = ?", (43210,)).fetchone()
    finally:
        con.close()
    assert row == (43210, 100)
    after = env.mount.stats()
    db = after["databases"][where]
    assert db["preloaded"] == CHUNK_SIZE
    assert after["fetch"]["gets"] - before["fetch"]["gets"] == len(chunks), (pages, chunks)
    assert db["reads"] == len(chunks), db  # no read of chunk 0 reached the mount


def _index_path(data: bytes, root: int, key: str) -> tuple[list[int], int]:
    """The pages a lookup of text ``key`` visits in an index b-tree of
    (text, rowid) entries, and the rowid found."""

    def entry(cell):  # (key, rowid) of a record of a text and an integer
        _, pos = _varint(data, cell)  # payload size
        hsize, body = _varint(data, pos)
        ktype, at = _varint(data, body)
        rtype, _ = _varint(data, at)
        start = pos + hsize
        klen = (ktype - 13) // 2
        n = {1: 1, 2: 2, 3: 3, 4: 4, 5: 6, 6: 8}[rtype]
        return data[start : start + klen].decode(), int.from_bytes(data[start + klen : start + klen + n], "big")

    path, page = [], root
    while True:
        path.append(page)
        p = _Page(data, page)
        assert p.kind in (0x02, 0x0A), (page, p.kind)
        child = p.right
        for i in range(p.ncells):
            k, rowid = entry(p.cell(i) + 4 if p.interior else p.cell(i))
            if k == key:
                return path, rowid
            if key < k:
                child = p.left_child(i) if p.interior else 0
                break
        if not child:
            raise KeyError(key)
        page = child


def test_cold_index_lookup_gets_with_bundled_btree_tops(env):
    """A replica written by the C VFS bundles, besides chunk 0, the chunks of
    its b-trees' upper levels that fit the writer's budget; the mount stores
    them all in the page cache at the first open, so a cold lookup through
    an index costs one GET per chunk of its path outside them: at most 4
    (the aim) on two 3-level trees."""
    where = env.add_written_db("written.db", 60000, seed=16, payload=100)  # chunks no other test read
    path = env.mount.path(where)
    wait_for(lambda: os.path.exists(path), 20, "written.db")
    data = env.sources[where]
    page_size = int.from_bytes(data[16:18], "big")
    with sqlite3.connect(":memory:") as mem:
        mem.deserialize(data)
        roots = dict(mem.execute("SELECT name, rootpage FROM sqlite_schema WHERE rootpage > 0"))
        key = mem.execute("SELECT k FROM t WHERE id = 43210").fetchone()[0]
    ipath, rowid = _index_path(data, roots["t_k"], key)
    assert rowid == 43210 and len(ipath) == 3, ipath  # key found in a leaf
    tpath = _rowid_path(data, roots["t"], rowid)
    assert len(tpath) == 3, tpath
    manifest = _manifest(env, where)
    bundled = set(manifest.bundled)
    assert bundled - {0}, "the writer bundled no b-tree top"
    chunks = {(p - 1) * page_size // CHUNK_SIZE for p in ipath + tpath}
    assert chunks & bundled - {0}, (chunks, bundled)  # the bundles are on the path

    before = env.mount.stats()
    con = sqlite3.connect("file:%s?mode=ro" % path, uri=True)
    try:
        row = con.execute("SELECT id, length(v) FROM t WHERE k = ?", (key,)).fetchone()
    finally:
        con.close()
    assert row == (43210, 100)
    after = env.mount.stats()
    db = after["databases"][where]
    assert db["preloaded"] == sum(len(b) for b in manifest.bundled.values())
    gets = after["fetch"]["gets"] - before["fetch"]["gets"]
    assert gets == len(chunks - bundled) <= 4, (ipath, tpath, bundled)
    assert db["reads"] == gets, db  # nothing bundled reached the mount


def _manifest(env: Env, where: str):
    from verneuil_fuse.format import decode_and_validate

    host, path = where[1:].split("/", 1)
    return decode_and_validate(env.store.manifests.get(manifest_name("/" + path, host)))


def _bdi_read_ahead_kb(mountpoint: str) -> str:
    dev = os.stat(mountpoint).st_dev
    with open("/sys/class/bdi/%d:%d/read_ahead_kb" % (os.major(dev), os.minor(dev))) as f:
        return f.read().strip()


def test_kernel_readahead_is_raised(env):
    """The mount raises its readahead from libfuse's 128 KiB to 4 MiB (set
    after the FUSE INIT reply, which would otherwise cap it again)."""
    wait_for(lambda: _bdi_read_ahead_kb(env.mount.mountpoint) == "4096", 10, "read_ahead_kb=4096")


def test_mount_point_checks(env):
    """A mount point already mounted is refused; a symlink to a directory is
    mounted at its target (so the readahead is tuned there); a mount whose
    process died is named as stale, with the way out."""
    def verneuil(*args):
        return subprocess.run([sys.executable, "-m", "verneuil_fuse.cli.mount", *args],
                              capture_output=True, text=True, timeout=60)

    source = env.url
    opts = "cache_dir=%s" % os.path.join(env.root, "cache3")
    out = verneuil(source, env.mount.mountpoint, "-o", opts)
    assert out.returncode == 4 and "already a mount point" in out.stderr, out.stderr
    target = os.path.join(env.root, "mnt3")
    os.makedirs(target, exist_ok=True)
    link = os.path.join(env.root, "mnt3-link")
    os.symlink(target, link)
    pid = None
    try:
        out = verneuil(source, link, "-o", opts)  # background mode: returns once mounted
        assert out.returncode == 0, out.stderr
        assert is_mounted(target)
        with open(os.path.join(target, ".verneuil", "stats")) as f:
            stats = json.load(f)
        pid = stats["mount"]["pid"]
        assert stats["mount"]["mountpoint"] == target
        wait_for(lambda: _bdi_read_ahead_kb(target) == "4096", 10, "read_ahead_kb=4096")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), 15, "the daemon to die")

        def disconnected() -> bool:
            try:
                os.listdir(target)
            except OSError as e:
                return e.errno == errno.ENOTCONN
            return False

        wait_for(disconnected, 10, "the mount to be disconnected")
        out = verneuil(source, target, "-o", opts)
        assert out.returncode == 4 and "stale FUSE mount" in out.stderr, out.stderr
        assert "fusermount3 -u %s" % target in out.stderr
    finally:
        unmount(target)
        if pid is not None:
            stop_pid(pid, 5)


def test_mount_helper_and_fstab(env):
    """`mount -t fuse.verneuil` and an fstab line (`mount -T`) mount it,
    `umount` ends it. The helper this installs in /usr/local/sbin (mount(8)
    looks nowhere else) is put back as it was afterwards."""
    helper = "/usr/local/sbin/verneuil"
    link = os.readlink(helper) if os.path.islink(helper) else None
    content = None
    if link is None and os.path.exists(helper):
        with open(helper, "rb") as f:
            content = f.read()
    subprocess.run(
        [os.path.join(REPO, "scripts", "install-mount-helper.sh"), sys.prefix],
        check=True, capture_output=True, timeout=30,
    )
    try:
        _mount_helper_and_fstab(env)
    finally:
        os.unlink(helper)
        if link is not None:
            os.symlink(link, helper)
        elif content is not None:
            with open(helper, "wb") as f:
                f.write(content)
            os.chmod(helper, 0o755)


def _mount_helper_and_fstab(env):
    mnt = os.path.join(env.root, "mnt2")
    os.makedirs(mnt, exist_ok=True)
    source = env.url
    opts = "cache_dir=%s" % os.path.join(env.root, "cache2")
    fstab = os.path.join(env.root, "fstab")
    with open(fstab, "w") as f:
        f.write("%s %s fuse.verneuil ro,allow_other,_netdev,nofail,%s 0 0\n" % (source, mnt, opts))
    from verneuil_fuse.cli.mount import SYSLOG_SOCKET, default_log_file

    log_file = default_log_file(mnt)
    assert os.path.basename(log_file) == mnt.strip("/").replace("/", "-") + ".log"  # plain, no escapes
    for cmd in (["mount", "-t", "fuse.verneuil", source, mnt, "-o", "ro," + opts], ["mount", "-T", fstab, mnt]):
        pid = None
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert is_mounted(mnt)  # live as soon as mount(8) returns
            if not os.path.exists(SYSLOG_SOCKET):
                # No syslog: the daemon logs to its default file and said where.
                assert log_file in out.stderr, out.stderr
                wait_for(lambda: "INFO mount: mounted" in _read(log_file).decode(), 10,
                         "the mount's start line in " + log_file)
            with open(os.path.join(mnt, ".verneuil", "stats")) as f:
                pid = json.load(f)["mount"]["pid"]
            small = "/%s/data/small.db" % HOST
            assert _read(os.path.join(mnt, small.lstrip("/"))) == env.sources[small]
            out = subprocess.run(["umount", mnt], capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            wait_for(lambda: not pid_alive(pid), 15, "the daemon to exit after umount")
            if not os.path.exists(SYSLOG_SOCKET):
                assert "INFO mount: unmounted" in _read(log_file).decode()
        finally:
            unmount(mnt)
            if pid is not None:
                stop_pid(pid, 5)
            if os.path.exists(log_file):
                os.unlink(log_file)


def test_sigterm_unmounts(env):
    mnt = os.path.join(env.root, "mnt3")
    m = Mount(env.url, mnt, "cache_dir=%s,read_ahead_kb=256" % os.path.join(env.root, "cache3"))
    m.start()
    try:
        assert os.listdir(m.mountpoint)
        wait_for(lambda: _bdi_read_ahead_kb(m.mountpoint) == "256", 10, "read_ahead_kb=256")
        m.proc.terminate()
        assert m.proc.wait(timeout=15) == 0
        assert not is_mounted(m.mountpoint)
    finally:
        m.stop()


# ------------------------------------------------------------ many databases
FLEET_SIZE = 1000


class Fleet:
    """A store of FLEET_SIZE small databases and a mount of it."""

    def __init__(self, root, store):
        self.root = str(root)
        self.store = store
        self.sources: dict[str, bytes] = {}
        self.mount: Mount | None = None

    def put(self, i: int, data: bytes | None = None) -> str:
        data = data if data is not None else b"SQLite format 3\0" + i.to_bytes(4, "big") + os.urandom(700)
        path = "/tenants/t%04d.db" % i
        publish(self.store, data, path)
        where = "/%s%s" % (HOST, path)
        self.sources[where] = data
        return where

    def stats(self) -> dict:
        return self.mount.stats()

    def rss(self) -> int:
        with open("/proc/%d/status" % self.mount.proc.pid) as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A directory store of FLEET_SIZE databases, mounted with polls every
    2 s (a database found by name before a poll shows it is then likely)."""
    from verneuil_fuse.store import open_store

    root = tmp_path_factory.mktemp("fleet")
    f = Fleet(root, open_store("file://%s/store" % root))
    for i in range(FLEET_SIZE):
        f.put(i)
    # A store that has not changed for a minute: older than the catalog's
    # settling time, so that no poll reads these manifests again.
    mdir = os.path.join(f.root, "store", "manifests")
    for name in os.listdir(mdir):
        os.utime(os.path.join(mdir, name), (time.time() - 60,) * 2)
    f.mount = Mount.under(f.root, f.store.url, "refresh=2")
    try:
        with f.mount:
            yield f
    finally:
        f.store.close()


def test_fleet_is_listed_by_name_and_read_at_lookup(fleet):
    m = fleet.mount
    before = fleet.stats()
    names = os.listdir(m.path(HOST, "tenants"))
    assert len(names) == FLEET_SIZE
    # Listing cost no manifest GET: a mount reads manifests when looked up.
    after = fleet.stats()
    assert after["fetch"]["manifest_gets"] == before["fetch"]["manifest_gets"]
    assert after["catalog"]["databases"] == FLEET_SIZE
    for where in sorted(fleet.sources)[:10]:
        assert os.stat(m.path(where)).st_size == len(fleet.sources[where])
        assert _read(m.path(where)) == fleet.sources[where]
    stats = fleet.stats()
    assert stats["catalog"]["loads"] >= 10
    assert set(sorted(fleet.sources)[:10]) <= set(stats["databases"])
    out = subprocess.run(["ls", "-l", m.path(HOST, "tenants")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    sizes = [int(line.split()[4]) for line in out.stdout.splitlines()[1:]]
    assert sizes == [len(fleet.sources[w]) for w in sorted(fleet.sources)]


def test_fleet_memory_bound_over_1000_opens(fleet):
    """Every database opened, read and closed in turn: at most
    `decoded_limit` manifests stay decoded, the mount's RSS stops growing,
    and a database opened again is decoded from the manifest cache, no GET."""
    m = fleet.mount
    wheres = sorted(fleet.sources)
    rss = []
    for n, where in enumerate(wheres):
        with open(m.path(where), "rb") as f:
            assert f.read() == fleet.sources[where]
        if n in (299, len(wheres) - 1):
            rss.append(fleet.rss())
    cat = fleet.stats()["catalog"]
    assert cat["decoded"] <= cat["decoded_limit"] < FLEET_SIZE, cat
    assert cat["parks"] >= FLEET_SIZE - cat["decoded_limit"], cat
    assert rss[1] - rss[0] < 30 << 20, rss  # 700 more databases opened: no more than noise
    gets = fleet.stats()["fetch"]["manifest_gets"]
    for where in wheres[:20]:  # parked long ago
        assert _read(m.path(where)) == fleet.sources[where]
    stats = fleet.stats()
    assert stats["catalog"]["unparks"] >= 20
    assert stats["fetch"]["manifest_gets"] == gets
    assert stats["catalog"]["manifest_cache"]["hits"] >= 20


def test_fleet_new_database_opens_at_once_by_path(fleet):
    """A database published after the last poll opens by its path before
    the next poll lists it (its manifest name follows from the path)."""
    m = fleet.mount
    for attempt in range(3):  # a poll may list it first: then try another
        found = fleet.stats()["catalog"]["direct_found"]
        where = fleet.put(FLEET_SIZE + attempt)
        assert _read(m.path(where)) == fleet.sources[where]
        if fleet.stats()["catalog"]["direct_found"] == found + 1:
            break
    else:
        pytest.fail("every new database was listed by a poll before its lookup")
    assert os.path.basename(where) in os.listdir(m.path(HOST, "tenants"))
    # A name absent from the store is ENOENT, and SQLite's side files are
    # not looked up in the store at all.
    lookups = fleet.stats()["catalog"]["direct_lookups"]
    assert not os.path.exists(m.path(HOST, "tenants", "nope.db"))
    assert not os.path.exists(m.path(HOST, "tenants", "t0001.db-journal"))
    assert fleet.stats()["catalog"]["direct_lookups"] == lookups + 1


def test_fleet_changed_database_shows_new_version_after_one_poll(fleet):
    """A new version reaches new opens after one poll, whether the database
    was decoded (read at the poll) or known by name only (read at lookup)."""
    m = fleet.mount
    read_before, unread = "/%s/tenants/t0500.db" % HOST, "/%s/tenants/t0999.db" % HOST
    assert _read(m.path(read_before)) == fleet.sources[read_before]
    polls = fleet.stats()["refresh"]["polls"]
    for where in (read_before, unread):
        i = int(where[-7:-3])
        fleet.put(i, b"SQLite format 3\0" + b"new version" + os.urandom(3 * CHUNK_SIZE))
    wait_for(lambda: fleet.stats()["refresh"]["polls"] >= polls + 2, 20, "a poll after the change")
    for where in (read_before, unread):
        assert os.stat(m.path(where)).st_size == len(fleet.sources[where])
        assert _read(m.path(where)) == fleet.sources[where]
    assert fleet.stats()["mount"]["handler_errors"] == 0
