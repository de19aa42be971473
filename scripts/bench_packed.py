#!/usr/bin/env python3
"""The packed layout under many small commits (docs/BENCHMARKS.md, "Packed
layout"): does a cold scan stay cheap, and the store small?

1. A --size-mb database (default 256: rows of 1000 random bytes, 4 KiB
   pages) is written through the writer VFS and shipped by a copier to a
   directory store of the packed layout keeping --keep-versions past
   versions of its manifest.
2. --commits small commits (default 1000), each rewriting --rows random
   rows (default 3), each shipped at once (Copier.flush), so that every
   commit makes its own small pack and the copier compacts as it goes.
3. Then compaction and GC have run as time would run them: the journal
   records are aged out (their 10 minutes), and the database's packs that
   no kept version needs are deleted (GC grace 0).

Printed: the range reads of a cold scan of the current version (one per
run of adjacent chunks of a pack, runs up to 1 MiB: `packing.scan_reads`,
and counted for real by a restore reading all its runs) beside those of
the same database packed fresh; the store's chunk bytes beside the live
bytes (the blobs the current version needs); and what compaction cost.
The done criterion of the packed layout: reads at most 2x, bytes at most
1.5x.

Usage: .venv/bin/python scripts/bench_packed.py [--size-mb 256] [--commits 1000] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from verneuil_fuse import format as fmt  # noqa: E402
from verneuil_fuse.copier import Copier  # noqa: E402
from verneuil_fuse.readback import fetch_manifest, write_snapshot  # noqa: E402
from verneuil_fuse.copier import spool as sp  # noqa: E402
from verneuil_fuse.copier.packing import PACK_TARGET_BYTES, PackBuilder, scan_reads  # noqa: E402
from verneuil_fuse.store import open_store  # noqa: E402

MB = 1 << 20
ROW = 1000
# Rows inserted per transaction while building the database: 16 MiB.
BUILD_BATCH = 16 * MB // ROW


def build(conn: sqlite3.Connection, size: int) -> int:
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
    rows = size // (ROW + 30)
    for start in range(0, rows, BUILD_BATCH):
        n = min(BUILD_BATCH, rows - start)
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t(v) SELECT randomblob(%d) FROM (WITH RECURSIVE c(x) AS "
                     "(SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < %d) SELECT x FROM c)" % (ROW, n))
        conn.execute("COMMIT")
    return rows


def fresh_pack_reads(data: bytes) -> int:
    """The cold scan reads of `data` packed fresh, as a copier packs a
    first snapshot: its blobs in file order, packs of PACK_TARGET_BYTES."""
    m, blobs = fmt.snapshot_of(data)
    builder = PackBuilder(PACK_TARGET_BYTES)
    places: dict = {}
    for fp in dict.fromkeys(m.chunks):
        if fp in blobs:
            builder.add(fp, fmt.compress_chunk(blobs[fp]))
            if builder.full:
                places.update(builder.take()[2])
    if builder.parts:
        places.update(builder.take()[2])
    m.layout = fmt.PackedLayout.build(fmt.Fprint(0, 0), [places.get(fp) for fp in m.chunks])
    return scan_reads(m)


class CountingBackend:
    """A backend whose reads are counted (a restore's range GETs)."""

    def __init__(self, inner):
        self.inner, self.reads = inner, 0

    def get(self, key, max_bytes=None):
        self.reads += 1
        return self.inner.get(key, max_bytes=max_bytes)

    def get_range(self, key, start, end):
        self.reads += 1
        return self.inner.get_range(key, start, end)


def store_bytes(root: str) -> tuple[int, int]:
    """(bytes of the chunk directory, of the manifests with their history)."""
    chunks = sum(e.stat().st_size for e in os.scandir(os.path.join(root, "chunks")) if e.is_file())
    manifests = sp.tree_size(os.path.join(root, "manifests"))[1]
    return chunks, manifests


def live_bytes(m: fmt.Manifest) -> int:
    """The blob bytes the current version needs: each place once."""
    places = {m.layout.place(i) for i in range(len(m.chunks))} - {None}
    return sum(n for _, _, n in places)


def cold_scan(store, m: fmt.Manifest) -> int:
    """Range GETs of a restore reading the whole version at once (runs of
    up to 1 MiB), checked byte for byte against nothing but fingerprints."""
    counting = CountingBackend(store.chunks)

    class View:
        chunks = counting

    with open(os.devnull, "wb") as out:
        write_snapshot(View, m, out, window=len(m.chunks))
    return counting.reads


def run(args, work: str) -> dict:
    import writer_vfs
    spool, db = os.path.join(work, "spool"), os.path.join(work, "big.db")
    root = os.path.join(work, "store")
    store = open_store("file://%s?layout=packed&keep_versions=%d" % (root, args.keep_versions))
    writer_vfs.register(spool_dir=spool)
    conn = writer_vfs.connect(db, isolation_level=None)
    conn.execute("PRAGMA page_size=4096")
    rows = build(conn, args.size_mb * MB)
    copier = Copier(spool, store, rate=0, workers=8)
    start = time.monotonic()
    copier.flush(timeout=3600)
    first = time.monotonic() - start
    name = fmt.manifest_name(db)
    m0 = fetch_manifest(store, name)
    rng = random.Random(args.seed)
    sent0 = copier.stats_snapshot()["chunk_bytes_sent"]
    start = time.monotonic()
    for k in range(args.commits):
        conn.execute("BEGIN")
        for _ in range(args.rows):
            conn.execute("UPDATE t SET v = randomblob(?) WHERE id = ?", (ROW, rng.randrange(1, rows + 1)))
        conn.execute("COMMIT")
        copier.flush(timeout=600)
        if args.progress and (k + 1) % 100 == 0:
            m = fetch_manifest(store, name)
            print("  %d commits: %d reads, %d packs" % (k + 1, scan_reads(m), len(m.layout.packs)), flush=True)
    commits_s = time.monotonic() - start
    stats = copier.stats_snapshot()
    m = fetch_manifest(store, name)
    before_gc = store_bytes(root)
    db_dir = next(d for r in sp.boot_roots(spool)[0] for d in sp.list_dbdirs(r))
    copier.packer.ledger(db_dir, name).journal.prune(time.time_ns(), grace=0)
    deleted = copier.packer.collect(db_dir, name, force=True, grace=0)
    after_gc = store_bytes(root)
    with open(db, "rb") as f:
        data = f.read()
    reads, fresh = cold_scan(store, m), fresh_pack_reads(data)
    copier.close()
    conn.close()
    live = live_bytes(m)
    return {"size_bytes": len(data), "commits": args.commits, "rows_per_commit": args.rows,
            "keep_versions": args.keep_versions, "first_sync_s": first, "commits_s": commits_s,
            "scan_reads": reads, "scan_reads_metric": scan_reads(m), "fresh_reads": fresh,
            "reads_ratio": reads / fresh, "first_version_reads": scan_reads(m0),
            "packs": len(m.layout.packs), "live_bytes": live, "chunk_bytes_before_gc": before_gc[0],
            "chunk_bytes": after_gc[0], "manifest_bytes": after_gc[1], "bytes_ratio": after_gc[0] / live,
            "packs_deleted": len(deleted), "chunks_repacked": stats["chunks_repacked"],
            "bytes_sent_by_commits": stats["chunk_bytes_sent"] - sent0, "packs_uploaded": stats["packs_uploaded"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=256, help="database size (MiB)")
    p.add_argument("--commits", type=int, default=1000, help="small commits")
    p.add_argument("--rows", type=int, default=3, help="random rows rewritten per commit")
    p.add_argument("--keep-versions", type=int, default=10,
                   help="past versions the store keeps (their packs stay; default 10)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--progress", action="store_true", help="a line every 100 commits")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-packed-") as work:
        r = run(args, work)
    print("packed layout, %.0f MiB database, %d commits of %d rows, %d past versions kept:"
          % (r["size_bytes"] / MB, r["commits"], r["rows_per_commit"], r["keep_versions"]))
    print("  cold scan: %d range reads, %d for the same database packed fresh (x%.2f; first version: %d)"
          % (r["scan_reads"], r["fresh_reads"], r["reads_ratio"], r["first_version_reads"]))
    print("  store: %.1f MiB of packs for %.1f MiB live (x%.2f) after GC deleted %d packs "
          "(%.1f MiB before); manifests %.1f MiB"
          % (r["chunk_bytes"] / MB, r["live_bytes"] / MB, r["bytes_ratio"], r["packs_deleted"],
             r["chunk_bytes_before_gc"] / MB, r["manifest_bytes"] / MB))
    print("  cost: first sync %.1f s; %d commits shipped in %.1f s, %d packs, %.1f MiB sent, "
          "%d chunks packed again by compaction"
          % (r["first_sync_s"], r["commits"], r["commits_s"], r["packs_uploaded"],
             r["bytes_sent_by_commits"] / MB, r["chunks_repacked"]))
    if args.json:
        print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
