"""The `sqlite3` shell writes through the loadable extension (`.load`), configured
from VERNEUIL_CONFIG, with the same result as through Python: staging equals
the file after the session."""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess

import pytest

import writer_vfs

from support import spoolutil

SQLITE3 = shutil.which("sqlite3")
pytestmark = pytest.mark.skipif(SQLITE3 is None, reason="the sqlite3 shell is not installed")


def run_shell(script: str, config, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if isinstance(config, dict):
        env["VERNEUIL_CONFIG"] = json.dumps(config)
    else:
        env["VERNEUIL_CONFIG"] = config
    out = subprocess.run([SQLITE3, "-batch", "-bail"], input=script, env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out


@pytest.mark.parametrize("config_in_file", [False, True])
def test_shell_writes_through_loadable_extension(tmp_path, config_in_file):
    spool = str(tmp_path / "spool")
    db = str(tmp_path / "shell.db")
    # The store targets the writer skips, this project's packed layout key included.
    config = {"replication_spooling_dir": spool,
              "replication_targets": [{"local": {"directory": "/nowhere", "num_shards": 4}},
                                      {"directory": {"path": "/nowhere", "layout": "packed"}},
                                      {"s3": {"chunk_bucket": "c", "layout": "packed"}}],
              "make_default": False}
    if config_in_file:
        (tmp_path / "config.json").write_text(json.dumps(config))
        config = "@" + str(tmp_path / "config.json")
    script = f"""
.log stderr
.load {writer_vfs.loadable_extension_path()}
.open 'file:{db}?vfs=verneuil'
PRAGMA page_size=8192;
CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB);
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 400)
  INSERT INTO t SELECT i, randomblob(i * 10) FROM n;
UPDATE t SET v = randomblob(50) WHERE id % 3 = 0;
DELETE FROM t WHERE id % 7 = 0;
VACUUM;
INSERT INTO t(v) VALUES (zeroblob(300000));
PRAGMA verneuil_stats;
PRAGMA verneuil_spool_dir;
"""
    out = run_shell(script, config, tmp_path)
    stats_line, dir_line = out.stdout.strip().splitlines()[-2:]
    stats = dict(kv.split("=") for kv in stats_line.split())
    assert int(stats["full"]) >= 1 and int(stats["incremental"]) >= 4, stats_line
    assert stats["failed"] == "0", stats_line
    db_dir = spoolutil.db_spool_dir(spool, db)
    assert dir_line == db_dir
    with open(db, "rb") as f:
        data = f.read()
    assert spoolutil.rebuild_from_staging(db_dir, db_path=db) == data
    assert spoolutil.check_published(db_dir) == 2  # staging and ready
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 400 - 57 + 1
    conn.close()


def test_shell_make_default_replicates_wal(tmp_path):
    """make_default: a plain .open goes through verneuil, and stays
    replicated once switched to WAL (nothing said on stderr)."""
    spool = str(tmp_path / "spool")
    db = str(tmp_path / "wal.db")
    script = f"""
.load {writer_vfs.loadable_extension_path()}
.open {db}
CREATE TABLE t(v);
INSERT INTO t VALUES (1);
PRAGMA journal_mode=WAL;
INSERT INTO t VALUES (2);
INSERT INTO t VALUES (randomblob(100000));
PRAGMA verneuil_stats;
"""
    out = run_shell(script, {"replication_spooling_dir": spool, "make_default": True}, tmp_path)
    assert "wal=1" in out.stdout and "failed=0" in out.stdout, out.stdout
    assert out.stderr == ""
    db_dir = spoolutil.db_spool_dir(spool, db)
    assert spoolutil.check_published(db_dir) >= 1
    # The shell closed the database: the WAL is gone, the file is the state.
    assert not os.path.exists(db + "-wal")
    data = bytearray(open(db, "rb").read())
    data[18:20] = b"\x01\x01"
    assert spoolutil.rebuild_from_staging(db_dir, db_path=db) == bytes(data)


def test_shell_without_config_does_not_replicate(tmp_path):
    db = str(tmp_path / "plain.db")
    script = f"""
.load {writer_vfs.loadable_extension_path()}
.open 'file:{db}?vfs=verneuil'
CREATE TABLE t(v);
INSERT INTO t VALUES (1);
PRAGMA verneuil_stats;
"""
    env_config = "{}"
    out = run_shell(script, env_config, tmp_path)
    # No spool: the VFS hands the file straight to SQLite's own VFS, which
    # knows no verneuil_stats pragma (replicating, it would print the stats).
    assert out.stdout == "", out.stdout
    # The database was written, and nothing else (no spool) was created.
    assert os.listdir(tmp_path) == ["plain.db"]
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT v FROM t").fetchall() == [(1,)]
    conn.close()


def test_a_database_created_in_wal_is_replicated_and_listed_by_lag(tmp_path):
    """A database that is WAL from its first page is replicated like any
    other, and `verneuilctl lag` lists it, in WAL mode, its snapshot that of
    the source."""
    import sys

    spool = str(tmp_path / "spool")
    db = str(tmp_path / "born-wal.db")
    script = f"""
.load {writer_vfs.loadable_extension_path()}
.open 'file:{db}?vfs=verneuil'
PRAGMA journal_mode=WAL;
CREATE TABLE t(v);
INSERT INTO t VALUES (1);
"""
    out = run_shell(script, {"replication_spooling_dir": spool}, tmp_path)
    assert out.stderr == ""
    lag = subprocess.run([sys.executable, "-m", "verneuil_fuse.cli", "lag", "--spool", spool, "--no-store"],
                         capture_output=True, text=True, timeout=60)
    assert lag.returncode == 0, lag.stderr
    assert os.path.realpath(db) in lag.stdout and "[WAL mode]" in lag.stdout, lag.stdout
    assert "source changed" not in lag.stdout and "never snapshotted" not in lag.stdout, lag.stdout
