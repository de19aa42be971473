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
   unpaced, with `verneuilctl flush`'s workers, in MB/s, in each store
   layout of --layout (Verneuil's chunks, and packed: packs of --pack-mb),
   beside a plain boto3 `upload_file` of the same file in the same run.
3. Dedup: bytes stored for --dbs databases copied from one base database
   and each changed a little, beside their total size, in each layout.

Usage: .venv/bin/python scripts/bench_copier.py [--size-mb 1024] [--layout packed] [--json]
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
from verneuil_fuse.cli.copier_cmds import FLUSH_WORKERS  # noqa: E402
from verneuil_fuse.copier import Copier  # noqa: E402
from verneuil_fuse.copier.packing import PACK_TARGET_BYTES  # noqa: E402
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


def make_store(server: S3Server, layout: str = "chunks"):
    """Fresh buckets, reached directly (no outage proxy in the way)."""
    chunks = server.new_bucket("bench-chunks")
    manifests = server.new_bucket("bench-manifests", versioned=True)
    params = {"layout": layout} if layout != "chunks" else {}
    url = server.url(chunks, manifests, **params).replace(server.endpoint, server.moto_endpoint)
    return open_store(url), chunks, manifests


def flush_only(spool: str, store, paths: list[str], workers: int, pack_bytes: int) -> tuple[float, Copier]:
    """Copier.flush() of the databases `paths` of `spool` (unpaced); its
    time in seconds and the copier (its stats)."""
    wanted = {os.path.realpath(p) for p in paths}
    copier = Copier(spool, store, rate=0, workers=workers)
    if copier.packer is not None:
        copier.packer.target = pack_bytes
    start = time.monotonic()
    copier.flush(timeout=3600, only=lambda db: db.source() in wanted)
    elapsed = time.monotonic() - start
    copier.close()
    return elapsed, copier


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


def bench_initial_sync(server: S3Server, work: str, size_mb: int, workers: int, layouts: list[str],
                       pack_mbs: list[int]) -> dict:
    spool = os.path.join(work, "big-spool")
    os.makedirs(spool)
    plain = os.path.join(work, "big-plain.db")
    conn = sqlite3.connect(plain, isolation_level=None)
    fill_db(conn, size_mb * MB)
    conn.close()
    size = os.path.getsize(plain)
    out: dict = {"size_bytes": size, "workers": workers}
    # A plain boto3 upload of the same file, same server, same run.  Every
    # upload starts on an empty server: moto keeps objects in memory, and
    # a server holding GiBs already answers slower.
    import boto3
    from boto3.s3.transfer import TransferConfig
    server.reset()
    bucket = server.new_bucket("bench-plain")
    client = boto3.client("s3", endpoint_url=server.moto_endpoint)
    start = time.monotonic()
    client.upload_file(plain, bucket, "big.db", Config=TransferConfig(max_concurrency=min(workers, 10)))
    boto_s = time.monotonic() - start
    out.update(boto3_s=boto_s, boto3_MBps=size / MB / boto_s)
    runs = [("chunks", 0)] if "chunks" in layouts else []
    runs += [("packed", mb) for mb in pack_mbs] if "packed" in layouts else []
    for layout, pack_mb in runs:
        server.reset()
        # The writer VFS snapshots the whole file at its first write.
        db = os.path.join(work, "big-%s-%d.db" % (layout, pack_mb))
        shutil.copyfile(plain, db)
        conn = open_writer(spool, db)
        conn.execute("PRAGMA user_version = 1")
        conn.close()
        store, _, _ = make_store(server, layout)
        copier_s, copier = flush_only(spool, store, [db], workers, pack_mb * MB)
        stored = sum(o.size for o in store.chunks.list()) + sum(o.size for o in store.manifests.list())
        store.close()
        label = layout if layout == "chunks" else "packed-%dMiB" % pack_mb
        out[label] = {"copier_s": copier_s, "copier_MBps": size / MB / copier_s,
                      "requests": copier.stats.requests, "stored_bytes": stored}
        os.unlink(db)
    return out


def bench_dedup(server: S3Server, work: str, dbs: int, db_mb: int, layout: str = "chunks") -> dict:
    spool = os.path.join(work, "dedup-spool-" + layout)
    os.makedirs(spool)
    base = os.path.join(work, "base.db")
    if not os.path.exists(base):
        conn = sqlite3.connect(base, isolation_level=None)
        fill_db(conn, db_mb * MB)
        conn.close()
    total = 0
    paths = []
    for i in range(dbs):
        path = os.path.join(work, "copy-%s-%d.db" % (layout, i))
        shutil.copyfile(base, path)
        conn = open_writer(spool, path)
        conn.execute("UPDATE big SET v = randomblob(60000) WHERE id = ?", (1 + i * 7,))
        conn.close()
        total += os.path.getsize(path)
        paths.append(path)
    store, _, _ = make_store(server, layout)
    flush_only(spool, store, paths, 8, PACK_TARGET_BYTES)
    chunk_bytes = sum(o.size for o in store.chunks.list())
    manifest_bytes = sum(o.size for o in store.manifests.list())
    store.close()
    return {"layout": layout, "dbs": dbs, "total_db_bytes": total, "stored_chunk_bytes": chunk_bytes,
            "stored_manifest_bytes": manifest_bytes,
            "ratio": (chunk_bytes + manifest_bytes) / total}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commits", type=int, default=100, help="commits for the lag test")
    p.add_argument("--hz", type=float, default=10.0, help="commits per second for the lag test")
    p.add_argument("--size-mb", type=int, default=64, help="large database size (MiB)")
    p.add_argument("--workers", type=int, default=FLUSH_WORKERS,
                   help="the copier's parallel uploads (default: verneuilctl flush's, %d); boto3 "
                        "upload_file uses as many, at most 10 (its default)" % FLUSH_WORKERS)
    p.add_argument("--layout", choices=["chunks", "packed"], action="append",
                   help="store layouts of the sync and dedup figures (default: both)")
    p.add_argument("--pack-mb", type=int, action="append",
                   help="pack sizes (MiB) of the packed layout's sync (default: the copier's, %d)"
                        % (PACK_TARGET_BYTES >> 20))
    p.add_argument("--dbs", type=int, default=10)
    p.add_argument("--db-mb", type=int, default=8, help="size of each dedup database (MiB)")
    p.add_argument("--only", choices=["lag", "sync", "dedup"], action="append")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    only = set(args.only or ["lag", "sync", "dedup"])
    layouts = args.layout or ["chunks", "packed"]
    pack_mbs = args.pack_mb or [PACK_TARGET_BYTES >> 20]
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
                r = results["sync"] = bench_initial_sync(server, work, args.size_mb, args.workers,
                                                         layouts, pack_mbs)
                for label, run in r.items():
                    if isinstance(run, dict):
                        print("initial sync of %.0f MiB, %s: copier %.1f MB/s (%.1f s, %d requests; "
                              "x%.2f of upload_file)"
                              % (r["size_bytes"] / MB, label, run["copier_MBps"], run["copier_s"],
                                 run["requests"], run["copier_MBps"] / r["boto3_MBps"]), flush=True)
                print("initial sync of %.0f MiB: plain boto3 upload_file %.1f MB/s (%.1f s)"
                      % (r["size_bytes"] / MB, r["boto3_MBps"], r["boto3_s"]), flush=True)
            for layout in layouts if "dedup" in only else []:
                r = results["dedup-" + layout] = bench_dedup(server, work, args.dbs, args.db_mb, layout)
                print("dedup, %s: %d databases, %.1f MiB in total, %.1f MiB stored (%.1f%%)"
                      % (layout, r["dbs"], r["total_db_bytes"] / MB,
                         (r["stored_chunk_bytes"] + r["stored_manifest_bytes"]) / MB,
                         100 * r["ratio"]), flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
