#!/usr/bin/env python3
"""Benchmark of the verneuil writer VFS (docs/WRITER.md has the figures).

1. Commit latency of one-row transactions on a 100 MB database, through
   `verneuil` and through the plain unix VFS, in the same run (interleaved
   rounds), at synchronous=FULL and OFF: median, p99, and the ratio.
2. Time to snapshot a 1 GB database from scratch (full scan, staging every
   chunk, publishing `ready`): seconds and MB/s.

Usage: .venv/bin/python scripts/bench_writer.py [--dir DIR] [--small]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sqlite3
import statistics
import tempfile
import time

import writer_vfs

ROW_BYTES = 1000


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


def commit_latency(plain_db, vn_db, sync, rounds, per_round, rng):
    conns = {
        "unix": sqlite3.connect(plain_db, isolation_level=None),
        "verneuil": writer_vfs.connect(vn_db, isolation_level=None),
    }
    rows = conns["unix"].execute("SELECT max(id) FROM t").fetchone()[0]
    times = {k: [] for k in conns}
    for c in conns.values():
        c.execute("PRAGMA synchronous=%s" % sync)
        c.execute("UPDATE t SET v = v WHERE id = 1")  # warm up (first snapshot)
    names = list(conns)
    for r in range(rounds):
        # Alternate transaction by transaction (and which VFS goes first), so
        # that both see the same noise from the rest of the machine.
        for name in (names if r % 2 == 0 else names[::-1]):
            c = conns[name]
            for _ in range(per_round):
                payload = rng.randbytes(100)
                key = rng.randrange(1, rows)
                t0 = time.perf_counter()
                c.execute("BEGIN")
                c.execute("UPDATE t SET v = ? WHERE id = ?", (payload, key))
                c.execute("COMMIT")
                times[name].append(time.perf_counter() - t0)
    stats = writer_vfs.stats(conns["verneuil"])
    for c in conns.values():
        c.close()
    return times, stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir in /tmp)")
    ap.add_argument("--small", action="store_true", help="10 MB / 100 MB instead of 100 MB / 1 GB")
    ap.add_argument("--spool", default=None,
                    help="spool root (default: inside the work dir, on the databases' file system)")
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
        plain_db = os.path.join(work, "plain.db")
        vn_db = os.path.join(work, "verneuil.db")
        make_db(plain_db, small_mb, ROW_BYTES)
        shutil.copyfile(plain_db, vn_db)
        size = os.path.getsize(plain_db)
        print("commit latency, one-row UPDATE transactions, %.0f MB database" % (size / 1e6))
        print("%-5s %-9s %10s %10s %8s" % ("sync", "vfs", "median ms", "p99 ms", "n"))
        for sync, rounds, per_round in (("FULL", 600, 1), ("OFF", 3000, 1)):
            times, stats = commit_latency(plain_db, vn_db, sync, rounds, per_round, rng)
            med = {}
            for name, xs in times.items():
                med[name] = statistics.median(xs)
                print("%-5s %-9s %10.3f %10.3f %8d" % (sync, name, med[name] * 1e3,
                                                      percentile(xs, 0.99) * 1e3, len(xs)))
            print("%-5s ratio verneuil/unix (median): %.2f   [%s]" % (
                sync, med["verneuil"] / med["unix"],
                " ".join("%s=%d" % kv for kv in stats.items() if kv[0] in
                         ("full", "incremental", "unchanged", "failed", "gc"))))
        os.unlink(plain_db)
        os.unlink(vn_db)
        shutil.rmtree(spool)
        spool = writer_vfs.register(spool_root)

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
