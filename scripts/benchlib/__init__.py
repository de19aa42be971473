"""Helpers of scripts/bench_all.py (the whole-system benchmark, docs/BENCHMARKS.md).

- `moto_ranged`: moto's S3 server, launched with ranged GETs that read only
  the range (stock moto copies the whole object for each ranged GET);
- `proxy`: a latency-adding TCP proxy (TCP_NODELAY) that counts requests
  and bytes, so every system's GETs are counted by the same meter;
- `peers`: s3fs-fuse and rclone mounts of one object on that server;
- `nginx_rig`: nginx in front of moto, a store that is not the bottleneck;
- `report`: the Markdown table and the PNG plots from the results JSON;
- `drop_page_cache`, `apt_install` and `make_events_db` (here): shared by the
  benchmark scripts.
"""
from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess


def apt_install(packages, log=print) -> None:
    """Install Debian packages with apt-get (root only; bounded in time);
    what could not be installed is for the caller to find missing."""
    if not packages or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return
    log("installing Debian packages: %s" % " ".join(packages))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], env=env, timeout=300,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-qq", *packages], env=env, timeout=600,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def drop_page_cache() -> bool:
    """sync, then drop the kernel's clean page cache (needs root); False if
    it could not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def make_events_db(path: str, rows: int, shift: float) -> None:
    """The fan-out benchmarks' tenant database: `events(id, kind, v, note)`,
    `rows` rows of about 140 bytes (7 kinds, `v` = row * 0.5 + `shift`, a
    96-hex-digit note), 4 KiB pages, rollback journal."""
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA page_size=4096")
    con.execute("CREATE TABLE events(id INTEGER PRIMARY KEY, kind TEXT, v REAL, note TEXT)")
    con.execute("BEGIN")
    con.execute("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<?) "
                "INSERT INTO events(kind, v, note) SELECT 'k' || (x % 7), x * 0.5 + ?, "
                "hex(randomblob(48)) FROM c", (rows, shift))
    con.execute("COMMIT")
    con.close()
