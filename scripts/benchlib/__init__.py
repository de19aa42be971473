"""Helpers of scripts/bench_all.py (the whole-system benchmark, docs/BENCHMARKS.md).

- `moto_ranged`: moto's S3 server, launched with ranged GETs that read only
  the range (stock moto copies the whole object for each ranged GET);
- `proxy`: a latency-adding TCP proxy (TCP_NODELAY) that counts requests
  and bytes, so every system's GETs are counted by the same meter;
- `peers`: s3fs-fuse and rclone mounts of one object on that server;
- `nginx_rig`: nginx in front of moto, a store that is not the bottleneck;
- `report`: the Markdown table and the PNG plots from the results JSON;
- `drop_page_cache` and `apt_install` (here): shared by every benchmark script.
"""
from __future__ import annotations

import os
import shutil
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
