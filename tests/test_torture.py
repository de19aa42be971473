"""Crash torture: writers (the C VFS, three processes) and copiers
(`verneuilctl copier`, two processes) killed with SIGKILL at random moments
replicating into a versioned bucket of moto's server: into a store of the
default layout for about 40 seconds, 30 with a rollback journal and 10 in
WAL mode (the WAL writers also checkpoint, in every mode, and autocheckpoint
often; VERNEUIL_TORTURE_WAL_SECONDS sets a longer WAL run), and for 20 s
with a rollback journal into a store of the packed layout (chunks in packs,
each manifest with their places: docs/FORMAT.md, "Packed layout").

What "committed state" means here: every writer transaction starts with
`BEGIN IMMEDIATE` (the write lock: nobody else can commit, and SQLite has
rolled back any hot journal or recovered the WAL), reads the counter row `n`
and the sha256 of the database's committed state (the file; in WAL mode the
file with the WAL's committed frames, support/walimage.py), appends "n sha"
to a shared log (O_APPEND), and only then changes anything and commits n+1.
So every committed state that any transaction started from is in the log;
the last one is logged by the test itself at the end.

Checked:
- whenever all copiers are dead (a random third of the rounds), the newest
  manifest version in the store, and every version not checked yet, restore
  completely (every chunk is there and verifies: chunks land before the
  manifest naming them);
- afterwards, every manifest version restores to a logged state, the states
  never go back in time (counters non-decreasing, oldest version first), and
  the newest restored state passes `PRAGMA integrity_check`;
- once things settle (one more commit through the VFS, then `verneuilctl
  flush`), the newest version is exactly the database file;
- the source database passes `PRAGMA integrity_check`.
"""
from __future__ import annotations

import hashlib
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from support.copier_support import opened_image, vfs_available
from support.walimage import CommittedImage
from test_faults import BucketView, list_manifest_versions
from verneuil_fuse import format as fmt

pytestmark = [pytest.mark.s3, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(not vfs_available(), reason="writer_vfs is not built")]

# CI's share of CI's 15 minutes: 16 s give each run some 4 to 20 rounds of
# kills (long runs: VERNEUIL_TORTURE_SECONDS=300, and the WAL one below).
TORTURE_SECONDS = float(os.environ.get("VERNEUIL_TORTURE_SECONDS", "16"))
# Each run's share of TORTURE_SECONDS.  The default layout's copier is
# tortured in both journal modes (the copier does not know the mode): 3/4
# with a rollback journal, 1/4 in WAL mode.  The packed layout's run, the
# same protocol with another upload step, gets half.
RUN_SHARE = {("delete", "chunks"): 0.75, ("delete", "packed"): 0.5, ("wal", "chunks"): 0.25}
# The long WAL run (e.g. VERNEUIL_TORTURE_WAL_SECONDS=300), outside CI.
WAL_TORTURE_SECONDS = os.environ.get("VERNEUIL_TORTURE_WAL_SECONDS")
# The schedule of kills and checks; another seed gives another interleaving
# (to chase a failure: VERNEUIL_TORTURE_SEED=n, many runs).
TORTURE_SEED = int(os.environ.get("VERNEUIL_TORTURE_SEED", "20240607"))
# Copier log level: "-vv" logs every request (a failure report quotes the
# lines naming a missing chunk); "-v" only manifest uploads.
COPIER_VERBOSITY = os.environ.get("VERNEUIL_TORTURE_COPIER_LOG", "-vv")
WRITERS = 3
COPIERS = 2
CTL = [sys.executable, "-m", "verneuil_fuse.cli"]
TESTS = os.path.dirname(os.path.abspath(__file__))

WRITER = r"""
import hashlib, os, random, sys, time
import writer_vfs
spool, db, log_path, seed, tests = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
sys.path.insert(0, tests)
from support.walimage import CommittedImage
rng = random.Random(seed)
writer_vfs.register(spool)
writer_vfs.set_log_stderr(True)  # the VFS's warnings go to writers.err
writer_vfs.set_gc_weight(rng.choice([0.0, 4.0, 1e9]))
# Opened before connecting and never closed: closing any descriptor of the
# database would drop every POSIX lock this process holds on it (SQLite's
# included).
image = CommittedImage(db)
conn = writer_vfs.connect(db, isolation_level=None, timeout=60)
conn.execute("PRAGMA synchronous=" + rng.choice(["OFF", "NORMAL", "FULL"]))
conn.execute("PRAGMA wal_autocheckpoint=" + rng.choice(["20", "100", "1000"]))
log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
print("ready", flush=True)
while True:
    conn.execute("BEGIN IMMEDIATE")
    (n,) = conn.execute("SELECT n FROM counter WHERE id = 1").fetchone()
    digest = hashlib.sha256(image.read()).hexdigest()
    os.write(log, b"%d %s\n" % (n, digest.encode()))
    n += 1
    conn.execute("UPDATE counter SET n = ? WHERE id = 1", (n,))
    op = rng.random()
    if op < 0.6:
        for _ in range(rng.randint(1, 3)):
            conn.execute("INSERT INTO log(n, pad) VALUES (?, ?)", (n, rng.randbytes(rng.randint(0, 20000))))
    elif op < 0.8:
        conn.execute("UPDATE log SET pad = ? WHERE rowid % ? = 0", (rng.randbytes(rng.randint(0, 3000)), rng.randint(5, 40)))
    elif op < 0.95:
        conn.execute("DELETE FROM log WHERE n < ?", (n - rng.randint(50, 150),))
    else:
        conn.execute("DELETE FROM big")
        if rng.random() < 0.5:
            conn.execute("INSERT INTO big VALUES (?)", (rng.randbytes(rng.randint(100000, 300000)),))
    conn.execute("COMMIT")
    if rng.random() < 0.05:  # no-op in rollback mode
        conn.execute("PRAGMA wal_checkpoint(%s)" % rng.choice(["PASSIVE", "FULL", "RESTART", "TRUNCATE"]))
    time.sleep(rng.uniform(0, 0.02))
"""


def read_log(path: str) -> dict[str, int]:
    """sha256 -> counter of every logged committed state (the last line may
    be cut by a kill: ignored)."""
    states: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2 and len(parts[1]) == 64 and line.endswith("\n"):
                states[parts[1]] = int(parts[0])
    return states


class Procs:
    """The writer and copier processes; every one is ended by PID."""

    def __init__(self, tmp, spool, db, log_path, store_url, rng):
        self.tmp, self.spool, self.db, self.log_path = tmp, spool, db, log_path
        self.store_url = store_url
        self.rng = rng
        self.writers: list[subprocess.Popen] = []
        self.copiers: list[subprocess.Popen] = []
        self.kills = {"writer": 0, "copier": 0}
        self.errors: list[str] = []

    def spawn_writer(self) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", WRITER, self.spool, self.db, self.log_path,
                              str(self.rng.randrange(2 ** 32)), TESTS],
                             stdout=subprocess.PIPE, stderr=open(os.path.join(self.tmp, "writers.err"), "ab"))
        return p

    def spawn_copier(self) -> subprocess.Popen:
        return subprocess.Popen(CTL + ["copier", COPIER_VERBOSITY, "--store", self.store_url, "--spool", self.spool,
                                       "--rate", "0", "--poll-interval", "0.02",
                                       "--lock-timeout", "5"],
                                stdout=subprocess.DEVNULL,
                                stderr=open(os.path.join(self.tmp, "copiers.err"), "ab"))

    def kill(self, p: subprocess.Popen, kind: str) -> None:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignored
            self.errors.append("pid %d survived SIGKILL" % p.pid)
        if p.returncode not in (-signal.SIGKILL,):
            self.errors.append("%s %d ended on its own: %s" % (kind, p.pid, p.returncode))
        if p.stdout is not None:
            p.stdout.close()
        self.kills[kind] += 1

    def kill_all(self) -> None:
        for p in self.writers:
            self.kill(p, "writer")
        for p in self.copiers:
            self.kill(p, "copier")
        self.writers, self.copiers = [], []


def _explain_missing(m, admin, chunk_bucket: str, tmp: str) -> str:
    """For a failure report: the manifest's chunks missing from the store,
    where copies of them are in the spool, and the log lines naming them."""
    missing = []
    for i, fp in enumerate(m.chunks):
        if i in m.bundled or fp == fmt.ZERO_CHUNK_FPRINT:
            continue
        key = fmt.chunk_source(m, i).key  # a chunk object, or its pack
        try:
            admin.head_object(Bucket=chunk_bucket, Key=key)
        except Exception:  # noqa: BLE001 - a diagnosis, never raised
            missing.append((i, fp.name if key == fp.name else "%s in %s" % (fp.name, key)))
    lines = ["; %d of %d chunks missing" % (len(missing), len(m.chunks))]
    for i, name in missing[:3]:
        where = [os.path.relpath(os.path.join(d, f), tmp)
                 for d, _, files in os.walk(os.path.join(tmp, "spool")) for f in files if f == name]
        logged = []
        for log_name in ("copiers.err", "writers.err"):
            with open(os.path.join(tmp, log_name), errors="replace") as f:
                logged += [line.strip()[:200] for line in f if name.split()[0] in line]
        lines.append("chunk %d %s: in the spool at %s; logged: %s" % (i, name, where, logged[-5:]))
    return "\n".join(lines)


def _integrity(data: bytes, tmp: str) -> str:
    with opened_image(data, tmp) as con:
        return con.execute("PRAGMA integrity_check").fetchone()[0]


@pytest.mark.parametrize("journal,layout", list(RUN_SHARE))
def test_sigkill_writers_and_copiers(s3_server, tmp_path, journal, layout):
    import writer_vfs

    if not s3_server.running:
        s3_server.start()
    tmp = str(tmp_path)
    store = s3_server.make_store(versioned=True, layout=layout)
    seconds = TORTURE_SECONDS * RUN_SHARE[journal, layout]
    if journal == "wal" and WAL_TORTURE_SECONDS:
        seconds = float(WAL_TORTURE_SECONDS)
    chunk_bucket = store.chunks.bucket
    manifest_bucket = store.manifests.bucket
    admin = s3_server.admin
    spool = os.path.join(tmp, "spool")
    db = os.path.join(tmp, "torture.db")
    log_path = os.path.join(tmp, "states.log")
    writer_vfs.register(spool)
    conn = writer_vfs.connect(db, isolation_level=None)
    conn.execute("PRAGMA page_size=4096")
    setup = CommittedImage(db)
    with open(log_path, "ab") as log:
        if journal == "wal":  # a commit of its own, an empty database in WAL
            conn.execute("PRAGMA journal_mode=WAL")
            log.write(b"0 %s\n" % hashlib.sha256(setup.read()).hexdigest().encode())
        conn.executescript(
            "BEGIN;"
            "CREATE TABLE counter(id INTEGER PRIMARY KEY, n INTEGER);"
            "CREATE TABLE log(n INTEGER, pad BLOB);"
            "CREATE TABLE big(b BLOB);"
            "INSERT INTO counter VALUES (1, 0);"
            "COMMIT;")
    conn.close()
    name = fmt.manifest_name(db)
    view = BucketView(admin, chunk_bucket)
    checked: dict[str, str] = {}   # version id -> sha256 of its restored bytes
    check_failures: list[str] = []

    def check_new_versions(label: str) -> int:
        """Restore every manifest version not checked yet (copiers are dead)."""
        new = 0
        for key, vid, _ in list_manifest_versions(admin, manifest_bucket):
            assert key == name, key
            if vid in checked:
                continue
            blob = admin.get_object(Bucket=manifest_bucket, Key=name, VersionId=vid)["Body"].read()
            m = None
            try:
                m = fmt.decode_and_validate(blob, fetch_chunk=view.chunk)
                data = view.restore(m)
            except Exception as e:  # noqa: BLE001 - recorded, asserted below
                check_failures.append("%s: version %s: %s: %s%s" % (
                    label, vid, type(e).__name__, e,
                    "" if m is None else _explain_missing(m, admin, chunk_bucket, tmp)))
                checked[vid] = ""
                continue
            checked[vid] = hashlib.sha256(data).hexdigest()
            new += 1
        return new

    rng = random.Random(TORTURE_SEED)
    procs = Procs(tmp, spool, db, log_path, store.url, rng)
    rounds = quiet_checks = 0
    try:
        procs.writers = [procs.spawn_writer() for _ in range(WRITERS)]
        procs.copiers = [procs.spawn_copier() for _ in range(COPIERS)]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and rounds < 400:
            rounds += 1
            time.sleep(rng.uniform(0.1, 0.7))
            event = rng.random()
            if event < 0.35:
                i = rng.randrange(len(procs.writers))
                procs.kill(procs.writers[i], "writer")
                procs.writers[i] = procs.spawn_writer()
            elif event < 0.47:
                i = rng.randrange(len(procs.copiers))
                procs.kill(procs.copiers[i], "copier")
                procs.copiers[i] = procs.spawn_copier()
            elif event < 0.53:
                # Every copier dies at once: whatever the store shows now
                # must be complete (no copier is left to finish anything).
                for p in procs.copiers:
                    procs.kill(p, "copier")
                check_new_versions("round %d" % rounds)
                quiet_checks += 1
                procs.copiers = [procs.spawn_copier() for _ in range(COPIERS)]
    finally:
        procs.kill_all()
    assert not check_failures, check_failures[:5]
    assert not procs.errors, procs.errors[:5]
    least = 10 * seconds / 40  # kills at least, in proportion to the time
    assert procs.kills["writer"] >= least and procs.kills["copier"] >= least, procs.kills
    check_new_versions("after the torture")
    assert not check_failures, check_failures[:5]

    # Settle: one more commit through the VFS (a writer killed between its
    # commit and its snapshot left the newest state unspooled: the next
    # transaction notices), log it, then a copier to completion.
    image = CommittedImage(db)  # before connecting: see WRITER
    conn = writer_vfs.connect(db, isolation_level=None, timeout=60)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with open(log_path, "ab") as log:
        for final in (False, True):
            conn.execute("BEGIN IMMEDIATE")
            (n,) = conn.execute("SELECT n FROM counter WHERE id = 1").fetchone()
            digest = hashlib.sha256(image.read()).hexdigest()
            log.write(b"%d %s\n" % (n, digest.encode()))
            if not final:
                conn.execute("UPDATE counter SET n = ? WHERE id = 1", (n + 1,))
            conn.execute("COMMIT")
    conn.close()
    flush = subprocess.run(CTL + ["flush", "--store", store.url, "--spool", spool, "--rate", "0",
                                  "--timeout", "60"], capture_output=True, text=True, timeout=120)
    assert flush.returncode == 0, flush.stderr
    final_n, final_sha = n, digest

    states = read_log(log_path)
    check_new_versions("after settling")
    assert not check_failures, check_failures[:5]
    versions = [vid for _, vid, _ in list_manifest_versions(admin, manifest_bucket)]  # oldest first
    unknown = [vid for vid in versions if checked[vid] not in states]
    assert not unknown, "%d of %d versions restore to no committed state" % (len(unknown), len(versions))
    counters = [states[checked[vid]] for vid in versions]
    back = [(a, b) for a, b in zip(counters, counters[1:]) if b < a]
    assert not back, "the store went back in time: %s" % back[:5]
    # The newest version is the database file, byte for byte.
    assert checked[versions[-1]] == final_sha
    assert counters[-1] == final_n
    blob = admin.get_object(Bucket=manifest_bucket, Key=name)["Body"].read()
    newest = view.restore(fmt.decode_and_validate(blob, fetch_chunk=view.chunk))
    assert newest == image.read()
    assert _integrity(newest, tmp) == "ok"
    for vid in rng.sample(versions, min(5, len(versions))):  # a few older ones too
        blob = admin.get_object(Bucket=manifest_bucket, Key=name, VersionId=vid)["Body"].read()
        assert _integrity(view.restore(fmt.decode_and_validate(blob, fetch_chunk=view.chunk)), tmp) == "ok"
    check = sqlite3.connect(db)
    assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    check.close()
    print("torture: %d rounds, %d writer kills, %d copier kills, %d quiet checks, %d commits, "
          "%d manifest versions (counters %d..%d), %d chunks"
          % (rounds, procs.kills["writer"], procs.kills["copier"], quiet_checks, final_n,
             len(versions), counters[0], counters[-1], len(view.cache)))
    store.close()
