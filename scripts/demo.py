#!/usr/bin/env python3
"""The main job, end to end on the embedded default (a local directory store):

  1. tenant databases are written through the `verneuil` VFS, and writes keep
     going while a copier ships the spool to the store;
  2. the store is mounted with FUSE;
  3. the replicas are queried with the `sqlite3` shell and with Spark, and the
     answers are checked against the source databases;
  4. history: one tenant's versions are listed, and the tenant as it was
     before the writes (`tenant_00.db@TIME` on the mount) is queried beside
     it now;
  5. the mount is taken down.

Everything lives under --dir (default ./demo); running again starts afresh
(the chunk cache is kept, as it would be across remounts).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)

# Enough tenants that Spark has real fan-out; small enough to finish in well
# under a minute of writing on 2 cores.
DEFAULT_TENANTS = 24
DEFAULT_ROWS = 2000          # rows per tenant at creation
DEFAULT_WRITE_SECONDS = 5.0  # how long writes keep going while the copier runs
MOUNT_WAIT_SECONDS = 30.0    # bound on waiting for the mount's files to appear
QUERY = ("SELECT region, count(*) AS orders, round(sum(amount), 2) AS revenue "
         "FROM orders GROUP BY region ORDER BY region")
HISTORY_QUERY = "SELECT count(*), round(sum(amount), 2) FROM orders"
# Pause on each side of the moment the history step looks back to: file
# ctimes (a version's time) come from the kernel's coarse clock, a tick
# (a few ms) behind, so no commit lands within it of that moment.
MARK_GAP_SECONDS = 0.1


class DemoError(Exception):
    """A step failed; printed as one line."""


def step(msg: str) -> None:
    print("\n==> %s" % msg, flush=True)


def info(msg: str) -> None:
    print("    %s" % msg, flush=True)


def unmount(mnt: str) -> None:
    if os.path.ismount(mnt):
        subprocess.run(["fusermount3", "-u", "-z", mnt], check=False)
        deadline = time.monotonic() + 10
        while os.path.ismount(mnt) and time.monotonic() < deadline:
            time.sleep(0.1)


def create_tenants(src_dir: str, n: int, rows: int, writer_vfs) -> list[str]:
    rnd = random.Random(7)
    regions = ["emea", "amer", "apac", "latam"]
    paths = []
    for i in range(n):
        path = os.path.join(src_dir, "tenant_%02d.db" % i)
        con = writer_vfs.connect(path)
        con.execute("PRAGMA page_size=4096")
        con.execute("CREATE TABLE orders(id INTEGER PRIMARY KEY, region TEXT, amount REAL, note TEXT)")
        con.executemany("INSERT INTO orders(region, amount, note) VALUES (?, ?, ?)",
                        [(rnd.choice(regions), round(rnd.uniform(1, 500), 2), "x" * rnd.randint(0, 200))
                         for _ in range(rows * (1 + i % 3))])
        con.commit()
        con.close()
        paths.append(path)
        if (i + 1) % 8 == 0 or i + 1 == n:
            info("created %d/%d tenant databases" % (i + 1, n))
    return paths


def keep_writing(paths: list[str], seconds: float, writer_vfs) -> int:
    """Small transactions into random tenants for `seconds`; returns commits."""
    rnd = random.Random(11)
    conns = {p: writer_vfs.connect(p) for p in paths}
    commits = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            con = conns[rnd.choice(paths)]
            con.execute("INSERT INTO orders(region, amount, note) VALUES (?, ?, ?)",
                        (rnd.choice(["emea", "amer", "apac", "latam"]), round(rnd.uniform(1, 500), 2), "live"))
            if rnd.random() < 0.2:
                con.execute("DELETE FROM orders WHERE id = (SELECT min(id) FROM orders)")
            con.commit()
            commits += 1
            if commits % 200 == 0:
                info("%d commits" % commits)
    finally:
        for c in conns.values():
            c.close()
    info("%d commits in %.0f s" % (commits, seconds))
    return commits


def direct_results(paths: list[str], query: str = QUERY) -> dict[str, list[tuple]]:
    out = {}
    for p in paths:
        con = sqlite3.connect("file:%s?mode=ro" % p, uri=True)
        out[p] = [tuple(r) for r in con.execute(query)]
        con.close()
    return out


def wait_for_files(replica_paths: list[str]) -> None:
    deadline = time.monotonic() + MOUNT_WAIT_SECONDS
    while time.monotonic() < deadline:
        if all(os.path.exists(p) for p in replica_paths):
            return
        time.sleep(0.2)
    missing = [p for p in replica_paths if not os.path.exists(p)]
    raise DemoError("%d replicas did not appear on the mount, e.g. %s" % (len(missing), missing[0]))


def show_history(store_url: str, path: str, replica: str, mark_ns: int, before: list[tuple]) -> None:
    """List one tenant's versions, then query it as it was at `mark_ns`
    (`<replica>@TIME` on the mount) beside it now; the past answer must be
    `before`, what the source said then."""
    from verneuil_fuse.history import format_time

    step("History of %s: its versions, and a query on its past state beside the current one"
         % os.path.basename(path))
    listing = subprocess.run([os.path.join(VENV_BIN, "verneuilctl"), "versions", "--store", store_url,
                              "-s", path], check=True, capture_output=True, text=True, timeout=120).stdout
    lines = listing.strip().splitlines()
    info("verneuilctl versions: %d versions; the first and the last:" % (len(lines) - 1))
    for line in [lines[0], lines[1], lines[-1]]:
        info("  " + line)
    past = "%s@%s" % (replica, format_time(mark_ns))
    answers = {}
    for label, p in (("before the writes", past), ("now", replica)):
        out = subprocess.run(["sqlite3", "-readonly", "file:%s?immutable=1" % p, HISTORY_QUERY + ";"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
        answers[label] = out
        info("%-18s %-70s orders|revenue = %s" % (label, os.path.basename(p), out))
    want = "|".join(str(v) for v in before[0])
    if answers["before the writes"] != want:
        raise DemoError("the past state answered %s, the source said %s then" % (answers["before the writes"], want))
    info("the past state answers what the source said then (%s)" % want)


def run(args) -> None:
    import writer_vfs
    from verneuil_fuse import copier
    from verneuil_fuse.format import local_hostname

    work = os.path.abspath(args.dir)
    spool, store_dir = os.path.join(work, "spool"), os.path.join(work, "store")
    src_dir, mnt = os.path.join(work, "sources"), os.path.join(work, "mnt")
    cache = os.path.join(work, "cache")
    store_url = "file://" + store_dir

    step("Starting afresh in %s" % work)
    unmount(mnt)
    for d in (spool, store_dir, src_dir, mnt):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    os.makedirs(cache, exist_ok=True)

    step("Writing %d tenant databases through the verneuil VFS (spool: %s)" % (args.tenants, spool))
    writer_vfs.register(spool)
    paths = create_tenants(src_dir, args.tenants, args.rows, writer_vfs)

    step("Copier running in the background while writes keep going (store: %s)" % store_url)
    bg = copier.start_background(spool, store_url)
    try:
        bg.flush(timeout=120)
        time.sleep(MARK_GAP_SECONDS)
        mark_ns = time.time_ns()  # the past state queried in the history step
        before = direct_results(paths[:1], HISTORY_QUERY)[paths[0]]
        time.sleep(MARK_GAP_SECONDS)
        commits = keep_writing(paths, args.write_seconds, writer_vfs)
        t0 = time.monotonic()
        bg.flush(timeout=120)
        stats = bg.stats
        info("flushed in %.1f s; copier so far: %s" % (time.monotonic() - t0, stats))
    finally:
        bg.stop()
    expected = direct_results(paths)

    step("Mounting the store at %s" % mnt)
    host = local_hostname()
    subprocess.run([os.path.join(VENV_BIN, "verneuil"), store_url, mnt,
                    "-o", "cache_dir=%s,refresh=2,log_file=%s" % (cache, os.path.join(work, "mount.log"))],
                   check=True, timeout=60)
    try:
        replica_dir = os.path.join(mnt, host) + src_dir
        replicas = [os.path.join(replica_dir, os.path.basename(p)) for p in paths]
        wait_for_files(replicas)
        info("replicas at %s/" % replica_dir)

        step("Querying replicas with the sqlite3 shell")
        for p in replicas[:3]:
            uri = "file:%s?immutable=1" % p
            check = subprocess.run(["sqlite3", "-readonly", uri, "PRAGMA integrity_check;"],
                                   check=True, capture_output=True, text=True, timeout=60).stdout.strip()
            if check != "ok":
                raise DemoError("integrity_check on %s: %s" % (p, check))
            out = subprocess.run(["sqlite3", "-readonly", "-header", "-column", uri, QUERY + ";"],
                                 check=True, capture_output=True, text=True, timeout=60).stdout
            info("%s (integrity_check: ok):" % os.path.basename(p))
            for line in out.strip().splitlines():
                info("  " + line)

        step("Querying all %d replicas with Spark (local[2])" % len(replicas))
        from verneuil_fuse.spark import spark_session
        spark = spark_session("local[2]", app="verneuil-demo", quiet=True)  # no JVM notices
        try:
            df = spark.read.format("verneuil").option("query", QUERY).load(replica_dir)
            rows = df.collect()
        finally:
            spark.stop()
        info("%d rows from %d databases; totals by region:" % (len(rows), len({r["_source"] for r in rows})))
        totals: dict[str, list] = {}
        for r in rows:
            t = totals.setdefault(r["region"], [0, 0.0])
            t[0] += r["orders"]
            t[1] += r["revenue"]
        for region, (n, revenue) in sorted(totals.items()):
            info("  %-6s orders=%-7d revenue=%.2f" % (region, n, revenue))

        got: dict[str, list[tuple]] = {}
        for r in rows:
            src = os.path.join(src_dir, os.path.basename(r["_source"]))
            got.setdefault(src, []).append((r["region"], r["orders"], r["revenue"]))
        for p in paths:
            if sorted(got.get(p, [])) != sorted(expected[p]):
                raise DemoError("Spark's answer for %s differs from the source database" % p)
        info("every replica's answer equals its source database's (%d commits replicated)" % commits)
        show_history(store_url, paths[0], replicas[0], mark_ns, before)
    finally:
        step("Unmounting %s" % mnt)
        unmount(mnt)

    step("Done. Where everything lives:")
    info("sources  %s" % src_dir)
    info("spool    %s" % spool)
    info("store    %s" % store_dir)
    info("cache    %s" % cache)
    info("mount    %s (unmounted; remount with: %s %s %s)"
         % (mnt, os.path.join(VENV_BIN, "verneuil"), store_url, mnt))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=os.path.join(ROOT, "demo"), help="working directory (default ./demo)")
    ap.add_argument("--tenants", type=int, default=DEFAULT_TENANTS, help="number of databases (default %(default)s)")
    ap.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="rows per tenant (default %(default)s)")
    ap.add_argument("--write-seconds", type=float, default=DEFAULT_WRITE_SECONDS,
                    help="seconds of writes while copying (default %(default)s)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        run(args)
    except (DemoError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        print("demo: error: %s" % e, file=sys.stderr)
        return 1
    print("\nmain job finished in %.0f s" % (time.monotonic() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
