"""Replicas that follow (issue 37), on one real mount of a directory store
fed by the real writer (the C VFS, in a process of its own) and a copier
daemon (``verneuilctl copier``): long-lived connections move to new
versions at their next read transaction, never inside one.

A directory store, not moto: these checks are about the mount's followers
and their timing, and moto's CPU per request on this 2-core machine would
make the 3 s bound a measure of moto (the S3 path of the follow loop, a
conditional GET, is checked in test_mount.py on moto and timed in
scripts/bench_follow.py).

Every wait is bounded; every process started here is stopped by its PID;
teardown unmounts.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from support.follow_writer import WriterProc, invariant_reader
from support.replicas import HOST, Mount, fuse_unavailable, make_db, publish, stop_pid, wait_for
from verneuil_fuse.cli.mount_options import DEFAULT_ENTRY_TIMEOUT
from verneuil_fuse.format import CHUNK_SIZE, local_hostname
from verneuil_fuse.reader.follow import RESERVE_SECONDS

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(300)]
if fuse_unavailable():
    pytestmark.append(pytest.mark.skip(reason=fuse_unavailable()))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# How long the 16 readers run against a writer committing 50 times a second:
# the issue asks for 2 minutes, which scripts/bench_follow.py runs (--torture);
# CI runs this much of it.
TORTURE_SECONDS = float(os.environ.get("VERNEUIL_FOLLOW_TORTURE_SECONDS", "8"))
# The bound: a commit is visible to a long-lived reader within 3 s.
VISIBLE_WITHIN_S = 3.0


class Rig:
    def __init__(self, root: str):
        from verneuil_fuse.store import open_store

        self.root = root
        self.store = open_store("file://%s/store" % root)
        self.spool = os.path.join(root, "spool")
        os.makedirs(self.spool, exist_ok=True)
        self.src = os.path.realpath(os.path.join(root, "src"))
        os.makedirs(self.src, exist_ok=True)
        self.copier = subprocess.Popen(
            [sys.executable, "-m", "verneuil_fuse.cli", "copier", "--spool", self.spool, "--store", self.store.url],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(root, "copier.log"), "ab"))
        self.mount = Mount.under(root, self.store.url)

    def live_path(self, name: str) -> str:
        """Where the writer's database ``name`` appears on the mount."""
        return self.mount.path(local_hostname(), self.src, name)

    def close(self) -> None:
        try:
            self.mount.stop()
        finally:
            self.copier.terminate()  # a daemon: it ends on SIGTERM, never on its own
            stop_pid(self.copier.pid, 10)
            self.copier.wait(timeout=10)
            self.store.close()


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    r = Rig(str(tmp_path_factory.mktemp("follow")))
    try:
        r.mount.start()
        yield r
    finally:
        r.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _connect(path: str, **kw) -> sqlite3.Connection:
    return sqlite3.connect("file:%s?mode=ro" % path, uri=True, isolation_level=None, **kw)


class Observers:
    """Three long-lived readers of one replica, polled side by side: a
    Python sqlite3 connection, Datasette in its default (mutable) mode over
    HTTP, and one `sqlite3` shell session fed a query at a time on its
    stdin. Each remembers when it first saw each row id."""

    def __init__(self, path: str, work: str):
        self.seen: dict[str, dict[int, float]] = {"python": {}, "datasette": {}, "shell": {}}
        self.errors: list[str] = []
        self.con = _connect(path, check_same_thread=False)
        self.port = _free_port()
        datasette = os.path.join(os.path.dirname(sys.executable), "datasette")
        self.datasette = subprocess.Popen(
            [datasette, "serve", path, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "datasette.log"), "ab"))
        self.shell = subprocess.Popen(["stdbuf", "-oL", "sqlite3", "-readonly", "file:%s?mode=ro" % path],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, bufsize=1)
        self.url = "http://127.0.0.1:%d/%s.json?sql=select+max(id)+as+n+from+t&_shape=array" % (
            self.port, os.path.splitext(os.path.basename(path))[0])
        wait_for(self._datasette_up, 60, "datasette to serve")

    def _datasette_up(self) -> bool:
        try:
            self._datasette_max()
            return True
        except OSError:
            return False

    def _datasette_max(self) -> int:
        with urllib.request.urlopen(self.url, timeout=10) as r:
            return json.loads(r.read())[0]["n"] or 0

    def _shell_max(self) -> int:
        self.shell.stdin.write("select max(id) from t;\n")
        self.shell.stdin.flush()
        line = self.shell.stdout.readline().strip()
        if not line.isdigit():
            raise AssertionError("sqlite3 shell: %r" % line)
        return int(line)

    def poll(self) -> None:
        for name, get in (("python", lambda: self.con.execute("select max(id) from t").fetchone()[0] or 0),
                          ("datasette", self._datasette_max), ("shell", self._shell_max)):
            try:
                n = get()
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.errors.append("%s: %r" % (name, e))
                continue
            now = time.time()
            for i in range(1, n + 1):
                self.seen[name].setdefault(i, now)

    def close(self) -> None:
        self.con.close()
        self.shell.stdin.close()
        self.datasette.terminate()  # a server: it ends on SIGTERM, never on its own
        for proc in (self.shell, self.datasette):
            stop_pid(proc.pid, 10)
            proc.wait(timeout=10)


def test_datasette_python_and_shell_see_each_commit_within_3s(rig):
    """Datasette (default mode, over HTTP), a long-lived Python sqlite3
    connection and one sqlite3 shell session, all opened before the
    commits, see each row the writer commits once a second within 3 s,
    with no restart."""
    db = os.path.join(rig.src, "app.db")
    writer = WriterProc(rig.spool, db, 1.0, commits=1)
    writer.wait(30)
    path = rig.live_path("app.db")
    wait_for(lambda: os.path.exists(path), 30, "the replica on the mount")
    obs = Observers(path, rig.root)
    try:
        obs.poll()
        writer = WriterProc(rig.spool, db, 1.0, commits=8)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            obs.poll()
            if writer.proc.poll() is not None and all(
                    set(writer.commits) <= set(s) for s in obs.seen.values()):
                break
            time.sleep(0.1)
        writer.wait(30)
    finally:
        obs.close()
    assert obs.errors == []
    assert len(writer.commits) == 8
    late = {}
    for name, seen in obs.seen.items():
        for n, committed in writer.commits.items():
            lag = seen.get(n, float("inf")) - committed
            if lag > VISIBLE_WITHIN_S:
                late["%s #%d" % (name, n)] = round(lag, 2)
    assert late == {}, late
    stats = rig.mount.stats()
    assert stats["follow"]["switches"] > 0 and stats["mount"]["read_errors"] == 0


def test_sixteen_readers_see_one_committed_state(rig):
    """16 long-lived connections run multi-statement read transactions
    while the writer commits 50 times a second: each transaction sees one
    committed state (no mix, no "malformed", integrity_check ok), and each
    connection's view moves forward, to the last commit."""
    db = os.path.join(rig.src, "bank.db")
    WriterProc(rig.spool, db, 50.0, commits=1).wait(30)
    path = rig.live_path("bank.db")
    wait_for(lambda: os.path.exists(path), 30, "the replica on the mount")
    writer = WriterProc(rig.spool, db, 50.0, seconds=TORTURE_SECONDS)
    stop = threading.Event()
    out: dict[int, list] = {}
    errors: list[str] = []
    threads = [threading.Thread(target=invariant_reader, args=(path, stop, out, errors, i)) for i in range(16)]
    try:
        for t in threads:
            t.start()
        writer.wait(TORTURE_SECONDS + 60)
        last = max(writer.commits)
        wait_for(lambda: errors or all(s and s[-1] == last for s in out.values()), 60,
                 "every reader to see the last commit")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        writer.stop()
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert len(writer.commits) >= TORTURE_SECONDS * 50 * 0.5, len(writer.commits)
    for seed, states in out.items():
        assert len(set(states)) >= 3, (seed, states[:5])  # it moved, more than once
    stats = rig.mount.stats()
    assert stats["mount"]["read_errors"] == 0 and stats["follow"]["switches"] >= 16


def test_concurrent_opens_get_their_own_inodes(rig):
    """24 threads open one live name at once, three times: every open
    succeeds (the kernel retries the ESTALE a taken follower answers with a
    fresh lookup; nobody sees it) and the handles open together are 24
    distinct inodes."""
    path = rig.live_path("app.db")
    for _ in range(3):
        barrier = threading.Barrier(24)
        inodes, errors, fds = [], [], []

        def opener() -> None:
            try:
                barrier.wait(10)
                fd = os.open(path, os.O_RDONLY)
                fds.append(fd)
                inodes.append(os.fstat(fd).st_ino)
                assert os.pread(fd, 16, 0) == b"SQLite format 3\x00"
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

        threads = [threading.Thread(target=opener) for _ in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for fd in fds:
            os.close(fd)
        assert errors == [] and len(inodes) == 24 and len(set(inodes)) == 24, (errors, inodes)


def _publish_rows(rig, name: str, rows: int, seed: int) -> bytes:
    src = os.path.join(rig.root, "pub", name)
    os.makedirs(os.path.dirname(src), exist_ok=True)
    make_db(src, rows, seed=seed)
    data = open(src, "rb").read()
    publish(rig.store, data, "/data/" + name)
    return data


def test_a_transaction_keeps_its_version_the_next_one_moves(rig):
    """A connection inside a read transaction when a new version lands keeps
    reading the old one (its pages re-read through the mount, SQLite's own
    cache kept tiny), whole; its next transaction reads the new one."""
    _publish_rows(rig, "txn.db", 3000, seed=1)
    path = rig.mount.path(HOST, "data", "txn.db")
    wait_for(lambda: os.path.exists(path), 30, "txn.db")
    con = _connect(path)
    con.execute("PRAGMA cache_size=5")
    con.execute("BEGIN")
    assert con.execute("SELECT count(*), sum(length(v)) FROM t").fetchone() == (3000, 3000 * 200)
    _publish_rows(rig, "txn.db", 5000, seed=2)

    def new_opens_see_it():
        with contextlib.closing(_connect(path)) as fresh:
            return fresh.execute("SELECT count(*) FROM t").fetchone()[0] == 5000

    wait_for(new_opens_see_it, 20, "the new version")
    for _ in range(3):
        assert con.execute("SELECT count(*), sum(length(v)) FROM t").fetchone() == (3000, 3000 * 200)
    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    con.execute("COMMIT")
    assert con.execute("SELECT count(*), sum(length(v)) FROM t").fetchone() == (5000, 5000 * 200)
    con.close()


def test_cat_reads_one_version_while_versions_land(rig):
    """`cat` of a replica while new versions land every 0.2 s gives exactly
    one published version, every time (a single pass never re-reads offset
    0, so it never moves)."""
    where = "/data/cat.db"
    versions = []
    rng = random.Random(3)

    def new_version() -> None:
        data = b"SQLite format 3\x00" + rng.randbytes(40 * CHUNK_SIZE - 16)
        versions.append(data)
        publish(rig.store, data, where)

    new_version()
    path = rig.mount.path(HOST, "data", "cat.db")
    wait_for(lambda: os.path.exists(path), 30, "cat.db")
    stop = threading.Event()

    def publisher() -> None:
        while not stop.wait(0.2):
            new_version()

    t = threading.Thread(target=publisher)
    t.start()
    try:
        outputs = []
        while len(outputs) < 20 and len(set(outputs)) < 3:
            outputs.append(subprocess.run(["cat", path], stdout=subprocess.PIPE, check=True, timeout=60).stdout)
            time.sleep(0.25)
    finally:
        stop.set()
        t.join(10)
    known = set(versions)
    assert all(out in known for out in outputs)
    assert len(set(outputs)) > 1  # the versions did land in between


def _journal_lookup(path: str) -> None:
    """What SQLite does at a read transaction's start: look for the hot
    journal (the mount takes it as the transaction-start signal)."""
    assert not os.path.exists(path + "-journal")


def test_a_handle_moves_only_at_a_transaction_start_with_a_clean_cache(rig):
    """A handle that is not SQLite's (no transaction start seen) keeps its
    version whatever it reads, offset 0 included. After a transaction
    start (the lookup of the -journal), a read from offset 0 moves it, in
    one piece; but when it read pages of its version since that start, a
    read from offset 0 of the whole file stays on that version (it would
    otherwise mix cached pages of the old version with the new ones), and
    the next transaction start moves it."""
    where = "/data/reread.db"
    v = [b"SQLite format 3\x00" + os.urandom(12 * CHUNK_SIZE - 16) for _ in range(3)]
    path = rig.mount.path(HOST, "data", "reread.db")

    def land(data: bytes) -> None:
        publish(rig.store, data, where)

        def new_opens_see_it():
            if not os.path.exists(path):  # a new directory: after a poll
                return False
            with open(path, "rb") as g:
                return g.read() == data

        wait_for(new_opens_see_it, 30, "the new version")

    land(v[0])
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == v[0][:4096]
        land(v[1])
        assert os.pread(fd, CHUNK_SIZE, 5 * CHUNK_SIZE) == v[0][5 * CHUNK_SIZE : 6 * CHUNK_SIZE]
        assert os.pread(fd, len(v[0]) + 1, 0) == v[0]  # no transaction start: stays
        assert os.fstat(fd).st_size == len(v[0])
        _journal_lookup(path)
        assert os.pread(fd, len(v[1]) + 1, 0) == v[1]  # a start, a clean cache: moves, whole
        land(v[2])
        _journal_lookup(path)
        assert os.pread(fd, CHUNK_SIZE, 5 * CHUNK_SIZE) == v[1][5 * CHUNK_SIZE : 6 * CHUNK_SIZE]
        assert os.pread(fd, len(v[1]) + 1, 0) == v[1]  # pages of v1 cached since: stays, whole
        _journal_lookup(path)
        assert os.pread(fd, len(v[2]) + 1, 0) == v[2]
    finally:
        os.close(fd)


def test_hot_rereads_stay_in_the_page_cache(rig):
    """Short-lived readers one after another (`cat`, a Python connection)
    reuse one follower and its page cache: once the file was read, reading
    it again sends no READ to the mount (but for pages the kernel evicted)."""
    data = _publish_rows(rig, "hot.db", 4000, seed=4)
    path = rig.mount.path(HOST, "data", "hot.db")
    wait_for(lambda: os.path.exists(path), 30, "hot.db")
    db = "/%s/data/hot.db" % HOST

    def read_bytes() -> int:
        return rig.mount.stats()["databases"][db]["read_bytes"]

    # What reaches the mount once the file was read is at most a few pages
    # the kernel evicted meanwhile: this VM pages out page-cache pages of
    # the physical regions its DAMON finds cold (kdamond's `pageout`
    # scheme), whatever file they hold. A page cache dropped would send the
    # file again (each `cat` below reads all of it).
    few = len(data) // 4
    assert subprocess.run(["cat", path], stdout=subprocess.PIPE, check=True).stdout == data
    before = read_bytes()
    inodes = set()
    for _ in range(3):
        assert subprocess.run(["cat", path], stdout=subprocess.PIPE, check=True).stdout == data
        with contextlib.closing(_connect(path)) as con:
            assert con.execute("SELECT count(*) FROM t").fetchone() == (4000,)
        inodes.add(os.stat(path).st_ino)
    assert read_bytes() - before < few
    assert len(inodes) == 1
    # A stat in one thread, then an open in another (Spark's driver plans
    # its tasks by the files' sizes, then the tasks open them): one
    # follower, its page cache still hot. The wait outlives the kernel's
    # entry timeout, so that the stat's LOOKUP reaches the mount, and any
    # retry of an open of this thread above (its reservation).
    time.sleep(max(DEFAULT_ENTRY_TIMEOUT, RESERVE_SECONDS) + 0.2)
    assert os.stat(path).st_ino in inodes
    seen = []

    def task() -> None:
        with open(path, "rb") as f:
            seen.append((os.fstat(f.fileno()).st_ino, f.read() == data))

    reader = threading.Thread(target=task)
    reader.start()
    reader.join(30)
    assert seen == [(inodes.pop(), True)] and read_bytes() - before < few
