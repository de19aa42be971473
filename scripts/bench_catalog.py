#!/usr/bin/env python3
"""How the mount scales with the number of databases in a store.

One small replica (a real SQLite database, chunk 0 bundled in its manifest)
is published once; its manifest blob is then copied under N manifest names
(``/tenants/tNNNNNN.db`` on host ``fleet``), so the store holds N databases
that share their chunks. For each N and each store kind (a directory store,
moto's S3 server) the benchmark mounts the store and prints:

- one listing of the manifests through the store's API alone (the floor
  of the mount's first poll);
- ready: from starting the mount to ``/.verneuil/stats`` answering with the
  mount ready (the first listing done);
- list: ``os.walk`` of the whole tree (names only, as ``find`` or ``ls`` do);
- stat: ``os.stat`` of 1,000 databases (each looks its manifest up);
- RSS of the mount process after the walk and the stats (and its peak);
- CPU per refresh poll of the unchanged store (the mount's user+system time
  over about three polls' time with ``refresh=1``, divided by the polls it
  made in that time).

Usage: ``bench_catalog.py [--sizes 1000,10000,100000] [--stores dir,s3]
[--out FILE.json]``. Needs root (FUSE) and the .venv (scripts/setup.sh).
Figures go to docs/BENCHMARKS.md ("Many databases").
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (os.path.join(HERE, "..", "tests"), HERE, os.path.join(HERE, "..")):
    if p not in sys.path:
        sys.path.insert(0, p)

from support.replicas import Mount, make_db, publish_file  # noqa: E402
from support.s3server import S3Server, fake_aws_env, patched_environ  # noqa: E402

from verneuil_fuse.format import manifest_name  # noqa: E402
from verneuil_fuse.reader.catalog import SETTLE_SECONDS  # noqa: E402
from verneuil_fuse.store import open_store  # noqa: E402

HOST = "fleet"
# Databases whose attributes the benchmark asks for: enough to time a
# lookup's manifest fetch, few enough for 100k-database runs to stay short.
STAT_SAMPLE = 1000
# Polls timed for the CPU of one refresh: the mount polls every second
# after a listing, so this many listings and seconds of an idle mount.
POLLS = 3
# Names written to moto per thread batch: moto's server takes ~3 ms per PUT.
S3_PUT_THREADS = 16


def db_path(i: int) -> str:
    return "/tenants/t%06d.db" % i


def build_store(kind: str, n: int, work: str, s3: S3Server | None) -> str:
    """A store holding ``n`` databases; returns the mount's SOURCE."""
    src = os.path.join(work, "src.db")
    if not os.path.exists(src):
        make_db(src, 200)
    if kind == "dir":
        root = os.path.join(work, "store-%d" % n)
        store = open_store("file://" + root)
        pub = publish_file(store, src, hostname=HOST)
        blob = store.manifests.get(pub.key)
        store.manifests.delete(pub.key)
        mdir = os.path.join(root, "manifests")
        settled = time.time() - 60  # an unchanged store: no blob written in the last minute
        for i in range(n):
            path = os.path.join(mdir, manifest_name(db_path(i), HOST))
            with open(path, "wb") as f:
                f.write(blob)
            os.utime(path, (settled, settled))
        store.close()
        return "file://" + root
    assert s3 is not None
    store = s3.make_store(versioned=False)
    pub = publish_file(store, src, hostname=HOST)
    blob = store.manifests.get(pub.key)
    store.manifests.delete(pub.key)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(S3_PUT_THREADS) as pool:
        list(pool.map(lambda i: store.manifests.put(manifest_name(db_path(i), HOST), blob), range(n)))
    url = store.url
    store.close()
    # An unchanged store: no manifest younger than the catalog's settling time.
    time.sleep(SETTLE_SECONDS + 1)
    return url


def listing_seconds(source: str, n: int) -> float:
    """One listing of the manifests through the store's own API, outside the
    mount: the floor of the mount's first poll."""
    store = open_store(source)
    try:
        t0 = time.monotonic()
        listed = sum(1 for _ in store.manifests.list(""))
        took = time.monotonic() - t0
    finally:
        store.close()
    if listed != n:
        raise RuntimeError("the store lists %d manifests, not %d" % (listed, n))
    return took


def proc_cpu(pid: int) -> float:
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss(pid: int) -> tuple[int, int]:
    rss = peak = 0
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return rss, peak


def measure(source: str, n: int, work: str, listing: float) -> dict:
    # A poll lists the store (as long as one listing, or a little more),
    # then waits a second (refresh=1).
    poll_period = 1.2 * listing + 1.1
    mnt = os.path.join(work, "mnt")
    m = Mount(source, mnt, "refresh=1", log_path=os.path.join(work, "mount-%d.log" % n))
    t0 = time.monotonic()
    m.start(timeout=600)
    ready = time.monotonic() - t0
    pid = m.proc.pid
    try:
        t0 = time.monotonic()
        files = sum(len(fs) for _, _, fs in os.walk(mnt))
        walk = time.monotonic() - t0
        if files < n:
            raise RuntimeError("listed %d files of %d" % (files, n))
        sample = [m.path(HOST, db_path(i)) for i in range(0, n, max(1, n // STAT_SAMPLE))]
        t0 = time.monotonic()
        sizes = {os.stat(p).st_size for p in sample}
        stat_s = time.monotonic() - t0
        if 0 in sizes:
            raise RuntimeError("a database has size 0")
        rss, peak = proc_rss(pid)
        # The stats are read only twice: rendering them costs CPU too.
        polls0, cpu0 = m.stats()["refresh"]["polls"], proc_cpu(pid)
        time.sleep(POLLS * poll_period)
        polls1, cpu1 = m.stats()["refresh"]["polls"], proc_cpu(pid)
        stats = m.stats()
    finally:
        m.stop()
    return {
        "databases": n, "ready_s": round(ready, 3), "walk_s": round(walk, 3),
        "stat_sample": len(sample), "stat_s": round(stat_s, 3),
        "rss_mb": round(rss / 1e6, 1), "peak_rss_mb": round(peak / 1e6, 1),
        "poll_cpu_s": round((cpu1 - cpu0) / max(1, polls1 - polls0), 3), "polls": polls1 - polls0,
        "catalog": stats.get("catalog"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="database counts (default: %(default)s)")
    ap.add_argument("--stores", default="dir,s3", help="store kinds: dir, s3 (default: %(default)s)")
    ap.add_argument("--out", help="write the results as JSON here too")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    kinds = [k for k in args.stores.split(",") if k]
    results = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
               "machine": "%s, %d cores" % (platform.machine(), os.cpu_count() or 0),
               "build": subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                       text=True, cwd=HERE).stdout.strip(),
               "runs": []}
    work = tempfile.mkdtemp(prefix="bench-catalog-")
    s3 = None
    try:
        with patched_environ(fake_aws_env()):
            if "s3" in kinds:
                s3 = S3Server(log_dir=work)
            for kind in kinds:
                for n in sizes:
                    t0 = time.monotonic()
                    source = build_store(kind, n, work, s3)
                    print("%s, %d databases: store built in %.1f s" % (kind, n, time.monotonic() - t0), flush=True)
                    listing = listing_seconds(source, n)
                    r = measure(source, n, work, listing)
                    r["store"], r["listing_s"] = kind, round(listing, 3)
                    results["runs"].append(r)
                    print("  listing alone %.2f s, ready %.2f s, walk %.2f s, stat of %d %.2f s, RSS %.0f MB (peak %.0f), "
                          "CPU per poll %.3f s" % (r["listing_s"], r["ready_s"], r["walk_s"], r["stat_sample"], r["stat_s"],
                                                  r["rss_mb"], r["peak_rss_mb"], r["poll_cpu_s"]), flush=True)
                    if kind == "dir":
                        shutil.rmtree(os.path.join(work, "store-%d" % n), ignore_errors=True)
    finally:
        if s3 is not None:
            s3.close()
        shutil.rmtree(work, ignore_errors=True)
    print(markdown(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def markdown(results: dict) -> str:
    """The runs as the table of docs/BENCHMARKS.md."""
    lines = ["%s, %s, build %s" % (results["date"], results["machine"], results["build"]), "",
             "| store | databases | one listing, alone | mount ready | walk of the tree | stat of 1,000 "
             "| RSS (peak) | CPU per poll |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        lines.append("| %s | %s | %.2f s | %.2f s | %.2f s | %.2f s | %.0f MB (%.0f) | %.3f s |" % (
            r["store"], format(r["databases"], ","), r["listing_s"], r["ready_s"], r["walk_s"], r["stat_s"], r["rss_mb"],
            r["peak_rss_mb"], r["poll_cpu_s"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
