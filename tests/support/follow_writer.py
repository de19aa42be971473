"""A writer for the follow tests and benchmark (run as a script, one
process), and the readers that check what it wrote: it commits through the verneuil VFS at a steady rate and prints one
line per commit, ``<n> <time.time() after COMMIT>``, flushed.

Each commit inserts row ``n`` into ``t(id, at)`` and moves a random amount
between two of ``--accounts`` rows of ``balance(id, amount)``, whose sum is
always 0: a reader that sees one committed state sees ``count(*) == max(id)``
in ``t`` and a zero sum. Stops after ``--commits`` commits or ``--seconds``,
whichever comes first, or at SIGTERM.

    python tests/support/follow_writer.py --spool DIR --db PATH --rate 50 --seconds 120

`WriterProc` runs it from Python and collects the commit times;
`invariant_reader` checks, in a thread, that each read transaction of a
long-lived connection sees one committed state and that they move forward.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WriterProc:
    """This script in a process of its own; its commit times, read from its
    stdout by a thread (for tests and benchmarks)."""

    def __init__(self, spool: str, db: str, rate: float, *, commits: int = 1 << 30, seconds: float = 3600.0):
        self.commits: dict[int, float] = {}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--spool", spool, "--db", db, "--rate", str(rate),
             "--commits", str(commits), "--seconds", str(seconds)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            n, at = line.split()
            self.commits[int(n)] = float(at)

    def wait(self, timeout: float) -> None:
        self.proc.wait(timeout=timeout)
        self._reader.join(5)
        assert self.proc.returncode == 0, self.proc.stderr.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(timeout=10)


def invariant_reader(path: str, stop: threading.Event, out: dict, errors: list, seed: int) -> None:
    """The readers of the writer's database (a thread each): multi-statement
    read transactions on a long-lived connection until ``stop``; every one must see
    one committed state (max(id) twice, count(*), a zero sum of balances);
    the states it sees (``out[seed]``, appended as it goes) must never go
    back."""
    rng = random.Random(seed)
    con = sqlite3.connect("file:%s?mode=ro" % path, uri=True, isolation_level=None)
    states: list[int] = []
    out[seed] = states  # the states seen so far, live
    try:
        while not stop.is_set():
            con.execute("BEGIN")
            (m1,) = con.execute("SELECT max(id) FROM t").fetchone()
            (total, accounts) = con.execute("SELECT sum(amount), count(*) FROM balance").fetchone()
            time.sleep(rng.random() * 0.03)  # new versions land meanwhile
            (m2, count) = con.execute("SELECT max(id), count(*) FROM t").fetchone()
            con.execute("COMMIT")
            if not (m1 == m2 == count and total == 0 and accounts > 0):
                errors.append("reader %d: max %s then %s, count %s, sum %s" % (seed, m1, m2, count, total))
                return
            if states and m1 < states[-1]:
                errors.append("reader %d went back from %d to %d" % (seed, states[-1], m1))
                return
            states.append(m1)
            if len(states) % 50 == 0:
                (check,) = con.execute("PRAGMA integrity_check").fetchone()
                if check != "ok":
                    errors.append("reader %d: integrity_check: %s" % (seed, check))
                    return
    except sqlite3.Error as e:
        errors.append("reader %d: %s" % (seed, e))
    finally:
        con.close()


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
