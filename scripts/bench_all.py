#!/usr/bin/env python3
"""The whole system beside its peers, in one run (docs/BENCHMARKS.md).

    .venv/bin/python scripts/bench_all.py            # full: `make bench`, ~25-30 min
    .venv/bin/python scripts/bench_all.py --quick    # small, one run each, < 5 min

Sets up moto's S3 server on 127.0.0.1 (ranged GETs read only the range, see
benchlib/moto_ranged.py) behind a proxy that adds --latency-ms per request
(TCP_NODELAY) and counts every request and byte; installs s3fs and rclone
with apt-get if they are missing.  Then measures, in this order:

1. writer: commit latency through the verneuil VFS beside the plain unix VFS
   (scripts/bench_writer.py's `commit_latency`, interleaved, same run);
2. lag: commit -> manifest visible in the store, under steady small writes
   (scripts/bench_copier.py's `bench_lag`, through the proxy);
3. sync: a fresh database (scripts/bench_reader.py's `make_db`, --size-mb)
   snapshotted by the VFS and shipped by the copier (unpaced), beside a plain
   boto3 `upload_file` of the same file as one object (the object s3fs and
   rclone then mount);
4. ceiling: what the store itself gives through the proxy: 64 KiB GETs/s
   with 16 threads, and one whole-object GET in MB/s;
5. read: cold point query (indexed key), cold full scan, warm full scan
   (same mount again, kernel page cache dropped: only each system's own
   cache helps), hot full scan (once more, page cache kept) for this mount, s3fs, rclone (vfs cache off and full),
   `verneuilctl restore` then query, and the local file; time, GETs and
   bytes from the proxy;
5b. rig: the read phase again against a store that is not the bottleneck:
   Debian's nginx serving the chunk objects and the raw file from files
   (benchlib/nginx_rig.py), the same latency added inside nginx, moto for
   the rest; first the rig's ceiling from curl --parallel (a C client); the
   mount's CPU per chunk GET over each cold scan;
6. fan-out: one aggregate query over --fanout-dbs replicated databases on a
   verneuil mount, Spark local[2] (verneuil_fuse.spark) beside a sequential
   Python loop, cold and warm (a child process, bounded);
7. storage: bytes stored for --dedup-dbs near-identical databases
   (bench_copier's `bench_dedup`) and for the databases above.

Each figure is the median of --runs runs (point queries: --point-runs);
ratios are taken between figures of this one run.  Writes results.json,
results.md and PNG plots to --out.  Needs root (FUSE mounts, dropping the
page cache).  Everything started is stopped by PID; mounts are unmounted
with `fusermount3 -u -z`; every wait is bounded.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

from support import s3server  # noqa: E402
from benchlib import drop_page_cache, make_events_db, moto_ranged, nginx_rig, peers, report  # noqa: E402
from benchlib.proxy import CountingProxy  # noqa: E402
from support.replicas import Mount, unmount  # noqa: E402
from support.s3server import REGION, S3Server, fake_aws_env, patched_environ  # noqa: E402

MB = 1 << 20
# The rig's chunk path without FUSE (`_rig_chunk_path`): as many GETs in
# flight as the mount keeps by default, and chunks packed this many to an
# object (1 MiB of chunks per GET, s3fs's and rclone's order of request
# size) for the layout it weighs.
CHUNK_PATH_IN_FLIGHT = 128
CHUNK_PATH_BATCH = 32  # requests per submission
PACK_CHUNKS = 16
PACK_PREFIX = "pack-"
# tmpfs, for the files the nginx rig serves (`Bench._rig_static_dir`).
RAM_DIR = "/dev/shm"
# --perf's sampling rate: a prime near 1 kHz (no lockstep with timers), ~2,000
# samples per core over a 2 s scan, a file of a few MB.
PERF_HZ = 997

MODES = {
    "quick": dict(size_mb=16, runs=1, point_runs=1, writer_mb=10, writer_rounds=(100, 300),
                  lag_commits=20, dedup_dbs=4, dedup_mb=2, fanout_dbs=100, fanout_kb=128,
                  spark_runs=1),
    "full": dict(size_mb=768, runs=3, point_runs=5, writer_mb=100, writer_rounds=(600, 3000),
                 lag_commits=200, dedup_dbs=10, dedup_mb=8, fanout_dbs=100, fanout_kb=1024,
                 spark_runs=3),
}

POINT_SQL = "SELECT length(v) FROM t WHERE k >= ? ORDER BY k LIMIT 1"
SCAN_SQL = "SELECT sum(length(v)) FROM t"
FANOUT_SQL = "SELECT count(*) AS n, sum(v) AS total, sum(length(note)) AS note_bytes FROM events"
FANOUT_SCHEMA = "n LONG, total DOUBLE, note_bytes LONG"

SYSTEMS = ("verneuil", "s3fs", "rclone_off", "rclone_full", "restore", "local")
# The readers measured again on the nginx rig: this mount beside the peer
# that reads large ranges, the peer with a full cache, and the local file.
RIG_SYSTEMS = ("verneuil", "s3fs", "rclone_full", "local")
SYSTEM_LABELS = {
    "verneuil": "verneuil mount (this)",
    "s3fs": "s3fs-fuse",
    "rclone_off": "rclone mount, vfs cache off",
    "rclone_full": "rclone mount, vfs cache full",
    "restore": "verneuilctl restore, then query",
    "local": "local file",
}

# Bounds on the child process of the fan-out phase (Spark start ~10 s here).
SPARK_CHILD_TIMEOUT = {"quick": 240, "full": 900}


def log(msg: str) -> None:
    print("[bench %s] %s" % (time.strftime("%H:%M:%S"), msg), flush=True)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def sqlite_ro(path: str) -> sqlite3.Connection:
    # immutable=1 for every system: no journal lookups, no locks; the same
    # read path on every file system (and what the Spark source uses).
    return sqlite3.connect("file:%s?immutable=1" % urllib.parse.quote(path), uri=True)


def find_file(top: str, name: str, timeout: float = 30.0) -> str:
    """The path of `name` somewhere under `top` (bounded walk and wait)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for root, _dirs, files in os.walk(top):
            if name in files:
                return os.path.join(root, name)
        time.sleep(0.2)
    raise TimeoutError("%s did not appear under %s" % (name, top))


class ServerView:
    """What bench_copier's functions need from an S3Server, pointed at the
    counting proxy (their `moto_endpoint` is the proxy, so their stores and
    boto3 clients go through the added latency too)."""

    def __init__(self, server: S3Server, endpoint: str) -> None:
        self._server = server
        self.endpoint = endpoint
        self.moto_endpoint = endpoint

    def new_bucket(self, *a, **kw) -> str:
        return self._server.new_bucket(*a, **kw)

    def url(self, *a, **kw) -> str:
        return self._server.url(*a, **kw).replace(self._server.endpoint, self.endpoint)


# ---------------------------------------------------------------- the run
class Bench:
    def __init__(self, args, cfg: dict) -> None:
        self.args = args
        self.cfg = cfg
        self.work = tempfile.mkdtemp(prefix="bench-all-", dir=args.work_dir)
        self.results: dict = {}
        self.errors: dict = {}
        self.n_mounts = 0
        self.server: S3Server | None = None
        self.proxy: CountingProxy | None = None

    # -- plumbing ---------------------------------------------------------
    def phase(self, name: str, fn, *a) -> None:
        if self.args.only and name not in self.args.only:
            return
        log("== %s" % name)
        start = time.monotonic()
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            traceback.print_exc()
            self.errors[name] = "%s: %s" % (type(e).__name__, e)
        self.results.setdefault("phase_seconds", {})[name] = round(time.monotonic() - start, 1)
        log("   %s done in %.0f s" % (name, time.monotonic() - start))

    def counted(self):
        return self.proxy.snapshot()

    def delta(self, before: dict) -> dict:
        return CountingProxy.delta(before, self.proxy.snapshot())

    def store(self, chunks: str, manifests: str, **kw):
        from verneuil_fuse.store import open_store
        return open_store(self.store_url(chunks, manifests), **kw)

    def store_url(self, chunks: str, manifests: str) -> str:
        params = {} if self.args.layout == "chunks" else {"layout": self.args.layout}
        return self.server.url(chunks, manifests, **params).replace(self.server.endpoint, self.proxy.endpoint)

    def boto3(self):
        import boto3
        from botocore.config import Config
        return boto3.client("s3", endpoint_url=self.proxy.endpoint, region_name=REGION,
                            config=Config(max_pool_connections=32,
                                          s3={"addressing_style": "path"}))

    # -- setup ------------------------------------------------------------
    def run(self) -> dict:
        a, cfg = self.args, self.cfg
        self.results["meta"] = meta(a, cfg)
        self.results["meta"]["tools"] = peers.ensure_tools(log)
        env = fake_aws_env()
        # Keep every object in moto's memory (a spilled object would be read
        # back from disk after we drop the page cache between cold runs).
        env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(4 << 30)
        with patched_environ(env):
            s3server._moto_command = lambda port: [
                sys.executable, moto_ranged.__file__, "-H", s3server.HOST, "-p", str(port)]
            self.server = S3Server(log_dir=self.work)
            moto_port = urllib.parse.urlparse(self.server.moto_endpoint).port
            self.proxy = CountingProxy(moto_port, latency=a.latency_ms / 1000.0)
            log("moto at %s, latency proxy (%.0f ms/request) at %s"
                % (self.server.moto_endpoint, a.latency_ms, self.proxy.endpoint))
            try:
                self.phase("writer", self.bench_writer)
                self.phase("lag", self.bench_lag)
                self.phase("sync", self.bench_sync)
                self.phase("ceiling", self.bench_ceiling)
                self.phase("read", self.bench_read)
                self.phase("rig", self.bench_rig)
                self.phase("fanout", self.bench_fanout)
                self.phase("storage", self.bench_storage)
            finally:
                self.proxy.close()
                self.server.close()
        self.results["errors"] = self.errors
        self.results["summary"] = summarize(self.results)
        self.results["meta"]["wall_seconds"] = round(time.monotonic() - T0, 1)
        self.results["meta"]["loadavg_end"] = loadavg()
        return self.results

    def close(self) -> None:
        for line in open("/proc/self/mountinfo").read().splitlines():
            fields = line.split()
            if len(fields) > 4 and fields[4].startswith(self.work):
                unmount(fields[4])
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)

    # -- 1. writer --------------------------------------------------------
    def bench_writer(self) -> None:
        import bench_writer
        import writer_vfs

        work = os.path.join(self.work, "writer")
        os.makedirs(work)
        writer_vfs.register(os.path.join(work, "spool"))
        plain, vn = os.path.join(work, "plain.db"), os.path.join(work, "verneuil.db")
        bench_writer.make_db(plain, self.cfg["writer_mb"], bench_writer.ROW_BYTES)
        shutil.copyfile(plain, vn)
        rng = random.Random(42)
        out = {"db_bytes": os.path.getsize(plain), "transaction": "one-row UPDATE", "sync": {}}
        for sync, rounds in zip(("FULL", "OFF"), self.cfg["writer_rounds"]):
            times, stats = bench_writer.commit_latency(plain, vn, "DELETE", sync, rounds, 1, rng)
            row = {"n": len(times["unix"])}
            for name, xs in times.items():
                row["%s_median_ms" % name] = round(statistics.median(xs) * 1e3, 4)
                row["%s_p99_ms" % name] = round(bench_writer.percentile(xs, 0.99) * 1e3, 4)
            row["ratio"] = round(row["verneuil_median_ms"] / row["unix_median_ms"], 3)
            row["overhead_ms"] = round(row["verneuil_median_ms"] - row["unix_median_ms"], 4)
            row["snapshots"] = {k: v for k, v in stats.items()
                                if k in ("full", "incremental", "unchanged", "failed")}
            out["sync"][sync] = row
            log("writer sync=%s: unix %.3f ms, verneuil %.3f ms (x%.2f)"
                % (sync, row["unix_median_ms"], row["verneuil_median_ms"], row["ratio"]))
        self.results["writer"] = out
        shutil.rmtree(work, ignore_errors=True)

    # -- 2. lag -----------------------------------------------------------
    def bench_lag(self) -> None:
        import bench_copier

        work = os.path.join(self.work, "lag")
        os.makedirs(work)
        view = ServerView(self.server, self.proxy.endpoint)
        r = bench_copier.bench_lag(view, work, self.cfg["lag_commits"], self.args.lag_hz)
        r["median_ms"] = round(r["median_s"] * 1e3, 1) if r["median_s"] is not None else None
        r["p99_ms"] = round(r["p99_s"] * 1e3, 1) if r["p99_s"] is not None else None
        r["copier"] = "verneuilctl copier, default pacing (30 requests/s, bursts of 100)"
        self.results["lag"] = r
        log("lag: median %s ms, p99 %s ms (%d/%d seen)"
            % (r["median_ms"], r["p99_ms"], r["seen"], r["commits"]))

    # -- 3. sync: the database every reader reads -------------------------
    def bench_sync(self) -> None:
        import bench_copier
        import bench_reader
        from boto3.s3.transfer import TransferConfig

        from verneuil_fuse.copier import Copier

        work = os.path.join(self.work, "sync")
        os.makedirs(work)
        db = os.path.join(work, "src.db")
        t = time.monotonic()
        rows = bench_reader.make_db(db, self.args.size_mb)
        log("built %s: %.1f MiB, %d rows in %.0f s" % (db, os.path.getsize(db) / MB, rows,
                                                       time.monotonic() - t))
        self.db, self.rows = db, rows
        spool = os.path.join(work, "spool")
        os.makedirs(spool)
        # The first write through the VFS snapshots the whole file.
        t = time.monotonic()
        conn = bench_copier.open_writer(spool, db)
        conn.execute("PRAGMA user_version = 1")
        conn.close()
        snapshot_s = time.monotonic() - t
        size = os.path.getsize(db)
        self.chunks_bucket = self.server.new_bucket("chunks")
        self.manifests_bucket = self.server.new_bucket("manifests", versioned=True)
        store = self.store(self.chunks_bucket, self.manifests_bucket, max_pool_connections=64)
        workers = self.args.workers
        copier = Copier(spool, store, rate=0, workers=workers)
        before = self.counted()
        t = time.monotonic()
        copier.flush(timeout=3600)
        copier_s = time.monotonic() - t
        copier_req = self.delta(before)
        copier.close()
        stored = sum(o.size for o in store.chunks.list()) + sum(o.size for o in store.manifests.list())
        store.close()
        self.raw_bucket = self.server.new_bucket("raw")
        client = self.boto3()
        before = self.counted()
        t = time.monotonic()
        client.upload_file(db, self.raw_bucket, "src.db",
                           Config=TransferConfig(max_concurrency=workers))
        plain_s = time.monotonic() - t
        plain_req = self.delta(before)
        client.close()
        r = {
            "db_bytes": size, "rows": rows, "workers": workers,
            "writer_snapshot_s": round(snapshot_s, 2),
            "writer_snapshot_MBps": round(size / MB / snapshot_s, 1),
            "copier_s": round(copier_s, 2), "copier_MBps": round(size / MB / copier_s, 2),
            "copier_requests": copier_req["requests"],
            "plain_upload_s": round(plain_s, 2), "plain_upload_MBps": round(size / MB / plain_s, 2),
            "plain_upload_requests": plain_req["requests"],
            "copier_vs_plain": round(plain_s / copier_s, 3),
            "stored_bytes": stored,
        }
        self.results["sync"] = r
        log("sync of %.0f MiB: copier %.1f MB/s (%d requests), plain upload_file %.1f MB/s (%d)"
            % (size / MB, r["copier_MBps"], r["copier_requests"], r["plain_upload_MBps"],
               r["plain_upload_requests"]))

    # -- 4. what the store gives ------------------------------------------
    def bench_ceiling(self) -> None:
        store = self.store(self.chunks_bucket, self.manifests_bucket, max_pool_connections=64)
        names = [o.key for o in store.chunks.list()][: max(64, self.args.ceiling_gets)]
        threads = 16
        before = self.counted()
        t = time.monotonic()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(lambda n: len(store.chunks.get(n)), names))
        dt = time.monotonic() - t
        store.close()
        client = self.boto3()
        t = time.monotonic()
        body = client.get_object(Bucket=self.raw_bucket, Key="src.db")["Body"]
        n = 0
        while True:
            b = body.read(1 << 20)
            if not b:
                break
            n += len(b)
        whole_s = time.monotonic() - t
        # One small ranged GET of the big object (what s3fs/rclone pay per seek).
        lat = []
        for i in range(5):
            t = time.monotonic()
            client.get_object(Bucket=self.raw_bucket, Key="src.db",
                              Range="bytes=%d-%d" % (i * MB, i * MB + 65535))["Body"].read()
            lat.append(time.monotonic() - t)
        client.close()
        self.results["ceiling"] = {
            "chunk_get_threads": threads, "chunk_gets": len(names),
            "chunk_GETs_per_s": round(len(names) / dt, 1),
            "chunk_MBps": round(total / dt / 1e6, 1),
            "whole_object_GET_MBps": round(n / whole_s / 1e6, 1),
            "ranged_64k_GET_ms": round(median(lat) * 1e3, 1),
            "requests": self.delta(before)["requests"],
        }
        log("ceiling: %s" % self.results["ceiling"])

    # -- 5. readers -------------------------------------------------------
    def _mount(self, system: str):
        """(handle, path of the database) on a fresh mount with empty caches."""
        self.n_mounts += 1
        mnt = os.path.join(self.work, "mnt-%s-%d" % (system, self.n_mounts))
        if system == "verneuil":
            cache = os.path.join(self.work, "vcache-%d" % self.n_mounts)
            opts = "cache_dir=%s,cache_size=%dM,refresh=3600,log_file=%s" % (
                cache, 2 * self.args.size_mb + 256, mnt + ".log")
            if self.args.mount_options:
                opts += "," + self.args.mount_options
            m = Mount(self.store_url(self.chunks_bucket, self.manifests_bucket), mnt, opts).start(60)
            try:
                return m, find_file(mnt, "src.db")
            except BaseException:
                m.stop()
                raise
        if system == "s3fs":
            m = peers.S3fsMount(self.proxy.endpoint, self.raw_bucket, mnt, self.work).start("src.db")
            return m, m.path("src.db")
        if system.startswith("rclone_"):
            cache = os.path.join(self.work, "rcache-%d" % self.n_mounts)
            m = peers.RcloneMount(self.proxy.endpoint, self.raw_bucket, mnt, self.work,
                                  system.split("_", 1)[1], cache).start("src.db")
            return m, m.path("src.db")
        raise ValueError(system)

    def _profile(self, pid: int, system: str):
        """With --profile DIR: py-spy sampling `pid` without pausing it (a
        paused mount misses its GETs' deadlines and retries them: a scan 50x
        slower), as collapsed stacks in DIR/<system>-<n>.txt, until SIGINT;
        else None."""
        if not self.args.profile or system != "verneuil":
            return None
        os.makedirs(self.args.profile, exist_ok=True)
        out = os.path.join(self.args.profile, "%s-%d.txt" % (system, self.n_mounts))
        spy = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "--pid",
                                str(pid), "--format", "raw", "--rate", "250", "--threads", "--nonblocking",
                                "-o", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached
        return spy

    def _perf(self, system: str):
        """With --perf DIR: `perf record` of the whole machine (every process
        and the kernel, call graphs) during `system`'s cold scan, in
        DIR/<system>-<n>.data, until SIGINT; else None."""
        if not self.args.perf:
            return None
        if shutil.which("perf") is None:
            raise RuntimeError("--perf needs perf (Debian package linux-perf)")
        os.makedirs(self.args.perf, exist_ok=True)
        out = os.path.join(self.args.perf, "%s-%d.data" % (system, self.n_mounts))
        rec = subprocess.Popen(["perf", "record", "-a", "-g", "-F", str(PERF_HZ), "-o", out],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # recording
        return rec

    def _drop_caches_on_disk(self) -> None:
        """Remove the disk caches of stopped mounts (bounded disk use)."""
        for name in os.listdir(self.work):
            if name.startswith(("vcache-", "rcache-")):
                shutil.rmtree(os.path.join(self.work, name), ignore_errors=True)

    def _timed(self, path: str, sql: str, params=()) -> tuple[float, object]:
        t = time.monotonic()
        con = sqlite_ro(path)
        try:
            value = con.execute(sql, params).fetchone()
        finally:
            con.close()
        return time.monotonic() - t, value

    def _restore(self) -> tuple[float, dict, str]:
        out = os.path.join(self.work, "restored.db")
        if os.path.exists(out):
            os.unlink(out)
        cmd = [sys.executable, "-m", "verneuil_fuse.cli", "restore", "-q",
               "--store", self.store_url(self.chunks_bucket, self.manifests_bucket),
               "-s", os.path.realpath(self.db), "-o", out]
        before = self.counted()
        t = time.monotonic()
        subprocess.run(cmd, check=True, timeout=3600, stdin=subprocess.DEVNULL)
        return time.monotonic() - t, self.delta(before), out

    def bench_read(self, key: str = "read", only: tuple = ()) -> None:
        rng = random.Random(7)
        keys = ["%016x" % rng.getrandbits(64) for _ in range(self.args.point_runs)]
        con = sqlite_ro(self.db)
        expected_points = [con.execute(POINT_SQL, (k,)).fetchone() for k in keys]
        expected_scan = con.execute(SCAN_SQL).fetchone()
        con.close()
        size = os.path.getsize(self.db)
        systems = [s for s in SYSTEMS if (not self.args.systems or s in self.args.systems)
                   and (not only or s in only)]
        raw: dict = {s: {"point": [], "scan": [], "warm": [], "hot": []} for s in systems}

        def check(what, got, want):
            if got != want:
                raise AssertionError("%s returned %r, expected %r" % (what, got, want))

        def point(system, i):
            if system == "local":
                drop_page_cache()
                dt, got = self._timed(self.db, POINT_SQL, (keys[i],))
                check("local point", got, expected_points[i])
                return {"s": dt}
            m, path = self._mount(system)
            try:
                drop_page_cache()
                before = self.counted()
                dt, got = self._timed(path, POINT_SQL, (keys[i],))
                d = self.delta(before)
                check("%s point" % system, got, expected_points[i])
                time.sleep(0.5)  # prefetches still in flight land in the total
                d_total = self.delta(before)
            finally:
                m.stop()
                self._drop_caches_on_disk()
            return {"s": dt, **d, "gets_incl_prefetch": d_total["gets"],
                    "bytes_down_incl_prefetch": d_total["bytes_down"]}

        def scans(system):
            if system == "local":
                drop_page_cache()
                dt, got = self._timed(self.db, SCAN_SQL)
                check("local scan", got, expected_scan)
                drop_page_cache()
                dt2, _ = self._timed(self.db, SCAN_SQL)
                dt3, _ = self._timed(self.db, SCAN_SQL)
                return {"s": dt}, {"s": dt2}, {"s": dt3}
            m, path = self._mount(system)
            try:
                drop_page_cache()
                before = self.counted()
                cpu = process_cpu_seconds(m.proc.pid)
                spy = self._profile(m.proc.pid, system)
                rec = self._perf(system)
                threads = thread_cpu_seconds(m.proc.pid)
                machine = machine_busy_seconds()
                dt, got = self._timed(path, SCAN_SQL)
                machine = machine_busy_seconds() - machine
                for sampler in (spy, rec):
                    if sampler is not None:
                        sampler.send_signal(signal.SIGINT)
                        sampler.wait(60)
                after = thread_cpu_seconds(m.proc.pid)
                by_tid = {tid: cpu_s - threads.get(tid, (name, 0.0))[1] for tid, (name, cpu_s) in after.items()}
                if spy is not None:
                    # By thread id: py-spy's stacks name each thread with its id.
                    with open(os.path.join(self.args.profile, "%s-%d-threads.json" % (system, self.n_mounts)),
                              "w") as f:
                        json.dump({k: round(v, 3) for k, v in sorted(by_tid.items())}, f, indent=1)
                d = self.delta(before)
                d["cpu_s"] = round(process_cpu_seconds(m.proc.pid) - cpu, 3)
                d["machine_busy_cores"] = round(machine / dt, 2)  # every process's, the kernel's too
                if d["gets"]:
                    d["cpu_ms_per_get"] = round(d["cpu_s"] * 1e3 / d["gets"], 3)
                    d["cpu_ms_per_get_by_thread"] = thread_roles(m.proc.pid, after, by_tid, d["gets"])
                check("%s scan" % system, got, expected_scan)
                drop_page_cache()
                before = self.counted()
                dt2, got = self._timed(path, SCAN_SQL)
                d2 = self.delta(before)
                check("%s warm scan" % system, got, expected_scan)
                # Hot: once more, the kernel's page cache kept.
                before = self.counted()
                dt3, got = self._timed(path, SCAN_SQL)
                d3 = self.delta(before)
                check("%s hot scan" % system, got, expected_scan)
            finally:
                m.stop()
                self._drop_caches_on_disk()
            return {"s": dt, **d}, {"s": dt2, **d2}, {"s": dt3, **d3}

        def restore_run(i):
            drop_page_cache()
            rs, d, path = self._restore()
            dt, got = self._timed(path, POINT_SQL, (keys[i % len(keys)],))
            check("restore point", got, expected_points[i % len(keys)])
            ds, got = self._timed(path, SCAN_SQL)
            check("restore scan", got, expected_scan)
            drop_page_cache()
            dw, _ = self._timed(path, SCAN_SQL)
            dh, _ = self._timed(path, SCAN_SQL)
            os.unlink(path)
            raw["restore"]["point"].append({"s": rs + dt, "restore_s": rs, **d})
            raw["restore"]["scan"].append({"s": rs + ds, "restore_s": rs, **d})
            raw["restore"]["warm"].append({"s": dw, "requests": 0, "gets": 0, "bytes_down": 0})
            raw["restore"]["hot"].append({"s": dh, "requests": 0, "gets": 0, "bytes_down": 0})

        # Runs are interleaved (run 1 of every system, then run 2, ...) so
        # that slow drifts of the machine hit every system alike.
        for i in range(max(self.args.runs, self.args.point_runs)):
            for system in systems:
                if system == "restore":
                    if i < self.args.runs:
                        restore_run(i)
                    continue
                if i < self.args.point_runs:
                    raw[system]["point"].append(point(system, i))
                if i < self.args.runs:
                    c, w, h = scans(system)
                    raw[system]["scan"].append(c)
                    raw[system]["warm"].append(w)
                    raw[system]["hot"].append(h)
            if i < self.args.runs:
                log("read run %d, cold scans (s): %s" % (
                    i + 1, {s: round(raw[s]["scan"][-1]["s"], 2) for s in systems if raw[s]["scan"]}))
        out = {"db_bytes": size, "rows": self.rows, "point_sql": POINT_SQL, "scan_sql": SCAN_SQL,
               "open": "file:...?immutable=1", "systems": {}}
        for system in systems:
            agg = {}
            for kind in ("point", "scan", "warm", "hot"):
                runs = raw[system][kind]
                if not runs:
                    continue
                fig = {"runs": len(runs), "median_s": round(median([r["s"] for r in runs]), 4),
                       "all_s": [round(r["s"], 4) for r in runs]}
                for k in ("requests", "gets", "revalidations", "lists", "heads", "bytes_down", "restore_s",
                          "gets_incl_prefetch", "bytes_down_incl_prefetch", "cpu_s", "cpu_ms_per_get",
                          "machine_busy_cores"):
                    vals = [r[k] for r in runs if k in r]
                    if vals:
                        fig[k] = median(vals)
                cpus = [r["cpu_s"] for r in runs if "cpu_s" in r]
                if len(cpus) == len(runs):  # each run's, beside all_s (builds compared run by run)
                    fig["all_cpu_s"] = cpus
                split = [r["cpu_ms_per_get_by_thread"] for r in runs if "cpu_ms_per_get_by_thread" in r]
                if split:
                    fig["cpu_ms_per_get_by_thread"] = {role: median([x[role] for x in split]) for role in split[0]}
                    if len(split) == len(runs):
                        fig["all_cpu_ms_per_get_by_thread"] = split
                if kind != "point":
                    fig["MBps"] = round(size / 1e6 / fig["median_s"], 1)
                agg[kind] = fig
            out["systems"][system] = agg
        self.results[key] = out

    # -- 5b. the readers against a store that is not the bottleneck ------
    def bench_rig(self) -> None:
        """The read phase again, with nginx serving the chunk objects and the
        raw file (benchlib/nginx_rig.py) and moto the rest, the same latency
        added per request; first the rig's own ceiling from curl, a C client."""
        version = nginx_rig.ensure_nginx(log)
        if version is None:
            raise RuntimeError("nginx with its echo module is not available (Debian: nginx-light, "
                               "libnginx-mod-http-echo)")
        static = self._rig_static_dir()
        t = time.monotonic()
        n = self._export_static(static)
        # Written back before any figure: the kernel's writeback of the
        # export (twice the database) would otherwise share the cores with
        # the first measurements.
        os.sync()
        log("rig: %d chunk objects and the raw file exported in %.0f s" % (n, time.monotonic() - t))
        moto_port = urllib.parse.urlparse(self.server.moto_endpoint).port
        rig = nginx_rig.NginxRig(os.path.join(self.work, "nginx"), static,
                                 [self.chunks_bucket, self.raw_bucket], moto_port, self.args.latency_ms)
        proxy, self.proxy = self.proxy, rig  # every reader's endpoint and meter
        try:
            self.results["rig"] = {"nginx": version, "latency_ms": self.args.latency_ms,
                                   "ceiling": self._rig_ceiling(rig, static)}
            log("rig ceiling: %s" % self.results["rig"]["ceiling"])
            if self.args.layout == "chunks":  # the chunk objects one by one, and packed (what packing buys)
                self.results["rig"]["chunk_path"] = self._rig_chunk_path(rig, static)
                log("rig chunk path: %s" % self.results["rig"]["chunk_path"])
            self.bench_read("read_rig", RIG_SYSTEMS)
            self.results["rig"]["sync"] = self._rig_sync()
            log("rig sync: %s" % self.results["rig"]["sync"])
        finally:
            self.proxy = proxy
            rig.close()
            shutil.rmtree(static, ignore_errors=True)

    def _rig_static_dir(self) -> str:
        """Where nginx's files go: in RAM (tmpfs) when it has room, so that
        the rig serves them from memory however long the benchmark runs
        (this VM's host pages out what stays untouched for a minute, page
        cache included, which would leave nginx's one worker waiting on the
        disk); else in the work directory."""
        need = 3 * os.path.getsize(self.db)  # the chunk objects, the raw file, the packs
        if os.path.isdir(RAM_DIR) and shutil.disk_usage(RAM_DIR).free > need + MB * 1024:
            return tempfile.mkdtemp(prefix="bench-rig-", dir=RAM_DIR)
        return os.path.join(self.work, "static")

    def _rig_sync(self) -> dict:
        """The initial sync again, to the rig (chunk PUTs land in nginx's
        files): `verneuilctl flush` with its default options after a fresh
        full snapshot, beside one plain boto3 upload_file of the same file
        (multipart, to moto through nginx); each process's own CPU."""
        import resource

        import bench_copier
        from boto3.s3.transfer import TransferConfig

        spool = os.path.join(self.work, "rig-spool")
        os.makedirs(spool)
        conn = bench_copier.open_writer(spool, self.db)  # a new spool: the whole file
        conn.execute("PRAGMA user_version = 2")
        conn.close()
        size = os.path.getsize(self.db)
        before, children = self.counted(), resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.monotonic()
        subprocess.run([sys.executable, "-m", "verneuil_fuse.cli", "flush", "-q", "--store",
                        self.store_url(self.chunks_bucket, self.manifests_bucket), "--spool", spool],
                       check=True, timeout=3600, stdin=subprocess.DEVNULL)
        flush_s = time.monotonic() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
        puts = self.delta(before)["puts"]
        client = self.boto3()
        t = time.monotonic()
        client.upload_file(self.db, self.raw_bucket, "rig-upload.db",
                           Config=TransferConfig(max_concurrency=self.args.workers))
        plain_s = time.monotonic() - t
        client.close()
        return {"flush": "verneuilctl flush (default options)", "flush_s": round(flush_s, 2),
                "flush_MBps": round(size / MB / flush_s, 1), "flush_puts": puts,
                "flush_cpu_s": round(cpu, 2), "flush_cpu_ms_per_put": round(cpu * 1e3 / max(1, puts), 3),
                "plain_upload_s": round(plain_s, 2), "plain_upload_MBps": round(size / MB / plain_s, 1),
                "flush_vs_plain": round(plain_s / flush_s, 3)}

    def _export_static(self, static: str) -> int:
        """The chunk bucket's objects and the raw file as files under
        `static`/<bucket>/<key> (what nginx serves); returns the chunk count."""
        import boto3
        from botocore.config import Config
        client = boto3.client("s3", endpoint_url=self.server.moto_endpoint, region_name=REGION,
                              config=Config(max_pool_connections=32, s3={"addressing_style": "path"}))
        chunk_dir = os.path.join(static, self.chunks_bucket)
        os.makedirs(chunk_dir)
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.chunks_bucket)
                for o in page.get("Contents", [])]

        def fetch(key: str) -> None:
            body = client.get_object(Bucket=self.chunks_bucket, Key=key)["Body"].read()
            with open(os.path.join(chunk_dir, key), "wb") as f:
                f.write(body)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(fetch, keys))
        client.close()
        os.makedirs(os.path.join(static, self.raw_bucket))
        shutil.copyfile(self.db, os.path.join(static, self.raw_bucket, "src.db"))
        return len(keys)

    def _rig_ceiling(self, rig, static: str) -> dict:
        """curl --parallel over chunk objects (GETs/s, nginx's CPU per GET)
        and one whole-object GET of the raw file."""
        names = sorted(os.listdir(os.path.join(static, self.chunks_bucket)))[: self.args.ceiling_gets]
        cfg = os.path.join(self.work, "curl-urls.cfg")
        with open(cfg, "w") as f:
            for name in names:
                f.write('url = "%s/%s/%s"\noutput = "/dev/null"\n'
                        % (rig.endpoint, self.chunks_bucket, urllib.parse.quote(name, safe="")))
        out = {"client": "curl --parallel", "chunk_gets": len(names)}
        for parallel in (16, 64):
            cpu = rig.worker_cpu_seconds()
            t = time.monotonic()
            subprocess.run(["curl", "-sS", "--no-progress-meter", "--fail", "--parallel", "--parallel-max", str(parallel), "-K", cfg],
                           check=True, timeout=600, stdout=subprocess.DEVNULL)
            dt = time.monotonic() - t
            out["GETs_per_s_%d" % parallel] = round(len(names) / dt, 1)
            out["nginx_cpu_ms_per_get_%d" % parallel] = round((rig.worker_cpu_seconds() - cpu) * 1e3 / len(names), 3)
        t = time.monotonic()
        subprocess.run(["curl", "-s", "--fail", "-o", "/dev/null",
                        "%s/%s/src.db" % (rig.endpoint, self.raw_bucket)], check=True, timeout=600)
        out["whole_object_GET_MBps"] = round(os.path.getsize(self.db) / 1e6 / (time.monotonic() - t), 1)
        out["bound"] = ("%d in flight / %.0f ms per request = %.0f GETs/s at most"
                        % (64, self.args.latency_ms, 64 / (self.args.latency_ms / 1e3))
                        if self.args.latency_ms else "nginx's one worker")
        return out

    def _rig_chunk_path(self, rig, static: str) -> dict:
        """The mount's work per chunk on its engine's side, without FUSE:
        one GET per chunk object on the chunk engine in C, the mount's
        (`chunk_engine_run`); the same on the store's HTTP engine in Python
        (`chunk_path_run`), then the same chunks packed `PACK_CHUNKS` to an
        object (`make_packs`), the layout docs/BENCHMARKS.md weighs."""
        import multiprocessing

        chunk_dir = os.path.join(static, self.chunks_bucket)
        singles, packs = make_packs(chunk_dir)
        os.sync()  # the packs written back before the figures, as the export
        url = "%s/%s/" % (rig.endpoint, self.chunks_bucket)
        # The runs in a new process, as a mount is, so that what the earlier
        # phases left in this one (the copier's objects, boto3's, the
        # proxy's threads) does not weigh on it; each run twice, the second
        # kept: the first of a series pays for memory the host took back
        # (docs/BENCHMARKS.md), whichever it is.
        try:
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                def second(fn, objects):
                    pool.apply(fn, (url, objects, self.work))
                    return pool.apply(fn, (url, objects, self.work))

                return {"chunks": len(singles), "in_flight": CHUNK_PATH_IN_FLIGHT, "pack_chunks": PACK_CHUNKS,
                        "engine": second(chunk_engine_run, singles), "singles": second(chunk_path_run, singles),
                        "packs": second(chunk_path_run, packs)}
        finally:
            for pack, _ in packs:
                os.unlink(os.path.join(chunk_dir, pack))

    # -- 6. fan-out -------------------------------------------------------
    def bench_fanout(self) -> None:
        import bench_copier

        from verneuil_fuse.copier import Copier

        work = os.path.join(self.work, "fanout")
        dbdir = os.path.join(work, "tenants")
        spool = os.path.join(work, "spool")
        os.makedirs(dbdir)
        os.makedirs(spool)
        n, kb = self.args.fanout_dbs, self.args.fanout_kb
        rows_per_db = max(10, kb * 1024 // 140)
        raw_bytes = 0
        t = time.monotonic()
        for i in range(n):
            path = os.path.join(dbdir, "tenant%03d.db" % i)
            make_events_db(path, rows_per_db, i)
            con = bench_copier.open_writer(spool, path)  # first write: a full snapshot
            con.execute("PRAGMA user_version = 1")
            con.close()
            raw_bytes += os.path.getsize(path)
        build_s = time.monotonic() - t
        chunks = self.server.new_bucket("fanout-chunks")
        manifests = self.server.new_bucket("fanout-manifests", versioned=True)
        store = self.store(chunks, manifests, max_pool_connections=64)
        copier = Copier(spool, store, rate=0, workers=self.args.workers)
        t = time.monotonic()
        copier.flush(timeout=1800)
        sync_s = time.monotonic() - t
        copier.close()
        stored = sum(o.size for o in store.chunks.list()) + sum(o.size for o in store.manifests.list())
        store.close()
        # The expected answer, from the source files.
        expected = [0, 0.0, 0]
        for p in sorted(os.listdir(dbdir)):
            con = sqlite_ro(os.path.join(dbdir, p))
            row = con.execute(FANOUT_SQL).fetchone()
            con.close()
            expected = [expected[0] + row[0], expected[1] + row[1], expected[2] + row[2]]
        child_out = os.path.join(work, "child.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--fanout-child",
               "--child-store", self.store_url(chunks, manifests),
               "--child-dir", os.path.realpath(dbdir), "--child-out", child_out,
               "--child-work", work, "--spark-runs", str(self.cfg["spark_runs"])]
        timeout = SPARK_CHILD_TIMEOUT[self.args.mode]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)
            raise TimeoutError("the fan-out child took more than %d s" % timeout)
        finally:
            for line in open("/proc/self/mountinfo").read().splitlines():
                f = line.split()
                if len(f) > 4 and f[4].startswith(work):
                    unmount(f[4])
        if proc.returncode != 0:
            raise RuntimeError("the fan-out child exited with %d" % proc.returncode)
        with open(child_out) as f:
            r = json.load(f)
        for variant in ("python", "spark"):
            for kind in ("cold", "warm"):
                got = r[variant][kind]["answer"]
                if got[0] != expected[0] or got[2] != expected[2] or abs(got[1] - expected[1]) > 1e-6 * abs(expected[1]):
                    raise AssertionError("fan-out %s %s answer %r, expected %r"
                                         % (variant, kind, got, expected))
        r.update({"dbs": n, "db_bytes_each": raw_bytes // n, "raw_bytes": raw_bytes,
                  "rows_per_db": rows_per_db, "sql": FANOUT_SQL, "build_s": round(build_s, 1),
                  "sync_s": round(sync_s, 2), "stored_bytes": stored, "answer": expected})
        for kind in ("cold", "warm"):
            r["spark_vs_python_" + kind] = round(
                r["python"][kind]["median_s"] / r["spark"][kind]["median_s"], 3)
        self.results["fanout"] = r
        log("fan-out: python cold %.2f s warm %.2f s; spark cold %.2f s warm %.2f s"
            % (r["python"]["cold"]["median_s"], r["python"]["warm"]["median_s"],
               r["spark"]["cold"]["median_s"], r["spark"]["warm"]["median_s"]))

    # -- 7. storage -------------------------------------------------------
    def bench_storage(self) -> None:
        import bench_copier

        work = os.path.join(self.work, "dedup")
        os.makedirs(work)
        view = ServerView(self.server, self.proxy.endpoint)
        r = bench_copier.bench_dedup(view, work, self.args.dedup_dbs, self.args.dedup_mb)
        out = {"dedup": {
            "dbs": r["dbs"], "db_mb": self.args.dedup_mb,
            "change": "one 60 KB row rewritten in each copy of one base database",
            "total_db_bytes": r["total_db_bytes"],
            "stored_bytes": r["stored_chunk_bytes"] + r["stored_manifest_bytes"],
            "ratio": round(r["ratio"], 4)}}
        if "sync" in self.results:
            s = self.results["sync"]
            out["sync_db"] = {"db_bytes": s["db_bytes"], "stored_bytes": s["stored_bytes"],
                              "ratio": round(s["stored_bytes"] / s["db_bytes"], 4),
                              "content": "random 200-byte blobs and hex keys (incompressible)"}
        if "fanout" in self.results:
            f = self.results["fanout"]
            out["fanout_dbs"] = {"dbs": f["dbs"], "db_bytes": f["raw_bytes"],
                                 "stored_bytes": f["stored_bytes"],
                                 "ratio": round(f["stored_bytes"] / f["raw_bytes"], 4),
                                 "content": "hex text and numbers (compressible)"}
        self.results["storage"] = out
        log("storage: %s" % out)


# ---------------------------------------------------------- fan-out child
def fanout_child(args) -> int:
    """Runs in its own process (bounded by the parent): Spark local[2] and a
    sequential Python loop over the replicated databases on verneuil mounts;
    for each variant and run, a fresh mount with an empty cache (cold), then
    the same query again after dropping the page cache (warm)."""
    from verneuil_fuse import spark as vspark

    out = {"python": {"cold": [], "warm": []}, "spark": {"cold": [], "warm": []}}
    t = time.monotonic()
    spark = vspark.spark_session("local[2]", app="verneuil-bench")
    out["spark_session_start_s"] = round(time.monotonic() - t, 2)
    from pyspark.sql import functions as F

    def python_loop(paths):
        total = [0, 0.0, 0]
        for p in paths:
            con = sqlite_ro(p)
            n, s, b = con.execute(FANOUT_SQL).fetchone()
            con.close()
            total = [total[0] + n, total[1] + s, total[2] + b]
        return total

    def spark_query(paths, schema=FANOUT_SCHEMA):
        reader = spark.read.format("verneuil").option("query", FANOUT_SQL)
        if schema:
            reader = reader.schema(schema)
        df = reader.option("paths", json.dumps(paths)).load()
        row = df.agg(F.sum("n"), F.sum("total"), F.sum("note_bytes")).collect()[0]
        return [int(row[0]), float(row[1]), int(row[2])]

    mounts = 0
    try:
        # Warm the JVM's code paths once on local files (not timed).
        spark_query(sorted(os.path.join(args.child_dir, p) for p in os.listdir(args.child_dir))[:4])
        for run in range(args.spark_runs):
            for variant, fn in (("python", python_loop), ("spark", spark_query)):
                mounts += 1
                mnt = os.path.join(args.child_work, "mnt-fanout-%d" % mounts)
                opts = "cache_dir=%s,refresh=3600,log_file=%s" % (
                    os.path.join(args.child_work, "fcache-%d" % mounts), mnt + ".log")
                m = Mount(args.child_store, mnt, opts).start(60)
                try:
                    top = os.path.join(mnt, "")
                    first = find_file(top, "tenant000.db")
                    paths = vspark.find_databases(os.path.dirname(first))
                    for kind in ("cold", "warm"):
                        drop_page_cache()
                        before = m.stats()["fetch"]["gets"]
                        t = time.monotonic()
                        answer = fn(paths)
                        dt = time.monotonic() - t
                        out[variant][kind].append({"s": dt, "gets": m.stats()["fetch"]["gets"] - before,
                                                   "answer": answer, "dbs": len(paths)})
                    if variant == "spark" and run == args.spark_runs - 1:
                        # Once: the same warm query letting the source infer
                        # the schema (it opens a database on the driver side).
                        t = time.monotonic()
                        spark_query(paths, schema=None)
                        out["spark_inferred_schema_warm_s"] = round(time.monotonic() - t, 2)
                finally:
                    m.stop()
                print("[fanout child] run %d %s: cold %.2f s, warm %.2f s" % (
                    run + 1, variant, out[variant]["cold"][-1]["s"], out[variant]["warm"][-1]["s"]),
                    flush=True)
    finally:
        from pyspark import SparkContext
        gateway = SparkContext._gateway
        spark.stop()
        proc = getattr(gateway, "proc", None)
        if proc is not None:  # the JVM: ended by its PID, bounded
            try:
                proc.terminate()
                proc.wait(timeout=20)
            except Exception:  # noqa: BLE001
                proc.kill()
    for variant in ("python", "spark"):
        for kind in ("cold", "warm"):
            runs = out[variant][kind]
            out[variant][kind] = {"runs": len(runs),
                                  "median_s": round(median([r["s"] for r in runs]), 3),
                                  "all_s": [round(r["s"], 3) for r in runs],
                                  "gets": median([r["gets"] for r in runs]),
                                  "answer": runs[-1]["answer"], "dbs": runs[-1]["dbs"]}
    out["master"] = "local[2]"
    with open(args.child_out, "w") as f:
        json.dump(out, f)
    return 0


# ------------------------------------------------------------ the summary
def meta(args, cfg) -> dict:
    cpu = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        mem = int(open("/proc/meminfo").readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import moto
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "mode": args.mode,
        "command": args.command_line,
        "machine": "%d cores (%s), %.0f GiB RAM, %s %s" % (
            os.cpu_count() or 0, cpu, mem / (1 << 30), platform.system(), platform.release()),
        "python": platform.python_version(), "sqlite": sqlite3.sqlite_version,
        "moto": moto.__version__,
        "latency_ms": args.latency_ms,
        "layout": args.layout,
        "store": "moto_server on 127.0.0.1 (ranged GETs patched to read only the range), "
                 "behind a proxy adding %.0f ms per request, TCP_NODELAY" % args.latency_ms,
        "size_mb": args.size_mb, "runs": args.runs, "point_runs": args.point_runs,
        "workers": args.workers,
        # Other work on the machine (the 1-minute load average, 2 cores):
        # every figure here shares the cores with moto, the proxy and the mounts.
        "loadavg_start": loadavg(),
    }


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (its threads included)."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds the machine's cores spent busy since boot (/proc/stat:
    all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict:
    """{thread id: (name, user + system CPU seconds)} of a process's threads."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                text = f.read()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def make_packs(chunk_dir: str) -> tuple[list, list]:
    """The chunk objects of `chunk_dir` one by one, and packed
    `PACK_CHUNKS` to an object (their blobs back to back, written there as
    `PACK_PREFIX`... files): two lists of (object name, [(fingerprint, offset
    in the object, blob size)])."""
    from verneuil_fuse.format.names import parse_chunk_name

    names = sorted(n for n in os.listdir(chunk_dir) if not n.startswith(PACK_PREFIX))
    singles, packs = [], []
    for i in range(0, len(names), PACK_CHUNKS):
        pack = "%s%06d" % (PACK_PREFIX, i // PACK_CHUNKS)
        group, off = [], 0
        with open(os.path.join(chunk_dir, pack), "wb") as out:
            for name in names[i:i + PACK_CHUNKS]:
                with open(os.path.join(chunk_dir, name), "rb") as f:
                    blob = f.read()
                out.write(blob)
                fp = parse_chunk_name(name)
                singles.append((name, [(fp, 0, len(blob))]))
                group.append((fp, off, len(blob)))
                off += len(blob)
        packs.append((pack, group))
    return singles, packs


def chunk_engine_run(url: str, objects: list, work: str) -> dict:
    """GET every chunk object of `objects` (`make_packs`'s singles) under
    `url` on the mount's chunk engine in C (`reader.chunk_engine`,
    `CHUNK_PATH_IN_FLIGHT` in flight): each decoded, verified and written
    to a new file with its index record to another, on the engine's thread,
    as the mount's disk cache has them: chunks/s and the CPU per chunk of
    the process (this run's only work)."""
    import resource

    import trio

    from verneuil_fuse.format import CHUNK_SIZE, MAX_CHUNK_BLOB_BYTES
    from verneuil_fuse.reader.chunk_engine import ChunkEngine

    sink, index = tempfile.TemporaryFile(dir=work), tempfile.TemporaryFile(dir=work)
    engine = ChunkEngine(CHUNK_PATH_IN_FLIGHT, MAX_CHUNK_BLOB_BYTES)
    engine.set_auth([], None, 3.0, 15.0)
    failed: list = []

    async def run() -> None:
        started = ended = 0
        with trio.fail_after(600):
            while ended < len(objects):
                n = min(engine.free, len(objects) - started)
                engine.start((k, url + urllib.parse.quote(objects[k][0], safe=""), objects[k][1][0][0],
                              (sink.fileno(), index.fileno(), k * CHUNK_SIZE), 60.0)
                             for k in range(started, started + n))
                started += n
                for k, outcome in await engine.answers():
                    ended += 1
                    if not outcome.written:
                        failed.append((objects[k][0], outcome))

    try:
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        trio.run(run)
        dt, r1 = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_SELF)
    finally:
        engine.close()
        sink.close()
        index.close()
    if failed:
        raise RuntimeError("chunk engine: %d GETs failed, first: %s" % (len(failed), failed[0]))
    cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
    return {"GETs": len(objects), "s": round(dt, 3), "chunks_per_s": round(len(objects) / dt),
            "cpu_ms_per_chunk": round(cpu * 1e3 / len(objects), 3)}


def chunk_path_run(url: str, objects: list, work: str) -> dict:
    """GET every object of `objects` (`make_packs`'s lists) under `url` on
    the store's HTTP engine in Python (`store.curl.CurlEngine`,
    `CHUNK_PATH_IN_FLIGHT` in flight) and, on the engine's thread as the
    mount does, decode and verify each chunk and write it to a new file:
    chunks/s and the CPU per chunk of this thread and the engine's."""
    import threading

    from verneuil_fuse.format import CHUNK_SIZE, decode_chunk
    from verneuil_fuse.store.curl import CurlEngine, Request

    nchunks = sum(len(group) for _, group in objects)
    # A new file, as a cold mount's cache: every write takes fresh pages.
    sink = tempfile.TemporaryFile(dir=work)
    engine = CurlEngine(CHUNK_PATH_IN_FLIGHT)
    done = threading.Semaphore(0)
    errors: list = []
    # The engine thread's CPU since it started, read on that thread after
    # each answer (clock_gettime's thread clock: nanoseconds, where
    # /proc's ticks of 10 ms round a quick run's few chunks to 0).
    engine_cpu = [0.0]
    slot = iter(range(nchunks))

    def answer(group, result) -> None:  # on the engine's thread
        try:
            if isinstance(result, OSError) or result.status != 200:
                raise RuntimeError("GET failed: %r" % (result,))
            body = result.body
            for fp, off, size in group:
                data = decode_chunk(body[off:off + size] if len(group) > 1 else body, fp)
                os.pwrite(sink.fileno(), data, next(slot) * CHUNK_SIZE)
        except Exception as e:  # noqa: BLE001 - counted, then raised below
            errors.append(e)
        finally:
            engine_cpu[0] = time.thread_time()
            done.release()

    def wait_answer() -> None:
        if not done.acquire(timeout=600):
            raise RuntimeError("chunk path: no answer in 600 s")

    try:
        engine.submit_many([])  # its thread started
        c0, t0 = time.thread_time(), time.monotonic()
        # Submitted as answers come back, a few in the engine's queue beyond
        # those in flight, as the mount's readahead does (not thousands at
        # once: their objects would weigh on every pass of Python's garbage
        # collector).
        answered = 0
        for i in range(0, len(objects), CHUNK_PATH_BATCH):
            while i - answered > CHUNK_PATH_IN_FLIGHT:
                wait_answer()
                answered += 1
            engine.submit_many([(Request("GET", url + urllib.parse.quote(name, safe=""), []),
                                 functools.partial(answer, group))
                                for name, group in objects[i:i + CHUNK_PATH_BATCH]])
        for _ in range(len(objects) - answered):
            wait_answer()
        dt, c1 = time.monotonic() - t0, time.thread_time()
    finally:
        engine.close()
        sink.close()
    if errors:
        raise RuntimeError("chunk path: %d answers failed, first: %s" % (len(errors), errors[0]))
    # This thread's CPU and the engine's, not the process's: the proxy's
    # threads and what earlier phases left run beside.
    cpu = c1 - c0 + engine_cpu[0]
    return {"GETs": len(objects), "s": round(dt, 3), "chunks_per_s": round(nchunks / dt),
            "cpu_ms_per_chunk": round(cpu * 1e3 / nchunks, 3)}


def thread_roles(pid: int, names: dict, cpu_by_tid: dict, gets: int) -> dict:
    """A mount's CPU per GET by what its threads do: trio's (the main
    thread: FUSE requests and replies, flights, readahead), trio's worker
    threads (named so by trio), and the HTTP engines' (the other threads,
    which Python leaves unnamed: requests, decoding and verifying answers,
    cache writes)."""
    roles = {"trio": 0.0, "engine": 0.0, "workers": 0.0}
    for tid, cpu_s in cpu_by_tid.items():
        name = names.get(tid, ("", 0.0))[0]
        role = "trio" if tid == str(pid) else "workers" if name.startswith("Trio thread") else "engine"
        roles[role] += cpu_s
    return {role: round(cpu_s * 1e3 / gets, 3) for role, cpu_s in roles.items()}


def loadavg() -> float | None:
    try:
        return float(open("/proc/loadavg").read().split()[0])
    except (OSError, ValueError):
        return None


def summarize(r: dict) -> dict:
    """The headline ratios, all between figures of this run."""
    s = {}
    w = r.get("writer", {}).get("sync", {})
    for sync in ("FULL", "OFF"):
        if sync in w:
            s["writer_commit_ratio_%s" % sync.lower()] = w[sync]["ratio"]
    if "lag" in r:
        s["lag_median_ms"] = r["lag"]["median_ms"]
    if "sync" in r:
        s["sync_copier_vs_plain"] = r["sync"]["copier_vs_plain"]
    read = r.get("read", {}).get("systems", {})
    v = read.get("verneuil")
    if v:
        for other in read:
            if other == "verneuil":
                continue
            o = read[other]
            for kind in ("point", "scan", "warm", "hot"):
                if kind in v and kind in o and v[kind]["median_s"]:
                    s["%s_%s_vs_verneuil" % (kind, other)] = round(
                        o[kind]["median_s"] / v[kind]["median_s"], 3)
    if "fanout" in r:
        s["fanout_spark_vs_python_cold"] = r["fanout"]["spark_vs_python_cold"]
        s["fanout_spark_vs_python_warm"] = r["fanout"]["spark_vs_python_warm"]
    if "storage" in r:
        s["dedup_stored_ratio"] = r["storage"]["dedup"]["ratio"]
    return s


T0 = time.monotonic()


def write_report(results: dict, out: str, plots: bool = True) -> None:
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(report.markdown(results))
    if plots:
        try:
            for path in report.plots(results, out):
                log("wrote %s" % path)
        except ImportError as e:
            log("no plots: %s (pip install matplotlib into .venv)" % e)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true", help="small databases, one run each (< 5 min)")
    p.add_argument("--out", help="where results.json, results.md and the PNGs go "
                                 "(default: docs/bench, or bench-results/quick with --quick)")
    p.add_argument("--size-mb", type=int, help="database for the readers (full: 768, quick: 16)")
    p.add_argument("--runs", type=int, help="runs per figure (full: 3, quick: 1)")
    p.add_argument("--point-runs", type=int, help="cold point queries (full: 5, quick: 1)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="added per request (default 20)")
    p.add_argument("--workers", type=int, default=16, help="parallel uploads (copier, boto3)")
    p.add_argument("--lag-hz", type=float, default=10.0, help="commits per second in the lag test")
    p.add_argument("--fanout-dbs", type=int, help="databases in the fan-out (default 100)")
    p.add_argument("--fanout-kb", type=int, help="size of each (full: 1024, quick: 128)")
    p.add_argument("--dedup-dbs", type=int, help="databases in the dedup test")
    p.add_argument("--dedup-mb", type=int, help="size of each")
    p.add_argument("--ceiling-gets", type=int, default=2000, help="64 KiB GETs in the ceiling test")
    p.add_argument("--only", action="append",
                   choices=["writer", "lag", "sync", "ceiling", "read", "rig", "fanout", "storage"],
                   help="run only these phases (sync is needed by ceiling and read)")
    p.add_argument("--systems", action="append", choices=SYSTEMS, help="readers to compare")
    p.add_argument("--work-dir", help="parent of the temporary directory (default /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--layout", choices=("chunks", "packed"), default="chunks",
                   help="the store layout the copier writes (default chunks, Verneuil's; packed: "
                        "docs/FORMAT.md, \"Packed layout\"); the readers need no option")
    p.add_argument("--mount-options", metavar="OPTS",
                   help="more -o options for the verneuil mounts (e.g. concurrency=64)")
    p.add_argument("--profile", metavar="DIR",
                   help="sample the mount with py-spy during each cold scan (collapsed stacks in DIR)")
    p.add_argument("--perf", metavar="DIR",
                   help="record the whole machine with perf (call graphs) during each cold scan "
                        "(DIR/<system>-<n>.data; `perf report -i ... --sort comm,dso`)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--replot", action="store_true",
                   help="only rewrite results.md and the PNGs from --out's results.json")
    # Internal: the fan-out child process.
    p.add_argument("--fanout-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-store", help=argparse.SUPPRESS)
    p.add_argument("--child-dir", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--child-work", help=argparse.SUPPRESS)
    p.add_argument("--spark-runs", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.fanout_child:
        return fanout_child(args)
    if args.profile and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "py-spy")):
        p.error("--profile needs py-spy beside this Python: .venv/bin/pip install -e '.[bench]'")
    args.mode = "quick" if args.quick else "full"
    cfg = dict(MODES[args.mode])
    for name in ("size_mb", "runs", "point_runs", "fanout_dbs", "fanout_kb", "dedup_dbs", "dedup_mb"):
        if getattr(args, name) is None:
            setattr(args, name, cfg[name])
        else:
            cfg[name] = getattr(args, name)
    args.out = args.out or (os.path.join(ROOT, "bench-results", "quick") if args.quick
                            else os.path.join(ROOT, "docs", "bench"))
    if args.replot:
        with open(os.path.join(args.out, "results.json")) as f:
            results = json.load(f)
        write_report(results, args.out, plots=not args.no_plots)
        return 0
    args.command_line = " ".join(["scripts/bench_all.py"] + list(sys.argv[1:] if argv is None else argv))
    if os.geteuid() != 0:
        print("bench_all: needs root (FUSE mounts, dropping the page cache)", file=sys.stderr)
        return 2
    for tool in ("fusermount3",):
        if shutil.which(tool) is None:
            print("bench_all: %s is missing (Debian package fuse3)" % tool, file=sys.stderr)
            return 2
    os.makedirs(args.out, exist_ok=True)
    bench = Bench(args, cfg)
    log("mode %s, work dir %s, output %s" % (args.mode, bench.work, args.out))
    try:
        results = bench.run()
    finally:
        bench.close()
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    write_report(results, args.out, plots=not args.no_plots)
    print(report.markdown(results))
    log("wrote %s/results.json and results.md in %.0f s" % (args.out, time.monotonic() - T0))
    if results["errors"]:
        log("phases that failed: %s" % results["errors"])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
