#!/usr/bin/env python3
"""Copier benchmarks against moto's S3 server on 127.0.0.1 (docs/COPIER.md).

Three figures:

1. Replication lag under steady small writes: one small write transaction
   every 1/--hz seconds through the writer VFS; a `verneuilctl copier`
   daemon (default pacing: 30 requests/s, bursts of 100) ships the spool;
   a poller GETs the manifest every few ms and reads SQLite's file change
   counter (header bytes 24..28, in the bundled chunk 0) to see which commit
   is visible.  Lag = commit -> manifest visible in the store.
2. Initial sync of a large database (--size-mb, default 64; 1024 is the
   documented target): Copier.flush() of the freshly staged snapshot,
   unpaced, in MB/s, beside a plain boto3 `upload_file` of the same file in
   the same run.
3. Dedup: bytes stored for --dbs databases copied from one base database
   and each changed a little, beside their total size.

Usage: .venv/bin/python scripts/bench_copier.py [--size-mb 1024] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from support.s3server import S3Server, fake_aws_env, patched_environ  # noqa: E402

from verneuil_fuse import format as fmt  # noqa: E402
from verneuil_fuse.copier import Copier  # noqa: E402
from verneuil_fuse.store import NotFound, open_store  # noqa: E402

MB = 1 << 20


def open_writer(spool: str, path: str) -> sqlite3.Connection:
    """A connection whose commits reach the spool: the C VFS when built,
    else the Python reference writer after every commit."""
    try:
        import writer_vfs
        writer_vfs.register(spool_dir=spool)
        return sqlite3.connect("file:%s?vfs=verneuil" % path, uri=True, isolation_level=None,
                               check_same_thread=False)
    except ImportError:
        raise SystemExit("writer_vfs is not built: pip install -e . first")


def make_store(server: S3Server):
    """Fresh buckets, reached directly (no outage proxy in the way)."""
    chunks = server.new_bucket("bench-chunks")
    manifests = server.new_bucket("bench-manifests", versioned=True)
    url = server.url(chunks, manifests).replace(server.endpoint, server.moto_endpoint)
    return open_store(url), chunks, manifests


def change_counter(path: str) -> int:
    with open(path, "rb") as f:
        return struct.unpack(">I", f.read(28)[24:28])[0]


def bench_lag(server: S3Server, work: str, commits: int, hz: float) -> dict:
    store, _, _ = make_store(server)
    spool = os.path.join(work, "lag-spool")
    os.makedirs(spool)
    db = os.path.join(work, "lag.db")
    conn = open_writer(spool, db)
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
    conn.execute("INSERT INTO t(v) SELECT randomblob(1000) FROM "
                 "(WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<2000) "
                 "SELECT x FROM c)")
    name = fmt.manifest_name(db)
    env = dict(os.environ)
    daemon = subprocess.Popen([sys.executable, "-m", "verneuil_fuse.cli", "copier",
                               "--store", store.url, "--spool", spool],
                              env=env, stderr=subprocess.DEVNULL)
    committed: dict[int, float] = {}
    lags: list[float] = []
    done = threading.Event()
    seen = {"counter": -1}

    def poll():
        while not done.is_set():
            try:
                m = fmt.decode_and_validate(store.manifests.get(name))
                counter = struct.unpack(">I", m.bundled[0][24:28])[0]
            except (NotFound, fmt.ManifestError):
                counter = -1
            now = time.monotonic()
            if counter > seen["counter"]:
                for c, t in list(committed.items()):
                    if c <= counter:
                        lags.append(now - t)
                        del committed[c]
                seen["counter"] = counter
            time.sleep(0.005)

    try:
        time.sleep(1.0)  # let the daemon start and ship the initial snapshot
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        period = 1.0 / hz
        next_at = time.monotonic()
        for i in range(commits):
            conn.execute("UPDATE t SET v = randomblob(1000) WHERE id = ?", (1 + (i * 37) % 2000,))
            committed[change_counter(db)] = time.monotonic()
            next_at += period
            time.sleep(max(0.0, next_at - time.monotonic()))
        deadline = time.monotonic() + 30
        while committed and time.monotonic() < deadline:
            time.sleep(0.05)
        done.set()
        poller.join(5)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(15)
        conn.close()
        store.close()
    lags.sort()
    return {"commits": commits, "hz": hz, "seen": len(lags), "missing": len(committed),
            "median_s": statistics.median(lags) if lags else None,
            "p99_s": lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else None}


def fill_db(conn: sqlite3.Connection, size: int) -> None:
    conn.execute("PRAGMA page_size=65536")
    conn.execute("CREATE TABLE big(id INTEGER PRIMARY KEY, v BLOB)")
    row = 60000
    rows = max(1, size // row)
    batch = 256
    for start in range(0, rows, batch):
        n = min(batch, rows - start)
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO big(v) VALUES (randomblob(?))", [(row,)] * n)
        conn.execute("COMMIT")


def bench_initial_sync(server: S3Server, work: str, size_mb: int, workers: int) -> dict:
    spool = os.path.join(work, "big-spool")
    os.makedirs(spool)
    plain = os.path.join(work, "big-plain.db")
    conn = sqlite3.connect(plain, isolation_level=None)
    fill_db(conn, size_mb * MB)
    conn.close()
    size = os.path.getsize(plain)
    # The writer VFS snapshots the whole file at its first write.
    db = os.path.join(work, "big.db")
    os.rename(plain, db)
    conn = open_writer(spool, db)
    conn.execute("PRAGMA user_version = 1")
    conn.close()
    store, _, _ = make_store(server)
    copier = Copier(spool, store, rate=0, workers=workers)
    start = time.monotonic()
    copier.flush(timeout=3600)
    copier_s = time.monotonic() - start
    copier.close()
    # A plain boto3 upload of the same file, same server, same run.
    import boto3
    from boto3.s3.transfer import TransferConfig
    bucket = server.new_bucket("bench-plain")
    client = boto3.client("s3", endpoint_url=server.moto_endpoint)
    start = time.monotonic()
    client.upload_file(db, bucket, "big.db", Config=TransferConfig(max_concurrency=workers))
    boto_s = time.monotonic() - start
    stored = sum(o.size for o in store.chunks.list()) + sum(o.size for o in store.manifests.list())
    store.close()
    return {"size_bytes": size, "copier_s": copier_s, "copier_MBps": size / MB / copier_s,
            "boto3_s": boto_s, "boto3_MBps": size / MB / boto_s, "workers": workers,
            "requests": copier.stats.requests, "stored_bytes": stored}


def bench_dedup(server: S3Server, work: str, dbs: int, db_mb: int) -> dict:
    spool = os.path.join(work, "dedup-spool")
    os.makedirs(spool)
    base = os.path.join(work, "base.db")
    conn = sqlite3.connect(base, isolation_level=None)
    fill_db(conn, db_mb * MB)
    conn.close()
    total = 0
    for i in range(dbs):
        path = os.path.join(work, "copy-%d.db" % i)
        shutil.copyfile(base, path)
        conn = open_writer(spool, path)
        conn.execute("UPDATE big SET v = randomblob(60000) WHERE id = ?", (1 + i * 7,))
        conn.close()
        total += os.path.getsize(path)
    store, _, _ = make_store(server)
    copier = Copier(spool, store, rate=0, workers=8)
    copier.flush(timeout=3600)
    copier.close()
    chunk_bytes = sum(o.size for o in store.chunks.list())
    manifest_bytes = sum(o.size for o in store.manifests.list())
    store.close()
    return {"dbs": dbs, "total_db_bytes": total, "stored_chunk_bytes": chunk_bytes,
            "stored_manifest_bytes": manifest_bytes,
            "ratio": (chunk_bytes + manifest_bytes) / total}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commits", type=int, default=100, help="commits for the lag test")
    p.add_argument("--hz", type=float, default=10.0, help="commits per second for the lag test")
    p.add_argument("--size-mb", type=int, default=64, help="large database size (MiB)")
    p.add_argument("--workers", type=int, default=8, help="parallel uploads (copier and boto3)")
    p.add_argument("--dbs", type=int, default=10)
    p.add_argument("--db-mb", type=int, default=8, help="size of each dedup database (MiB)")
    p.add_argument("--only", choices=["lag", "sync", "dedup"], action="append")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    only = set(args.only or ["lag", "sync", "dedup"])
    results = {}
    with patched_environ(fake_aws_env()), tempfile.TemporaryDirectory(prefix="bench-copier-") as work:
        with S3Server(log_dir=work) as server:
            if "lag" in only:
                r = results["lag"] = bench_lag(server, work, args.commits, args.hz)
                print("replication lag, %d commits at %.0f/s: median %.3f s, p99 %.3f s "
                      "(%d seen, %d never seen)" % (r["commits"], r["hz"], r["median_s"] or -1,
                                                    r["p99_s"] or -1, r["seen"], r["missing"]),
                      flush=True)
            if "sync" in only:
                r = results["sync"] = bench_initial_sync(server, work, args.size_mb, args.workers)
                print("initial sync of %.0f MiB: copier %.1f MB/s (%.1f s, %d requests), "
                      "plain boto3 upload_file %.1f MB/s (%.1f s)"
                      % (r["size_bytes"] / MB, r["copier_MBps"], r["copier_s"], r["requests"],
                         r["boto3_MBps"], r["boto3_s"]), flush=True)
            if "dedup" in only:
                r = results["dedup"] = bench_dedup(server, work, args.dbs, args.db_mb)
                print("dedup: %d databases, %.1f MiB in total, %.1f MiB stored (%.1f%%)"
                      % (r["dbs"], r["total_db_bytes"] / MB,
                         (r["stored_chunk_bytes"] + r["stored_manifest_bytes"]) / MB,
                         100 * r["ratio"]), flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
