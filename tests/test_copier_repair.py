"""`verneuilctl repair`: a store that lost chunk objects gets them back from
the source database files.  Real stores (a directory and moto's S3 server),
databases replicated through the C VFS and a copier, and the real
`verneuilctl` program in a subprocess, as an operator runs it."""
from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
import sys
import time

import pytest

from verneuil_fuse import cli
from verneuil_fuse import format as fmt
from verneuil_fuse.copier import Copier
from verneuil_fuse.readback import fetch_manifest, restore_bytes
from verneuil_fuse.copier import spool as sp

from support.pyspoolwriter import SpoolWriter
from support.replicas import make_db, publish_file, replicate
from support.copier_support import vfs_available

needs_vfs = pytest.mark.skipif(not vfs_available(), reason="writer_vfs is not built")

# The installed console script when there is one (what an operator types),
# else the same entry point through the interpreter.
_SCRIPT = os.path.join(os.path.dirname(sys.executable), "verneuilctl")
CTL = [_SCRIPT] if os.access(_SCRIPT, os.X_OK) else [sys.executable, "-m", "verneuil_fuse.cli"]

ROWS = 3000  # about 760 KiB with make_db's 200-byte values: 12 chunks


def run(args, timeout=120):
    env = dict(os.environ)
    env.pop("VERNEUIL_CONFIG", None)
    return subprocess.run(CTL + args, capture_output=True, env=env, timeout=timeout)


def assert_one_line_error(proc, *needles):
    err = proc.stderr.decode()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("verneuilctl: error: "), err
    for needle in needles:
        assert needle.lower() in err.lower(), err


def live_chunks(m: fmt.Manifest) -> list[str]:
    """Chunk names the store must hold for `m` (every one but chunk 0 and
    the zero chunk), in file order."""
    names: dict[str, None] = {}
    for i, fp in enumerate(m.chunks):
        if i != 0 and fp != fmt.ZERO_CHUNK_FPRINT:
            names.setdefault(fp.name)
    return list(names)


def changed_chunks(m: fmt.Manifest, data: bytes) -> set[str]:
    """Names of `m`'s chunks that no position of `data` holds any more."""
    now = {fmt.chunk_fingerprint(data[i:i + fmt.CHUNK_SIZE]).name
           for i in range(0, len(data), fmt.CHUNK_SIZE)}
    return {fp.name for fp in m.chunks} - now


@pytest.fixture
def replicated(any_store, tmp_path):
    """A database of several chunks replicated for real (C VFS + copier)."""
    if not vfs_available():
        pytest.skip("writer_vfs is not built")
    db = str(tmp_path / "app.db")
    make_db(db, ROWS, payload=200)
    spool = str(tmp_path / "spool")
    replicate(any_store, db, spool)
    db = os.path.realpath(db)
    m = fetch_manifest(any_store, fmt.manifest_name(db))
    assert len(live_chunks(m)) >= 8
    return any_store, db, spool, m


def test_repair_uploads_lost_chunks(replicated, tmp_path):
    store, db, spool, m = replicated
    live = live_chunks(m)
    lost = live[::2]
    for name in lost:
        store.chunks.delete(name)
    proc = run(["restore", "--store", store.url, "-s", db, "-o", "-"])
    assert proc.returncode == cli.EXIT_ERROR
    assert_one_line_error(proc, "missing")

    # --dry-run reports and uploads nothing.
    proc = run(["repair", "--store", store.url, db, "--dry-run", "--json"])
    assert proc.returncode == cli.EXIT_REPAIRABLE, proc.stderr
    (report,) = json.loads(proc.stdout)
    assert (report["checked"], report["missing"], report["repairable"], report["repaired"],
            report["unrepairable"]) == (len(live), len(lost), len(lost), 0, 0)
    assert set(report["missing_chunks"]) == set(lost)
    assert report["dry_run"] and not report["complete"]
    assert not any(store.chunks.exists(name) for name in lost)

    proc = run(["repair", "--store", store.url, db])
    assert proc.returncode == cli.EXIT_OK, proc.stderr
    assert proc.stderr == b""  # no progress on a pipe without -v, no error
    assert proc.stdout.decode().strip() == (
        "%s: %d chunks checked, %d missing, %d repaired, 0 unrepairable (complete)"
        % (db, len(live), len(lost), len(lost)))
    assert all(store.chunks.exists(name) for name in lost)
    out = tmp_path / "restored.db"
    proc = run(["restore", "--store", store.url, "-s", db, "-o", str(out)])
    assert proc.returncode == 0, proc.stderr
    with open(db, "rb") as f:
        assert out.read_bytes() == f.read()

    # Once complete, another run finds nothing missing.
    proc = run(["repair", "--store", store.url, "--json", "-s", db])
    assert proc.returncode == cli.EXIT_OK, proc.stderr
    (report,) = json.loads(proc.stdout)
    assert (report["missing"], report["complete"]) == (0, True)


def test_repair_source_changed_since_the_snapshot(replicated, tmp_path):
    store, db, spool, m = replicated
    con = sqlite3.connect(db)  # a write the store has no snapshot of
    con.execute("UPDATE t SET v = randomblob(200) WHERE id % 1000 = 7")
    con.commit()
    con.close()
    with open(db, "rb") as f:
        changed = changed_chunks(m, f.read()) & set(live_chunks(m))
    unchanged = [name for name in live_chunks(m) if name not in changed]
    assert changed and len(unchanged) >= 2
    lost_changed = sorted(changed)
    lost_unchanged = unchanged[:3]
    for name in lost_changed + lost_unchanged:
        store.chunks.delete(name)

    proc = run(["repair", "--store", store.url, db, "--json"])
    assert proc.returncode == cli.EXIT_UNREPAIRABLE, proc.stderr
    assert_one_line_error(proc, db, "changed since", "verneuilctl sync", "verneuil_full_snapshot",
                          "`verneuilctl repair` again")
    (report,) = json.loads(proc.stdout)
    assert report["missing"] == len(lost_changed) + len(lost_unchanged)
    assert report["repaired"] == len(lost_unchanged)
    assert sorted(report["unrepairable_chunks"]) == lost_changed
    assert not report["complete"]
    # What still matched went back; what changed did not.
    assert all(store.chunks.exists(name) for name in lost_unchanged)
    assert not any(store.chunks.exists(name) for name in lost_changed)

    proc = run(["repair", "--store", store.url, db])  # the text report lists them
    assert proc.returncode == cli.EXIT_UNREPAIRABLE
    text = proc.stdout.decode()
    assert "%d unrepairable" % len(lost_changed) in text
    assert all("unrepairable: %s" % name in text for name in lost_changed)

    # The advice works: publish the file as it is now, then repair again.
    proc = run(["sync", "--store", store.url, "--spool", spool, db])
    assert proc.returncode == 0, proc.stderr
    proc = run(["repair", "--store", store.url, db])
    assert proc.returncode == cli.EXIT_OK, proc.stderr
    proc = run(["restore", "--store", store.url, "-s", db, "-o", "-"])
    assert proc.returncode == 0, proc.stderr
    with open(db, "rb") as f:
        assert proc.stdout == f.read()


def test_repair_without_manifest_or_file(any_store, tmp_path):
    db = str(tmp_path / "never.db")
    make_db(db, 10)
    proc = run(["repair", "--store", any_store.url, db])
    assert proc.returncode == cli.EXIT_ERROR
    assert_one_line_error(proc, db, "nothing to repair", "no manifest")
    assert proc.stdout == b""
    proc = run(["repair", "--store", any_store.url, db, "--json"])
    assert proc.returncode == cli.EXIT_ERROR
    (entry,) = json.loads(proc.stdout)
    assert "no manifest" in entry["error"]
    proc = run(["repair", "--store", any_store.url, str(tmp_path / "nosuch.db")])
    assert proc.returncode == cli.EXIT_USAGE
    assert_one_line_error(proc, "no such database file")
    proc = run(["repair", "--store", any_store.url])
    assert proc.returncode == cli.EXIT_USAGE
    assert_one_line_error(proc, "--all")


@needs_vfs
def test_repair_all_databases_of_a_spool(local_store, tmp_path):
    spool = str(tmp_path / "spool")
    dbs = []
    for name in ("a.db", "b.db"):
        db = str(tmp_path / name)
        make_db(db, ROWS // 2, seed=len(dbs))
        replicate(local_store, db, spool)
        dbs.append(os.path.realpath(db))
    lost = []
    for db in dbs:
        m = fetch_manifest(local_store, fmt.manifest_name(db))
        lost += live_chunks(m)[:2]
    for name in lost:
        local_store.chunks.delete(name)
    proc = run(["repair", "--store", local_store.url, "--spool", spool, "--all", "--json"])
    assert proc.returncode == cli.EXIT_OK, proc.stderr
    reports = json.loads(proc.stdout)
    assert sorted(r["source"] for r in reports) == sorted(dbs)
    assert sum(r["repaired"] for r in reports) == len(lost)
    for db in dbs:
        data = restore_bytes(local_store, fetch_manifest(local_store, fmt.manifest_name(db)))
        with open(db, "rb") as f:
            assert data == f.read()
    proc = run(["repair", "--store", local_store.url, "--spool", spool, "--all", dbs[0]])
    assert proc.returncode == cli.EXIT_USAGE
    assert_one_line_error(proc, "not both")


def test_repair_rebuilds_a_lost_base_chunk(local_store, tmp_path):
    """Verneuil writers XOR long chunk lists with a base chunk: when the store
    lost it, the manifest cannot even be read; it is rebuilt from the source."""
    db = str(tmp_path / "app.db")
    make_db(db, ROWS // 2)
    db = os.path.realpath(db)
    with open(db, "rb") as f:
        data = f.read()
    m, blobs = fmt.snapshot_of(data)
    base = os.urandom(16 * 7)  # the words of an older chunk list, say
    m.base_chunks_fprint = fmt.chunk_fingerprint(base)
    for fp, raw in blobs.items():
        local_store.chunks.put(fp.name, fmt.compress_chunk(raw))
    name = fmt.manifest_name(db)
    local_store.manifests.put(name, fmt.compress_manifest(fmt.encode_manifest(m, base)))
    lost = [m.base_chunks_fprint.name, live_chunks(m)[1]]
    for chunk in lost:
        local_store.chunks.delete(chunk)
    assert_one_line_error(run(["restore", "--store", local_store.url, "-s", db, "-o", "-"]),
                          "base chunk")
    proc = run(["repair", "--store", local_store.url, db, "--json"])
    assert proc.returncode == cli.EXIT_OK, proc.stderr
    (report,) = json.loads(proc.stdout)
    assert sorted(report["missing_chunks"]) == sorted(lost) and report["repaired"] == 2
    assert restore_bytes(local_store, fetch_manifest(local_store, name)) == data

    # A source that changed since cannot give the base chunk back.
    local_store.chunks.delete(m.base_chunks_fprint.name)
    con = sqlite3.connect(db)
    con.execute("UPDATE t SET v = randomblob(200) WHERE id = 3")
    con.commit()
    con.close()
    proc = run(["repair", "--store", local_store.url, db, "--json"])
    assert proc.returncode == cli.EXIT_UNREPAIRABLE
    assert_one_line_error(proc, "base chunk", "changed since")
    (report,) = json.loads(proc.stdout)
    assert report["base_chunk_unrepairable"] and report["unrepairable_chunks"] == [lost[0]]


def test_bundled_chunks_come_back_from_the_manifest(local_store, tmp_path):
    """A bundled b-tree top is uploaded too (a later manifest may name it
    without bundling it): its bytes are in the manifest, whatever the file
    holds now."""
    db = str(tmp_path / "app.db")
    make_db(db, ROWS // 2)
    pub = publish_file(local_store, db, hostname=fmt.local_hostname(), bundle=(3,))
    bundled = pub.manifest.chunks[3].name
    other = next(n for n in live_chunks(pub.manifest) if n != bundled)
    local_store.chunks.delete(bundled)
    local_store.chunks.delete(other)
    make_db(db, ROWS // 2, seed=99)  # another file at the same path now
    proc = run(["repair", "--store", local_store.url, db, "--json"])
    assert proc.returncode == cli.EXIT_UNREPAIRABLE
    (report,) = json.loads(proc.stdout)
    assert report["repaired"] == 1 and report["unrepairable_chunks"] == [other]
    assert local_store.chunks.exists(bundled)


def test_progress_lines_with_verbose(local_store, tmp_path, monkeypatch, caplog, capsys):
    db = str(tmp_path / "app.db")
    make_db(db, ROWS // 2)
    pub = publish_file(local_store, db, hostname=fmt.local_hostname())
    for name in live_chunks(pub.manifest):
        local_store.chunks.delete(name)
    monkeypatch.setattr(cli.common, "PHASE_PROGRESS_INTERVAL", 0.0)
    caplog.set_level(logging.INFO, logger="verneuilctl")
    assert cli.main(["repair", "-v", "--store", local_store.url, db]) == cli.EXIT_OK
    lines = [r.getMessage() for r in caplog.records if r.name == "verneuilctl"]
    assert any("checking chunks" in line for line in lines), lines
    assert any("repairing chunks" in line for line in lines), lines
    assert "0 unrepairable (complete)" in capsys.readouterr().out


def test_help():
    proc = run(["repair", "--help"])
    assert proc.returncode == 0
    text = proc.stdout.decode()
    for needle in ("--dry-run", "--json", "--all", "--hostname", "--store", "--spool"):
        assert needle in text
    assert "repair" in run(["--help"]).stdout.decode()


# -- the copier's touch patrol points at `repair` ---------------------------------------

def test_touch_patrol_warns_once_per_database(tmp_path, caplog):
    from verneuil_fuse.store import open_store
    spool = tmp_path / "spool"
    spool.mkdir()
    store = open_store("file://%s/store" % tmp_path)
    db = tmp_path / "db.bin"
    db.write_bytes(os.urandom(6 * 65536))
    w = SpoolWriter(str(spool), str(db))
    w.snapshot()
    c = Copier(str(spool), store, rate=0, touch_interval=3600)
    try:
        c.run_once()
        lost = live_chunks(fetch_manifest(store, w.name))[:3]
        for name in lost:
            store.chunks.delete(name)

        def patrol():
            old = time.time() - 7200
            os.utime(w.db.sub(sp.TOUCHED_FILE), (old, old))
            c.recent = type(c.recent)(16)  # forgotten, as in a long-running copier
            for st in c._states.values():
                st.next_touch_check = 0
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="verneuil_fuse.copier.copier"):
                c.run_once()
            return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

        for round_ in (1, 2):
            warnings = patrol()
            assert c.stats.touch_missing == 3 * round_
            assert len(warnings) == 1, warnings
            assert str(db.resolve()) in warnings[0] and "verneuilctl repair" in warnings[0]
    finally:
        c.close()
        store.close()
