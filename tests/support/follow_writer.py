"""A writer for the follow tests and benchmark (run as a script, one
process): commits through the verneuil VFS at a steady rate and prints one
line per commit, ``<n> <time.time() after COMMIT>``, flushed.

Each commit inserts row ``n`` into ``t(id, at)`` and moves a random amount
between two of ``--accounts`` rows of ``balance(id, amount)``, whose sum is
always 0: a reader that sees one committed state sees ``count(*) == max(id)``
in ``t`` and a zero sum. Stops after ``--commits`` commits or ``--seconds``,
whichever comes first, or at SIGTERM.

    python tests/support/follow_writer.py --spool DIR --db PATH --rate 50 --seconds 120
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import sqlite3
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spool", required=True)
    p.add_argument("--db", required=True)
    p.add_argument("--rate", type=float, default=1.0, help="commits per second")
    p.add_argument("--commits", type=int, default=1 << 30)
    p.add_argument("--seconds", type=float, default=3600.0)
    p.add_argument("--accounts", type=int, default=100)
    p.add_argument("--pad", type=int, default=200, help="bytes of padding per row of t")
    a = p.parse_args(argv)
    sys.path.insert(0, REPO)
    import writer_vfs

    writer_vfs.register(a.spool)
    con = sqlite3.connect("file:%s?vfs=verneuil" % os.path.realpath(a.db), uri=True, isolation_level=None)
    con.execute("PRAGMA journal_mode=DELETE")
    con.executescript(
        "BEGIN;"
        "CREATE TABLE IF NOT EXISTS t(id INTEGER PRIMARY KEY, at REAL, pad BLOB);"
        "CREATE TABLE IF NOT EXISTS balance(id INTEGER PRIMARY KEY, amount INTEGER);"
        "COMMIT;")
    if con.execute("SELECT count(*) FROM balance").fetchone()[0] == 0:
        con.execute("BEGIN")
        con.executemany("INSERT INTO balance VALUES (?, 0)", [(i,) for i in range(a.accounts)])
        con.execute("COMMIT")
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    rng = random.Random(os.getpid())
    (n,) = con.execute("SELECT coalesce(max(id), 0) FROM t").fetchone()
    start = time.monotonic()
    done = 0
    while not stop and done < a.commits and time.monotonic() - start < a.seconds:
        n += 1
        src, dst = rng.sample(range(a.accounts), 2)
        amount = rng.randrange(1, 1000)
        con.execute("BEGIN IMMEDIATE")
        con.execute("INSERT INTO t VALUES (?, ?, randomblob(?))", (n, time.time(), a.pad))
        con.execute("UPDATE balance SET amount = amount - ? WHERE id = ?", (amount, src))
        con.execute("UPDATE balance SET amount = amount + ? WHERE id = ?", (amount, dst))
        con.execute("COMMIT")
        print(n, repr(time.time()), flush=True)
        done += 1
        next_at = start + done / a.rate
        time.sleep(max(0.0, next_at - time.monotonic()))
    con.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
