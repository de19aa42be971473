#!/usr/bin/env python3
"""The Spark fan-out benchmark at a realistic size (docs/BENCHMARKS.md, "Spark
over many replicas"): one aggregate over every replicated database through a
verneuil mount, by

- `loop`: a sequential Python loop (sqlite3, immutable=1, as the source opens);
- `pool2`: a 2-process multiprocessing pool doing the same, one database a call;
- `spark`: Spark local[2], query mode with the schema given, Arrow batches;
- `spark_tuples`: the same with option arrow=false (rows as tuples);

each cold (a fresh mount with an empty cache, kernel page cache dropped),
warm (the same mount again, its disk cache full, kernel page cache dropped;
--warm-runs times) and hot (again, the page cache kept, as a repeated query
on a machine with the memory sees it; --warm-runs times). Rounds interleave the variants, so a machine's drifts
hit all of them alike.
The store is a local directory (file://): cold figures measure the mount
fetching, decompressing and caching chunks, not a network.

    .venv/bin/python scripts/bench_spark.py --dbs 200 --mb 8 --out bench-spark.json

Also measures the per-query overhead of Spark on 100 tiny databases in an
open session, and `verneuilctl query` over 6 tiny databases end to end.
Every process started (the mount, the Spark JVM, the pool) is stopped by PID
before exit; every wait is bounded."""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT, os.path.join(ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

from benchlib import drop_page_cache, make_events_db  # noqa: E402

# The workloads, one row per database of the same shape: `scan` reads every
# row and does little with it (bound by reading the mount), `search` does a
# substring search in every note as well (bound by SQLite's CPU).
WORKLOADS = {
    "scan": "SELECT count(*) AS n, sum(v) AS total, sum(length(note)) AS note_bytes FROM events",
    "search": "SELECT count(*) AS n, coalesce(sum(v), 0) AS total, "
              "coalesce(sum(length(note)), 0) AS note_bytes FROM events "
              "WHERE note LIKE '%ABCD%' OR note LIKE '%1234%'",
}
SQL = WORKLOADS["scan"]
SCHEMA = "n LONG, total DOUBLE, note_bytes LONG"
# Bytes a row of `events` takes on disk (a 96-character hex note, a kind, a
# REAL and the rowid, with b-tree overhead; 117 measured at 4 KiB pages), a
# little under so each database is at least --mb.
ROW_BYTES = 110
# Seconds the copier may take to ship every database to the store.
SYNC_TIMEOUT = 3600
# Seconds `verneuilctl query` may take before it is stopped.
CTL_TIMEOUT = 300


def log(msg: str) -> None:
    print("[bench_spark %s] %s" % (time.strftime("%H:%M:%S"), msg), flush=True)


def sqlite_ro(path: str) -> sqlite3.Connection:
    return sqlite3.connect("file:%s?immutable=1" % urllib.parse.quote(path), uri=True)


def one_db(path: str) -> tuple:
    con = sqlite_ro(path)
    try:
        return con.execute(SQL).fetchone()
    finally:
        con.close()


def add(rows) -> list:
    total = [0, 0.0, 0]
    for n, s, b in rows:
        total = [total[0] + n, total[1] + s, total[2] + b]
    return total


def build(work: str, dbs: int, mb: int) -> tuple[str, str, int]:
    """`dbs` databases of about `mb` MiB, written through the C VFS and
    shipped by the copier to a file:// store; (source dir, store URL, bytes)."""
    import bench_copier
    from verneuil_fuse import copier

    src, spool = os.path.join(work, "src"), os.path.join(work, "spool")
    store_url = "file://" + os.path.join(work, "store")
    os.makedirs(src)
    rows = max(10, (mb << 20) // ROW_BYTES)
    total = 0
    with copier.start_background(spool, store_url, rate=0) as bg:
        for i in range(dbs):
            path = os.path.join(src, "tenant%03d.db" % i)
            make_events_db(path, rows, i)
            con = bench_copier.open_writer(spool, path)  # first write: a full snapshot
            con.execute("PRAGMA user_version = 1")
            con.close()
            total += os.path.getsize(path)
            if i % 20 == 19:
                log("built %d/%d databases" % (i + 1, dbs))
        bg.flush(timeout=SYNC_TIMEOUT)
    return src, store_url, total


class Runner:
    """The variants, each given the replica paths and returning the answer."""

    def __init__(self, spark, pool):
        self.spark, self.pool = spark, pool

    def loop(self, paths):
        return add(one_db(p) for p in paths)

    def pool2(self, paths):
        return add(self.pool.map(one_db, paths, chunksize=1))

    def spark_query(self, paths, arrow="true"):
        from pyspark.sql import functions as F
        df = (self.spark.read.format("verneuil").schema(SCHEMA).option("query", SQL)
              .option("arrow", arrow).option("paths", json.dumps(paths)).load())
        row = df.agg(F.sum("n"), F.sum("total"), F.sum("note_bytes")).collect()[0]
        return [int(row[0]), float(row[1]), int(row[2])]

    def spark_tuples(self, paths):
        return self.spark_query(paths, arrow="false")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (all its threads)."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU time the whole machine has spent busy (user, nice, system, irq,
    softirq; all cores), from /proc/stat: what a query costs every process
    on the machine, the JVM and Python workers included."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:8]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields)
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def fanout(args, src: str, store_url: str, runner: Runner, expected: list) -> dict:
    from support.replicas import Mount
    from verneuil_fuse.format import local_hostname
    from verneuil_fuse.spark import find_databases

    variants = {"loop": runner.loop, "pool2": runner.pool2, "spark": runner.spark_query,
                "spark_tuples": runner.spark_tuples}
    out = {v: {"cold": [], "warm": [], "hot": []} for v in variants}
    mount_cpu = {v: {"cold": [], "warm": [], "hot": []} for v in variants}
    machine_cpu = {v: {"cold": [], "warm": [], "hot": []} for v in variants}
    mounts = 0
    for run in range(args.runs):
        for name, fn in variants.items():
            mounts += 1
            mnt = os.path.join(args.work, "mnt%d" % mounts)
            m = Mount(store_url, mnt, "cache_dir=%s,refresh=3600%s" % (os.path.join(
                args.work, "cache%d" % mounts), "," + args.options if args.options else "")).start(60)
            try:
                paths = find_databases(m.path(local_hostname(), src))
                for kind in ["cold"] + ["warm"] * args.warm_runs + ["hot"] * args.warm_runs:
                    if kind != "hot":
                        drop_page_cache()
                    t, cpu, busy = time.monotonic(), cpu_seconds(m.proc.pid), machine_busy_seconds()
                    got = fn(paths)
                    dt = time.monotonic() - t
                    mount_cpu[name][kind].append(round(cpu_seconds(m.proc.pid) - cpu, 2))
                    machine_cpu[name][kind].append(round(machine_busy_seconds() - busy, 2))
                    if got[0] != expected[0] or got[2] != expected[2] or abs(got[1] - expected[1]) > 1e-6 * abs(expected[1]):
                        raise AssertionError("%s %s answered %r, expected %r" % (name, kind, got, expected))
                    out[name][kind].append(round(dt, 3))
                    log("run %d %s %s: %.2f s (mount CPU %.2f s, machine CPU %.2f s)"
                        % (run + 1, name, kind, dt, mount_cpu[name][kind][-1], machine_cpu[name][kind][-1]))
            finally:
                m.stop()
    return out, mount_cpu, machine_cpu


def overhead(spark, work: str) -> dict:
    """Seconds per query on 100 tiny databases in an open session (median
    of 5, after one untimed), beside the same loop in Python."""
    tiny = os.path.join(work, "tiny")
    os.makedirs(tiny)
    for i in range(100):
        con = sqlite3.connect(os.path.join(tiny, "t%03d.db" % i))
        con.execute("CREATE TABLE events(kind TEXT, v REAL, note TEXT)")
        con.executemany("INSERT INTO events VALUES (?, ?, ?)", [("k%d" % j, j * 0.5, "x") for j in range(20)])
        con.commit()
        con.close()
    paths = sorted(os.path.join(tiny, p) for p in os.listdir(tiny))
    runner = Runner(spark, None)
    runner.spark_query(paths)
    times = []
    for _ in range(5):
        t = time.monotonic()
        runner.spark_query(paths)
        times.append(time.monotonic() - t)
    t = time.monotonic()
    runner.loop(paths)
    return {"dbs": 100, "spark_median_s": round(statistics.median(times), 3),
            "spark_all_s": [round(x, 3) for x in times], "loop_s": round(time.monotonic() - t, 4)}


def ctl_query(work: str) -> dict:
    """`verneuilctl query` over 6 tiny databases, end to end (JVM start in)."""
    six = os.path.join(work, "six")
    os.makedirs(six)
    for i in range(6):
        con = sqlite3.connect(os.path.join(six, "t%d.db" % i))
        con.execute("CREATE TABLE events(kind TEXT, v REAL)")
        con.executemany("INSERT INTO events VALUES (?, ?)", [("a", i), ("b", 2)])
        con.commit()
        con.close()
    ctl = os.path.join(os.path.dirname(sys.executable), "verneuilctl")
    times = []
    for _ in range(3):
        t = time.monotonic()
        subprocess.run([ctl, "query", six, "SELECT kind, sum(v) AS s FROM events GROUP BY kind",
                        "--master", "local[2]"], check=True, capture_output=True, timeout=CTL_TIMEOUT)
        times.append(time.monotonic() - t)
    return {"dbs": 6, "median_s": round(statistics.median(times), 2), "all_s": [round(x, 2) for x in times]}


def stop_spark(spark) -> None:
    from pyspark import SparkContext
    gateway = SparkContext._gateway
    spark.stop()
    proc = getattr(gateway, "proc", None)
    if proc is not None:  # the JVM, by its PID, bounded
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def run_fanout(args, spark, pool) -> dict:
    """Build and ship the databases, run every variant, and summarise."""
    t = time.monotonic()
    src, store_url, raw = build(args.work, args.dbs, args.mb)
    out = {"dbs": args.dbs, "db_bytes": raw, "build_s": round(time.monotonic() - t, 1), "sql": SQL,
           "workload": args.workload}
    log("built and shipped %d databases, %.2f GiB, in %.0f s" % (args.dbs, raw / (1 << 30), out["build_s"]))
    expected = add(one_db(os.path.join(src, f)) for f in sorted(os.listdir(src)))
    runner = Runner(spark, pool)
    runner.spark_query(sorted(os.path.join(src, f) for f in os.listdir(src))[:4])  # JIT warm-up
    r, cpu, busy = fanout(args, src, store_url, runner, expected)
    f = out["fanout"] = {v: {k: {"median_s": statistics.median(x), "min_s": min(x), "all_s": x,
                                 "mount_cpu_median_s": statistics.median(cpu[v][k]),
                                 "machine_cpu_median_s": statistics.median(busy[v][k])}
                             for k, x in kinds.items()} for v, kinds in r.items()}
    for kind in ("cold", "warm", "hot"):
        out["spark_vs_loop_" + kind] = round(f["loop"][kind]["median_s"] / f["spark"][kind]["median_s"], 2)
        out["spark_vs_pool2_" + kind] = round(f["pool2"][kind]["median_s"] / f["spark"][kind]["median_s"], 2)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dbs", type=int, default=200)
    p.add_argument("--mb", type=int, default=8, help="MiB per database")
    p.add_argument("--runs", type=int, default=2, help="rounds per variant, each on a new mount")
    p.add_argument("--warm-runs", type=int, default=3, help="warm queries after each cold one")
    p.add_argument("--work", help="scratch directory (default: a new temporary one)")
    p.add_argument("--out", default="bench-spark.json")
    p.add_argument("--options", default="", help="extra mount options (cache_size=0: no disk cache)")
    p.add_argument("--skip-fanout", action="store_true", help="only the overhead figures")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="scan")
    p.add_argument("--skip-overhead", action="store_true",
                   help="no verneuilctl and per-query overhead figures")
    args = p.parse_args()
    own_work = args.work is None  # a temporary one is removed at the end
    args.work = args.work or tempfile.mkdtemp(prefix="bench-spark-")
    global SQL
    SQL = WORKLOADS[args.workload]  # read by the pool's forked workers too
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": "%s, %d cores, Python %s" % (platform.platform(), os.cpu_count() or 0,
                                                      platform.python_version()),
              "build": subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                                      capture_output=True, text=True).stdout.strip(),
              "load_before": os.getloadavg()}
    if not args.skip_overhead:
        result["ctl_query"] = ctl_query(args.work)
        log("verneuilctl query, 6 tiny databases: %s" % result["ctl_query"])
    pool = multiprocessing.get_context("fork").Pool(2)  # before the JVM's threads exist
    from verneuil_fuse.spark import spark_session
    t = time.monotonic()
    spark = spark_session("local[2]", app="verneuil-bench-spark")
    result["session_start_s"] = round(time.monotonic() - t, 2)
    try:
        if not args.skip_overhead:
            result["overhead"] = overhead(spark, args.work)
            log("per-query overhead, 100 tiny databases: %s" % result["overhead"])
        if not args.skip_fanout:
            result.update(run_fanout(args, spark, pool))
    finally:
        stop_spark(spark)
        pool.terminate()
        pool.join()
        if own_work:
            shutil.rmtree(args.work, ignore_errors=True)
    result["load_after"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log("wrote %s" % args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
