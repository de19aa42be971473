#!/usr/bin/env python3
"""The reader's chunk engine alone (reader/chunk_engine.py, csrc/chunk_engine.c),
without FUSE: what a chunk costs it, read from a directory store or by
range GETs, against reading the same files raw in one Python thread.

    .venv/bin/python scripts/bench_chunk_engine.py [--size-mb 384] [--workers 1,2,4,8]
        [--no-http] [--json out.json]

A --size-mb SQLite database (scripts/benchlib's events table: ~2:1 under
zstd, as the replicas issue 40 measured) is cut into 64 KiB chunks, each
compressed as a writer uploads it, and stored twice on this disk: one file
per chunk (Verneuil's layout, a `file://` store's chunks/), and in packs of
16 MiB (the packed layout), read as runs of adjacent blobs of up to 1 MiB
(`format.MAX_RUN_BYTES`). Each figure is a cold read (the store's files
evicted from the page cache before it: fdatasync, then
POSIX_FADV_DONTNEED, file by file, so that other users of the machine
keep theirs) in a new process, of every chunk:

- raw: every file read whole by one Python thread (open, read, close), the
  yardstick of issue 40 (no decode, no verify);
- engine, file reads of (a) chunk files, one request each, (b) 1 MiB runs
  of packs, one request each, with ``--workers`` threads; (c) range GETs of
  the same runs from Debian's nginx on 127.0.0.1 (benchlib/nginx_rig.py, no
  added latency), finished on the engine's HTTP thread (0 workers) or on
  `READ_WORKERS` threads;
- each engine mode twice: ``cache`` (each chunk written into a disk cache
  segment with its index record, as a mount's cache has them, not handed
  back) and ``memory`` (no cache write: each chunk's bytes handed back and
  copied into a Python bytes object, as a mount would serve them).

Printed per mode (the median of --repeat cold runs): seconds, MB/s of
database bytes, the time against raw, and the process's CPU per chunk
(every thread: trio's, the engine's).
The machine may be shared: CPU figures are the process's own, wall times
move with the neighbours' load.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from benchlib import make_events_db  # noqa: E402

from verneuil_fuse.format import (CHUNK_SIZE, MAX_CHUNK_BLOB_BYTES, MAX_RUN_BYTES,  # noqa: E402
                                  ZERO_CHUNK_FPRINT, compress_chunk, fingerprint)
from verneuil_fuse.reader.chunk_engine import READ_WORKERS  # noqa: E402
from verneuil_fuse.reader.flights import RUN_PARTS  # noqa: E402  (chunks per request, as a mount's)

MB = 1 << 20
# Bytes per pack: the copier's (copier.packing.PACK_TARGET_BYTES).
PACK_BYTES = 16 << 20
# Rows of the events table per MiB of database (4 KiB pages, ~140-byte rows).
ROWS_PER_MB = 8900
# Requests in flight: single chunks as the mount's directory-store path
# keeps them (fetcher.DEFAULT_THREAD_CONCURRENCY / 2: its prefetch share),
# and runs of up to 16 chunks: 16 MiB, the mount's readahead.
SINGLE_IN_FLIGHT, RUN_IN_FLIGHT = 64, 16
RUN_TIME_LIMIT = 900.0  # seconds: one mode's cold read, bounded


# -- the store -----------------------------------------------------------------

def build(work: str, size_mb: int) -> dict:
    """The database, its chunk files and its packs under ``work``; what the
    runs read: chunk files, pack files, runs (pack, start, end, parts)."""
    db = os.path.join(work, "events.db")
    make_events_db(db, size_mb * ROWS_PER_MB, 0.0)
    single, packed = os.path.join(work, "single"), os.path.join(work, "packed")
    os.makedirs(single)
    os.makedirs(packed)
    chunks, seen, packs = [], set(), []
    pack_out, pack_at = None, PACK_BYTES
    with open(db, "rb") as f:
        while True:
            data = f.read(CHUNK_SIZE)
            if not data:
                break
            fp = fingerprint(data)
            if fp == ZERO_CHUNK_FPRINT or fp in seen:
                continue
            seen.add(fp)
            blob = compress_chunk(data)
            with open(os.path.join(single, fp.name), "wb") as out:
                out.write(blob)
            if pack_at + len(blob) > PACK_BYTES:
                if pack_out is not None:
                    pack_out.close()
                packs.append(("pack-%04d" % len(packs), []))
                pack_out, pack_at = open(os.path.join(packed, packs[-1][0]), "wb"), 0
            pack_out.write(blob)
            packs[-1][1].append((fp, pack_at, pack_at + len(blob)))
            chunks.append((fp.name, tuple(fp), len(data)))
            pack_at += len(blob)
    pack_out.close()
    os.sync()
    return {"db_bytes": os.path.getsize(db), "chunks": chunks, "runs": runs_of(packs),
            "chunk_bytes": sum(c[2] for c in chunks), "single": single, "packed": packed,
            "blob_bytes": sum(os.path.getsize(os.path.join(single, c[0])) for c in chunks)}


def runs_of(packs: list) -> list:
    """Adjacent blobs of a pack as runs of at most MAX_RUN_BYTES (the rule
    of `format.chunk_runs`): (pack, start, end, [(fp, lo, hi)])."""
    runs = []
    for name, blobs in packs:
        run = None
        for fp, lo, hi in blobs:
            if run is None or hi - run[1] > MAX_RUN_BYTES or len(run[3]) == RUN_PARTS:
                run = [name, lo, hi, []]
                runs.append(run)
            run[2] = hi
            run[3].append((tuple(fp), lo - run[1], hi - run[1]))
    return runs


def evict(paths: list[str]) -> None:
    """The files out of the page cache (theirs only)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- the runs (each in a new process) -------------------------------------------

def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_raw(paths: list[str]) -> dict:
    """Every file read whole, one after the other, in this thread."""
    cpu, t = _cpu(), time.monotonic()
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            total += len(f.read())
    return {"s": time.monotonic() - t, "cpu_s": _cpu() - cpu, "bytes": total}


def run_engine(reads: list, work: str, cache: bool, workers: int, in_flight: int, parts: int) -> dict:
    """Every `Read` (as tuples: where, start, end, file, [(fp, lo, hi)]) on
    a new engine: cached (each chunk written to a segment file and its
    record to an index file, not kept) or handed back (copied to bytes)."""
    import trio

    from verneuil_fuse.format import Fprint
    from verneuil_fuse.reader.chunk_engine import ChunkEngine, Part, Read

    seg = tempfile.TemporaryFile(dir=work)
    idx = open(os.path.join(work, "bench.idx"), "ab")  # O_APPEND, as the cache's index
    nparts = sum(len(r[4]) for r in reads)
    bad: list = []
    engine = ChunkEngine(in_flight, max(MAX_CHUNK_BLOB_BYTES, MAX_RUN_BYTES), max_parts=parts, workers=workers)
    engine.set_auth([], None, 3.0, 15.0)
    made, k = [], 0
    for where, start, end, file, blobs in reads:
        ps = []
        for fp, lo, hi in blobs:
            target = (seg.fileno(), idx.fileno(), k * CHUNK_SIZE) if cache else None
            ps.append(Part(k, Fprint(*fp), lo, hi, target, not cache))
            k += 1
        made.append(Read(where, ps, start, end, 60.0, file))

    async def go() -> int:
        got, pending, size = 0, made, 0
        with trio.fail_after(RUN_TIME_LIMIT):
            while got < nparts:
                n = min(engine.free, len(pending))
                if n:
                    engine.submit(pending[:n])
                    pending = pending[n:]
                for token, outcome in await engine.answers():
                    got += 1
                    if not outcome.verified or (cache and not outcome.written):
                        bad.append((token, outcome))
                    elif outcome.data is not None:
                        size += len(outcome.data)
        return size

    cpu, t = _cpu(), time.monotonic()
    try:
        kept = trio.run(go)
        dt, cpu = time.monotonic() - t, _cpu() - cpu
    finally:
        engine.close()
        seg.close()
        idx.close()
        os.unlink(os.path.join(work, "bench.idx"))
    if bad:
        raise RuntimeError("%d chunks failed, first: %r" % (len(bad), bad[0]))
    return {"s": dt, "cpu_s": cpu, "kept_bytes": kept}


# -- the plan -------------------------------------------------------------------

def file_reads(store: dict, runs: bool) -> tuple[list, list[str]]:
    """The reads of every chunk file, or of every run of the packs; the files."""
    if not runs:
        paths = [os.path.join(store["single"], name) for name, _, _ in store["chunks"]]
        return [(p, 0, None, True, [(fp, 0, None)]) for p, (_, fp, _) in zip(paths, store["chunks"])], paths
    reads = [(os.path.join(store["packed"], pack), start, end, True, blobs) for pack, start, end, blobs in store["runs"]]
    return reads, sorted({os.path.join(store["packed"], r[0]) for r in store["runs"]})


def figures(result: dict, store: dict, raw_s: float | None) -> dict:
    n = len(store["chunks"])
    out = {"s": round(result["s"], 3), "MBps": round(store["chunk_bytes"] / MB / result["s"], 1),
           "cpu_ms_per_chunk": round(result["cpu_s"] * 1e3 / n, 3)}
    if raw_s:
        out["x_raw_time"] = round(result["s"] / raw_s, 2)
    return out


class Plan:
    """Every run of the benchmark, each cold, in a process of its own."""

    def __init__(self, args, store: dict, work: str):
        self.args, self.store, self.work = args, store, work
        self.pool = multiprocessing.get_context("spawn").Pool(1)
        self.results: dict = {}

    def close(self) -> None:
        self.pool.close()
        self.pool.join()

    def cold(self, name: str, fn, files: list[str], *args, raw_s: float | None = None) -> float:
        """``fn(*args)`` --repeat times, each cold: the median time and CPU."""
        runs = []
        for _ in range(self.args.repeat):
            evict(files)
            runs.append(self.pool.apply(fn, args))
        result = {key: statistics.median(r[key] for r in runs) for key in ("s", "cpu_s")}
        self.results[name] = figures(result, self.store, raw_s)
        print("%-44s %s" % (name, self.results[name]), flush=True)
        return result["s"]

    def run(self) -> dict:
        store = self.store
        singles, single_files = file_reads(store, False)
        runs, pack_files = file_reads(store, True)
        raw_s = self.cold("raw chunk files, 1 Python thread", run_raw, single_files, single_files)
        self.cold("raw pack files, 1 Python thread", run_raw, pack_files, pack_files)
        for workers in self.args.workers:
            for cache in (True, False):
                how = "cache" if cache else "memory"
                self.cold("(a) chunk files, %d workers, %s" % (workers, how), run_engine, single_files, singles,
                          self.work, cache, workers, SINGLE_IN_FLIGHT, 1, raw_s=raw_s)
                self.cold("(b) 1 MiB runs, %d workers, %s" % (workers, how), run_engine, pack_files, runs,
                          self.work, cache, workers, RUN_IN_FLIGHT, RUN_PARTS, raw_s=raw_s)
        if self.args.http:
            self.http(runs, pack_files, raw_s)
        return self.results

    def http(self, runs: list, pack_files: list[str], raw_s: float) -> None:
        """(c): the runs as range GETs from nginx serving the packs; and the
        chunk files, a GET each (the mount's path on S3 today)."""
        from benchlib.nginx_rig import NginxRig, ensure_nginx

        if ensure_nginx(lambda *a: None) is None:
            print("no nginx: (c) skipped", flush=True)
            return
        root = os.path.join(self.work, "www")
        os.makedirs(root)
        os.symlink(self.store["packed"], os.path.join(root, "packs"))
        os.symlink(self.store["single"], os.path.join(root, "chunks"))
        with socket.socket() as s:  # moto's place: never asked, the packs are files
            s.bind(("127.0.0.1", 0))
            unused = s.getsockname()[1]
        rig = NginxRig(os.path.join(self.work, "nginx"), root, ["packs", "chunks"], unused, 0.0)
        try:
            url = rig.endpoint + "/packs/"
            gets = [(url + urllib.parse.quote(os.path.basename(where), safe=""), start, end, False, blobs)
                    for where, start, end, _, blobs in runs]
            singles = [(rig.endpoint + "/chunks/" + urllib.parse.quote(name, safe=""), 0, None, False, [(fp, 0, None)])
                       for name, fp, _ in self.store["chunks"]]
            files = [os.path.join(self.store["single"], name) for name, _, _ in self.store["chunks"]]
            for cache in (True, False):
                self.cold("(c) chunk objects, a GET each, %s" % ("cache" if cache else "memory"), run_engine, files,
                          singles, self.work, cache, 0, SINGLE_IN_FLIGHT, 1, raw_s=raw_s)
            for workers in (0, READ_WORKERS):
                for cache in (True, False):
                    self.cold("(c) 1 MiB range GETs, %d workers, %s" % (workers, "cache" if cache else "memory"),
                              run_engine, pack_files, gets, self.work, cache, workers, RUN_IN_FLIGHT, RUN_PARTS,
                              raw_s=raw_s)
        finally:
            rig.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=384, help="database size in MiB (default 384, issue 40's)")
    p.add_argument("--workers", default="1,2,4,8", help="worker threads to try, comma-separated (default 1,2,4,8)")
    p.add_argument("--no-http", dest="http", action="store_false", help="skip (c), the range GETs from nginx")
    p.add_argument("--repeat", type=int, default=3, help="cold runs of each mode, the median kept (default 3)")
    p.add_argument("--work", help="directory for the store (default: a new one under /var/tmp, removed)")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    try:
        args.workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        p.error("--workers: comma-separated integers")
    work = tempfile.mkdtemp(prefix="bench-chunk-engine-", dir=args.work or "/var/tmp")
    try:
        results = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def measure(args, work: str) -> dict:
    """The store built under ``work``, then every run of the plan."""
    t = time.monotonic()
    store = build(work, args.size_mb)
    print("store: %d chunks, %.0f MiB of chunks, %.0f MiB of blobs, %d runs (%.0f s to build)"
          % (len(store["chunks"]), store["chunk_bytes"] / MB, store["blob_bytes"] / MB, len(store["runs"]),
             time.monotonic() - t), flush=True)
    plan = Plan(args, store, work)
    try:
        results = plan.run()
    finally:
        plan.close()
    results["store"] = {"chunks": len(store["chunks"]), "chunk_MiB": round(store["chunk_bytes"] / MB, 1),
                        "blob_MiB": round(store["blob_bytes"] / MB, 1), "runs": len(store["runs"]),
                        "repeat": args.repeat, "load_average": os.getloadavg()}
    return results


if __name__ == "__main__":
    sys.exit(main())
