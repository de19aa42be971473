"""The floor of the mount's read path: a file served from memory by the
smallest pyfuse3 + trio file system, read the way the benchmarks read a
replica, beside a plain read of the same file.

The file system here does nothing a replica does (no store, no cache, no
fingerprint): `read` returns a view of a bytes object already in memory.
What a sequential read costs through it is what pyfuse3, trio and the
kernel's FUSE path cost, the floor under any cold or warm scan of a
verneuil mount on this machine (docs/BENCHMARKS.md, "The packed layout
at 1 GiB, side by side": the floor under a scan).

    .venv/bin/python scripts/bench_fuse_floor.py DB [--runs 3] [--read-ahead-kb 4096]

DB is an SQLite database (e.g. bench_all.py --keep's sync/src.db); each run
mounts it afresh (an empty page cache for the mounted file) and times
``SELECT sum(length(v)) FROM t`` (or ``--sql``) and a sequential read in
1 MiB `read`s, with the mount's CPU by thread.
"""
from __future__ import annotations

import argparse
import errno
import os
import select
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time

# Per-request FUSE limits as the verneuil mount has them: libfuse 3
# negotiates requests of up to 1 MiB, and the mount raises the kernel's
# readahead to 4 MiB (verneuil_fuse/cli/mount.py, tune_kernel_readahead).
DEFAULT_READ_AHEAD_KB = 4096
# How long a mount may take to appear, and an unmount to finish.
MOUNT_TIMEOUT_S = 30
READ_BYTES = 1 << 20


def serve(path: str, mountpoint: str, read_ahead_kb: int) -> None:
    """Mount ``path``'s bytes, from memory, as ``mountpoint/db``; runs until
    unmounted (the child process of `mount`)."""
    import pyfuse3
    import trio

    with open(path, "rb") as f:
        data = f.read()
    view = memoryview(data)
    inode = pyfuse3.ROOT_INODE + 1

    class Floor(pyfuse3.Operations):
        def _attr(self, ino):
            a = pyfuse3.EntryAttributes()
            a.st_ino = ino
            if ino == pyfuse3.ROOT_INODE:
                a.st_mode = stat.S_IFDIR | 0o555
            else:
                a.st_mode = stat.S_IFREG | 0o444
                a.st_size = len(data)
            a.st_nlink = 1
            a.attr_timeout = a.entry_timeout = 3600
            return a

        async def getattr(self, inode_, ctx=None):
            if inode_ not in (pyfuse3.ROOT_INODE, inode):
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._attr(inode_)

        async def lookup(self, parent, name, ctx=None):
            if parent != pyfuse3.ROOT_INODE or name != b"db":
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._attr(inode)

        async def open(self, inode_, flags, ctx):
            fi = pyfuse3.FileInfo(fh=inode_)
            fi.keep_cache = True
            return fi

        async def read(self, fh, off, size):
            return view[off : off + size]

    pyfuse3.init(Floor(), mountpoint, ["ro", "fsname=floor"])

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pyfuse3.main)
            await trio.to_thread.run_sync(os.stat, mountpoint)  # INIT processed
            _set_read_ahead(mountpoint, read_ahead_kb)
            print("ready", flush=True)

    try:
        trio.run(main)
    finally:
        pyfuse3.close(unmount=False)


def _set_read_ahead(mountpoint: str, kb: int) -> None:
    st = os.stat(mountpoint)
    try:
        with open("/sys/class/bdi/%d:%d/read_ahead_kb" % (os.major(st.st_dev), os.minor(st.st_dev)), "w") as f:
            f.write("%d\n" % kb)
    except OSError as e:  # not root: the kernel's 128 KiB, and the figures say less
        print("cannot set read_ahead_kb (%s): the kernel's default applies" % e, file=sys.stderr)


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid``, by name."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open("/proc/%d/task/%s/comm" % (pid, tid)) as f:
                name = f.read().strip()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def one_run(db: str, sql: str, read_ahead_kb: int, what: str) -> dict:
    """Mount, time one read of the mounted file, unmount."""
    mnt = tempfile.mkdtemp(prefix="fuse-floor-")
    child = subprocess.Popen([sys.executable, __file__, "--serve", db, mnt, "--read-ahead-kb", str(read_ahead_kb)],
                             stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], MOUNT_TIMEOUT_S)
        line = child.stdout.readline() if ready else ""
        if line.strip() != "ready":
            raise SystemExit("the floor file system did not start")
        path = os.path.join(mnt, "db")
        before = _thread_cpu(child.pid)
        t = time.perf_counter()
        if what == "sql":
            con = sqlite3.connect("file:%s?mode=ro&immutable=1" % path, uri=True)
            result = con.execute(sql).fetchone()
            con.close()
        else:
            result = 0
            with open(path, "rb", buffering=0) as f:
                buf = bytearray(READ_BYTES)
                while n := f.readinto(buf):
                    result += n
        dt = time.perf_counter() - t
        after = _thread_cpu(child.pid)
        cpu = {k: round(after.get(k, 0) - before.get(k, 0), 2) for k in after}
        return {"what": what, "seconds": round(dt, 3), "result": result,
                "MBps": round(os.path.getsize(db) / 1e6 / dt, 1), "mount_cpu_by_thread": cpu}
    finally:
        subprocess.run(["fusermount3", "-u", "-z", mnt], check=False)
        try:
            child.wait(MOUNT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        os.rmdir(mnt)


def plain(db: str, sql: str) -> float:
    """The same SQL on the file itself, its pages in the page cache."""
    con = sqlite3.connect("file:%s?mode=ro&immutable=1" % db, uri=True)
    con.execute(sql).fetchone()  # into the page cache
    t = time.perf_counter()
    con.execute(sql).fetchone()
    dt = time.perf_counter() - t
    con.close()
    return dt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("db", help="an SQLite database file")
    p.add_argument("mountpoint", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--runs", type=int, default=3, help="mounts per kind of read (default 3)")
    p.add_argument("--read-ahead-kb", type=int, default=DEFAULT_READ_AHEAD_KB,
                   help="the mount's read_ahead_kb (default %d, the verneuil mount's)" % DEFAULT_READ_AHEAD_KB)
    p.add_argument("--sql", default="SELECT sum(length(v)) FROM t", help="the scan (default: bench_all.py's)")
    args = p.parse_args(argv)
    if not os.path.isfile(args.db):
        print("no such file: %s" % args.db, file=sys.stderr)
        return 2
    if args.serve:
        serve(args.db, args.mountpoint, args.read_ahead_kb)
        return 0
    print("plain SQL scan, page cache hot: %.3f s" % plain(args.db, args.sql), flush=True)
    for _ in range(args.runs):
        for what in ("sql", "read"):
            print(one_run(args.db, args.sql, args.read_ahead_kb, what), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
