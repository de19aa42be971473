"""Copiers of a packed store (docs/COPIER.md, "The packed layout"): the real
writer VFS, a copier, a directory store or moto's S3 server with
`layout=packed`, and every chunk read back verified.

Checked: round trips (the store holds packs only, each manifest says where
every chunk is, unchanged chunks keep their place, also after the spool is
lost); compaction keeps a cold scan within 2x the range reads of a fresh
pack and GC the store within 1.5x the live bytes, sparing every kept
version; chunks the spool lost track of are found in the source file, and
when they cannot be, nothing is uploaded and the writer is made to publish
a full snapshot; the touch patrol, `repair` and `versions` see packs;
`verneuilctl convert` goes both ways and resumes where it stopped.
"""
from __future__ import annotations

import json
import logging
import os
import random
import sqlite3
import subprocess
import sys

import pytest

from support.copier_support import Writer, vfs_available
from support.replicas import publish_file
from verneuil_fuse import format as fmt
from verneuil_fuse.copier import Copier
from verneuil_fuse.readback import fetch_manifest, restore_bytes
from verneuil_fuse.copier import packing
from verneuil_fuse.copier import spool as sp
from verneuil_fuse.store import StoreError, TransientError, open_store

pytestmark = pytest.mark.skipif(not vfs_available(), reason="writer_vfs is not built")

CTL = [sys.executable, "-m", "verneuil_fuse.cli"]
MB = 1 << 20


def run(args, **kw):
    return subprocess.run(CTL + args, capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture(params=["local", "s3"])
def packed_store(request, tmp_path):
    if request.param == "local":
        store = open_store("file://%s/store?layout=packed&keep_versions=3" % tmp_path)
    else:
        server = request.getfixturevalue("s3_server")
        if not server.running:
            server.start()
        store = server.make_store(layout="packed")
    try:
        yield store
    finally:
        store.close()


def flush(spool, store, **kw) -> Copier:
    c = Copier(spool, store, rate=0, **kw)
    try:
        c.flush(timeout=60)
    finally:
        c.close()
    return c


def written(tmp_path, commits: int, payload: int):
    """A directory store of the packed layout, a spool and a database of
    the writer VFS that committed `commits` times, all shipped."""
    store = open_store("file://%s/store?layout=packed" % tmp_path)
    spool = str(tmp_path / "spool")
    w = Writer("vfs", spool, str(tmp_path / "app.db"), payload=payload)
    for _ in range(commits):
        w.bump()
    flush(spool, store)
    return store, spool, w


def chunk_keys(store) -> list[str]:
    return sorted(o.key for o in store.chunks.list())


def db_dir(spool: str) -> sp.DbDir:
    (d,) = [d for r in sp.boot_roots(spool)[0] for d in sp.list_dbdirs(r)]
    return d


def test_round_trip_and_unchanged_chunks_keep_their_place(packed_store, tmp_path):
    store, spool = packed_store, str(tmp_path / "spool")
    w = Writer("vfs", spool, str(tmp_path / "app.db"), payload=20000)
    for _ in range(20):
        w.bump()
    w.execute("CREATE TABLE big(x)")
    w.execute("INSERT INTO big VALUES (randomblob(3000000))")
    first = flush(spool, store)
    m1 = fetch_manifest(store, w.name)
    assert m1.layout is not None and restore_bytes(store, m1) == w.data()
    # Only packs in the chunk namespace, every stored chunk in one.
    assert all(fmt.parse_pack_key(k) for k in chunk_keys(store))
    assert all(fmt.chunk_source(m1, i).ranged for i in packing.scanned_chunks(m1))
    assert first.stats.packs_uploaded >= 1 and first.stats.chunks_uploaded >= len(m1.chunks) - 1
    n = w.bump()
    again = flush(spool, store)
    m2 = fetch_manifest(store, w.name)
    assert restore_bytes(store, m2) == w.data() and n > 20
    same = [i for i in range(1, len(m1.chunks)) if m1.chunks[i] == m2.chunks[i]]
    assert len(same) >= len(m1.chunks) // 2
    assert all(m2.layout.place(i) == m1.layout.place(i) for i in same)
    # The commit's new chunks went into one small pack.
    assert again.stats.packs_uploaded == 1 and again.stats.chunk_bytes_sent < 5 * 65536
    lag = run(["lag", "--json", "--spool", spool, "--store", store.url])
    assert lag.returncode == 0, lag.stderr
    (entry,) = json.loads(lag.stdout)
    assert [e["in_store"] for e in entry["manifests"]] == ["current"]
    shown = run(["manifest", "--store", store.url, "-m", w.name])
    assert "layout:          packed, %d packs" % len(m2.layout.packs) in shown.stdout
    w.close()


def test_a_lost_spool_keeps_the_places(tmp_path):
    """After a reboot (the spool starts empty, the writer stages every chunk
    again), the copier takes the places from the store's manifest: nothing
    unchanged is uploaded again."""
    store, spool, w = written(tmp_path, 40, 40000)
    before = chunk_keys(store)
    w.close()
    import shutil
    shutil.rmtree(spool)
    w = Writer("vfs", spool, str(tmp_path / "app.db"))
    w.bump()
    c = flush(spool, store)
    m = fetch_manifest(store, w.name)
    assert restore_bytes(store, m) == w.data()
    assert c.stats.chunks_skipped >= len(m.chunks) // 2  # restaged, kept their place
    assert c.stats.chunk_bytes_sent < 4 * 65536
    assert len(set(chunk_keys(store)) - set(before)) == 1
    w.close()


def _small_commits(tmp_path, store, commits: int, target: int):
    """An 8 MiB database and `commits` commits of 3 random rows each, every
    one shipped at once; yields each manifest uploaded."""
    import writer_vfs
    spool, db = str(tmp_path / "spool"), str(tmp_path / "small.db")
    writer_vfs.register(spool_dir=spool)
    conn = writer_vfs.connect(db, isolation_level=None)
    conn.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB)")
    conn.execute("INSERT INTO t(v) SELECT randomblob(1000) FROM (WITH RECURSIVE c(x) AS "
                 "(SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 7800) SELECT x FROM c)")
    c = Copier(spool, store, rate=0)
    c.packer.target = target
    rng = random.Random(5)
    try:
        c.flush(timeout=60)
        for _ in range(commits):
            conn.execute("BEGIN")
            for _ in range(3):
                conn.execute("UPDATE t SET v = randomblob(1000) WHERE id = ?", (rng.randrange(1, 7800),))
            conn.execute("COMMIT")
            c.flush(timeout=60)
            yield c, db, fetch_manifest(store, fmt.manifest_name(db))
    finally:
        c.close()
        conn.close()


def _live_bytes(m) -> int:
    return sum(n for _, _, n in {m.layout.place(i) for i in range(len(m.chunks))} - {None})


def test_compaction_and_gc_bound_reads_and_bytes(tmp_path, monkeypatch):
    """The done criterion of the packed layout, small: after many small
    commits a cold scan takes at most 2x the range reads of a fresh pack,
    and once GC has run (no history kept: past versions' packs are theirs)
    the store holds at most 1.5x the live bytes. (No slack: the small
    database's bounds are the ratios themselves.)"""
    monkeypatch.setattr(packing, "COMPACT_SLACK", 0)
    monkeypatch.setattr(packing, "LIVE_SLACK", 0)
    root = str(tmp_path / "store")
    store = open_store("file://%s?layout=packed&keep_versions=0" % root)
    worst = 0.0
    for c, db, m in _small_commits(tmp_path, store, 60, 1 * MB):
        worst = max(worst, packing.scan_reads(m) / packing.fresh_reads(m))
        last = (c, db, m)
    c, db, m = last
    assert c.stats.chunks_repacked > 0 and worst <= 2.0, (c.stats.chunks_repacked, worst)
    assert restore_bytes(store, m) == open(db, "rb").read()
    name = fmt.manifest_name(db)
    d = db_dir(str(tmp_path / "spool"))
    c.packer.ledger(d, name).journal.prune(2**63, grace=0)  # as if its records had aged out
    deleted = c.packer.collect(d, name, force=True, grace=0)
    stored = sum(o.size for o in store.chunks.list())
    assert deleted and stored <= 1.5 * _live_bytes(m), (stored, _live_bytes(m))
    assert restore_bytes(store, fetch_manifest(store, name)) == open(db, "rb").read()


@pytest.mark.s3
def test_gc_spares_every_kept_version(s3_server, tmp_path):
    """S3: every noncurrent version of the manifest is kept, so GC deletes
    only a pack none names (a copier died between its PUT and its journal
    record), and none while it is young; every version still restores."""
    if not s3_server.running:
        s3_server.start()
    store = s3_server.make_store(layout="packed")
    spool = str(tmp_path / "spool")
    w = Writer("vfs", spool, str(tmp_path / "app.db"), payload=30000)
    c = Copier(spool, store, rate=0)
    try:
        for _ in range(6):
            w.bump()
            c.flush(timeout=60)
        d = db_dir(spool)
        ledger = c.packer.ledger(d, w.name)
        orphan = fmt.pack_key(ledger.space, fmt.Fprint(7, 7))
        store.chunks.put(orphan, b"no version names this")
        ledger.journal.prune(2**63, grace=0)
        assert c.packer.collect(d, w.name, force=True) == []  # everything is younger than GC_GRACE
        assert c.packer.collect(d, w.name, force=True, grace=0) == [orphan]
        versions = store.manifests.list_versions(w.name)
        assert len(versions) >= 6
        for info in versions:
            m = fetch_manifest(store, w.name, info.version_id)
            assert len(restore_bytes(store, m)) == m.len
    finally:
        c.close()
        w.close()
        store.close()


def test_chunks_the_spool_lost_track_of(tmp_path, monkeypatch, caplog):
    """A commit's chunks packed, then their journal records lost: the upload
    finds them in the source file. When the file no longer holds them either,
    nothing is uploaded and the writer's next commit is a full snapshot,
    which goes through."""
    store, spool, w = written(tmp_path, 10, 20000)
    w.bump()
    monkeypatch.setattr(packing.Journal, "write", lambda self, places, sizes: None)
    caplog.set_level(logging.WARNING)
    flush(spool, store)
    assert "found in no pack; packed from the database file" in caplog.text
    assert restore_bytes(store, fetch_manifest(store, w.name)) == w.data()
    # Lost again, and the file changed behind the writer's back meanwhile.
    w.bump()
    theirs = sqlite3.connect(w.path)
    theirs.execute("UPDATE log SET pad = randomblob(30000)")
    theirs.commit()
    theirs.close()
    assert os.getxattr(w.path, "user.verneuil.version_id")
    c = flush(spool, store)
    assert c.stats.manifests_uploaded == 0 and "in neither the spool nor a pack" in caplog.text
    with pytest.raises(OSError):  # the writer's next commit rescans the whole file
        os.getxattr(w.path, "user.verneuil.version_id")
    monkeypatch.undo()
    n = w.bump()
    flush(spool, store)
    data = restore_bytes(store, fetch_manifest(store, w.name))
    assert data == w.data() and n == 13
    w.close()


def test_touch_repair_and_versions_see_packs(tmp_path):
    store, spool, w = written(tmp_path, 10, 30000)
    m1 = fetch_manifest(store, w.name)
    w.execute("UPDATE log SET pad = randomblob(30000)")  # every chunk changes
    flush(spool, store)
    m2 = fetch_manifest(store, w.name)
    # The touch patrol touches the packs the live manifest needs.
    c = Copier(spool, store, rate=0, touch_interval=0)
    os.utime(db_dir(spool).sub(sp.TOUCHED_FILE), (0, 0))
    touched: set[str] = set()
    real_touch = store.chunks.touch
    store.chunks.touch = lambda key: (touched.add(key), real_touch(key))[1]
    c.flush(timeout=30)
    store.chunks.touch = real_touch
    c.close()
    assert touched == set(fmt.stored_objects(m2)) == set(m2.layout.keys()) and c.stats.touch_missing == 0
    # A pack only the first version needs goes missing: `versions` says so.
    only_first = sorted(set(m1.layout.keys()) - set(m2.layout.keys()))
    live = sorted(m2.layout.keys())
    assert only_first and live
    store.chunks.delete(only_first[0])
    target = ["--store", store.url, "-s", w.path]
    rows = json.loads(run(["versions", "--json"] + target).stdout)
    assert [r["complete"] for r in rows[-2:]] == [False, True] and rows[-2]["missing_chunks"] >= 1
    # A pack the live manifest needs goes missing: `repair` rebuilds it from the file.
    store.chunks.delete(live[0])
    proc = run(["repair", "--json", "--dry-run"] + target[:2] + [w.path])
    assert proc.returncode == 4, proc.stderr
    proc = run(["repair"] + target[:2] + [w.path])
    assert proc.returncode == 0, proc.stderr
    assert "%d objects (packs and chunks) checked, 1 missing, 1 repaired" % len(live) in proc.stdout
    assert store.chunks.exists(live[0])
    assert restore_bytes(store, fetch_manifest(store, w.name)) == w.data()
    w.close()


def test_convert_both_ways_and_resume(tmp_path, capsys):
    from verneuil_fuse import cli
    from verneuil_fuse.copier.convert import convert_database
    from support.replicas import make_db

    store = open_store("file://%s/store" % tmp_path)
    db = str(tmp_path / "src.db")
    make_db(db, 6000, seed=3)
    pub = publish_file(store, db, hostname="h1")
    data = open(db, "rb").read()
    assert cli.main(["convert", "--store", store.url, "--to", "packed", "--all"]) == 0
    assert "converted to the packed layout" in capsys.readouterr().out
    m = fetch_manifest(store, pub.key)
    assert m.layout is not None and restore_bytes(store, m) == data
    for key in chunk_keys(store):  # only the packs are needed now
        if fmt.parse_pack_key(key) is None:
            store.chunks.delete(key)
    assert restore_bytes(store, fetch_manifest(store, pub.key)) == data
    assert cli.main(["convert", "--store", store.url, "--to", "packed", "-m", pub.key]) == 0
    assert "already in the packed layout" in capsys.readouterr().out
    # Back to chunks, interrupted after a few uploads, then resumed.
    puts = {"n": 0}
    real_put = store.chunks.put_if_absent

    def failing_put(key, data):
        puts["n"] += 1
        if puts["n"] > 10:
            raise StoreError("the store went away")
        return real_put(key, data)

    store.chunks.put_if_absent = failing_put
    with pytest.raises(StoreError):
        convert_database(store, pub.key, "chunks", workers=1)
    store.chunks.put_if_absent = real_put
    report = convert_database(store, pub.key, "chunks")
    assert report.converted and report.skipped == 10 and report.written == report.chunks - 10
    m = fetch_manifest(store, pub.key)
    assert m.layout is None
    for key in chunk_keys(store):  # Verneuil's layout needs no pack
        if fmt.parse_pack_key(key) is not None:
            store.chunks.delete(key)
    assert restore_bytes(store, m) == data
    # Errors: one line, no traceback.
    proc = run(["convert", "--store", store.url, "--to", "packed", "-m", "nope"])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    proc = run(["convert", "--store", store.url, "--to", "packed", "-s", "/no/such.db", "--hostname", "h1"])
    assert proc.returncode == 1 and "no such replicated database" in proc.stderr, proc.stderr
    proc = run(["convert", "--store", store.url, "--to", "sideways", "--all"])
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
