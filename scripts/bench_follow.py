#!/usr/bin/env python3
"""Replicas that follow (issue 37): what following gives and what it costs.

    .venv/bin/python scripts/bench_follow.py [--only freshness|torture|hot]
        [--freshness-seconds 120] [--torture-seconds 120] [--rounds 5] [--json FILE]

Needs root (FUSE mounts, dropping the page cache). Phases:

- **freshness**: moto's S3 server; a writer commits once a second through the
  verneuil VFS (tests/support/follow_writer.py); `verneuilctl copier` ships the
  spool with its defaults; a mount with its defaults reads the bucket. A
  long-lived Python connection runs a new read transaction every 10 ms and a
  fresh connection opens every 50 ms: for each commit, the time from its
  COMMIT to the first transaction that sees it (median, p99, max), and the
  store requests per minute of the mount and of the copier (two counting
  proxies, one each).
- **torture**: 16 long-lived connections run multi-statement read
  transactions against an invariant (a zero sum of balances, one row per
  commit) while the writer commits 50 times a second, on a directory store:
  transactions, errors, states each connection saw (the CI test runs 15 s of
  this).
- **hot**: what following costs a hot query: a 64 MiB database on a
  directory store, mounted with ``follow=on`` (the default) and with
  ``follow=off`` (a handle pinned to its version's inode, concurrent handles
  sharing its page cache) in alternate rounds: a point query on a new
  connection each time (open, query, close; ``mode=ro`` and ``immutable=1``),
  the page cache warm; a full scan with the page cache kept (hot) and after
  dropping it (warm: from the mount's disk cache).

Every process started is stopped by its PID; mounts are unmounted with
``fusermount3 -u -z``; every wait is bounded; only 127.0.0.1 is used.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from support.follow_writer import WriterProc, invariant_reader  # noqa: E402
from support.replicas import Mount, make_db, publish, stop_pid, wait_for  # noqa: E402
from support.s3server import Proxy, S3Server, fake_aws_env, patched_environ  # noqa: E402
from verneuil_fuse.format import local_hostname  # noqa: E402
from verneuil_fuse.store import open_store  # noqa: E402

POINT_SQL = "SELECT length(v) FROM t WHERE k >= ? ORDER BY k LIMIT 1"
SCAN_SQL = "SELECT sum(length(v)) FROM t"


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def copier_process(spool: str, url: str, log: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "verneuil_fuse.cli", "copier", "--spool", spool, "--store", url],
                            stdout=subprocess.DEVNULL, stderr=open(log, "ab"))


# ------------------------------------------------------------------ freshness
def _observe(path: str, fresh: bool, seen: dict, stop: threading.Event) -> None:
    """A new read transaction every 10 ms on one connection, or a new
    connection every 50 ms (``fresh``): when each row id was first seen."""
    con = None
    try:
        while not stop.is_set():
            if con is None or fresh:
                if con is not None:
                    con.close()
                con = sqlite3.connect("file:%s?mode=ro" % path, uri=True)
            (n,) = con.execute("SELECT coalesce(max(id), 0) FROM t").fetchone()
            now = time.time()
            for i in range(max(seen, default=0) + 1, n + 1):
                seen[i] = now
            time.sleep(0.05 if fresh else 0.01)
    finally:
        if con is not None:
            con.close()


def freshness(work: str, seconds: float, rate: float) -> dict:
    with patched_environ(fake_aws_env()):
        server = S3Server(log_dir=work)
        try:
            return _freshness(server, work, seconds, rate)
        finally:
            server.close()


def _freshness(server: S3Server, work: str, seconds: float, rate: float) -> dict:
    chunks, manifests = server.new_bucket("f-chunks"), server.new_bucket("f-manifests", versioned=True)
    moto_port = int(server.moto_endpoint.rsplit(":", 1)[1])
    meters = {"copier": Proxy(moto_port), "mount": Proxy(moto_port)}
    for p in meters.values():
        p.start()

    def url(who: str) -> str:
        return server.url(chunks, manifests).replace(server.endpoint, meters[who].endpoint)

    spool, src = os.path.join(work, "spool"), os.path.join(work, "src")
    os.makedirs(spool)
    os.makedirs(src)
    db = os.path.join(os.path.realpath(src), "app.db")
    copier = copier_process(spool, url("copier"), os.path.join(work, "copier.log"))
    mount = Mount(url("mount"), os.path.join(work, "mnt"), "cache_dir=%s,log_file=%s"
                  % (os.path.join(work, "cache"), os.path.join(work, "mount.log")))
    try:
        WriterProc(spool, db, rate, commits=1).wait(60)
        mount.start()
        path = mount.path(local_hostname(), db)
        wait_for(lambda: os.path.exists(path), 60, "the replica")
        seen: dict[str, dict[int, float]] = {"long_lived": {}, "new_connection": {}}
        stop = threading.Event()
        threads = [threading.Thread(target=_observe, args=(path, kind == "new_connection", seen[kind], stop))
                   for kind in seen]
        for t in threads:
            t.start()
        time.sleep(2)
        before = {who: p.snapshot() for who, p in meters.items()}
        started = time.monotonic()
        writer = WriterProc(spool, db, rate, seconds=seconds)
        writer.wait(seconds + 60)
        elapsed = time.monotonic() - started
        after = {who: p.snapshot() for who, p in meters.items()}
        time.sleep(3)
        stop.set()
        for t in threads:
            t.join(30)
        follow = mount.stats()["follow"]
    finally:
        mount.stop()
        stop_pid(copier.pid, 10)
        for p in meters.values():
            p.stop()
    out: dict = {"commits": len(writer.commits), "rate_hz": rate, "seconds": round(elapsed, 1),
                 "mount_follow_stats": follow}
    for kind, first in seen.items():
        lags = [first[n] - at for n, at in writer.commits.items() if n in first]
        out[kind] = {"seen": len(lags), "missing": len(writer.commits) - len(lags),
                     "median_s": round(statistics.median(lags), 3), "p99_s": round(quantile(lags, 0.99), 3),
                     "max_s": round(max(lags), 3)}
    for who in meters:
        delta = Proxy.delta(before[who], after[who])
        out[who + "_requests_per_minute"] = {k: round(v * 60 / elapsed, 1) for k, v in sorted(delta.items())
                                             if not k.startswith("bytes_")}
    return out


# -------------------------------------------------------------------- torture
def torture(work: str, seconds: float) -> dict:
    store = open_store("file://%s/store" % work)
    spool, src = os.path.join(work, "spool"), os.path.realpath(os.path.join(work, "src"))
    os.makedirs(spool)
    os.makedirs(src)
    db = os.path.join(src, "bank.db")
    copier = copier_process(spool, store.url, os.path.join(work, "copier.log"))
    mount = Mount.under(work, store.url)
    stop = threading.Event()
    try:
        WriterProc(spool, db, 50.0, commits=1).wait(60)
        mount.start()
        path = mount.path(local_hostname(), db)
        wait_for(lambda: os.path.exists(path), 60, "the replica")
        out: dict[int, list] = {}
        errors: list[str] = []
        threads = [threading.Thread(target=invariant_reader, args=(path, stop, out, errors, i)) for i in range(16)]
        for t in threads:
            t.start()
        writer = WriterProc(spool, db, 50.0, seconds=seconds)
        writer.wait(seconds + 120)
        last = max(writer.commits)
        ended = time.monotonic()
        wait_for(lambda: errors or all(s and s[-1] == last for s in out.values()), 60, "the readers to catch up")
        caught_up_s = time.monotonic() - ended
        stop.set()
        for t in threads:
            t.join(60)
        stats = mount.stats()
    finally:
        stop.set()
        mount.stop()
        stop_pid(copier.pid, 10)
        store.close()
    return {"seconds": seconds, "commits": len(writer.commits), "readers": 16, "errors": errors,
            "transactions": sum(len(s) for s in out.values()),
            "states_seen_min": min(len(set(s)) for s in out.values()),
            "all_at_last_commit_after_s": round(caught_up_s, 2),
            "switches": stats["follow"]["switches"], "read_errors": stats["mount"]["read_errors"]}


# ------------------------------------------------------------------------ hot
def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _hot_round(mount: Mount, where: str, keys: list[str], expected: list, total: int) -> dict:
    path = mount.path(where)

    def point(uri_flags: str, k: int):
        def go():
            with contextlib.closing(sqlite3.connect("file:%s?%s" % (path, uri_flags), uri=True)) as con:
                assert con.execute(POINT_SQL, (keys[k],)).fetchone() == expected[k]
        return go

    def scan():
        with contextlib.closing(sqlite3.connect("file:%s?mode=ro" % path, uri=True)) as con:
            assert con.execute(SCAN_SQL).fetchone()[0] == total

    for k in range(len(keys)):  # warm every page the queries touch
        point("mode=ro", k)()
    scan()
    out = {"point_ro_ms": [_time(point("mode=ro", k)) * 1e3 for k in range(len(keys))],
           "point_immutable_ms": [_time(point("immutable=1", k)) * 1e3 for k in range(len(keys))],
           "hot_scan_s": [_time(scan) for _ in range(3)]}
    drop_page_cache()
    out["warm_scan_s"] = [_time(scan)]
    return out


def hot(work: str, rounds: int, size_mb: int) -> dict:
    store = open_store("file://%s/store" % work)
    src = os.path.join(work, "hot.db")
    rows = size_mb * (1 << 20) // 260
    make_db(src, rows, seed=7)
    publish(store, open(src, "rb").read(), "/data/hot.db")
    rng = random.Random(1)
    keys = ["%016x" % rng.getrandbits(64) for _ in range(50)]
    with contextlib.closing(sqlite3.connect(src)) as con:
        expected = [con.execute(POINT_SQL, (k,)).fetchone() for k in keys]
        (total,) = con.execute(SCAN_SQL).fetchone()
    where = "/testhost/data/hot.db"
    samples: dict[str, dict[str, list]] = {"on": {}, "off": {}}
    for r in range(rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            with Mount.under(os.path.join(work, "m-" + mode), store.url, "follow=%s" % mode) as m:
                got = _hot_round(m, where, keys, expected, total)
            for k, v in got.items():
                samples[mode].setdefault(k, []).extend(v)
    store.close()
    out: dict = {"db_bytes": os.path.getsize(src), "rounds": rounds}
    for mode, figures in samples.items():
        out["follow_" + mode] = {k: round(statistics.median(v), 4) for k, v in figures.items()}
        out["follow_%s_all" % mode] = {k: [round(x, 4) for x in v] for k, v in figures.items() if k.endswith("_s")}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", choices=("freshness", "torture", "hot"))
    p.add_argument("--freshness-seconds", type=float, default=120.0)
    p.add_argument("--rate", type=float, default=1.0, help="writer commits per second (freshness)")
    p.add_argument("--torture-seconds", type=float, default=120.0)
    p.add_argument("--rounds", type=int, default=4, help="hot: rounds of each mode")
    p.add_argument("--size-mb", type=int, default=64, help="hot: database size")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench_follow needs root (FUSE mounts, dropping the page cache)")
    phases = a.only or ["freshness", "torture", "hot"]
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "machine": "%d cores, Linux %s" % (os.cpu_count() or 0, platform.release()),
                     "loadavg_start": os.getloadavg()[0]}
    work = tempfile.mkdtemp(prefix="bench-follow-")
    try:
        for phase in phases:
            where = os.path.join(work, phase)
            os.makedirs(where)
            start = time.monotonic()
            if phase == "freshness":
                results[phase] = freshness(where, a.freshness_seconds, a.rate)
            elif phase == "torture":
                results[phase] = torture(where, a.torture_seconds)
            else:
                results[phase] = hot(where, a.rounds, a.size_mb)
            results[phase]["phase_seconds"] = round(time.monotonic() - start, 1)
            print(json.dumps({phase: results[phase]}, indent=1), flush=True)
        results["loadavg_end"] = os.getloadavg()[0]
        if a.json:
            with open(a.json, "w") as out:
                json.dump(results, out, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
