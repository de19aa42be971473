"""The verneuil VFS through Python's sqlite3: staging always equals the db.

After every commit, rebuilding the file from `staging` (manifest + bundled
chunk 0 + chunk files + zero chunk) must give exactly the database's bytes,
and the manifest must pass verneuil_fuse.format.decode_and_validate.
"""
from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import writer_vfs
from verneuil_fuse.format import GENERATED_BY, header_fprint_of, manifest_name

from support import spoolutil

PAGE_SIZES = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]


@pytest.fixture
def spool(tmp_path):
    path = str(tmp_path / "spool")
    writer_vfs.register(path)
    writer_vfs.set_gc_weight(4.0)
    yield path
    writer_vfs.set_gc_weight(4.0)


def open_db(path, page_size=None):
    conn = writer_vfs.connect(path, isolation_level=None)
    if page_size is not None:
        conn.execute("PRAGMA page_size=%d" % page_size)
    return conn


def db_dir_of(conn) -> str:
    return conn.execute("PRAGMA verneuil_spool_dir").fetchone()[0]


def assert_staged(db_path, spool_root):
    """staging rebuilds to exactly the file's bytes."""
    with open(db_path, "rb") as f:
        data = f.read()
    db_dir = spoolutil.db_spool_dir(spool_root, db_path)
    got = spoolutil.rebuild_from_staging(db_dir, db_path=db_path)
    assert len(got) == len(data)
    assert got == data
    return db_dir


def test_register_guards_and_paths(spool, tmp_path):
    assert writer_vfs._LIBVERSION == sqlite3.sqlite_version
    assert os.path.exists(writer_vfs.loadable_extension_path())
    db = str(tmp_path / "a b%c.db")  # needs URI quoting
    conn = open_db(db)
    conn.execute("CREATE TABLE t(x)")
    # The C and Python agree on the spool layout and the manifest name.
    db_dir = db_dir_of(conn)
    assert db_dir == spoolutil.db_spool_dir(spool, db) == writer_vfs.db_spool_dir(db, spool)
    with open(os.path.join(db_dir, "source"), "rb") as f:
        assert f.read() == os.fsencode(os.path.realpath(db))
    name, m = spoolutil.read_manifest_dir(os.path.join(db_dir, "staging", "meta"))
    assert name == manifest_name(db)
    assert m.generated_by == GENERATED_BY
    assert 0 in m.bundled
    assert len(m.version_id) == 32
    assert m.version_id[16:] == header_fprint_of(m.bundled[0]).major.to_bytes(8, "little") + \
        header_fprint_of(m.bundled[0]).minor.to_bytes(8, "little")
    assert m.version_id[:16] == os.getxattr(db, "user.verneuil.version_id")
    st_ = os.stat(db)
    assert (m.ctime, m.ctime_ns) == (st_.st_ctime_ns // 10**9, st_.st_ctime_ns % 10**9)
    assert_staged(db, spool)
    # Published files are read-only.
    for sub in ("staging/meta", "staging/chunks"):
        for f in os.listdir(os.path.join(db_dir, sub)):
            assert os.stat(os.path.join(db_dir, sub, f)).st_mode & 0o222 == 0
    conn.close()


def test_incremental_after_first_snapshot(spool, tmp_path):
    db = str(tmp_path / "inc.db")
    conn = open_db(db, 4096)
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
    conn.execute("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 300) "
                 "INSERT INTO t SELECT i, randomblob(3000) FROM n")
    for i in range(20):
        conn.execute("UPDATE t SET v = randomblob(100) WHERE id = ?", (i * 7 + 1,))
        assert_staged(db, spool)
    s = writer_vfs.stats(conn)
    assert s["full"] == 1, s          # only the very first snapshot
    assert s["incremental"] >= 20, s
    assert s["failed"] == 0, s
    # A read-write transaction that writes nothing leaves the snapshot alone.
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("COMMIT")
    assert writer_vfs.stats(conn)["unchanged"] >= 1
    # The pragma forces a full rebuild.
    conn.execute("PRAGMA verneuil_full_snapshot")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("COMMIT")
    assert writer_vfs.stats(conn)["full"] == 2
    assert_staged(db, spool)
    conn.close()


def test_without_xattrs_every_snapshot_is_full(spool, tmp_path):
    db = str(tmp_path / "noxattr.db")
    conn = open_db(db)
    conn.execute("PRAGMA verneuil_no_xattr")
    conn.execute("CREATE TABLE t(v)")
    for i in range(5):
        conn.execute("INSERT INTO t VALUES (randomblob(20000))")
        assert_staged(db, spool)
    s = writer_vfs.stats(conn)
    assert s["no_xattr"] == 1 and s["incremental"] == 0 and s["full"] == 6, s
    db_dir = db_dir_of(conn)
    _, m = spoolutil.read_manifest_dir(os.path.join(db_dir, "staging", "meta"))
    assert len(m.version_id) == 16  # header fingerprint alone
    conn.close()


def test_changes_behind_our_back_are_caught(spool, tmp_path):
    """A byte changed in a chunk with no version change is found by the
    random re-hash of clean chunks, and forces a full rebuild."""
    db = str(tmp_path / "sneaky.db")
    conn = open_db(db, 65536)  # one page per chunk
    conn.execute("CREATE TABLE small(id INTEGER PRIMARY KEY, v)")
    conn.execute("CREATE TABLE big(v BLOB)")
    conn.execute("INSERT INTO small VALUES (1, 'x')")
    conn.execute("INSERT INTO big VALUES (zeroblob(400000))")
    conn.close()
    size = os.path.getsize(db)
    with open(db, "r+b") as f:  # inside the blob's overflow pages
        f.seek(size - 65536 + 1000)
        f.write(b"behind the VFS's back")
    conn = open_db(db)
    for i in range(60):
        conn.execute("UPDATE small SET v = ? WHERE id = 1", (str(i),))
        if writer_vfs.stats(conn)["verify_mismatch"]:
            break
    assert writer_vfs.stats(conn)["verify_mismatch"] >= 1
    assert_staged(db, spool)
    conn.close()


def test_replication_errors_never_fail_sqlite(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    # A spool that cannot be created: register() says so and carries on.
    assert writer_vfs.register(str(blocker / "spool")) == str(blocker / "spool")
    db = str(tmp_path / "err.db")
    conn = open_db(db)
    conn.execute("CREATE TABLE t(v)")
    for i in range(3):
        conn.execute("INSERT INTO t VALUES (?)", (i,))
    assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 3
    assert writer_vfs.stats(conn)["failed"] >= 3
    conn.close()
    assert not os.path.exists(db + "-journal")


@pytest.mark.parametrize("config", ["{bad json", '{"replication_spooling_dir": 42}', "@/nonexistent.json"])
def test_unusable_config_is_logged_not_raised(tmp_path, config):
    """An application must not fail to start because VERNEUIL_CONFIG is
    wrong: register() logs it and the VFS passes everything through."""
    script = r"""
import logging, sys, writer_vfs
logging.basicConfig()
assert writer_vfs.register() is None
c = writer_vfs.connect(sys.argv[1], isolation_level=None)
c.execute("CREATE TABLE t(v)")
c.execute("INSERT INTO t VALUES (1)")
print(c.execute("SELECT count(*) FROM t").fetchone()[0])
"""
    env = dict(os.environ, VERNEUIL_CONFIG=config)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "x.db")],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
    assert "VERNEUIL_CONFIG" in out.stderr and "replicates nothing" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_spool_leaves_its_file_system_room_for_sqlite(tmp_path):
    """Database and spool on one small file system (a real 24 MiB tmpfs),
    another program takes all but a little more than the spool's reserve:
    every commit stands, the spool writes nothing past its reserve (SQLite
    alone may use it), one log line says why (not one per commit); once there
    is room again the next commit stages the whole file again."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    fs = tmp_path / "fs"
    fs.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(fs)], check=True)
    script = r"""
import json, os, sys, writer_vfs
spool, db, filler = sys.argv[1:4]
writer_vfs.register(spool); writer_vfs.set_log_stderr(True)
c = writer_vfs.connect(db, isolation_level=None)
c.execute("CREATE TABLE t(k INTEGER PRIMARY KEY, v)")
for i in range(16):
    c.execute("INSERT INTO t(v) VALUES (randomblob(200000))")
before = writer_vfs.stats(c)
st = os.statvfs(db)
reserve = st.f_blocks * st.f_frsize * 5 // 100
with open(filler, "wb") as f:  # leave the reserve and 1 MiB more
    f.write(b"x" * (st.f_bavail * st.f_frsize - reserve - (1 << 20)))
lowest = None
for i in range(60):
    c.execute("UPDATE t SET v = randomblob(200000) WHERE k = ?", (i % 16 + 1,))
    st = os.statvfs(db)
    lowest = min(lowest or st.f_bavail, st.f_bavail)
during = writer_vfs.stats(c)
print(json.dumps({"before": before, "during": during, "lowest_free": lowest * st.f_frsize,
                  "reserve": reserve}))
sys.stdout.flush()
os.unlink(filler)
c.execute("UPDATE t SET v = randomblob(200000) WHERE k = 1")
print(json.dumps(writer_vfs.stats(c)))
assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
"""
    try:
        db = str(fs / "db" / "x.db")
        os.makedirs(os.path.dirname(db))
        spool_root = str(fs / "spool")
        out = subprocess.run([sys.executable, "-c", script, spool_root, db, str(fs / "filler")],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        first, last = [json.loads(line) for line in out.stdout.splitlines()]
        before, during = first["before"], first["during"]
        assert before["failed"] == 0 and before["low_space"] == 0, before
        # Every commit stood; the spool went on where a snapshot fitted
        # above the reserve (GC frees chunks too), and abandoned the others
        # for want of room, and for nothing else.
        assert during["low_space"] >= 10 and during["failed"] == during["low_space"], during
        assert first["lowest_free"] >= first["reserve"] - (64 << 10), first
        assert out.stderr.count("snapshot abandoned") == 1, out.stderr
        assert "keep the spool's file system from filling up" in out.stderr
        # Room again: the next commit rebuilt the snapshot from a full scan.
        assert last["low_space"] == during["low_space"] and last["full"] == during["full"] + 1, last
        assert_staged(db, spool_root)
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)


@pytest.mark.parametrize("locking", ["NORMAL", "EXCLUSIVE"])
def test_leaving_wal_replicates_again(tmp_path, locking):
    """A database taken out of WAL mode is snapshotted again (found by
    SQLite's exclusive.test under the self-checking testfixture)."""
    spool, db = str(tmp_path / "spool"), str(tmp_path / "w.db")
    writer_vfs.register(spool)
    c = writer_vfs.connect(db, isolation_level=None)
    c.execute("PRAGMA locking_mode=%s" % locking)
    c.execute("CREATE TABLE t(v)")
    assert c.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    c.execute("INSERT INTO t VALUES (randomblob(70000))")
    assert c.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete"
    c.execute("INSERT INTO t VALUES (randomblob(70000))")
    c.execute("INSERT INTO t VALUES (2)")
    assert writer_vfs.stats(c)["wal"] == 0
    c.execute("PRAGMA locking_mode=NORMAL")
    c.execute("SELECT count(*) FROM t").fetchone()  # releases an exclusive lock
    c.close()
    with open(db, "rb") as f:
        data = f.read()
    assert spoolutil.rebuild_from_staging(spoolutil.db_spool_dir(spool, db), db_path=db) == data


# ---- property-based: random workloads, staging == file after every commit ----

OPS = st.one_of(
    st.tuples(st.just("insert"), st.integers(1, 60), st.integers(0, 6000)),
    st.tuples(st.just("blob"), st.integers(60_000, 400_000), st.just(0)),
    st.tuples(st.just("update"), st.integers(1, 100), st.integers(0, 9000)),
    st.tuples(st.just("delete"), st.integers(1, 100), st.just(0)),
    st.tuples(st.just("vacuum"), st.just(0), st.just(0)),
    st.tuples(st.just("shrink"), st.just(0), st.just(0)),
    st.tuples(st.just("rollback"), st.integers(1, 20), st.integers(0, 3000)),
)


@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(page_size=st.sampled_from(PAGE_SIZES), ops=st.lists(OPS, min_size=1, max_size=10),
       seed=st.integers(0, 2**32 - 1), gc_weight=st.sampled_from([0.0, 4.0, 1e9]))
def test_random_workloads_stage_exact_snapshots(spool, page_size, ops, seed, gc_weight):
    rng = random.Random(seed)
    writer_vfs.set_gc_weight(gc_weight)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(spool)) as d:
        db = os.path.join(d, "w.db")
        conn = open_db(db, page_size)
        conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
        assert_staged(db, spool)
        for kind, n, size in ops:
            if kind == "insert":
                conn.execute("BEGIN")
                conn.executemany("INSERT INTO t(v) VALUES (?)",
                                 [(rng.randbytes(rng.randint(0, size)),) for _ in range(n)])
                conn.execute("COMMIT")
            elif kind == "blob":
                conn.execute("INSERT INTO t(v) VALUES (?)", (rng.randbytes(n),))
            elif kind == "update":
                conn.execute("UPDATE t SET v = ? WHERE id % ? = 0",
                             (rng.randbytes(rng.randint(0, size)), rng.randint(1, n)))
            elif kind == "delete":
                conn.execute("DELETE FROM t WHERE id % ? = 0", (rng.randint(1, n),))
            elif kind == "vacuum":
                conn.execute("VACUUM")
            elif kind == "shrink":
                conn.execute("DELETE FROM t WHERE id % 5 != 0")
                conn.execute("VACUUM")
            elif kind == "rollback":
                conn.execute("BEGIN")
                conn.executemany("INSERT INTO t(v) VALUES (?)",
                                 [(rng.randbytes(size),) for _ in range(n)])
                conn.execute("ROLLBACK")
            db_dir = assert_staged(db, spool)
            assert spoolutil.check_published(db_dir) >= 1
        s = writer_vfs.stats(conn)
        assert s["failed"] == 0 and s["verify_mismatch"] == 0, s
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        conn.close()


def test_exclusive_locking_mode_snapshots_at_unlock(spool, tmp_path):
    db = str(tmp_path / "excl.db")
    conn = open_db(db)
    conn.execute("PRAGMA locking_mode=EXCLUSIVE")
    conn.execute("CREATE TABLE t(v)")
    for i in range(5):
        conn.execute("INSERT INTO t VALUES (randomblob(30000))")
    conn.close()  # the write lock is released (and the snapshot staged) here
    assert_staged(db, spool)
    for mode in ("PERSIST", "TRUNCATE", "MEMORY", "OFF"):
        conn = open_db(db)
        conn.execute("PRAGMA journal_mode=%s" % mode)
        conn.execute("INSERT INTO t VALUES (randomblob(70000))")
        assert_staged(db, spool)
        s = writer_vfs.stats(conn)
        assert s["failed"] == 0 and s["hot_journal"] == 0, (mode, s)
        conn.close()


def test_an_unwritable_spool_is_said_on_stderr_once(tmp_path):
    """Every commit stands; stderr says once (not once per commit) that the
    database is not replicated, since Python listens to no sqlite3_log."""
    script = r"""
import sys, writer_vfs
writer_vfs.register(sys.argv[1])
c = writer_vfs.connect(sys.argv[2], isolation_level=None)
c.execute("CREATE TABLE t(v)")
for i in range(20):
    c.execute("INSERT INTO t VALUES (?)", (i,))
print(c.execute("SELECT count(*) FROM t").fetchone()[0], writer_vfs.stats(c)["failed"])
"""
    spool = tmp_path / "spool"
    spool.write_text("a file where the spool should be")
    out = subprocess.run([sys.executable, "-c", script, str(spool / "sub"), str(tmp_path / "x.db")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows, failed = map(int, out.stdout.split())
    assert rows == 20 and failed >= 20
    assert out.stderr.count("snapshot abandoned") == 1, out.stderr
    assert "NOT replicated until the spool takes snapshots again" in out.stderr
