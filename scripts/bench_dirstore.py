#!/usr/bin/env python3
"""A directory store read cold through a mount, against its chunk files read
raw (docs/BENCHMARKS.md, "Directory store, cold").

    .venv/bin/python scripts/bench_dirstore.py [--size-mb 384] [--layout chunks|packed] [--json]

A --size-mb SQLite database (scripts/benchlib's events table: ~2:1 under
zstd) is replicated for real (one commit through the C VFS, the copier) to a
`file://` store on this disk, in the layout --layout names. Then, the page
cache dropped before each (needs root):

- raw: every file of the store's chunks/ read whole by one Python thread
  (open, read, close): the same bytes from the same disk, no decode, no
  verify;
- mount, no disk cache (`cache_size=0`) and mount with a disk cache (a new
  cache directory): `dd`-like 1 MiB reads of the replica on a fresh mount,
  the bytes compared with the source's; then again on a new mount, the page
  cache dropped (the disk cache's segments, or the store's files, read
  from the disk again), and again with the page cache hot.

Printed per phase: seconds, MB/s of database bytes, the time against raw,
the mount process's CPU (all its threads) per chunk read from the store, and
the store requests the mount made (`gets`: one per chunk file, or one per
run of a pack). The machine may be shared: CPU figures are the mount's own,
wall times move with the neighbours' load.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from benchlib import drop_page_cache, make_events_db  # noqa: E402
from support.replicas import Mount, replicate  # noqa: E402

from verneuil_fuse.store import open_store  # noqa: E402

# Rows of the events table per MiB of database (as bench_chunk_engine.py).
ROWS_PER_MB = 8900
# The reads of the replica: 1 MiB, what `dd bs=1M` and a scan's readahead ask.
READ_BYTES = 1 << 20


def raw_read(root: str) -> tuple[float, int, int]:
    """Every chunk file of the store read whole in one thread: seconds,
    files, bytes."""
    chunks = os.path.join(root, "chunks")
    start = time.perf_counter()
    files = size = 0
    with os.scandir(chunks) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                with open(entry.path, "rb") as f:
                    size += len(f.read())
                files += 1
    return time.perf_counter() - start, files, size


def cpu_seconds(pid: int) -> float:
    """User and system CPU of process ``pid`` (every thread), in seconds."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_through(mount: Mount, path: str) -> tuple[float, float, str]:
    """The replica read in 1 MiB reads, as `dd` would: seconds, the mount's
    CPU seconds over the read, the bytes' SHA-256. The blocks are kept and
    hashed once the clock has stopped, so that the reader's own work is a
    copy, like the raw read's (hashing in the loop took a core's share from
    the mount on this 2-core machine)."""
    blocks = []
    cpu = cpu_seconds(mount.proc.pid)
    start = time.perf_counter()
    with open(mount.path(path), "rb", buffering=0) as f:
        while True:
            block = f.read(READ_BYTES)
            if not block:
                break
            blocks.append(block)
    took = time.perf_counter() - start
    cpu = cpu_seconds(mount.proc.pid) - cpu
    digest = hashlib.sha256()
    for block in blocks:
        digest.update(block)
    return took, cpu, digest.hexdigest()


def phase(name: str, mount: Mount, path: str, expect: str, raw: float, size: int, drop: bool = True) -> dict:
    if drop:
        drop_page_cache()
    before = mount.stats()["fetch"]
    took, cpu, digest = read_through(mount, path)
    after = mount.stats()["fetch"]
    if digest != expect:
        raise SystemExit("%s: the replica's bytes differ from the source's" % name)
    chunks = after["store_fetches"] - before["store_fetches"]
    gets = after["gets"] - before["gets"]
    row = {"phase": name, "seconds": round(took, 3), "mb_s": round(size / took / 1e6, 1),
           "x_raw": round(took / raw, 2), "chunks": chunks, "gets": gets, "cpu_s": round(cpu, 2),
           "cpu_ms_per_chunk": round(cpu * 1000 / chunks, 3) if chunks else None}
    print("%-44s %7.2fs %7.1f MB/s  x%.2f raw  %6d chunks %6d requests  CPU %.2fs (%s ms/chunk)"
          % (name, took, row["mb_s"], row["x_raw"], chunks, gets, cpu, row["cpu_ms_per_chunk"]), flush=True)
    return row


def run(args, work: str) -> dict:
    db = os.path.join(work, "db", "bench.db")
    os.makedirs(os.path.dirname(db))
    make_events_db(db, args.size_mb * ROWS_PER_MB, 0.0)
    root = os.path.join(work, "store")
    url = "file://%s%s" % (root, "?layout=packed" if args.layout == "packed" else "")
    store = open_store(url, create=True)
    start = time.perf_counter()
    path = replicate(store, db, os.path.join(work, "spool"))
    size = os.path.getsize(db)
    with open(db, "rb") as f:  # as the replica's commit left it
        expect = hashlib.sha256(f.read()).hexdigest()
    print("replica: %.1f MiB, %s layout, shipped in %.1fs" % (size / 2**20, args.layout, time.perf_counter() - start))
    if not drop_page_cache():
        raise SystemExit("cannot drop the page cache: run as root")
    raw, files, stored = raw_read(root)
    print("%-44s %7.2fs %7.1f MB/s  %d files, %.1f MiB" % ("raw read of chunks/", raw, size / raw / 1e6, files,
                                                           stored / 2**20), flush=True)
    rows = []
    for name, options in (("no disk cache", "cache_size=0"), ("disk cache", "")):
        where = os.path.join(work, name.replace(" ", "_"))
        for what, drop in (("cold", True), ("again, page cache dropped", True), ("again, page cache hot", False)):
            mount = Mount.under(where, url.split("?")[0], options).start()
            try:
                rows.append(phase("%s, %s" % (name, what), mount, path, expect, raw, size, drop))
            finally:
                mount.stop()
    return {"size_mb": args.size_mb, "layout": args.layout, "bytes": size, "raw_seconds": round(raw, 3),
            "chunk_files": files, "stored_bytes": stored, "phases": rows}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=384)
    parser.add_argument("--layout", choices=("chunks", "packed"), default="chunks")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON at the end")
    parser.add_argument("--work", help="directory for the store and mounts (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        result = run(args, work)
    if args.json:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
