#!/usr/bin/env python3
"""Benchmark of the verneuil writer VFS (docs/WRITER.md and
docs/BENCHMARKS.md have the figures).

1. Commit latency of one-row transactions on a 100 MB database, through
   `verneuil` and through the plain unix VFS, in the same run (interleaved
   rounds): with a rollback journal at synchronous=FULL, NORMAL and OFF, and
   in WAL mode at FULL and NORMAL, with the stager thread (the default) and
   with the snapshot on the commit path ("WAL/cp"); median, p99, and the
   ratio; for the stager, how long after a commit began its snapshot was
   staged (median, p99: the replica's freshness); then each WAL ratio
   beside the rollback journal's at the same setting.
2. Time to snapshot a 1 GB database from scratch (full scan, staging every
   chunk, publishing `ready`): seconds and MB/s.
3. With --checkpoints only: how often another process's TRUNCATE checkpoint,
   without a busy timeout, answers busy while a WAL writer commits (plain
   SQLite, the stager, the snapshot on the commit path), with a pause
   between commits and without.

Usage: .venv/bin/python scripts/bench_writer.py [--dir DIR] [--spool DIR]
       [--small] [--latency-only | --checkpoints]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time

import writer_vfs

ROW_BYTES = 1000
# (journal mode, synchronous, transactions per VFS): enough for a stable
# median at each setting; fast settings get more, since they cost less.
# "WAL/cp": WAL with the snapshot on the commit path (writer_vfs.set_wal_async).
LATENCY_RUNS = (("DELETE", "FULL", 600), ("DELETE", "NORMAL", 600), ("DELETE", "OFF", 3000),
                ("WAL", "FULL", 1500), ("WAL", "NORMAL", 3000),
                ("WAL/cp", "FULL", 600), ("WAL/cp", "NORMAL", 1000))
# Commits timed from their start to their snapshot staged (wait_staged).
STAGED_AFTER_COMMITS = 300


def make_db(path: str, megabytes: int, row_bytes: int) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
    rows = megabytes * 10**6 // row_bytes
    conn.execute("BEGIN")
    conn.execute("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) "
                 "INSERT INTO t SELECT i, randomblob(?) FROM n", (rows, row_bytes))
    conn.execute("COMMIT")
    conn.close()


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def one_update(c, rng, rows):
    c.execute("BEGIN")
    c.execute("UPDATE t SET v = ? WHERE id = ?", (rng.randbytes(100), rng.randrange(1, rows)))
    c.execute("COMMIT")


def staged_after(conn, rng, rows):
    """Seconds from a commit's start to its snapshot staged, for
    STAGED_AFTER_COMMITS commits."""
    out = []
    for _ in range(STAGED_AFTER_COMMITS):
        t0 = time.perf_counter()
        one_update(conn, rng, rows)
        assert writer_vfs.wait_staged(conn)
        out.append(time.perf_counter() - t0)
    return out


def commit_latency(plain_db, vn_db, journal, sync, rounds, per_round, rng):
    wal_async = writer_vfs.set_wal_async(journal != "WAL/cp")
    journal = journal.split("/")[0]
    conns = {
        "unix": sqlite3.connect(plain_db, isolation_level=None),
        "verneuil": writer_vfs.connect(vn_db, isolation_level=None),
    }
    rows = conns["unix"].execute("SELECT max(id) FROM t").fetchone()[0]
    times = {k: [] for k in conns}
    for c in conns.values():
        assert c.execute("PRAGMA journal_mode=%s" % journal).fetchone()[0] == journal.lower()
        c.execute("PRAGMA synchronous=%s" % sync)
        c.execute("UPDATE t SET v = v WHERE id = 1")  # warm up (first snapshot)
    names = list(conns)
    for r in range(rounds):
        # Alternate transaction by transaction (and which VFS goes first), so
        # that both see the same noise from the rest of the machine.
        for name in (names if r % 2 == 0 else names[::-1]):
            c = conns[name]
            for _ in range(per_round):
                t0 = time.perf_counter()
                one_update(c, rng, rows)
                times[name].append(time.perf_counter() - t0)
    stats = writer_vfs.stats(conns["verneuil"])
    if journal == "WAL" and stats["wal_async"]:
        times["staged"] = staged_after(conns["verneuil"], rng, rows)
    for c in conns.values():
        c.close()
    writer_vfs.set_wal_async(wal_async)
    return times, stats


def latency_table(plain_db, vn_db, size, rng):
    """The commit latencies of LATENCY_RUNS, then each WAL ratio beside the
    rollback journal's at the same synchronous setting."""
    print("commit latency, one-row UPDATE transactions, %.0f MB database" % (size / 1e6))
    print("%-6s %-6s %-9s %10s %10s %8s" % ("journal", "sync", "vfs", "median ms", "p99 ms", "n"))
    ratios = {}
    for journal, sync, rounds in LATENCY_RUNS:
        times, stats = commit_latency(plain_db, vn_db, journal, sync, rounds, 1, rng)
        med = {}
        for name, xs in times.items():
            med[name] = statistics.median(xs)
            label = "staged at" if name == "staged" else name
            print("%-6s %-6s %-9s %10.3f %10.3f %8d" % (journal, sync, label, med[name] * 1e3,
                                                        percentile(xs, 0.99) * 1e3, len(xs)))
        ratios[journal, sync] = med["verneuil"] / med["unix"]
        print("%-6s %-6s ratio verneuil/unix (median): %.2f   [%s]" % (
            journal, sync, ratios[journal, sync],
            " ".join("%s=%d" % kv for kv in stats.items() if kv[0] in
                     ("full", "incremental", "unchanged", "failed", "gc", "wal_snapshots",
                      "wal_async", "wal_coalesced", "wal_sync"))))
    for sync in ("FULL", "NORMAL"):
        print("%-6s WAL ratio %.2f (snapshot on the commit path: %.2f), rollback journal ratio %.2f" % (
            sync, ratios["WAL", sync], ratios["WAL/cp", sync], ratios["DELETE", sync]))


# --checkpoints: the writer commits for this long, the checkpointer starts
# after the first half second and tries every CHECKPOINT_EVERY seconds.
CHECKPOINT_WRITER_SECONDS = 3.0
CHECKPOINT_EVERY = 0.01
CHECKPOINT_WRITER = r"""
import sqlite3, sys, time, writer_vfs
mode, spool, db, pause = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
if mode == "plain":
    c = sqlite3.connect(db, isolation_level=None, timeout=30)
else:
    writer_vfs.register(spool)
    writer_vfs.set_wal_async(mode == "stager")
    c = writer_vfs.connect(db, isolation_level=None, timeout=30)
end, n = time.monotonic() + float(sys.argv[5]), 0
while time.monotonic() < end:
    c.execute("INSERT OR REPLACE INTO t(id, v) VALUES (?, randomblob(2000))", (n % 300,))
    n += 1
    time.sleep(pause)
print(n)
"""


def checkpoint_busy(work, spool_root):
    """TRUNCATE checkpoints of another process (timeout=0) against a WAL
    writer: how many answer busy."""
    print("TRUNCATE checkpoints of another process without a busy timeout, against a WAL writer")
    for pause in (0.002, 0.0):
        for mode in ("plain", "stager", "commit-path"):
            d = tempfile.mkdtemp(dir=work)
            db = os.path.join(d, "c.db")
            setup = sqlite3.connect(db, isolation_level=None)
            setup.execute("PRAGMA journal_mode=WAL")
            setup.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
            setup.close()
            writer = subprocess.Popen([sys.executable, "-c", CHECKPOINT_WRITER, mode, spool_root, db,
                                       str(pause), str(CHECKPOINT_WRITER_SECONDS)],
                                      stdout=subprocess.PIPE, text=True)
            time.sleep(0.5)
            ck = sqlite3.connect(db, isolation_level=None, timeout=0)
            busy = total = 0
            end = time.monotonic() + CHECKPOINT_WRITER_SECONDS - 1
            while time.monotonic() < end:
                try:
                    busy += ck.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
                except sqlite3.OperationalError:  # SQLITE_BUSY before it started
                    busy += 1
                total += 1
                time.sleep(CHECKPOINT_EVERY)
            ck.close()
            commits = writer.communicate(timeout=60)[0].strip()
            print("pause %.3f s  %-11s commits %6s  checkpoints %4d  busy %4d (%.0f%%)" % (
                pause, mode, commits, total, busy, 100.0 * busy / max(1, total)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir in /tmp)")
    ap.add_argument("--small", action="store_true", help="10 MB / 100 MB instead of 100 MB / 1 GB")
    ap.add_argument("--spool", default=None,
                    help="spool root (default: inside the work dir, on the databases' file system)")
    ap.add_argument("--latency-only", action="store_true", help="skip the snapshot from scratch")
    ap.add_argument("--checkpoints", action="store_true",
                    help="only measure busy answers of another process's checkpoints")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench_writer.", dir=args.dir)
    small_mb, big_mb = (10, 100) if args.small else (100, 1024)
    rng = random.Random(42)
    try:
        spool_root = args.spool or os.path.join(work, "spool")
        if args.spool:
            spool_root = tempfile.mkdtemp(prefix="bench_spool.", dir=args.spool)
        spool = writer_vfs.register(spool_root)
        print("databases in %s, spool in %s" % (work, spool))
        if args.checkpoints:
            checkpoint_busy(work, spool)
            return
        plain_db = os.path.join(work, "plain.db")
        vn_db = os.path.join(work, "verneuil.db")
        make_db(plain_db, small_mb, ROW_BYTES)
        shutil.copyfile(plain_db, vn_db)
        size = os.path.getsize(plain_db)
        latency_table(plain_db, vn_db, size, rng)
        for path in (plain_db, vn_db):
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(path + suffix):
                    os.unlink(path + suffix)
        shutil.rmtree(spool)
        spool = writer_vfs.register(spool_root)
        if args.latency_only:
            return

        big = os.path.join(work, "big.db")
        make_db(big, big_mb, 1 << 20 if not args.small else 100_000)
        size = os.path.getsize(big)
        with open(big, "rb") as f:  # same page-cache state as a live database
            while f.read(1 << 24):
                pass
        t0 = time.perf_counter()
        stats = writer_vfs.force_snapshot(big)
        dt = time.perf_counter() - t0
        print("snapshot from scratch of a %.0f MB database: %.2f s, %.0f MB/s "
              "(full=%d ready=%d staged=%d chunks)" % (size / 1e6, dt, size / 1e6 / dt,
                                                      stats["full"], stats["ready"], stats["staged"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.spool:
            shutil.rmtree(spool_root, ignore_errors=True)


if __name__ == "__main__":
    main()
