"""The verneuil VFS on databases in WAL mode (docs/WRITER.md, "WAL
databases"): after every commit the staged snapshot is the committed state,
the file with the WAL's committed frames (support/spoolutil.committed_image,
which lets SQLite itself checkpoint a copy), with header bytes 18 and 19 read
as 1; whatever the writers (connections, processes, a writer without the
VFS), the checkpoints, WAL resets, locking mode and journal-mode switches.
"""
from __future__ import annotations

import os
import pathlib
import random
import sqlite3
import subprocess
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import writer_vfs

from support import spoolutil
from test_writer_vfs import spool  # noqa: F401 - the fixture: a fresh spool


def wal_db(path, page_size=4096, locking="NORMAL"):
    conn = writer_vfs.connect(path, isolation_level=None, timeout=30)
    conn.execute("PRAGMA page_size=%d" % page_size)
    conn.execute("PRAGMA locking_mode=%s" % locking)
    assert conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    return conn


def assert_staged(db, spool, tmp_path):
    """The staged snapshot rebuilds to the committed state; its header says
    rollback journal (bytes 18-19 = 1)."""
    assert writer_vfs.wait_staged(timeout=30)  # this process's stager threads
    want = spoolutil.committed_image(db, str(tmp_path / "committed"))
    got = spoolutil.rebuild_from_staging(spoolutil.db_spool_dir(spool, db), db_path=db)
    assert got[18:20] == b"\x01\x01"
    assert len(got) == len(want)
    assert got == want


def totals(*conns):
    out = {}
    for c in conns:
        for k, v in writer_vfs.stats(c).items():
            out[k] = out.get(k, 0) + v
    return out


OTHER_PROCESS = r"""
import sys, writer_vfs
writer_vfs.register(sys.argv[1])
c = writer_vfs.connect(sys.argv[2], isolation_level=None, timeout=30)
for i in range(int(sys.argv[3])):
    c.execute("INSERT INTO t(v) VALUES (randomblob(3000))")
c.execute("PRAGMA wal_checkpoint(" + sys.argv[4] + ")")
print(writer_vfs.stats(c)["full"])
"""


def test_writers_and_every_checkpoint_stage_each_committed_state(spool, tmp_path):
    """Two connections and another process commit, with checkpoints of each
    kind (and frequent autocheckpoints) in between: every commit stages
    exactly its state, incrementally (one full scan, the first)."""
    db = str(tmp_path / "w.db")
    a = wal_db(db)
    a.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
    b = writer_vfs.connect(db, isolation_level=None, timeout=30)
    b.execute("PRAGMA wal_autocheckpoint=20")
    assert_staged(db, spool, tmp_path)
    rng = random.Random(7)
    for step in range(60):
        conn = a if step % 2 else b
        kind = step % 6
        if kind == 0:
            conn.execute("INSERT INTO t(v) VALUES (?)", (rng.randbytes(rng.randint(100, 70000)),))
        elif kind == 1:
            conn.execute("UPDATE t SET v = ? WHERE id % 4 = ?", (rng.randbytes(500), step % 4))
        elif kind == 2:
            mode = ("PASSIVE", "FULL", "RESTART", "TRUNCATE")[step % 4]
            conn.execute("PRAGMA wal_checkpoint(%s)" % mode)
        elif kind == 3:
            out = subprocess.run([sys.executable, "-c", OTHER_PROCESS, spool, db, "3",
                                  ("PASSIVE", "TRUNCATE")[step % 2]],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert out.stdout.strip() == "0", out.stdout  # incremental there too
        elif kind == 4:
            conn.execute("DELETE FROM t WHERE id % 3 = ?", (step % 3,))
        else:
            conn.execute("VACUUM")
        assert_staged(db, spool, tmp_path)
    s = totals(a, b)
    assert s["full"] <= 1 and s["failed"] == 0 and s["verify_mismatch"] == 0, s
    assert s["wal_snapshots"] >= 40 and s["wal"] == 2, s
    assert a.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    a.close()
    b.close()


@pytest.mark.parametrize("from_start", [True, False])
def test_exclusive_locking_mode_snapshots_every_commit(spool, tmp_path, from_start):
    """locking_mode=EXCLUSIVE takes no shared-memory lock: each commit is
    snapshotted at SQLITE_FCNTL_COMMIT_PHASETWO, WAL resets included."""
    db = str(tmp_path / "x.db")
    if from_start:  # the WAL in heap memory, never in shared memory
        conn = wal_db(db, locking="EXCLUSIVE")
    else:  # shared memory first, then exclusive
        conn = wal_db(db)
        conn.execute("CREATE TABLE warm(v)")
        conn.execute("PRAGMA locking_mode=EXCLUSIVE")
    conn.execute("PRAGMA wal_autocheckpoint=8")
    conn.execute("CREATE TABLE t(v)")
    for i in range(30):
        conn.execute("INSERT INTO t VALUES (randomblob(?))", (1000 * (i % 7) + 10,))
        if i % 10 == 9:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert_staged(db, spool, tmp_path)
    s = writer_vfs.stats(conn)
    assert s["full"] <= 1 and s["failed"] == 0 and s["wal_snapshots"] >= 30, s
    conn.close()
    assert_staged(db, spool, tmp_path)


@pytest.mark.parametrize("locking", ["NORMAL", "EXCLUSIVE"])
def test_switching_between_wal_and_rollback_modes(spool, tmp_path, locking):
    db = str(tmp_path / "s.db")
    conn = writer_vfs.connect(db, isolation_level=None)
    conn.execute("PRAGMA locking_mode=%s" % locking)
    conn.execute("CREATE TABLE t(v)")
    for round_ in range(3):
        assert conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
        for i in range(4):
            conn.execute("INSERT INTO t VALUES (randomblob(20000))")
            assert_staged(db, spool, tmp_path)
        assert conn.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete"
        conn.execute("INSERT INTO t VALUES (randomblob(30000))")
        if locking == "NORMAL":  # EXCLUSIVE: rollback commits snapshot at unlock
            assert_staged(db, spool, tmp_path)
    conn.execute("PRAGMA locking_mode=NORMAL")
    conn.execute("SELECT count(*) FROM t").fetchone()
    s = writer_vfs.stats(conn)
    assert s["failed"] == 0, s
    conn.close()
    assert_staged(db, spool, tmp_path)


def test_closing_and_reopening_stays_incremental(spool, tmp_path):
    """The last connection's close checkpoints and deletes the WAL: the
    snapshot is recorded as the file, so the next session's first commit
    updates it from the new WAL's frames, not from a full scan."""
    db = str(tmp_path / "r.db")
    conn = wal_db(db)
    conn.execute("CREATE TABLE t(v)")
    conn.execute("INSERT INTO t VALUES (randomblob(200000))")
    conn.close()
    assert not os.path.exists(db + "-wal")
    for i in range(3):
        conn = writer_vfs.connect(db, isolation_level=None)
        conn.execute("INSERT INTO t VALUES (randomblob(5000))")
        assert_staged(db, spool, tmp_path)
        s = writer_vfs.stats(conn)
        assert s["full"] == 0 and s["incremental"] == 1, s
        conn.close()
        assert_staged(db, spool, tmp_path)


def test_writers_without_the_vfs_are_caught_up(spool, tmp_path):
    """Commits by a plain SQLite connection show in the WAL: the next commit
    through the VFS stages them too (incrementally while the WAL generation
    is the same; after a reset the VFS did not see, from a full scan)."""
    db = str(tmp_path / "f.db")
    conn = wal_db(db)
    conn.execute("CREATE TABLE t(v)")
    conn.execute("INSERT INTO t VALUES (1)")
    plain = sqlite3.connect(db, isolation_level=None)
    plain.execute("INSERT INTO t VALUES (randomblob(90000))")
    conn.execute("INSERT INTO t VALUES (2)")
    assert_staged(db, spool, tmp_path)
    assert writer_vfs.stats(conn)["full"] == 1  # the first snapshot only
    plain.execute("INSERT INTO t VALUES (randomblob(90000))")
    plain.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    plain.execute("INSERT INTO t VALUES (3)")  # a new generation
    conn.execute("INSERT INTO t VALUES (4)")
    assert_staged(db, spool, tmp_path)
    assert writer_vfs.stats(conn)["full"] == 2
    plain.close()
    conn.close()
    assert_staged(db, spool, tmp_path)


def test_a_file_changed_between_sessions_is_scanned_again(spool, tmp_path):
    """After the last close the snapshot is recorded as the file; a session
    without the VFS that commits and checkpoints into the file changes it
    (size, times, header): the next commit through the VFS scans it all."""
    db = str(tmp_path / "between.db")
    conn = wal_db(db)
    conn.execute("CREATE TABLE t(v)")
    conn.execute("INSERT INTO t VALUES (randomblob(150000))")
    conn.close()
    plain = sqlite3.connect(db, isolation_level=None)
    plain.execute("UPDATE t SET v = randomblob(150000)")
    plain.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    plain.close()
    conn = writer_vfs.connect(db, isolation_level=None)
    conn.execute("INSERT INTO t VALUES (1)")
    s = writer_vfs.stats(conn)
    # The record's proof says so (not the random re-hash, which may miss it).
    assert s["full"] == 1 and s["verify_mismatch"] == 0, s
    assert_staged(db, spool, tmp_path)
    conn.close()


def test_a_crashed_writer_s_commits_are_staged_by_the_next(spool, tmp_path):
    """A process that dies right after its commits (no snapshot of the last
    ones: SIGKILL is simulated by _exit before its VFS could) leaves frames
    in the WAL; the next connection's recovery and commit stage them."""
    db = str(tmp_path / "k.db")
    conn = wal_db(db)
    conn.execute("CREATE TABLE t(v)")
    conn.close()
    script = r"""
import os, sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None)
for i in range(20):
    c.execute("INSERT INTO t VALUES (randomblob(4000))")
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", script, db], check=True, timeout=60)
    assert os.path.getsize(db + "-wal") > 0
    conn = writer_vfs.connect(db, isolation_level=None)
    assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 20
    assert_staged(db, spool, tmp_path)  # staged at the recovery
    conn.execute("INSERT INTO t VALUES (1)")
    assert_staged(db, spool, tmp_path)
    conn.close()


OPS = st.one_of(
    st.tuples(st.just("insert"), st.integers(1, 40), st.integers(0, 6000)),
    st.tuples(st.just("blob"), st.integers(60_000, 300_000)),
    st.tuples(st.just("update"), st.integers(1, 50), st.integers(0, 5000)),
    st.tuples(st.just("delete"), st.integers(2, 9), st.just(0)),
    st.tuples(st.just("checkpoint"), st.sampled_from(["PASSIVE", "FULL", "RESTART", "TRUNCATE"])),
    st.tuples(st.just("rollback"), st.integers(1, 300), st.integers(0, 3000)),
    st.tuples(st.just("vacuum"),),
    st.tuples(st.just("reopen"),),
)


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(page_size=st.sampled_from([512, 4096, 65536]), ops=st.lists(OPS, min_size=1, max_size=8),
       seed=st.integers(0, 2**32 - 1), gc_weight=st.sampled_from([0.0, 4.0, 1e9]))
def test_random_wal_workloads_stage_exact_snapshots(spool, tmp_path, page_size, ops, seed, gc_weight):
    rng = random.Random(seed)
    writer_vfs.set_gc_weight(gc_weight)
    with tempfile.TemporaryDirectory(dir=tmp_path) as work:
        run_wal_workload(spool, os.path.join(work, "w.db"), page_size, ops, rng)


def run_wal_workload(spool, db, page_size, ops, rng):
    work = os.path.dirname(db)
    conn = wal_db(db, page_size)
    conn.execute("PRAGMA cache_size=10")  # big transactions spill frames
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
    for op in ops:
        if op[0] == "insert":
            conn.execute("BEGIN")
            conn.executemany("INSERT INTO t(v) VALUES (?)",
                             [(rng.randbytes(rng.randint(0, op[2])),) for _ in range(op[1])])
            conn.execute("COMMIT")
        elif op[0] == "blob":
            conn.execute("INSERT INTO t(v) VALUES (?)", (rng.randbytes(op[1]),))
        elif op[0] == "update":
            conn.execute("UPDATE t SET v = ? WHERE id % ? = 0", (rng.randbytes(op[2]), op[1]))
        elif op[0] == "delete":
            conn.execute("DELETE FROM t WHERE id % ? = 0", (op[1],))
        elif op[0] == "checkpoint":
            conn.execute("PRAGMA wal_checkpoint(%s)" % op[1])
        elif op[0] == "rollback":  # large enough to spill frames, then undone
            conn.execute("BEGIN")
            conn.executemany("INSERT INTO t(v) VALUES (?)", [(rng.randbytes(op[2]),) for _ in range(op[1])])
            conn.execute("ROLLBACK")
        elif op[0] == "vacuum":
            conn.execute("VACUUM")
        else:
            conn.close()
            conn = writer_vfs.connect(db, isolation_level=None)
        assert_staged(db, spool, pathlib.Path(work))
        assert spoolutil.check_published(spoolutil.db_spool_dir(spool, db)) >= 1
    s = writer_vfs.stats(conn)
    assert s["failed"] == 0 and s["verify_mismatch"] == 0, s
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()


def test_wal_is_replicated_quietly_from_another_process(tmp_path):
    """A program that switches to WAL, commits and checkpoints prints
    nothing on stderr (nothing is left unreplicated), and its snapshot is
    the committed state."""
    script = r"""
import sys, writer_vfs
writer_vfs.register(sys.argv[1])
c = writer_vfs.connect(sys.argv[2], isolation_level=None)
c.execute("CREATE TABLE t(v)")
assert c.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
for i in range(50):
    c.execute("INSERT INTO t VALUES (randomblob(5000))")
c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
c.execute("INSERT INTO t VALUES (1)")
s = writer_vfs.stats(c)
print(s["wal"], s["wal_async"] + s["wal_sync"] + s["wal_coalesced"], s["wal_snapshots"], s["failed"],
      s["wal_unreplicated"])
"""
    spool, db = str(tmp_path / "spool"), str(tmp_path / "wal.db")
    out = subprocess.run([sys.executable, "-c", script, spool, db],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    # Every WAL commit is the one a staging pass (the stager's, or the commit
    # path's) pinned, or coalesced into a later pass. Not every pass makes a
    # snapshot: one that pinned a later commit than it was handed covers the
    # commits handed after it, and the next pass finds its state staged.
    wal, handled, snapshots, failed, unreplicated = map(int, out.stdout.split())
    assert wal == 1 and handled >= 52 and snapshots >= 1 and failed == 0 and unreplicated == 0, out.stdout
    assert_staged(db, spool, tmp_path)


def test_free_pages_never_written_are_read_as_zeros(spool, tmp_path):
    """Without secure_delete, pages that end a transaction on the freelist
    are never written: past the file's end they have no frame, and SQLite
    reads them as zeros.  The database is still the file and the WAL (not a
    piece of one: it stays replicated), and its snapshot has those zeros."""
    db = str(tmp_path / "free.db")
    conn = wal_db(db)
    conn.execute("PRAGMA secure_delete=OFF")
    conn.execute("PRAGMA wal_autocheckpoint=0")
    conn.execute("CREATE TABLE t(v)")
    conn.execute("INSERT INTO t VALUES (1)")
    conn.execute("BEGIN")
    conn.execute("INSERT INTO t VALUES (randomblob(300000))")
    conn.execute("INSERT INTO t VALUES (2)")
    conn.execute("DELETE FROM t WHERE length(v) > 1000")
    conn.execute("COMMIT")
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    assert pages * 4096 > os.path.getsize(db)  # pages past the file's end
    assert conn.execute("PRAGMA freelist_count").fetchone()[0] > 0
    assert_staged(db, spool, tmp_path)
    conn.execute("INSERT INTO t VALUES (3)")
    assert_staged(db, spool, tmp_path)
    s = writer_vfs.stats(conn)
    assert s["wal_unreplicated"] == 0 and s["failed"] == 0, s
    conn.close()


def consistent_counter(image: bytes, path: str) -> int:
    """Opens a staged image: integrity ok, and its counter row equals its row
    count (each commit moved both): a committed state, not a mix."""
    with open(path, "wb") as f:
        f.write(image)
    check = sqlite3.connect(path)
    try:
        assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        (n,) = check.execute("SELECT n FROM counter").fetchone()
        assert check.execute("SELECT count(*) FROM t").fetchone()[0] == n
        return n
    finally:
        check.close()


def test_a_burst_of_commits_converges_to_the_newest_state(spool, tmp_path):
    """Commits of two connections in a burst, nobody waiting: the stager
    threads coalesce them, every snapshot seen meanwhile is a committed state
    (never a mix, never older than the one before), and the last one is the
    newest state, byte for byte."""
    writer_vfs.set_gc_weight(0.0)  # staged chunks stay for the reads below
    try:
        db = str(tmp_path / "burst.db")
        a = wal_db(db)
        a.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
        a.execute("CREATE TABLE counter(n INTEGER)")
        a.execute("INSERT INTO counter VALUES (0)")
        b = writer_vfs.connect(db, isolation_level=None, timeout=30)
        db_dir = spoolutil.db_spool_dir(spool, db)
        seen = [0]
        for i in range(1, 121):
            conn = a if i % 3 else b
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO t(v) VALUES (randomblob(?))", (500 + 97 * i % 9000,))
            conn.execute("UPDATE counter SET n = n + 1")
            conn.execute("COMMIT")
            if i % 10 == 0:  # a look at the spool while the stagers work
                got = spoolutil.rebuild_from_staging(db_dir, db_path=db)
                seen.append(consistent_counter(got, str(tmp_path / "seen.db")))
        assert seen == sorted(seen), seen
        assert writer_vfs.wait_staged(timeout=30)
        assert consistent_counter(spoolutil.rebuild_from_staging(db_dir, db_path=db),
                                  str(tmp_path / "last.db")) == 120
        assert_staged(db, spool, tmp_path)
        s = totals(a, b)
        # Each commit staged, or covered by a later snapshot; none on the
        # commit path.
        assert s["wal_async"] + s["wal_coalesced"] >= 120 and s["wal_sync"] == 0, s
        assert s["failed"] == 0 and s["full"] <= 1, s
        a.close()
        b.close()
    finally:
        writer_vfs.set_gc_weight(4.0)


def test_stats_count_commits_staged_on_and_off_the_commit_path(spool, tmp_path):
    """wal_sync counts the commits snapshotted on the commit path (the stager
    turned off), wal_async the stager's snapshots; both stage each state."""
    db = str(tmp_path / "counts.db")
    old = writer_vfs.set_wal_async(False)
    try:
        conn = wal_db(db)
        conn.execute("CREATE TABLE t(v)")
        for _ in range(5):
            conn.execute("INSERT INTO t VALUES (randomblob(3000))")
            assert_staged(db, spool, tmp_path)
        s = writer_vfs.stats(conn)
        assert s["wal_sync"] >= 6 and s["wal_async"] == 0 and s["wal_coalesced"] == 0, s
        conn.close()
    finally:
        writer_vfs.set_wal_async(old)
    conn = writer_vfs.connect(db, isolation_level=None)
    for _ in range(5):
        conn.execute("INSERT INTO t VALUES (randomblob(3000))")
        assert writer_vfs.wait_staged(conn)
        assert_staged(db, spool, tmp_path)
    s = writer_vfs.stats(conn)
    assert s["wal_async"] >= 5 and s["wal_sync"] == 0, s
    # A full snapshot asked for is made by the stager too, even of a
    # transaction that changed nothing (writer_vfs.force_snapshot's way).
    conn.execute("PRAGMA verneuil_full_snapshot")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("COMMIT")
    assert writer_vfs.stats(conn)["full"] == s["full"] + 1
    assert_staged(db, spool, tmp_path)
    conn.close()


EXIT_WITHOUT_CLOSE = r"""
import ctypes, sys, writer_vfs
writer_vfs.register(sys.argv[1])
c = writer_vfs.connect(sys.argv[2], isolation_level=None)
c.execute("PRAGMA journal_mode=WAL")
c.execute("CREATE TABLE t(v)")
c.execute("INSERT INTO t VALUES (randomblob(4000000))")  # a long snapshot
# exit(3) from C: the connection is never closed, Python does not finalise;
# only the library's exit handler can wait for the stager.
ctypes.CDLL(None).exit(0)
"""


def test_a_commit_then_exit_without_close_is_staged(tmp_path):
    spool, db = str(tmp_path / "spool"), str(tmp_path / "exit.db")
    out = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, spool, db],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert os.path.getsize(db + "-wal") > 4000000  # the commit is in the WAL only
    assert_staged(db, spool, tmp_path)


# Frames a continuous writer's WAL may reach with the stager pinning states:
# the stager's threshold (csrc/stager.c, VN_STAGER_GAP_FRAMES) plus the
# commits of one gap, with room to spare; without resets it grows past 5000.
CONTINUOUS_WAL_MAX_FRAMES = 2500


def test_a_continuous_writer_s_wal_is_still_reset(spool, tmp_path):
    """A writer that commits without a pause, with SQLite's default
    autocheckpoint: the stager's pins never keep the WAL from being reset."""
    db = str(tmp_path / "cont.db")
    conn = wal_db(db)
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
    for i in range(2500):
        conn.execute("INSERT OR REPLACE INTO t(id, v) VALUES (?, randomblob(3000))", (i % 400,))
    frames = (os.path.getsize(db + "-wal") - 32) // (4096 + 24)
    assert frames <= CONTINUOUS_WAL_MAX_FRAMES, frames
    assert writer_vfs.wait_staged(conn)
    assert_staged(db, spool, tmp_path)
    s = writer_vfs.stats(conn)
    assert s["wal_sync"] == 0 and s["failed"] == 0 and s["full"] <= 1, s
    conn.close()


def test_this_process_s_checkpoints_never_meet_the_stager(spool, tmp_path):
    """A TRUNCATE checkpoint right after a commit, without a busy timeout, by
    the committing connection or by one that never writes: this process's
    stagers of the database are drained first, so it is never busy and
    empties the WAL."""
    db = str(tmp_path / "ck.db")
    a = wal_db(db)
    a.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
    a.execute("PRAGMA busy_timeout=0")
    reader = writer_vfs.connect(db, isolation_level=None, timeout=0)
    for i in range(20):  # rows of 1 MB: each snapshot takes a few ms
        a.execute("INSERT OR REPLACE INTO t(id, v) VALUES (?, randomblob(1000000))", (i % 3,))
        checkpointer = reader if i % 2 else a
        assert checkpointer.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone() == (0, 0, 0)
        assert os.path.getsize(db + "-wal") == 0
    assert_staged(db, spool, tmp_path)
    a.close()
    reader.close()


FORKED = r"""
import os, sys, writer_vfs
spool, db, db2 = sys.argv[1:4]
writer_vfs.register(spool)
c = writer_vfs.connect(db, isolation_level=None)
c.execute("PRAGMA journal_mode=WAL")
c.execute("CREATE TABLE t(v)")
c.execute("INSERT INTO t VALUES (randomblob(3000))")  # this process's stager runs
pid = os.fork()
if pid == 0:  # the child: a connection of its own, a stager of its own
    d = writer_vfs.connect(db2, isolation_level=None)
    d.execute("PRAGMA journal_mode=WAL")
    d.execute("CREATE TABLE t(v)")
    d.execute("INSERT INTO t VALUES (randomblob(3000))")
    ok = writer_vfs.wait_staged(d, 10) and writer_vfs.stats(d)["wal_async"] >= 1
    d.close()
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
c.execute("INSERT INTO t VALUES (randomblob(3000))")
assert writer_vfs.wait_staged(c, 10)
c.close()
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_stages_with_a_stager_of_its_own(tmp_path):
    spool, db, db2 = str(tmp_path / "spool"), str(tmp_path / "p.db"), str(tmp_path / "c.db")
    out = subprocess.run([sys.executable, "-c", FORKED, spool, db, db2],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert_staged(db, spool, tmp_path)
    assert_staged(db2, spool, tmp_path)
