"""The spool is bounded with no copier: 1,000 commits on a 50 MB database
leave the spool (each inode counted once) under 4x the database's size."""
from __future__ import annotations

import os
import random

import writer_vfs

from support import spoolutil

ROWS = 50_000          # ~1 KB each: a ~52 MB database
ROW_BYTES = 1000
COMMITS = 1000


def test_thousand_commits_on_50mb_stay_under_4x(tmp_path):
    spool = str(tmp_path / "spool")
    db = str(tmp_path / "big.db")
    writer_vfs.register(spool)
    writer_vfs.set_gc_weight(4.0)  # the default
    rng = random.Random(7)
    conn = writer_vfs.connect(db, isolation_level=None)
    conn.execute("PRAGMA synchronous=OFF")
    # One transaction: its snapshot is also published as `ready` (a full
    # copy that no copier consumes), the worst case for the bound.
    conn.execute("BEGIN")
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
    conn.executemany("INSERT INTO t VALUES (?, ?)",
                     ((i, rng.randbytes(ROW_BYTES)) for i in range(ROWS)))
    conn.execute("COMMIT")
    size = os.path.getsize(db)
    assert size >= 50 * 10**6
    for _ in range(COMMITS):
        conn.execute("BEGIN")
        for _ in range(rng.randint(3, 6)):
            conn.execute("UPDATE t SET v = ? WHERE id = ?",
                         (rng.randbytes(ROW_BYTES), rng.randrange(ROWS)))
        conn.execute("COMMIT")
    s = writer_vfs.stats(conn)
    assert s["failed"] == 0 and s["full"] == 1, s  # only the first commit
    assert s["incremental"] >= COMMITS, s
    assert s["ready"] == 1 and s["gc"] >= 1, s
    # Without GC, the chunks staged would exceed the bound on their own.
    assert s["staged"] * 65536 > 4 * size, s
    used = spoolutil.disk_usage(spool)
    assert used < 4 * size, (used, size, s)
    db_dir = spoolutil.db_spool_dir(spool, db)
    with open(db, "rb") as f:
        assert spoolutil.rebuild_from_staging(db_dir, db_path=db) == f.read()
    conn.close()
    print("spool %.1f MB for a %.1f MB db (%.2fx); %s" % (used / 1e6, size / 1e6, used / size, s))
