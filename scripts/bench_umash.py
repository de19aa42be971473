#!/usr/bin/env python3
"""Prints UMASH throughput on 64 KiB inputs beside hashlib.blake2b and
zlib.crc32 on the same buffers, in the same run (issue: foundation).

Usage: .venv/bin/python scripts/bench_umash.py [--mib N] [--repeats R]
"""
import argparse
import hashlib
import os
import statistics
import time
import zlib

from verneuil_fuse import format as fmt

CHUNK = fmt.CHUNK_SIZE


def rate(fn, bufs, repeats):
    """Median GB/s of `fn` over all buffers, `repeats` passes."""
    total = sum(len(b) for b in bufs)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b in bufs:
            fn(b)
        runs.append(total / (time.perf_counter() - t0) / 1e9)
    return statistics.median(runs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB of random 64 KiB buffers (default 64)")
    ap.add_argument("--repeats", type=int, default=7, help="passes; the median is shown (default 7)")
    args = ap.parse_args(argv)
    bufs = [os.urandom(CHUNK) for _ in range(args.mib * (1 << 20) // CHUNK)]
    rows = []
    for impl in ("clmul", "portable"):
        if fmt.select_impl(impl) != impl:
            continue
        rows.append(("umash fingerprint (%s)" % impl, rate(fmt.fingerprint, bufs, args.repeats)))
        rows.append(("umash hash64 (%s)" % impl,
                     rate(lambda b: fmt.hash64(b, fmt.CHUNK_KEY), bufs, args.repeats)))
    fmt.select_impl("auto")
    rows.append(("hashlib.blake2b", rate(lambda b: hashlib.blake2b(b).digest(), bufs, args.repeats)))
    rows.append(("zlib.crc32", rate(zlib.crc32, bufs, args.repeats)))
    blake = dict(rows)["hashlib.blake2b"]
    print("%d MiB of 64 KiB buffers, median of %d passes" % (args.mib, args.repeats))
    print("%-32s %8s %10s" % ("function", "GB/s", "x blake2b"))
    for name, r in rows:
        print("%-32s %8.2f %10.2f" % (name, r, r / blake))


if __name__ == "__main__":
    main()
