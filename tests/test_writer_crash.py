"""A writer killed with SIGKILL at random moments, many times: the database
stays intact, the next transaction leaves a staging snapshot equal to the
file, and no published manifest (staging, ready/<uuid>, consuming/<uuid>)
ever names a chunk that is missing or has other bytes.

Between kills the test sometimes plays a copier: it consumes `ready` (rename
to consuming, move the chunks into a fake store, delete the rest), so that
the writer republishes `ready` under fire too.  Staged manifests may then
name chunks that only the store holds, exactly as with a real copier.
"""
from __future__ import annotations

import os
import random
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import writer_vfs

from support import spoolutil

WORKER = r"""
import random, sys, writer_vfs
spool, db, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)
writer_vfs.register(spool)
writer_vfs.set_gc_weight(rng.choice([0.0, 4.0, 1e9]))
conn = writer_vfs.connect(db, isolation_level=None, timeout=60)
conn.execute("PRAGMA synchronous=" + rng.choice(["OFF", "FULL"]))
print("ready", flush=True)
while True:
    op = rng.random()
    if op < 0.05:
        conn.execute("PRAGMA verneuil_full_snapshot")
    if op < 0.5:
        conn.execute("BEGIN")
        for _ in range(rng.randint(1, 8)):
            conn.execute("INSERT INTO t(v) VALUES (?)", (rng.randbytes(rng.randint(0, 150000)),))
        conn.execute("COMMIT")
    elif op < 0.8:
        conn.execute("UPDATE t SET v = ? WHERE id % ? = 0", (rng.randbytes(rng.randint(0, 5000)), rng.randint(2, 30)))
    elif op < 0.97:
        conn.execute("DELETE FROM t WHERE id % ? = 0", (rng.randint(2, 5),))
    else:
        conn.execute("VACUUM")
"""


def consume_ready(db_dir: str, store: str) -> bool:
    """A minimal copier: ready -> consuming, chunks into the store, then gone."""
    ready = os.path.join(db_dir, "ready")
    consuming = os.path.join(db_dir, "consuming")
    try:
        os.rename(ready, consuming)
    except OSError:
        return False
    for uuid in os.listdir(consuming):
        chunks = os.path.join(consuming, uuid, "chunks")
        for name in os.listdir(chunks):
            os.replace(os.path.join(chunks, name), os.path.join(store, name))
    shutil.rmtree(consuming)
    return True


def test_sigkill_at_random_moments(tmp_path):
    spool = str(tmp_path / "spool")
    store = str(tmp_path / "store")
    os.makedirs(store)
    db = str(tmp_path / "crash.db")
    writer_vfs.register(spool)
    conn = writer_vfs.connect(db, isolation_level=None)
    conn.execute("PRAGMA page_size=4096")
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
    conn.close()
    db_dir = spoolutil.db_spool_dir(spool, db)
    rng = random.Random(1234)
    kills = 0
    deadline = time.monotonic() + 60
    for round_ in range(30):  # CI's minutes: 30 kills at random moments, ~10 s
        if time.monotonic() > deadline and round_ >= 15:
            break
        p = subprocess.Popen([sys.executable, "-c", WORKER, spool, db, str(rng.randrange(2**32))],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # Bounded: a worker that neither says "ready" nor dies fails the test.
            if not select.select([p.stdout], [], [], 30)[0]:
                raise AssertionError("worker not ready after 30 s")
            if p.stdout.readline().strip() != "ready":
                p.kill()
                raise AssertionError("worker failed to start: %s" % p.communicate(timeout=30)[1])
            time.sleep(rng.uniform(0.0, 0.4))
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
            if p.returncode != -signal.SIGKILL:
                raise AssertionError("worker died on its own: %s" % p.stderr.read())
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
            p.stdout.close()
            p.stderr.close()
        kills += 1
        # Right after the kill: whatever is published is complete.
        spoolutil.check_published(db_dir, [store])
        if rng.random() < 0.4:
            consume_ready(db_dir, store)
            spoolutil.check_published(db_dir, [store])
        # The next user (through verneuil) recovers any hot journal; the db is
        # intact, and the next transaction stages an exact snapshot.
        conn = writer_vfs.connect(db, isolation_level=None, timeout=60)
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        conn.execute("INSERT INTO t(v) VALUES (?)", (b"after kill %d" % round_,))
        s = writer_vfs.stats(conn)
        assert s["failed"] == 0, s
        conn.close()
        with open(db, "rb") as f:
            data = f.read()
        assert spoolutil.rebuild_from_staging(db_dir, [store], db_path=db) == data
        spoolutil.check_published(db_dir, [store])
    assert kills >= 15
    check = sqlite3.connect(db)
    assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    check.close()
