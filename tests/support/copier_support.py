"""Helpers shared by the copier and CLI tests (this module has no tests).

`Writer` commits to a SQLite database and gets each commit into a spool:
kind "py" through the Python reference writer (`SpoolWriter`, always
available), kind "vfs" through the real C VFS (`writer_vfs`, when built).
The database holds a counter table: `bump()` commits counter+1, so any
restored snapshot tells which commit it is. `CopierDaemon` runs
`verneuilctl copier` and reads its log.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from support.pyspoolwriter import SpoolWriter
from verneuil_fuse.readback import fetch_manifest, restore_bytes


def vfs_available() -> bool:
    try:
        import writer_vfs  # noqa: F401
    except Exception:
        return False
    return True


WRITER_KINDS = ["py", pytest.param("vfs", marks=pytest.mark.skipif(
    not vfs_available(), reason="writer_vfs is not built"))]


class Writer:
    def __init__(self, kind: str, spool: str, path: str, *, payload: int = 3000):
        self.kind = kind
        self.spool = spool
        self.payload = payload
        if kind == "vfs":
            import writer_vfs
            writer_vfs.register(spool_dir=spool)
            self.conn = sqlite3.connect("file:%s?vfs=verneuil" % path, uri=True,
                                        isolation_level=None, check_same_thread=False)
        else:
            self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        # One transaction, so that every snapshot has the counter.
        self.conn.executescript(
            "BEGIN;"
            "CREATE TABLE IF NOT EXISTS counter(id INTEGER PRIMARY KEY, n INTEGER);"
            "CREATE TABLE IF NOT EXISTS log(n INTEGER PRIMARY KEY, pad BLOB);"
            "INSERT OR IGNORE INTO counter VALUES (1, 0);"
            "COMMIT;")
        self.path = os.path.realpath(path)
        self.py = SpoolWriter(spool, self.path) if kind == "py" else None
        self._snap()

    def _snap(self) -> None:
        if self.py is not None:
            self.py.snapshot()

    @property
    def name(self) -> str:
        from verneuil_fuse.format import manifest_name
        return manifest_name(self.path)

    def bump(self) -> int:
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        (n,) = c.execute("SELECT n FROM counter WHERE id = 1").fetchone()
        n += 1
        c.execute("UPDATE counter SET n = ? WHERE id = 1", (n,))
        c.execute("INSERT INTO log VALUES (?, randomblob(?))", (n, self.payload))
        c.execute("COMMIT")
        self._snap()
        return n

    def execute(self, sql: str, *params) -> None:
        self.conn.execute(sql, params)
        self._snap()

    def close(self) -> None:
        self.conn.close()

    def data(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read()


@contextlib.contextmanager
def opened_image(data: bytes, tmpdir: str):
    """A read-only sqlite3 connection to a database image (written to a
    scratch file, removed afterwards)."""
    path = os.path.join(tmpdir, "probe-%d.db" % time.monotonic_ns())
    with open(path, "wb") as f:
        f.write(data)
    try:
        conn = sqlite3.connect("file:%s?mode=ro" % path, uri=True)
        try:
            yield conn
        finally:
            conn.close()
    finally:
        os.unlink(path)


def counter_of(data: bytes, tmpdir: str) -> int:
    """The counter of a database image (checked for integrity too)."""
    with opened_image(data, tmpdir) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        (n,) = conn.execute("SELECT n FROM counter WHERE id = 1").fetchone()
        (logged,) = conn.execute("SELECT count(*) FROM log").fetchone()
        assert logged == n, "snapshot mixes commits: counter %d, %d log rows" % (n, logged)
        return n


def store_counter(store, name: str, tmpdir: str, version_id=None):
    """Counter of the store's snapshot (None if there is none yet)."""
    from verneuil_fuse.store import ReadError
    try:
        m = fetch_manifest(store, name, version_id)
    except ReadError:
        return None
    return counter_of(restore_bytes(store, m), tmpdir)


def wait_for(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return value
        time.sleep(interval)


class CopierDaemon:
    """`verneuilctl copier` in a child process, its log read as it comes:
    `until(text)` reads lines until one holds `text` (bounded); `stop()`
    sends SIGTERM, checks the clean exit and returns all it logged; as a
    context manager it always ends the process."""

    def __init__(self, spool: str, store_url: str, *extra: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "verneuil_fuse.cli", "copier", "--store", store_url,
                                      "--spool", spool, "--poll-interval", "0.05", *extra],
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []

    def until(self, text: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines) and time.monotonic() < deadline:
            self.lines.append(self.proc.stderr.readline())
        return "".join(self.lines)

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(15) == 0
        return "".join(self.lines) + self.proc.stderr.read()

    def __enter__(self) -> "CopierDaemon":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.proc.stderr.close()
