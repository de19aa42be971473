"""The writer, the copier and `verneuilctl lag` agree on the size bound
(issue 36, case 7; docs/GUARANTEES.md, docs/COPIER.md).

One bound, `format.MAX_REPLICATED_DB_SIZE` (the C writer's VN_MAX_DB_SIZE,
about 1.5 TiB), lowered here to 1 MiB through VERNEUIL_CONFIG's
`max_db_size`:
- a copier with the lowered bound, behind a writer with its default one
  (the issue's run): 40 commits of a database past the bound are refused,
  said once, the dead letters stay within their bound (the oldest dropped),
  the store keeps its last copy, and `lag` says the database stopped
  replicating, since when, and the dead letters; back under the bound, it
  replicates again;
- a writer with the lowered bound takes no snapshot past it, says so once,
  and `lag` says why.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from support.copier_support import Writer, vfs_available
from verneuil_fuse import format as fmt
from verneuil_fuse.copier import Copier
from verneuil_fuse.copier import spool as sp
from verneuil_fuse.readback import fetch_manifest, restore_bytes
from verneuil_fuse.store import open_store

pytestmark = pytest.mark.skipif(not vfs_available(), reason="writer_vfs is not built")

CTL = [sys.executable, "-m", "verneuil_fuse.cli"]
BOUND = 1 << 20  # the lowered max_db_size
COMMITS = 40


def _config(store_dir: str, spool: str, **extra) -> str:
    return json.dumps({"replication_targets": [{"directory": {"path": store_dir}}],
                       "replication_spooling_dir": spool, **extra})


def _lag(config: str) -> tuple[dict, str]:
    env = dict(os.environ, VERNEUIL_CONFIG=config)
    out = subprocess.run(CTL + ["lag", "--json"], capture_output=True, env=env, timeout=60)
    (db,) = json.loads(out.stdout)
    # lag's exit code: 0 when the database is in sync, 3 when it is not
    # replicated (stopped, or a writer that does not snapshot it).
    assert out.returncode == (0 if db["in_sync"] else 3), out.stderr.decode()
    text = subprocess.run(CTL + ["lag"], capture_output=True, env=env, timeout=60)
    assert text.returncode == out.returncode and b"Traceback" not in text.stderr, text.stderr.decode()
    return db, text.stdout.decode()


def test_one_bound_for_the_writer_the_copier_and_lag():
    import writer_vfs
    assert fmt.MAX_REPLICATED_DB_SIZE == writer_vfs.MAX_DB_SIZE  # the C writer's VN_MAX_DB_SIZE
    assert 1.4 * (1 << 40) < fmt.MAX_REPLICATED_DB_SIZE < 1.5 * (1 << 40)
    assert fmt.manifest_blob_limit(fmt.MAX_REPLICATED_DB_SIZE) <= fmt.MAX_MANIFEST_BYTES
    from verneuil_fuse import config
    assert config.max_db_size({}) == fmt.MAX_REPLICATED_DB_SIZE
    assert config.max_db_size({"max_db_size": BOUND}) == BOUND
    for bad in (0, -1, "1M", True, fmt.MAX_REPLICATED_DB_SIZE + 1):
        with pytest.raises(Exception, match="max_db_size must be"):
            config.max_db_size({"max_db_size": bad})
    old = os.environ.get("VERNEUIL_CONFIG")
    os.environ["VERNEUIL_CONFIG"] = json.dumps({"max_db_size": BOUND, "replication_spooling_dir": None})
    try:
        assert writer_vfs._config_from_env()[3] == BOUND  # csrc/config.c reads the same key
    finally:
        if old is None:
            del os.environ["VERNEUIL_CONFIG"]
        else:
            os.environ["VERNEUIL_CONFIG"] = old


def test_a_database_past_the_copier_bound_stops_loudly_and_boundedly(tmp_path, caplog, monkeypatch):
    spool, store_dir = str(tmp_path / "spool"), str(tmp_path / "store")
    os.mkdir(spool)
    store = open_store("file://" + store_dir)
    config = _config(store_dir, spool, max_db_size=BOUND)
    monkeypatch.setattr(sp, "DEAD_LETTER_MAX_ENTRIES", 8)  # bound reached within the test's commits
    copier = Copier(spool, store, rate=None, max_db_size=BOUND)
    w = Writer("vfs", spool, str(tmp_path / "app.db"), payload=1000)
    try:
        for _ in range(5):
            w.bump()
        w.execute("CREATE TABLE big(x)")
        copier.flush(timeout=60)
        good = w.data()
        assert restore_bytes(store, fetch_manifest(store, w.name)) == good
        assert _lag(config)[0]["in_sync"]

        # Past the copier's bound; the writer (default bound) goes on.
        w.execute("INSERT INTO big VALUES (randomblob(?))", BOUND + 200_000)
        stopped_at = time.time()
        with caplog.at_level(logging.WARNING):
            for _ in range(COMMITS):
                w.bump()
                copier.run_once()
        refusals = [r for r in caplog.records if "NOT replicated from now on" in r.getMessage()]
        assert len(refusals) == 1 and refusals[0].levelno == logging.ERROR, [r.getMessage() for r in refusals]
        letters = sp.dead_letters(os.path.join(sp.boot_roots(spool)[0][0], sp.DEAD_LETTER))
        assert letters["entries"] <= 8 and letters["dropped"] >= 1, letters
        assert restore_bytes(store, fetch_manifest(store, w.name)) == good  # the store keeps its last copy
        time.sleep(0.3)
        db, text = _lag(config)
        assert db["in_sync"] is False and db["stopped"] is not None, db
        assert "refused" in db["stopped"]["reason"] and db["stopped"]["since"] >= stopped_at - 1, db
        assert db["lag"] >= time.time() - db["stopped"]["since"] - 1, db
        assert "STOPPED replicating" in text and "dead letters:" in text and "dropped" in text, text

        # Back under the bound: replicated again, said once, and lag agrees.
        w.execute("DROP TABLE big")
        w.execute("VACUUM")
        w.bump()
        copier.flush(timeout=60)
        assert restore_bytes(store, fetch_manifest(store, w.name)) == w.data()
        db, text = _lag(config)
        assert db["stopped"] is None and db["in_sync"] is True, db
    finally:
        w.close()
        copier.close()
        store.close()


@pytest.mark.parametrize("journal", ["delete", "wal"])
def test_a_database_past_the_writers_bound_is_not_snapshotted(tmp_path, capfd, journal):
    """In WAL mode the bound holds the committed state (file + WAL), which
    lag reads from the WAL's last page 1 too."""
    import writer_vfs
    spool, store_dir = str(tmp_path / "spool"), str(tmp_path / "store")
    os.mkdir(spool)
    config = _config(store_dir, spool, max_db_size=BOUND)
    old = writer_vfs.set_max_db_size(BOUND)
    assert old == writer_vfs.MAX_DB_SIZE
    w = Writer("vfs", spool, str(tmp_path / "app.db"), payload=1000)
    try:
        if journal == "wal":
            assert w.conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
            w.execute("PRAGMA wal_autocheckpoint=0")  # the big commit stays in the WAL
        w.bump()
        store = open_store("file://" + store_dir)
        copier = Copier(spool, store, rate=None, max_db_size=BOUND)
        copier.flush(timeout=60)
        w.execute("CREATE TABLE big(x)")
        w.execute("INSERT INTO big VALUES (randomblob(?))", BOUND + 200_000)
        assert writer_vfs.wait_staged(w.conn)  # each WAL commit staged, none coalesced
        for _ in range(5):
            w.bump()
            assert writer_vfs.wait_staged(w.conn)
        stats = writer_vfs.stats(w.conn)
        assert stats["too_large"] >= 6 and stats["failed"] == 0, stats
        err = capfd.readouterr().err
        assert err.count("past max_db_size") == 1 and "NOT replicated" in err, err
        copier.flush(timeout=60)
        db, text = _lag(config)
        assert db["in_sync"] is False and "the writer does not replicate it" in db["stopped"]["reason"], db
        assert "STOPPED replicating" in text, text
        copier.close()
        store.close()
    finally:
        writer_vfs.set_max_db_size(old)
        w.close()
