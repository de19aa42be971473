"""A WAL database replicated end to end: two writer processes and this one
commit through the C VFS, with checkpoints of every kind in between and the
last commits left in the WAL; `verneuilctl flush` ships the spool to a
directory store; on a real FUSE mount the replica opens with
`sqlite3 -readonly` (no -wal or -shm beside it), passes integrity_check and
is the source's committed state; `verneuilctl restore` gives the same file,
which SQLite opens read-write."""
from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys

import pytest

from support import spoolutil
from support.replicas import Mount, fuse_unavailable
from verneuil_fuse.format import local_hostname

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(300)]
if fuse_unavailable():
    pytestmark.append(pytest.mark.skip(reason=fuse_unavailable()))
if shutil.which("sqlite3") is None:
    pytestmark.append(pytest.mark.skip(reason="no sqlite3 shell"))

CTL = [sys.executable, "-m", "verneuil_fuse.cli"]
WRITERS = 2
COMMITS = 40

WRITER = r"""
import os, random, sys, time, writer_vfs
spool, db, wid = sys.argv[1], sys.argv[2], int(sys.argv[3])
writer_vfs.register(spool)
rng = random.Random(wid)
c = writer_vfs.connect(db, isolation_level=None, timeout=60)
c.execute("PRAGMA wal_autocheckpoint=25")
while not os.path.exists(db + ".go"):
    time.sleep(0.005)
for i in range(int(sys.argv[4])):
    c.execute("INSERT INTO t(w, v) VALUES (?, ?)", (wid, rng.randbytes(rng.randint(10, 9000))))
    if i % 10 == 9:
        mode = ("PASSIVE", "FULL", "RESTART", "TRUNCATE")[(i // 10 + wid) % 4]
        c.execute("PRAGMA wal_checkpoint(%s)" % mode)
s = writer_vfs.stats(c)
assert s["failed"] == 0 and s["wal_unreplicated"] == 0, s
# Every commit pinned by a staging pass (a snapshot, or a state found staged by
# an earlier pass that pinned a later commit), or coalesced into a later pass.
print(s["wal_async"] + s["wal_sync"] + s["wal_coalesced"])
"""


def sqlite3_shell(*args):
    out = subprocess.run(["sqlite3", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_wal_database_replicates_to_a_mount_and_restores(tmp_path):
    import writer_vfs

    spool, store = str(tmp_path / "spool"), "file://%s" % (tmp_path / "store")
    src = tmp_path / "src"
    src.mkdir()
    db = str(src / "wal.db")
    writer_vfs.register(spool)
    conn = writer_vfs.connect(db, isolation_level=None, timeout=60)
    assert conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, w INTEGER, v BLOB)")
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, spool, db, str(w), str(COMMITS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for w in range(WRITERS)]
    try:
        open(db + ".go", "w").close()
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err
            assert int(out) >= COMMITS, out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    # The last commits stay in the WAL: this connection keeps it open.
    for i in range(3):
        conn.execute("INSERT INTO t(w, v) VALUES (-1, randomblob(70000))")
    assert os.path.getsize(db + "-wal") > 0
    rows = conn.execute("SELECT count(*), sum(length(v)) FROM t").fetchone()
    assert rows[0] == WRITERS * COMMITS + 3
    want = spoolutil.committed_image(db, str(tmp_path / "committed"))

    flush = subprocess.run(CTL + ["flush", "--store", store, "--spool", spool, "--rate", "0"],
                           capture_output=True, text=True, timeout=120)
    assert flush.returncode == 0, flush.stderr
    with Mount(store, str(tmp_path / "mnt"), "cache_dir=%s" % (tmp_path / "cache")) as mount:
        replica = mount.path(local_hostname(), db)
        with open(replica, "rb") as f:
            assert f.read() == want
        # No immutable=1, no -wal nor -shm: the replica is a rollback file.
        assert sqlite3_shell("-readonly", replica, "PRAGMA integrity_check;") == "ok"
        got = sqlite3_shell("-readonly", replica, "SELECT count(*), sum(length(v)) FROM t;")
        assert got == "%d|%d" % rows
        assert sqlite3_shell("-readonly", replica, "PRAGMA journal_mode;") == "delete"
        assert sorted(os.listdir(os.path.dirname(replica))) == ["wal.db"]
    back = str(tmp_path / "back.db")
    restore = subprocess.run(CTL + ["restore", "--store", store, "-s", db, "-o", back],
                             capture_output=True, text=True, timeout=120)
    assert restore.returncode == 0, restore.stderr
    with open(back, "rb") as f:
        assert f.read() == want
    check = sqlite3.connect(back)  # read-write, as any program opens it
    assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert check.execute("SELECT count(*), sum(length(v)) FROM t").fetchone() == rows
    check.execute("INSERT INTO t(w, v) VALUES (0, 'the restored file is writable')")
    check.commit()
    check.close()
    conn.close()
