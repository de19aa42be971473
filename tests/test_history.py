"""History: `verneuilctl versions`, `restore --at`, a directory store's kept
versions and their retention, and past states on a real mount
(``app.db@TIME``), on both store kinds (a directory, and S3 through moto's
server with a versioned manifest bucket).

Versions are published with chosen manifest ctimes (`replicas.publish`), so
that times and boundaries are exact; one test goes through the real writer
VFS and a copier.  Every wait is bounded; mounts are always unmounted
(`fusermount3 -u -z`) and their process ended.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time

import pytest
import trio

from support.replicas import HOST, Mount, fuse_unavailable, make_db, publish, wait_for
from verneuil_fuse.readback import fetch_manifest
from verneuil_fuse.readback.repair import live_chunks
from verneuil_fuse.format import manifest_name
from verneuil_fuse.history import TIMES_AT_ONCE, BadTime, format_time, newest_at, newest_at_async, parse_time
from verneuil_fuse.store import LocalBackend, open_store

CTL = [sys.executable, "-m", "verneuil_fuse.cli"]
NS = 1_000_000_000
PATH = "/data/app.db"
# Manifest ctimes of the three versions published (2023-11-14), with
# fractions of a second that floats hold exactly.
CTIMES = [1_700_000_000.25, 1_700_000_100.5, 1_700_000_200.75]
MANIFEST = "7cb1-verneuil%3Atest.com%3A80ad%2F%2Ftmp%2Ftest.db"


def ns_of(ctime: float) -> int:
    return int(ctime) * NS + int((ctime % 1) * 1e9)


def run(args, timeout=120):
    env = dict(os.environ)
    env.pop("VERNEUIL_CONFIG", None)
    return subprocess.run(CTL + args, capture_output=True, env=env, timeout=timeout)


def assert_one_line_error(proc, code, *needles):
    err = proc.stderr.decode()
    assert proc.returncode == code, (proc.returncode, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("verneuilctl: error: "), err
    for needle in needles:
        assert needle.lower() in err.lower(), err


def db_bytes(tmp, rows: int, seed: int) -> bytes:
    path = os.path.join(str(tmp), "src-%d-%d.db" % (rows, seed))
    make_db(path, rows, seed=seed)
    with open(path, "rb") as f:
        return f.read()


def publish_versions(store, tmp, path=PATH, rows=(200, 400, 600)):
    """Three versions of `path`, at CTIMES; their bytes, oldest first."""
    out = []
    for n, ctime in zip(rows, CTIMES):
        data = db_bytes(tmp, n, seed=n)
        publish(store, data, path, hostname=HOST, ctime=ctime)
        out.append(data)
    return out


# -- times -----------------------------------------------------------------------


def test_parse_and_format_times():
    t = parse_time("2026-11-26T19:00:00Z")
    assert t == 1_795_719_600 * NS
    assert parse_time("2026-11-26T19:00:00") == t  # no zone: UTC
    assert parse_time("2026-11-26 19:00") == t
    assert parse_time("2026-11-26T21:00:00+02:00") == t == parse_time("2026-11-26T21:00:00+0200")
    assert parse_time("2026-11-26T18:00:00-01") == t
    assert parse_time("2026-11-26") == t - 19 * 3600 * NS
    assert parse_time("2026-11-26T19:00:00.000000001Z") == t + 1
    assert parse_time("2026-11-26T19:00:00,5Z") == t + NS // 2
    now = 1_800_000_000 * NS
    assert parse_time("-2h", now) == now - 2 * 3600 * NS
    assert parse_time("-30m", now) == now - 30 * 60 * NS
    assert parse_time("-1d", now) == now - 86400 * NS
    assert parse_time("-1h30m", now) == now - 5400 * NS
    assert parse_time("-1.5s", now) == now - 3 * NS // 2
    for ns in (t, t + 1, t + 123_456_789, ns_of(CTIMES[0])):
        assert parse_time(format_time(ns)) == ns
    assert format_time(t) == "2026-11-26T19:00:00Z"
    assert format_time(t + 120_000_000) == "2026-11-26T19:00:00.12Z"
    for bad in ("", "yesterday", "2026-13-01", "2026-02-30T00:00", "2026-11-26T25:00", "-2x", "2h",
                "2026-11-26T19:00:00+25:00", "2026-11-26T19:00:00Z-journal", "1" * 100):
        with pytest.raises(BadTime):
            parse_time(bad)


def test_newest_at_boundaries():
    times = [10, 20, 20, 30]
    seen = []

    def time_of(i):
        seen.append(i)
        return times[i]

    assert newest_at(4, 9, time_of) is None
    assert newest_at(4, 10, time_of) == 0
    assert newest_at(4, 19, time_of) == 0
    assert newest_at(4, 20, time_of) == 2
    assert newest_at(4, 29, time_of) == 2
    assert newest_at(4, 30, time_of) == 3
    assert newest_at(4, 10**30, time_of) == 3
    assert newest_at(0, 10, time_of) is None
    seen.clear()
    big = list(range(0, 10000, 10))
    assert newest_at(len(big), 10**6, lambda i: seen.append(i) or big[i]) == 999
    assert seen == [999]  # after the newest version: one read
    seen.clear()
    assert newest_at(len(big), 9975, lambda i: seen.append(i) or big[i]) == 997
    assert seen == [999, 998, 997]  # back from the newest, no further than the answer


def test_newest_at_follows_store_order_when_the_clock_stepped_back():
    """Issue 36, case 8: versions at +10, +30, +20, +40 (the writer's clock
    stepped back): the newest version in the store's order whose time is at
    or before T, also through the mount's batched walk."""
    times = [10, 30, 20, 40]
    assert [newest_at(4, t, times.__getitem__) for t in (9, 10, 22, 29, 30, 35, 40)] == \
        [None, 0, 2, 2, 2, 2, 3]
    asked = []

    async def times_of(indices):
        asked.append(indices)
        return [times[i] for i in indices]

    assert trio.run(newest_at_async, 4, 22, times_of) == 2
    assert asked == [[3], [2, 1, 0]]
    asked.clear()
    assert trio.run(newest_at_async, 4, 9, times_of) is None
    assert asked == [[3], [2, 1, 0]]


def test_times_out_of_range_are_bad_times():
    """Issue 36, case 8: a time past what 64-bit nanoseconds hold is one
    BadTime, never an overflow."""
    now = 1_800_000_000 * NS
    for bad in ("9999-12-31T23:59:59-23:59", "-300000000w", "-99999999999999999999w", "0001-01-01",
                "2263-01-01", "-" + "9" * 40 + "s"):
        with pytest.raises(BadTime, match="out of range"):
            parse_time(bad, now)
    assert parse_time("1677-09-22") < 0
    assert parse_time("2262-04-11") > 0


# -- directory store history and retention -----------------------------------------


def test_directory_store_keeps_versions_newest_first(tmp_path):
    store = open_store("file://%s/store" % tmp_path)
    m = store.manifests
    for n in range(4):
        m.put(MANIFEST, b"version %d" % n)
    versions = m.list_versions(MANIFEST)
    assert [m.get_version(MANIFEST, v.version_id) for v in versions] == [
        b"version 3", b"version 2", b"version 1", b"version 0"]
    assert [v.is_latest for v in versions] == [True, False, False, False]
    assert [v.mtime for v in versions] == sorted((v.mtime for v in versions), reverse=True)
    # Listings and the mount see only the current manifest.
    assert [i.key for i in m.list("")] == [MANIFEST]
    # A delete keeps past versions, as a delete marker would.
    m.delete(MANIFEST)
    assert [v.version_id for v in m.list_versions(MANIFEST)] == [v.version_id for v in versions]
    assert not any(v.is_latest for v in m.list_versions(MANIFEST))
    # Version ids are names of files under the store: nothing else is read.
    from verneuil_fuse.store import NotFound
    for bad in ("../../chunks/x", "null-ish", "0" * 20 + "-zzzzzzzz", ".."):
        with pytest.raises(NotFound):
            m.get_version(MANIFEST, bad)
    # Chunks keep no history.
    store.chunks.put("c", b"1")
    store.chunks.put("c", b"2")
    assert [(v.version_id, v.is_latest) for v in store.chunks.list_versions("c")] == [("null", True)]


def test_directory_store_retention_by_count_and_age(tmp_path):
    m = LocalBackend(tmp_path / "m", keep_versions=2)
    for n in range(5):
        m.put(MANIFEST, b"v%d" % n)
    assert [m.get_version(MANIFEST, v.version_id) for v in m.list_versions(MANIFEST)] == [b"v4", b"v3", b"v2"]
    # By age: a past version is deleted once it has not been current for
    # keep_seconds; the current one never is.
    aged = LocalBackend(tmp_path / "a", keep_versions=100, keep_seconds=0.5)
    aged.put(MANIFEST, b"a0")
    aged.put(MANIFEST, b"a1")
    time.sleep(0.7)
    aged.put(MANIFEST, b"a2")  # a0 stopped being current 0.7 s ago; a1 just now
    assert [aged.get_version(MANIFEST, v.version_id) for v in aged.list_versions(MANIFEST)] == [b"a2", b"a1"]
    time.sleep(0.7)
    aged.put(MANIFEST, b"a2")
    assert [aged.get_version(MANIFEST, v.version_id) for v in aged.list_versions(MANIFEST)] == [b"a2", b"a2"]


def test_directory_store_adopts_a_current_file_written_without_history(tmp_path):
    plain = LocalBackend(tmp_path / "m")  # keep_versions=0: no history
    plain.put(MANIFEST, b"old")
    assert [(v.version_id, v.is_latest) for v in plain.list_versions(MANIFEST)] == [("null", True)]
    kept = LocalBackend(tmp_path / "m", keep_versions=10)
    kept.put(MANIFEST, b"new")
    versions = kept.list_versions(MANIFEST)
    assert [kept.get_version(MANIFEST, v.version_id) for v in versions] == [b"new", b"old"]
    assert versions[0].is_latest and "null" not in [v.version_id for v in versions]


def test_retention_settings_in_urls_and_json(tmp_path):
    from verneuil_fuse.store import ConfigError, parse_config, store_target
    store = open_store("file://%s/s?keep_versions=5&keep_days=0.5" % tmp_path)
    assert (store.manifests.keep_versions, store.manifests.keep_seconds) == (5, 43200.0)
    assert store.chunks.keep_versions == 0
    assert open_store(store.url).manifests.keep_versions == 5
    default = open_store("file://%s/d" % tmp_path)
    assert (default.manifests.keep_versions, default.manifests.keep_seconds) == (1000, 7 * 86400.0)
    assert "keep" not in default.url
    target = store_target(parse_config({"directory": {"path": "/x", "keep_versions": 0, "keep_days": 0}}))
    assert (target["keep_versions"], target["keep_days"]) == (0, 0)
    for bad in ("keep_versions=-1", "keep_versions=1.5", "keep_days=nan", "keep_days=inf", "keep_days=x"):
        with pytest.raises(ConfigError):
            open_store("file://%s/s?%s" % (tmp_path, bad))
    proc = run(["versions", "--store", "file://%s/s?keep_days=-1" % tmp_path, "-s", "/x.db"])
    assert_one_line_error(proc, 2, "keep_days")


# -- verneuilctl versions / restore --at, both store kinds --------------------------


def test_versions_and_restore_at(any_store, tmp_path):
    store = any_store
    datas = publish_versions(store, tmp_path)
    url = store.url
    target = ["--store", url, "--hostname", HOST, "-s", PATH]
    proc = run(["versions", "--json"] + target)
    assert proc.returncode == 0, proc.stderr.decode()
    rows = json.loads(proc.stdout)
    assert [r["time"] for r in rows] == [format_time(ns_of(c)) for c in CTIMES]
    assert [r["time_ns"] for r in rows] == [ns_of(c) for c in CTIMES]
    assert [r["time_source"] for r in rows] == ["manifest"] * 3
    assert [r["size"] for r in rows] == [len(d) for d in datas]
    assert [r["is_latest"] for r in rows] == [False, False, True]
    assert [r["complete"] for r in rows] == [True] * 3 and [r["missing_chunks"] for r in rows] == [0] * 3
    ids = [r["version_id"] for r in rows]
    assert len(set(ids)) == 3
    text = run(["versions"] + target)
    assert text.returncode == 0 and text.stdout.decode().count("all present") == 3, text.stderr.decode()
    assert format_time(ns_of(CTIMES[1])) in text.stdout.decode()

    def restore_at(at: str) -> bytes:
        out = tmp_path / "out.db"
        proc = run(["restore", "--at", at, "-o", str(out), "--force"] + target)
        assert proc.returncode == 0, proc.stderr.decode()
        return out.read_bytes()

    t0, t1, t2 = (ns_of(c) for c in CTIMES)
    assert restore_at(format_time(t1)) == datas[1]  # exactly at a version's time: that version
    assert restore_at(format_time(t1 - 1)) == datas[0]  # one nanosecond before: the one before
    assert restore_at(format_time(t0)) == datas[0]
    assert restore_at(format_time(t2 - 1)) == datas[1]
    assert restore_at(format_time(t2)) == datas[2]
    assert restore_at("2030-01-01") == datas[2]
    assert restore_at("-1h") == datas[2]
    utc = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t1 // NS))
    assert restore_at(utc) == datas[0]  # whole seconds, no zone: UTC, before t1's .5 s
    assert restore_at(utc + ".5") == datas[1]
    plus2 = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t1 // NS + 7200)) + ".5+02:00"
    assert restore_at(plus2) == datas[1]
    # Too old, garbled, both ways of naming a version, unknown database.
    proc = run(["restore", "--at", format_time(t0 - 1), "-o", str(tmp_path / "x.db")] + target)
    assert_one_line_error(proc, 1, "no version", "as old as")
    assert not (tmp_path / "x.db").exists()
    proc = run(["restore", "--at", "last tuesday", "-o", str(tmp_path / "x.db")] + target)
    assert_one_line_error(proc, 2, "not a time")
    for out_of_range in ("9999-12-31T23:59:59-23:59", "-300000000w"):  # issue 36, case 8: no traceback
        proc = run(["restore", "--at", out_of_range, "-o", str(tmp_path / "x.db")] + target)
        assert_one_line_error(proc, 2, "not a time", "out of range")
    proc = run(["restore", "--at", "-1h", "--version-id", ids[0], "-o", str(tmp_path / "x.db")] + target)
    assert_one_line_error(proc, 2, "not both")
    unknown = ["--store", url, "--hostname", HOST, "-s", "/data/nope.db"]
    assert_one_line_error(run(["versions"] + unknown), 1, "no such replicated database")
    assert_one_line_error(run(["restore", "--at", "-1h", "-o", str(tmp_path / "x.db")] + unknown), 1,
                          "no such replicated database")
    # A chunk only the middle version names goes missing: that version says so.
    name = manifest_name(PATH, HOST)
    chunk_sets = [set(live_chunks(fetch_manifest(store, name, r["version_id"]))) for r in rows]
    only_middle = sorted(chunk_sets[1] - chunk_sets[0] - chunk_sets[2])
    assert only_middle, "the middle version shares all its chunks"
    store.chunks.delete(only_middle[0].name)
    rows = json.loads(run(["versions", "--json"] + target).stdout)
    assert [r["complete"] for r in rows] == [True, False, True] and rows[1]["missing_chunks"] == 1
    assert [r["version_id"] for r in rows] == ids
    unchecked = json.loads(run(["versions", "--json", "--no-check"] + target).stdout)
    assert [r["complete"] for r in unchecked] == [None] * 3
    # An older version only: exit 0 (the database can be restored as it is
    # now), and a warning says what the missing chunks cost.
    proc = run(["versions"] + target)
    assert proc.returncode == 0 and b"1 MISSING" in proc.stdout, proc.stderr
    assert b"warning: 1 older version misses chunks and cannot be restored" in proc.stderr, proc.stderr
    # A chunk of the latest version: exit 3, and the warning says so.
    only_latest = sorted(chunk_sets[2] - chunk_sets[0] - chunk_sets[1])
    assert only_latest, "the latest version shares all its chunks"
    store.chunks.delete(only_latest[0].name)
    proc = run(["versions"] + target)
    assert proc.returncode == 3, proc.stderr
    assert b"warning: the latest version misses 1 chunk: restoring or reading" in proc.stderr, proc.stderr
    assert run(["versions", "--json"] + target).returncode == 3
    assert run(["versions", "--no-check"] + target).returncode == 0  # not checked: not known


@pytest.mark.skipif(not shutil.which("sqlite3"), reason="no sqlite3 shell")
def test_versions_of_a_database_written_through_the_vfs(any_store, tmp_path):
    """The real writer and copier: two commits, two versions, each restored
    by its own time."""
    pytest.importorskip("writer_vfs")
    from support.replicas import replicate
    from verneuil_fuse.format import local_hostname

    path = os.path.realpath(str(tmp_path / "w.db"))
    make_db(path, 300, seed=1)
    spool = str(tmp_path / "spool")
    replicate(any_store, path, spool, timeout=60)
    first = open(path, "rb").read()
    time.sleep(0.05)
    con = sqlite3.connect(path)
    con.execute("DELETE FROM t WHERE id < 100")
    con.commit()
    con.close()
    replicate(any_store, path, spool, timeout=60)
    second = open(path, "rb").read()
    target = ["--store", any_store.url, "--hostname", local_hostname(), "-s", path]
    rows = json.loads(run(["versions", "--json"] + target).stdout)
    assert len(rows) >= 2 and rows[-1]["is_latest"] and all(r["complete"] for r in rows)
    assert [r["time_ns"] for r in rows] == sorted(r["time_ns"] for r in rows)
    out = tmp_path / "out.db"
    for at, want in ((rows[0]["time"], first), (rows[-1]["time"], second)):
        proc = run(["restore", "--at", at, "-o", str(out), "--force"] + target)
        assert proc.returncode == 0, proc.stderr.decode()
        assert out.read_bytes()[100:] == want[100:]  # the VFS's commit rewrote the header's counters


# -- past states on a real mount -------------------------------------------------------


class MountEnv:
    def __init__(self, root, store, datas, mount):
        self.root, self.store, self.datas, self.mount = root, store, datas, mount

    def past(self, name: str) -> str:
        return self.mount.path(HOST, "data", name)


@pytest.fixture(scope="module", params=["local", "s3"])
def menv(request, tmp_path_factory):
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("history-" + request.param)
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        if not server.running:
            server.start()
        store = server.make_store()
    else:
        store = open_store("file://%s/store" % root)
    datas = publish_versions(store, root)
    mount = Mount(store.url, os.path.join(str(root), "mnt"),
                  "cache_dir=%s,refresh=0.5,retries=1,timeout=5,log_level=info,log_file=%s"
                  % (os.path.join(str(root), "cache"), os.path.join(str(root), "verneuil.log")))
    mount.start()
    try:
        yield MountEnv(root, store, datas, mount)
    finally:
        mount.stop()
        store.close()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _count(uri: str) -> int:
    out = subprocess.run(["sqlite3", "-readonly", uri, "SELECT count(*) FROM t;"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.fuse
@pytest.mark.timeout(240)
@pytest.mark.skipif(not shutil.which("sqlite3"), reason="no sqlite3 shell")
def test_past_states_on_the_mount(menv):
    t0, t1, t2 = (ns_of(c) for c in CTIMES)
    live = menv.past("app.db")
    assert _read(live) == menv.datas[2]
    at1 = menv.past("app.db@" + format_time(t1))
    assert _read(at1) == menv.datas[1]  # exactly at its time
    assert _read(menv.past("app.db@" + format_time(t1 - 1))) == menv.datas[0]
    assert _read(menv.past("app.db@" + format_time(t2))) == menv.datas[2]
    st = os.stat(at1)
    assert st.st_size == len(menv.datas[1]) and st.st_mtime_ns == t1
    assert st.st_ino != os.stat(live).st_ino
    # Zones and whole seconds read as for the CLI.
    whole = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t1 // NS))
    assert _read(menv.past("app.db@%s.5+00:00" % whole)) == menv.datas[1]
    assert _read(menv.past("app.db@%s" % whole)) == menv.datas[0]
    # The sqlite3 shell opens a past state by URI: '@' and ':' need no escape.
    uri = "file:%s?immutable=1" % at1
    assert _count(uri) == 400
    assert _count("file:%s?immutable=1" % live) == 600
    # '+' needs no escape either (SQLite decodes only %XX in a URI's path).
    zoned = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t1 // NS + 3600)) + ".5+01:00"
    assert _count("file:%s?immutable=1" % menv.past("app.db@" + zoned)) == 400
    # Never listed; unknown, too old and garbled times are ENOENT.
    assert os.listdir(menv.mount.path(HOST, "data")) == ["app.db"]
    for name in ("app.db@" + format_time(t0 - 1), "app.db@1999-01-01", "app.db@garbled", "app.db@",
                 "nope.db@" + format_time(t1), "app.db@" + format_time(t1) + "-journal"):
        with pytest.raises(FileNotFoundError):
            os.stat(menv.past(name))
    # The live file moves on; the past state keeps its bytes, and a handle
    # opened on it before keeps reading them.
    with open(at1, "rb") as held:
        data = db_bytes(menv.root, 800, seed=800)
        publish(menv.store, data, PATH, hostname=HOST, ctime=CTIMES[2] + 100)
        wait_for(lambda: os.stat(live).st_size == len(data), 30, "the new version on the mount")
        assert _read(live) == data
        assert held.read() == menv.datas[1]
    assert _read(at1) == menv.datas[1]
    assert _count(uri) == 400
    assert _read(menv.past("app.db@" + format_time(t2))) == menv.datas[2]
    # A past state shares the live file's chunk cache: the state of now (a
    # replica and inode of its own) is read with no GET, the live file's
    # chunks having been fetched already.
    before = menv.mount.stats()["fetch"]["store_fetches"]
    now = menv.past("app.db@-1s")
    assert os.stat(now).st_ino != os.stat(live).st_ino
    assert _read(now) == data
    assert menv.mount.stats()["fetch"]["store_fetches"] == before
    # The same version is the same inode, whatever time named it.
    assert os.stat(menv.past("app.db@" + format_time(t1 + 1))).st_ino == os.stat(at1).st_ino
    with pytest.raises(OSError) as err:
        os.open(at1, os.O_WRONLY)
    assert err.value.errno in (errno.EROFS, errno.EACCES)


# -- the mount's resolution, without FUSE ----------------------------------------------


def test_past_state_resolution_reads_each_version_once_and_reports_store_failures(tmp_path):
    """64 versions: a time is resolved reading the versions from the newest
    back to the one chosen (8 at a time), each version's time read once per
    mount; the same version twice is the same replica, and a store that
    fails is FetchError (EREMOTEIO on the mount), not 'no such version'."""
    import trio

    from verneuil_fuse.reader.fetcher import FetchError, Fetcher
    from verneuil_fuse.reader.past import PastStates
    from verneuil_fuse.store import Store, TransientError

    store = open_store("file://%s/store" % tmp_path)
    base = 1_700_000_000
    for n in range(64):
        publish(store, b"SQLite format 3\x00" + bytes([n]) * 5000, PATH, hostname=HOST, ctime=base + n)
    key = manifest_name(PATH, HOST)
    inodes = iter(range(1000, 2000))

    async def main():
        past = PastStates(Fetcher(store), lambda: next(inodes))
        r = await past.resolve(key, "app.db@x", (base + 20) * NS + 5)
        assert r is not None and r.mtime_ns == (base + 20) * NS and r.size == 5016
        assert 44 <= past.manifest_reads <= 44 + TIMES_AT_ONCE  # versions 63 .. 20, one batch past
        again = await past.resolve(key, "app.db@y", (base + 20) * NS + 7)
        assert again is r
        assert await past.resolve(key, "app.db@z", base * NS - 1) is None
        assert await past.resolve(key, "app.db@w", (1 << 63) - 1) is not None
        assert past.manifest_reads <= 64 + 2  # each version's time once (and two chosen ones again)

        class Failing:
            def __getattr__(self, name):
                return getattr(store.manifests, name)

            def list_versions(self, key):
                raise TransientError("store down")

        broken = PastStates(Fetcher(Store(store.chunks, Failing(), store.url)), lambda: next(inodes))
        with pytest.raises(FetchError):
            await broken.resolve(key, "app.db@v", base * NS)

    trio.run(main)
