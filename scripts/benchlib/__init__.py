"""Helpers of scripts/bench_all.py (the whole-system benchmark, docs/BENCHMARKS.md).

- `moto_ranged`: moto's S3 server, launched with ranged GETs that read only
  the range (stock moto copies the whole object for each ranged GET);
- `proxy`: a latency-adding TCP proxy (TCP_NODELAY) that counts requests
  and bytes, so every system's GETs are counted by the same meter;
- `peers`: s3fs-fuse and rclone mounts of one object on that server;
- `report`: the Markdown table and the PNG plots from the results JSON;
- `drop_page_cache` (here): shared by every benchmark script.
"""
from __future__ import annotations

import os


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
