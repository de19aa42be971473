#!/usr/bin/env python3
"""Benchmark the FUSE reader against moto's S3 server behind a latency proxy.

    .venv/bin/python scripts/bench_reader.py [--size-mb 64] [--latency-ms 20]
        [--concurrency 16] [--points 5] [--json out.json]

The replica is made for real: one commit through the C VFS (a full snapshot,
with the b-tree tops the writer bundles), shipped by the copier, in the
store layout ``--layout`` names (Verneuil's ``chunks``, default, or
``packed``: docs/FORMAT.md, "Packed layout"; the mount reads both alike).

What it measures (each "cold" figure on a fresh mount with an empty cache):
- cold point query: open the replica with sqlite3 (mode=ro) and look up one
  row by rowid, and one by an indexed key: wall time and GETs (from
  /.verneuil/stats);
- cold sequential read of the whole file (1 MiB reads) and cold SQL full scan
  (``SELECT sum(length(v)) FROM t``, b-tree order): MB/s, GETs;
- warm read: a new mount over the filled disk cache (page cache dropped),
  then again with the page cache hot; the same for the local source file;
- store ceiling: parallel GETs (``--concurrency`` threads, boto3, no FUSE) of
  the same chunk blobs through the same proxy (a range GET each, in the
  packed layout): MB/s and GETs/s.

Needs root (mounts) and moto[server]. The documented target size is 1 GiB
(``--size-mb 1024``); the default runs in a few minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

from benchlib import drop_page_cache  # noqa: E402
from support.replicas import Mount, replicate  # noqa: E402
from support.s3server import S3Server, fake_aws_env, patched_environ  # noqa: E402

from verneuil_fuse.format import (  # noqa: E402
    CHUNK_SIZE,
    ZERO_CHUNK_FPRINT,
    chunk_source,
    decode_and_validate,
    local_hostname,
    manifest_name,
)


def make_db(path: str, size_mb: int, seed: int = 0) -> int:
    """A table t(id INTEGER PRIMARY KEY, k TEXT UNIQUE, v BLOB) of about size_mb MiB."""
    import random

    rng = random.Random(seed)
    if os.path.exists(path):
        os.unlink(path)
    con = sqlite3.connect(path)
    con.execute("PRAGMA page_size=4096")
    con.execute("PRAGMA journal_mode=DELETE")
    con.execute("PRAGMA synchronous=OFF")
    con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, k TEXT, v BLOB)")
    con.execute("CREATE INDEX t_k ON t(k)")
    rows = size_mb * (1 << 20) // 290
    for start in range(0, rows, 20000):
        con.executemany(
            "INSERT INTO t VALUES (?, ?, ?)",
            ((i, "%016x" % rng.getrandbits(64), rng.randbytes(200))
             for i in range(start, min(rows, start + 20000))),
        )
    con.commit()
    con.close()
    return rows


def read_all(path: str, block: int = 1 << 20) -> tuple[int, float]:
    start = time.monotonic()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(block)
            if not b:
                break
            n += len(b)
    return n, time.monotonic() - start


class Bench:
    def __init__(self, args):
        self.args = args
        self.tmp = tempfile.mkdtemp(prefix="bench-reader-")
        self.results: dict = {"size_mb": args.size_mb, "latency_ms": args.latency_ms,
                              "concurrency": args.concurrency, "layout": args.layout}
        self.n_mounts = 0

    def mount(self, cache: str | None = None) -> Mount:
        self.n_mounts += 1
        cache = cache or os.path.join(self.tmp, "cache%d" % self.n_mounts)
        opts = "cache_dir=%s,cache_size=%dM,concurrency=%d,refresh=3600,log_file=%s" % (
            cache, self.args.size_mb * 2 + 64, self.args.concurrency, os.path.join(self.tmp, "verneuil.log"))
        if self.args.options:
            opts += "," + self.args.options
        return Mount(self.url, os.path.join(self.tmp, "mnt%d" % self.n_mounts), opts).start()

    def run(self) -> dict:
        a = self.args
        src = os.path.realpath(os.path.join(self.tmp, "src.db"))
        t = time.monotonic()
        rows = make_db(src, a.size_mb)
        data = open(src, "rb").read()
        print("built %s: %.1f MiB, %d rows in %.1fs" % (src, len(data) / 2**20, rows, time.monotonic() - t))
        self.results["db_bytes"] = len(data)
        with patched_environ(fake_aws_env()):
            server = S3Server(log_dir=self.tmp)
            try:
                store = server.make_store(max_pool_connections=64, layout=a.layout)
                self.url = store.url
                t = time.monotonic()
                self._upload(store, src)
                print("uploaded in %.1fs" % (time.monotonic() - t))
                server.latency = a.latency_ms / 1000.0
                self._point_queries(rows)
                self._cold_scans(len(data))
                self._warm(src, len(data))
                self._ceiling(store, data)
                store.close()
            finally:
                server.close()
        return self.results

    def _upload(self, store, src):
        """Replicate ``src`` for real: the C VFS, then a copier
        (replicas.replicate)."""
        self.where = replicate(store, src, os.path.join(self.tmp, "spool"))
        manifest = decode_and_validate(store.manifests.get(manifest_name(src, local_hostname())))
        self.results["bundled_chunks"] = sorted(manifest.bundled)
        # Where each stored chunk is: a chunk object, or a range of a pack.
        self.chunk_sources = sorted({chunk_source(manifest, i) for i, fp in enumerate(manifest.chunks)
                                     if i != 0 and fp != ZERO_CHUNK_FPRINT})
        if manifest.layout is not None:
            self.results["packs"] = len(manifest.layout.packs)

    def _db(self, m: Mount) -> str:
        return m.path(self.where)

    def _point_queries(self, rows):
        import random

        rng = random.Random(7)
        out = {}
        for kind, sql in (("rowid", "SELECT length(v) FROM t WHERE id = ?"),
                          ("index", "SELECT length(v) FROM t WHERE k >= ? ORDER BY k LIMIT 1")):
            times, gets = [], []
            for _ in range(self.args.points):
                m = self.mount()
                try:
                    key = rng.randrange(rows) if kind == "rowid" else "%016x" % rng.getrandbits(64)
                    before = m.stats()["fetch"]["gets"]
                    start = time.monotonic()
                    con = sqlite3.connect("file:%s?mode=ro" % self._db(m), uri=True)
                    assert con.execute(sql, (key,)).fetchone() is not None
                    con.close()
                    times.append(time.monotonic() - start)
                    gets.append(m.stats()["fetch"]["gets"] - before)
                finally:
                    m.stop()
            out[kind] = {"median_ms": round(statistics.median(times) * 1000, 1),
                         "max_ms": round(max(times) * 1000, 1),
                         "gets": gets}
            print("cold point query (%s): median %.1f ms, GETs %s" % (kind, out[kind]["median_ms"], gets))
        self.results["cold_point_query"] = out

    def _cold_scans(self, size):
        m = self.mount()
        try:
            n, dt = read_all(self._db(m))
            s = m.stats()["fetch"]
            self.results["cold_sequential_read"] = {"MBps": round(n / dt / 1e6, 1), "seconds": round(dt, 2),
                                                    "gets": s["gets"], "prefetch_hits": s["prefetch_hits"],
                                                    "prefetch_waste": s["prefetch_waste"]}
            print("cold sequential read: %.1f MB/s (%d GETs)" % (n / dt / 1e6, s["gets"]))
        finally:
            m.stop()
        m = self.mount()
        try:
            start = time.monotonic()
            con = sqlite3.connect("file:%s?mode=ro" % self._db(m), uri=True)
            con.execute("SELECT sum(length(v)) FROM t").fetchone()
            con.close()
            dt = time.monotonic() - start
            s = m.stats()["fetch"]
            self.results["cold_sql_scan"] = {"MBps": round(size / dt / 1e6, 1), "seconds": round(dt, 2),
                                             "gets": s["gets"], "prefetch_hits": s["prefetch_hits"],
                                             "prefetch_waste": s["prefetch_waste"]}
            print("cold SQL full scan: %.1f MB/s (%d GETs)" % (size / dt / 1e6, s["gets"]))
            self.scan_cache = m.options.split("cache_dir=")[1].split(",")[0]
        finally:
            m.stop()

    def _warm(self, src, size):
        dropped = drop_page_cache()
        n, dt = read_all(src)
        local_cold = n / dt / 1e6
        n, dt = read_all(src)
        local_hot = n / dt / 1e6
        m = self.mount(cache=self.scan_cache)  # the disk cache the SQL scan filled
        try:
            path = self._db(m)
            n, dt = read_all(path)
            warm_disk = n / dt / 1e6
            gets = m.stats()["fetch"]["gets"]
            n, dt = read_all(path)
            warm_page = n / dt / 1e6
            sql_start = time.monotonic()
            con = sqlite3.connect("file:%s?mode=ro" % path, uri=True)
            con.execute("SELECT sum(length(v)) FROM t").fetchone()
            con.close()
            sql_hot = size / (time.monotonic() - sql_start) / 1e6
        finally:
            m.stop()
        con = sqlite3.connect("file:%s?mode=ro" % src, uri=True)
        sql_start = time.monotonic()
        con.execute("SELECT sum(length(v)) FROM t").fetchone()
        sql_local = size / (time.monotonic() - sql_start) / 1e6
        con.close()
        self.results["warm_read"] = {
            "mount_disk_cache_MBps": round(warm_disk, 1), "mount_disk_cache_gets": gets,
            "mount_page_cache_MBps": round(warm_page, 1),
            "mount_sql_scan_hot_MBps": round(sql_hot, 1),
            "local_file_cold_MBps": round(local_cold, 1) if dropped else None,
            "local_file_hot_MBps": round(local_hot, 1),
            "local_sql_scan_hot_MBps": round(sql_local, 1),
        }
        print("warm: %s" % self.results["warm_read"])

    def _ceiling(self, store, data):
        names = self.chunk_sources
        total = [0]
        lock = threading.Lock()

        def get(source):
            if source.ranged:
                blob = store.chunks.get_range(source.key, source.start, source.end)
            else:
                blob = store.chunks.get(source.key)
            with lock:
                total[0] += len(blob)

        start = time.monotonic()
        with ThreadPoolExecutor(self.args.concurrency) as pool:
            list(pool.map(get, names))
        dt = time.monotonic() - start
        self.results["store_ceiling"] = {
            "threads": self.args.concurrency, "gets": len(names),
            "GETs_per_s": round(len(names) / dt, 1),
            "blob_MBps": round(total[0] / dt / 1e6, 1),
            "chunk_MBps": round(len(names) * CHUNK_SIZE / dt / 1e6, 1),
        }
        print("store ceiling: %s" % self.results["store_ceiling"])

    def close(self):
        if not self.args.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=64, help="database size (default 64; target 1024)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="added per S3 request (default 20)")
    p.add_argument("--concurrency", type=int, default=16, help="mount's concurrency= and ceiling threads")
    p.add_argument("--points", type=int, default=5, help="cold point queries of each kind (default 5)")
    p.add_argument("--options", default="", help="extra mount options")
    p.add_argument("--layout", choices=("chunks", "packed"), default="chunks",
                   help="the store layout the copier writes (default chunks, Verneuil's)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_reader: needs root (FUSE mounts)", file=sys.stderr)
        return 2
    bench = Bench(args)
    try:
        results = bench.run()
    finally:
        bench.close()
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
