"""Four processes write one database at once through the verneuil VFS; they
cooperate through the spool under SQLite's locks only.  Afterwards staging
equals the file and every published manifest is complete."""
from __future__ import annotations

import ast
import os
import sqlite3
import subprocess
import sys
import time

import writer_vfs

from support import spoolutil

WORKER = r"""
import os, random, sys, sqlite3, time, writer_vfs
spool, db, wid, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
go = db + ".go"
writer_vfs.register(spool)
writer_vfs.set_gc_weight(float(sys.argv[5]))
rng = random.Random(wid)
conn = writer_vfs.connect(db, isolation_level=None, timeout=60)
conn.execute("PRAGMA synchronous=OFF")
while not os.path.exists(go):  # start together
    time.sleep(0.005)
for i in range(n):
    conn.execute("BEGIN IMMEDIATE")
    op = rng.random()
    if op < 0.6:
        conn.execute("INSERT INTO t(w, v) VALUES (?, ?)", (wid, rng.randbytes(rng.randint(10, 20000))))
    elif op < 0.9:
        conn.execute("UPDATE t SET v = ? WHERE id % 17 = ?", (rng.randbytes(rng.randint(0, 3000)), rng.randint(0, 16)))
    else:
        conn.execute("DELETE FROM t WHERE id % 29 = ?", (rng.randint(0, 28),))
    conn.execute("COMMIT")
    if i % 40 == 39 and wid == 0:
        conn.execute("VACUUM")
s = writer_vfs.stats(conn)
assert s["failed"] == 0, s
print(s)
"""


def test_four_processes_share_one_spool(tmp_path):
    spool = str(tmp_path / "spool")
    db = str(tmp_path / "shared.db")
    writer_vfs.register(spool)
    conn = writer_vfs.connect(db, isolation_level=None)
    conn.execute("PRAGMA page_size=4096")
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, w INTEGER, v BLOB)")
    conn.close()
    procs: list[subprocess.Popen] = []
    stats = []
    try:
        for w in range(4):
            procs.append(subprocess.Popen([sys.executable, "-c", WORKER, spool, db, str(w), "150",
                                           str([0.0, 4.0, 4.0, 1e9][w])],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        with open(db + ".go", "w"):
            pass
        deadline = time.monotonic() + 240
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, err
            stats.append(ast.literal_eval(out.strip().splitlines()[-1]))
    finally:
        # On a failure or a timeout, no worker is left running.
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
            p.stdout.close()
            p.stderr.close()
    # Each writer updates the snapshot that the others staged: incremental
    # almost always (a full rebuild would mean a version mismatch).
    assert sum(s["incremental"] + s["unchanged"] for s in stats) >= 4 * 150, stats
    assert sum(s["full"] for s in stats) <= 4, stats
    assert sum(s["verify_mismatch"] + s["failed"] for s in stats) == 0, stats
    db_dir = spoolutil.db_spool_dir(spool, db)
    with open(db, "rb") as f:
        data = f.read()
    assert spoolutil.rebuild_from_staging(db_dir, db_path=db) == data
    assert spoolutil.check_published(db_dir) == 2
    # Nothing left behind in scratch by live writers.
    assert os.listdir(os.path.join(db_dir, "staging", "scratch")) == []
    check = sqlite3.connect(db)
    assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    check.close()
