"""Test helper: publish a snapshot of a database file straight into a Store.

It writes the same blobs a writer + copier would (docs/FORMAT.md): every chunk but
chunk 0 and the zero chunk uploaded (zstd or raw), the manifest (zstd or raw)
with chunk 0 bundled, under the manifest name of ``(hostname, path)``.
"""
from __future__ import annotations

import os
import random
import sqlite3
import time
from typing import NamedTuple

from verneuil_fuse.format import (
    CHUNK_SIZE,
    Fprint,
    Manifest,
    compress_chunk,
    compress_manifest,
    encode_manifest,
    manifest_name,
    snapshot_of,
)

HOST = "testhost"


class Published(NamedTuple):
    key: str
    manifest: Manifest
    chunks: dict[Fprint, bytes]
    data: bytes


def publish(
    store,
    data: bytes,
    path: str,
    *,
    hostname: str = HOST,
    compress: bool = True,
    ctime: float | None = None,
    bundle: tuple[int, ...] = (),
    packed: int = 0,
) -> Published:
    """Upload a snapshot of ``data`` as the replica of ``hostname:path``;
    the chunks of ``bundle`` are bundled in the manifest besides chunk 0 (as
    the C writer does with b-tree tops), and uploaded too.  ``packed``: in
    the packed layout, in packs of about that many bytes, in file order (as
    a copier of a packed store writes them); 0: a chunk object each."""
    now = time.time() if ctime is None else ctime
    manifest, chunks = snapshot_of(data, ctime=int(now), ctime_ns=int((now % 1) * 1e9), bundle=bundle)
    key = manifest_name(path, hostname)
    if packed:
        manifest.layout = publish_packs(store, key, manifest, chunks, packed, compress)
    else:
        for fp, raw in chunks.items():
            store.chunks.put(fp.name, compress_chunk(raw) if compress else raw)
    blob = encode_manifest(manifest)
    store.manifests.put(key, compress_manifest(blob) if compress else blob)
    return Published(key, manifest, chunks, bytes(data))


def publish_packs(store, key: str, manifest: Manifest, chunks: dict[Fprint, bytes], target: int,
                  compress: bool = True):
    """Upload ``chunks`` (those of ``manifest``) into packs of about
    ``target`` bytes, in file order; their `PackedLayout`."""
    from verneuil_fuse.copier.packing import PackBuilder, space_of
    from verneuil_fuse.format import PackedLayout, pack_key

    space = space_of(key)
    places: dict = {}
    builder = PackBuilder(target)

    def flush():
        pack, data, where = builder.take()
        store.chunks.put(pack_key(space, pack), data)
        places.update(where)

    for fp in dict.fromkeys(manifest.chunks):
        if fp in chunks:
            builder.add(fp, compress_chunk(chunks[fp]) if compress else chunks[fp])
            if builder.full:
                flush()
    if builder.parts:
        flush()
    return PackedLayout.build(space, [places.get(fp) for fp in manifest.chunks])


def replicate(store, db_path: str, spool: str, *, timeout: float = 3600) -> str:
    """Replicate ``db_path`` for real: one commit through the C VFS (a full
    snapshot, b-tree tops bundled as the writer chooses), then a copier ships
    the spool into ``store``.  Returns the replica's path under a mount
    (``/<hostname>/<real path>``)."""
    import writer_vfs
    from verneuil_fuse.copier import Copier
    from verneuil_fuse.format import local_hostname

    path = os.path.realpath(db_path)
    writer_vfs.register(spool)
    con = writer_vfs.connect(path)
    con.execute("PRAGMA user_version = 1")
    con.commit()
    con.close()
    copier = Copier(spool, store, rate=0, workers=16, create_spool=True)
    try:
        copier.flush(timeout=timeout)
    finally:
        copier.close()
    return "/%s%s" % (local_hostname(), path)


def publish_large_base(store, path: str, hostname: str = "h"):
    """A replica of 4,200 chunks (275 MB, zero chunks but the first and last
    two) whose chunk list is XOR-ed with a base chunk as long as the list
    (67,200 bytes, as Verneuil's writer makes them): larger than a chunk
    object may be. Returns (manifest, {chunk index: bytes}, size)."""
    import dataclasses
    from verneuil_fuse.format import ZERO_CHUNK_FPRINT, chunk_fingerprint, contents_fprint_of, fingerprint

    n = 4200
    first = os.urandom(CHUNK_SIZE)
    small, _ = snapshot_of(first)  # the header's fingerprint and metadata
    real = {0: first, n - 2: os.urandom(CHUNK_SIZE), n - 1: os.urandom(1000)}
    fps = [ZERO_CHUNK_FPRINT] * n
    for i, raw in real.items():
        fps[i] = chunk_fingerprint(raw)
        store.chunks.put(fps[i].name, compress_chunk(raw))
    size = (n - 1) * CHUNK_SIZE + 1000
    manifest = dataclasses.replace(small, chunks=fps, len=size, bundled={0: real[0]},
                                   contents_fprint=contents_fprint_of(fps))
    base = os.urandom(16 * n)  # raw: 67,200 bytes, more than a chunk object's 66,560
    base_fp = fingerprint(base)
    store.chunks.put(base_fp.name, base)
    stored = dataclasses.replace(manifest, base_chunks_fprint=base_fp)
    store.manifests.put(manifest_name(path, hostname), compress_manifest(encode_manifest(stored, base=base)))
    return manifest, real, size


def publish_file(store, db_path: str, **kw) -> Published:
    with open(db_path, "rb") as f:
        data = f.read()
    return publish(store, data, os.path.realpath(db_path), **kw)


def make_db(path: str, rows: int, *, seed: int = 0, page_size: int = 4096, payload: int = 200,
            index: bool = True) -> None:
    """A SQLite database (rollback journal) with a table ``t(id, k, v)`` of
    ``rows`` rows, random keys ``k`` (indexed) and ``payload``-byte values."""
    rng = random.Random(seed)
    if os.path.exists(path):
        os.unlink(path)
    con = sqlite3.connect(path)
    con.execute("PRAGMA page_size=%d" % page_size)
    con.execute("PRAGMA journal_mode=DELETE")
    con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, k TEXT, v BLOB)")
    if index:
        con.execute("CREATE INDEX t_k ON t(k)")
    batch = []
    for i in range(rows):
        batch.append((i, "%016x" % rng.getrandbits(64), rng.randbytes(payload)))
        if len(batch) == 5000:
            con.executemany("INSERT INTO t VALUES (?, ?, ?)", batch)
            batch.clear()
    con.executemany("INSERT INTO t VALUES (?, ?, ?)", batch)
    con.commit()
    con.close()


# ------------------------------------------------------------------ mounting
FUSERMOUNT = "fusermount3"


def fuse_unavailable() -> str | None:
    """Why real mounts cannot run here (None if they can)."""
    import shutil

    if os.geteuid() != 0:
        return "mount tests need root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which(FUSERMOUNT) is None:
        return "no fusermount3"
    return None


def is_mounted(path: str) -> bool:
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4].replace("\\040", " ") == path:
                return True
    return False


def unmount(path: str) -> None:
    import subprocess

    if is_mounted(path):
        subprocess.run([FUSERMOUNT, "-u", "-z", path], timeout=20, capture_output=True)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("timed out after %.0fs waiting for %s" % (timeout, what))
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_pid(pid: int, timeout: float = 10.0) -> None:
    """Wait (bounded) for a process to end; SIGTERM then SIGKILL it if not."""
    import signal

    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None and pid_alive(pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
        try:
            wait_for(lambda: not pid_alive(pid), timeout, "pid %d to exit" % pid)
            return
        except TimeoutError:
            continue


class FuseProcess:
    """A FUSE daemon run in the foreground in a subprocess (so the caller
    knows its PID); ready once the mount point is in /proc/self/mountinfo;
    `stop` always unmounts (lazily) and ends that PID, every wait bounded.
    Subclasses give the `command` (and the `env`, if not ours)."""

    name = "mount"

    def __init__(self, mountpoint: str, log_path: str) -> None:
        self.mountpoint = os.path.realpath(mountpoint)
        self.log_path = log_path
        self.proc = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict | None:
        return None  # inherit ours

    def start(self, timeout: float = 30.0):
        import subprocess

        os.makedirs(self.mountpoint, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     env=self.env())
        log.close()
        try:
            wait_for(lambda: is_mounted(self.mountpoint) or self.proc.poll() is not None, timeout,
                     "the %s mount" % self.name)
        except TimeoutError:
            self.stop()
            raise
        if self.proc.poll() is not None:
            raise RuntimeError("%s exited with %s: %s" % (self.name, self.proc.returncode, self.log_tail()))
        return self

    def log_tail(self, size: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-size:].decode(errors="replace")
        except OSError:
            return ""

    def path(self, *parts: str) -> str:
        return os.path.join(self.mountpoint, *[p.lstrip("/") for p in parts])

    def stop(self) -> None:
        try:
            unmount(self.mountpoint)
        finally:
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=10)
                except Exception:  # noqa: BLE001
                    stop_pid(self.proc.pid, 5)
                    self.proc.wait(timeout=5)


class Mount(FuseProcess):
    """``verneuil SOURCE MNT -f -o OPTIONS``."""

    name = "verneuil"

    def __init__(self, source: str, mountpoint: str, options: str = "", log_path: str | None = None):
        super().__init__(mountpoint, log_path or mountpoint.rstrip("/") + ".log")
        self.source = source
        self.options = options

    @classmethod
    def under(cls, root: str, source: str, options: str = "") -> "Mount":
        """A mount of ``source`` on ``root``/mnt, its disk cache in
        ``root``/cache and its log (level info) in ``root``/verneuil.log;
        ``options`` come after those."""
        base = "cache_dir=%s,log_level=info,log_file=%s" % (os.path.join(root, "cache"),
                                                             os.path.join(root, "verneuil.log"))
        return cls(source, os.path.join(root, "mnt"), base + ("," + options if options else ""))

    def command(self) -> list[str]:
        import sys

        cmd = [sys.executable, "-m", "verneuil_fuse.cli.mount", self.source, self.mountpoint, "-f"]
        if self.options:
            cmd += ["-o", self.options]
        return cmd

    def start(self, timeout: float = 30.0) -> "Mount":
        """Mounted, then ready (its kernel readahead set, as `verneuil`
        without ``-f`` waits for before returning)."""
        super().start(timeout)
        try:
            wait_for(lambda: self.stats()["mount"].get("ready"), timeout, "the mount to be ready")
        except BaseException:
            self.stop()
            raise
        return self

    def stats(self) -> dict:
        import json

        with open(self.path(".verneuil", "stats")) as f:
            return json.load(f)

    def __enter__(self) -> "Mount":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
