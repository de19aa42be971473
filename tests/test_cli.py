"""verneuilctl through its real entry point: outputs checked against the
reference vectors, every subcommand's --help, and bad inputs (one-line
errors, non-zero exit, no traceback, never a wrong file)."""
from __future__ import annotations

import json
import os
import pathlib
import random
import sqlite3
import subprocess
import sys
import time

import pytest

from verneuil_fuse import cli
from verneuil_fuse import format as fmt
from verneuil_fuse.cli.common import store_from_args

from support import spoolutil
from support.copier_support import Writer, vfs_available

VECTORS = pathlib.Path(__file__).parent / "data" / "umash_verneuil.json"
CTL = [sys.executable, "-m", "verneuil_fuse.cli"]
# Every subcommand, in the order `verneuilctl --help` lists them.
SUBCOMMANDS = ["fingerprint", "manifest-name", "sqlite-extension", "copier", "flush", "sync",
               "restore", "versions", "ls", "manifest", "lag", "repair", "convert", "query"]


@pytest.fixture(scope="module")
def vectors():
    return json.loads(VECTORS.read_text())


def input_of(entry) -> bytes:
    if "hex" in entry:
        return bytes.fromhex(entry["hex"])
    if entry["fill"] == "zeros":
        return bytes(entry["len"])
    return bytes(i % 256 for i in range(entry["len"]))


def key_arg(params_key: str) -> str:
    for short, key in fmt.KEYS.items():
        if key.decode() == params_key:
            return short
    raise AssertionError(params_key)


def run(args, env=None, input=None, timeout=60):
    full_env = dict(os.environ)
    full_env.pop("VERNEUIL_CONFIG", None)
    if env:
        full_env.update(env)
    return subprocess.run(CTL + args, capture_output=True, env=full_env, input=input,
                          timeout=timeout)


def assert_one_line_error(proc, *needles):
    err = proc.stderr.decode()
    assert proc.returncode != 0, (proc.returncode, err)
    assert "Traceback" not in err, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("verneuilctl: error: "), err
    for needle in needles:
        assert needle.lower() in err.lower(), err


def assert_flush_restores(url, spool, path, data):
    """`flush` succeeds, then `restore` of `path` gives exactly `data`."""
    proc = run(["flush", "--store", url, "--spool", spool])
    assert proc.returncode == 0, proc.stderr
    proc = run(["restore", "--store", url, "-s", path, "-o", "-"])
    assert proc.returncode == 0 and proc.stdout == data, proc.stderr


# -- fingerprint / manifest-name against the vectors ----------------------------------

def test_fingerprint_vectors_in_process(vectors, tmp_path, capsys):
    sample = random.Random(1).sample(vectors["fingerprints"], 60)
    for i, entry in enumerate(sample):
        f = tmp_path / ("in%d" % i)
        f.write_bytes(input_of(entry))
        key = key_arg(entry["params_key"])
        assert cli.main(["fingerprint", "--key", key, str(f)]) == 0
        major, minor = entry["fprint"]
        assert capsys.readouterr().out.strip() == "%s%%2F%s" % (major, minor)
        assert cli.main(["fingerprint", "--hash64", "--key", entry["params_key"], str(f)]) == 0
        assert capsys.readouterr().out.strip() == entry["hash64"]


def test_fingerprint_and_names_through_the_real_cli(vectors, tmp_path):
    rng = random.Random(2)
    for i, entry in enumerate(rng.sample(vectors["fingerprints"], 8)):
        f = tmp_path / ("in%d" % i)
        f.write_bytes(input_of(entry))
        key = key_arg(entry["params_key"])
        flags = ["--hash64"] if i % 2 else []
        proc = run(["fingerprint", "--key", key] + flags + [str(f)])
        assert proc.returncode == 0, proc.stderr
        want = entry["hash64"] if flags else "%s%%2F%s" % tuple(entry["fprint"])
        assert proc.stdout.decode().strip() == want
    for entry in rng.sample(vectors["manifest_names"], 6):
        proc = run(["manifest-name", "--hostname", entry["hostname"], entry["path"]])
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.decode().strip() == entry["name"]


def test_every_manifest_name(vectors, capsys):
    for entry in vectors["manifest_names"]:
        assert cli.main(["manifest-name", "--hostname", entry["hostname"], entry["path"]]) == 0
        assert capsys.readouterr().out.strip() == entry["name"]


def test_fingerprint_chunks_and_defaults(tmp_path, capsys):
    data = os.urandom(3 * 65536 + 17)
    f = tmp_path / "f"
    f.write_bytes(data)
    assert cli.main(["fingerprint", "--chunks", str(f)]) == 0
    lines = capsys.readouterr().out.split()
    assert lines == [fmt.chunk_fingerprint(data[i:i + 65536]).name
                     for i in range(0, len(data), 65536)]
    zero = tmp_path / "zero"
    zero.write_bytes(bytes(65536))
    assert cli.main(["fingerprint", str(zero)]) == 0
    assert capsys.readouterr().out.strip() == fmt.ZERO_CHUNK_NAME


def test_manifest_name_canonical_without_hostname(tmp_path, capsys):
    real = tmp_path / "real.db"
    real.write_bytes(b"")
    link = tmp_path / "link.db"
    link.symlink_to(real)
    assert cli.main(["manifest-name", str(link)]) == 0
    assert capsys.readouterr().out.strip() == fmt.manifest_name(str(real), fmt.local_hostname())
    assert cli.main(["manifest-name", "--hostname", "h", str(link)]) == 0
    assert capsys.readouterr().out.strip() == fmt.manifest_name(str(link), "h")


def test_help_for_every_subcommand():
    proc = run(["--help"])
    assert proc.returncode == 0
    for name in SUBCOMMANDS:
        assert name in proc.stdout.decode()
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0
    # build_parser adds exactly these, in this order (the order of --help).
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert list(sub.choices) == SUBCOMMANDS


def test_verneuil_config_is_read_by_the_store_layer(monkeypatch, tmp_path):
    """VERNEUIL_CONFIG unset or blank is "nothing configured" alike for the
    store layer, the config module and verneuilctl; set, all three use it."""
    from verneuil_fuse import config
    from verneuil_fuse.store import ConfigError
    from verneuil_fuse.store.config import env_config, env_config_present

    args = cli.build_parser().parse_args(["lag", "--spool", str(tmp_path)])
    for value in (None, "", " \n"):
        if value is None:
            monkeypatch.delenv("VERNEUIL_CONFIG", raising=False)
        else:
            monkeypatch.setenv("VERNEUIL_CONFIG", value)
        assert env_config() is None and not env_config_present()
        assert config.load_optional() == {}
        assert store_from_args(args, required=False) is None
        with pytest.raises(ConfigError, match="no store given and VERNEUIL_CONFIG is not set"):
            config.load()
        with pytest.raises(ConfigError, match="set replication_spooling_dir in VERNEUIL_CONFIG"):
            config.spool_dir(None)
    value = json.dumps({"replication_spooling_dir": str(tmp_path / "spool"),
                        "replication_targets": [{"directory": {"path": str(tmp_path / "store")}}]})
    monkeypatch.setenv("VERNEUIL_CONFIG", value)
    assert env_config() == value and env_config_present()
    assert config.spool_dir(None) == str(tmp_path / "spool")
    store = store_from_args(args, required=False)
    try:
        assert store.url == "file://%s" % (tmp_path / "store")
    finally:
        store.close()


# -- the replication commands on a directory store ---------------------------------------

@pytest.fixture
def replicated(tmp_path):
    """A spool with one database flushed to a directory store."""
    spool = tmp_path / "spool"
    spool.mkdir()
    store_url = "file://%s/store" % tmp_path
    w = Writer("py", str(spool), str(tmp_path / "app.db"))
    for _ in range(10):
        w.bump()
    w.execute("CREATE TABLE big(x)")
    w.execute("INSERT INTO big VALUES (randomblob(300000))")
    proc = run(["flush", "--store", store_url, "--spool", str(spool)])
    assert proc.returncode == 0, proc.stderr
    yield w, str(spool), store_url
    w.close()


def test_restore_file_stdout_and_manifest_file(replicated, tmp_path):
    w, spool, url = replicated
    out = tmp_path / "out.db"
    proc = run(["restore", "--store", url, "-s", w.path, "-o", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == w.data()
    assert proc.stderr == b""  # no progress bar when stderr is not a terminal
    proc = run(["restore", "--store", url, "-m", w.name, "-o", "-"])
    assert proc.returncode == 0 and proc.stdout == w.data()
    proc = run(["restore", "--store", url, "--hostname", fmt.local_hostname(), "-s", w.path,
                "-o", "-"])
    assert proc.stdout == w.data()
    blob = tmp_path / "manifest.blob"
    blob.write_bytes(open(os.path.join(url[len("file://"):], "manifests", w.name), "rb").read())
    proc = run(["restore", "--store", url, "--manifest-file", str(blob), "-o", "-"])
    assert proc.stdout == w.data()


def test_ls_and_manifest_outputs(replicated):
    w, spool, url = replicated
    proc = run(["ls", "--store", url])
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout.decode()
    assert w.path in text and fmt.local_hostname() in text and "VERSIONS" in text
    listing = json.loads(run(["ls", "--store", url, "--json"]).stdout)
    # Each manifest upload is a version: the directory store keeps history.
    assert listing[0]["size"] == len(w.data()) and listing[0]["versions"] >= 1
    manifest = json.loads(run(["manifest", "--store", url, "-s", w.path, "--json"]).stdout)
    assert manifest["len"] == len(w.data()) and manifest["path"] == w.path
    assert manifest["bundled_chunks"] == [0]
    assert len(manifest["chunks"]) == manifest["num_chunks"]
    text = run(["manifest", "--store", url, "-m", w.name]).stdout.decode()
    assert "contents_fprint" in text and w.path in text


def test_lag_reports_pending_then_in_sync(replicated, tmp_path):
    w, spool, url = replicated
    report = json.loads(run(["lag", "--store", url, "--spool", spool, "--json"]).stdout)
    (db,) = report
    assert db["source"] == w.path and db["in_sync"] is True and db["lag"] == 0
    assert db["source_changed"] is False
    # Without a store: nothing left in the spool is nothing pending, however
    # old the staged manifest.
    (db,) = json.loads(run(["lag", "--spool", spool, "--no-store", "--json"]).stdout)
    assert db["in_sync"] is None and db["lag"] == 0 and db["pending_bytes"] == 0
    assert "nothing pending" in run(["lag", "--spool", spool, "--no-store"]).stdout.decode()
    w.bump()
    report = json.loads(run(["lag", "--store", url, "--spool", spool, "--json"]).stdout)
    (db,) = report
    assert db["in_sync"] is False and db["pending_bytes"] > 0
    assert db["manifests"][0]["in_store"] == "behind"
    text = run(["lag", "--store", url, "--spool", spool]).stdout.decode()
    assert w.path in text and "behind" in text
    proc = run(["lag", "--spool", spool, "--no-store"])
    assert proc.returncode == 0 and "pending for" in proc.stdout.decode()
    # Behind by more than --max-lag: exit 3, a monitoring check's "not OK".
    time.sleep(0.3)
    proc = run(["lag", "--store", url, "--spool", spool, "--max-lag", "0.2"])
    assert proc.returncode == 3 and "behind" in proc.stdout.decode(), proc.stdout
    assert run(["lag", "--store", url, "--spool", spool, "--max-lag", "600"]).returncode == 0


def test_log_lines_carry_the_time_unless_journald_does(tmp_path):
    """Log lines start with the time, the program and its PID; on the
    journal's stream (JOURNAL_STREAM names stderr's device and inode, as
    systemd sets it) they are the level and the message alone."""
    import re
    spool = tmp_path / "spool"
    spool.mkdir()
    args = CTL + ["-v", "flush", "--store", "file://%s/store" % tmp_path, "--spool", str(spool)]
    env = {k: v for k, v in os.environ.items() if k not in ("VERNEUIL_CONFIG", "JOURNAL_STREAM")}
    plain = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
    assert plain.returncode == 0, plain.stderr
    lines = plain.stderr.splitlines()
    assert lines and all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d{4} verneuilctl\[\d+\] INFO: ", line)
                         for line in lines), lines
    r, w = os.pipe()
    try:
        st = os.fstat(w)
        journal = dict(env, JOURNAL_STREAM="%d:%d" % (st.st_dev, st.st_ino))
        proc = subprocess.Popen(args, stderr=w, env=journal)
        os.close(w)
        w = -1
        with os.fdopen(r, "r") as f:
            r = -1
            text = f.read()
        assert proc.wait(60) == 0
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)
    assert text.splitlines() and all(line.startswith("INFO: flush") for line in text.splitlines()), text


def test_lag_sees_writes_that_were_not_snapshotted(replicated):
    """A commit the VFS could not snapshot (a full spool; here a writer that
    bypasses it) leaves the store current with the staged manifest but
    behind the file: lag must not say in sync."""
    w, spool, url = replicated
    other = sqlite3.connect(w.path)
    other.execute("CREATE TABLE unseen(x)")
    other.commit()
    other.close()
    (db,) = json.loads(run(["lag", "--store", url, "--spool", spool, "--json"]).stdout)
    assert db["in_sync"] is False and db["source_changed"] is True and db["lag"] > 0
    assert db["manifests"][0]["in_store"] == "current"
    proc = run(["lag", "--store", url, "--spool", spool])
    text = proc.stdout.decode()
    assert "behind" in text and "source changed since" in text and "in sync" not in text
    assert proc.returncode == 3  # not replicated, however recent


@pytest.mark.skipif(not vfs_available(), reason="writer_vfs is not built")
def test_lag_of_a_database_in_wal_from_its_first_commit(tmp_path):
    """A database in WAL mode from its first commit is snapshotted at that
    commit (its last commits still in the WAL): lag says WAL mode, pending
    without a store, and in sync (exit 0) once flushed."""
    import writer_vfs
    spool = str(tmp_path / "spool")
    store = "file://%s/store" % tmp_path
    writer_vfs.register(spool)
    writer_vfs.set_warn_stderr(False)
    con = writer_vfs.connect(str(tmp_path / "w.db"))
    try:
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("CREATE TABLE t(x)")
        con.commit()
        assert writer_vfs.wait_staged(con)  # WAL commits are staged off the commit path
        (db,) = json.loads(run(["lag", "--spool", spool, "--no-store", "--json"]).stdout)
        assert db["snapshotted"] is not False and db["wal"] is True and db["source_changed"] is False, db
        text = run(["lag", "--spool", spool, "--no-store"]).stdout.decode()
        assert "[WAL mode]" in text and "never snapshotted" not in text and "NOT" not in text, text
        assert run(["flush", "--store", store, "--spool", spool]).returncode == 0
        proc = run(["lag", "--spool", spool, "--store", store])
        text = proc.stdout.decode()
        assert proc.returncode == 0 and "in sync [WAL mode]" in text, text
    finally:
        con.close()


@pytest.mark.skipif(not vfs_available(), reason="writer_vfs is not built")
def test_lag_of_a_database_never_snapshotted(tmp_path):
    """A spool directory with no snapshot in it (as a writer whose snapshots
    were all abandoned leaves it): lag says never snapshotted (never "in
    sync"), with or without a store, and exits 3."""
    import shutil
    import writer_vfs
    spool = str(tmp_path / "spool")
    writer_vfs.register(spool)
    con = writer_vfs.connect(str(tmp_path / "w.db"))
    con.execute("CREATE TABLE t(x)")
    con.commit()
    con.close()
    (dbdir,) = [os.path.join(d, sub) for d, subs, _ in os.walk(spool) for sub in subs
                if os.path.isdir(os.path.join(d, sub, "staging"))]
    shutil.rmtree(os.path.join(dbdir, "ready"))
    for name in os.listdir(os.path.join(dbdir, "staging", "meta")):
        os.unlink(os.path.join(dbdir, "staging", "meta", name))
    for where in (["--store", "file://%s/store" % tmp_path], ["--no-store"]):
        proc = run(["lag", "--spool", spool] + where)
        text = proc.stdout.decode()
        assert proc.returncode == 3, (where, text)
        assert "never snapshotted" in text and "in sync" not in text, text
        (db,) = json.loads(run(["lag", "--spool", spool, "--json"] + where).stdout)
        assert db["snapshotted"] is False and db["in_sync"] in (False, None), db


def test_flush_timeout_stops_uploads_midway(tmp_path):
    """--timeout holds inside a pass too: paced at 5 requests a second, 3 MiB
    of chunks (48 PUTs, about 10 s) stop at the 1 s deadline, with a clear
    error; what was sent stays sent, and the next flush finishes the job."""
    spool = tmp_path / "spool"
    spool.mkdir()
    store_dir = tmp_path / "store"
    url = "file://%s" % store_dir
    w = Writer("py", str(spool), str(tmp_path / "app.db"))
    w.execute("CREATE TABLE big(x)")
    w.execute("INSERT INTO big VALUES (randomblob(3 << 20))")
    w.bump()
    start = time.monotonic()
    proc = run(["flush", "--store", url, "--spool", str(spool), "--rate", "5", "--burst", "1",
                "--timeout", "1"])
    elapsed = time.monotonic() - start
    assert_one_line_error(proc, "deadline", "--timeout 1s", "paced at 5 requests/s (--rate")
    assert elapsed < 8, elapsed  # not the ~10 s the whole upload takes at this pace
    sent = os.listdir(store_dir / "chunks")
    assert 0 < len(sent) < 48
    # Earlier, smaller snapshots may have landed; the last one has not.
    assert run(["restore", "--store", url, "-s", w.path, "-o", "-"]).stdout != w.data()
    assert_flush_restores(url, str(spool), w.path, w.data())
    w.close()


def test_flush_ships_unpaced_by_default(tmp_path):
    """A one-off flush is not paced like the daemon (30 requests/s, 4
    workers): it says so with -v, and ships the database with no --timeout."""
    spool = tmp_path / "spool"
    spool.mkdir()
    url = "file://%s/store" % tmp_path
    w = Writer("py", str(spool), str(tmp_path / "app.db"))
    w.execute("CREATE TABLE big(x)")
    w.execute("INSERT INTO big VALUES (randomblob(3 << 20))")
    w.bump()
    proc = run(["flush", "-v", "--store", url, "--spool", str(spool)])
    assert proc.returncode == 0, proc.stderr
    text = proc.stderr.decode()
    assert "unpaced, 64 workers" in text and "MiB pending in" in text, text
    assert_flush_restores(url, str(spool), w.path, w.data())
    w.close()


def test_a_spool_ships_to_one_store(replicated, tmp_path):
    """Chunks leave the spool once sent: flushing the same spool to a second
    store would publish manifests naming chunks it never got. The copier
    refuses, says how to start over, and starting over works."""
    w, spool, url = replicated
    other = "file://%s/other" % tmp_path
    w.bump()
    proc = run(["flush", "--store", other, "--spool", spool])
    assert_one_line_error(proc, "ships to file://", "remove that directory")
    assert not os.path.exists(os.path.join(other[len("file://"):], "manifests", w.name))
    # The first store still takes it.
    assert run(["flush", "--store", url, "--spool", spool]).returncode == 0
    # Junk in place of the record is moved aside, and the record made again.
    db_dir = spoolutil.db_spool_dir(spool, w.path)
    os.unlink(os.path.join(db_dir, "copier.store"))
    os.symlink("/nonexistent", os.path.join(db_dir, "copier.store"))
    w.bump()
    assert run(["flush", "--store", url, "--spool", spool]).returncode == 0
    assert open(os.path.join(db_dir, "copier.store")).read() == "file://%s/store/chunks" % tmp_path
    # Starting over for the other store: a fresh spool, a full snapshot.
    spool2 = tmp_path / "spool2"
    spool2.mkdir()
    w2 = Writer("py", str(spool2), w.path)
    w2.bump()
    assert_flush_restores(other, str(spool2), w.path, w2.data())
    w2.close()


def test_config_from_environment(replicated, tmp_path):
    w, spool, url = replicated
    w.bump()
    config = {"replication_spooling_dir": spool,
              "replication_targets": [{"directory": {"path": url[len("file://"):]}}]}
    cfg_file = tmp_path / "verneuil.json"
    cfg_file.write_text(json.dumps(config))
    proc = run(["flush"], env={"VERNEUIL_CONFIG": "@%s" % cfg_file})
    assert proc.returncode == 0, proc.stderr
    proc = run(["restore", "-s", w.path, "-o", "-"], env={"VERNEUIL_CONFIG": json.dumps(config)})
    assert proc.stdout == w.data()
    proc = run(["restore", "--store", "@%s" % cfg_file, "-s", w.path, "-o", "-"])
    assert proc.stdout == w.data()


@pytest.mark.skipif(not vfs_available(), reason="writer_vfs is not built")
def test_sync_forces_a_snapshot(tmp_path):
    spool = tmp_path / "spool"
    db = tmp_path / "plain.db"
    conn = sqlite3.connect(str(db))  # written without the VFS: nothing spooled
    conn.execute("CREATE TABLE t(x)")
    conn.execute("INSERT INTO t VALUES (randomblob(100000))")
    conn.commit()
    conn.close()
    url = "file://%s/store" % tmp_path
    proc = run(["sync", "--store", url, "--spool", str(spool), str(db)])
    assert proc.returncode == 0, proc.stderr
    proc = run(["restore", "--store", url, "-s", str(db), "-o", "-"])
    assert proc.returncode == 0, proc.stderr
    # Same database (the no-op write bumps only the header's change counter).
    assert proc.stdout == db.read_bytes()
    # A WAL database too, its last commits still in the WAL (another
    # connection keeps it open): the replica is its committed state, with
    # the header of a rollback-journal database.
    wal = tmp_path / "wal.db"
    conn = sqlite3.connect(str(wal), isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t(x)")
    conn.execute("INSERT INTO t VALUES (randomblob(70000))")
    assert os.path.getsize(str(wal) + "-wal") > 0
    proc = run(["sync", "--store", url, "--spool", str(spool), str(wal)])
    assert proc.returncode == 0, proc.stderr
    proc = run(["restore", "--store", url, "-s", str(wal), "-o", str(tmp_path / "back.db")])
    assert proc.returncode == 0, proc.stderr
    back = sqlite3.connect(str(tmp_path / "back.db"))
    assert back.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert back.execute("SELECT length(x) FROM t").fetchall() == [(70000,)]
    back.close()
    conn.close()


# -- bad inputs ------------------------------------------------------------------------

def test_unknown_database(replicated, tmp_path):
    w, spool, url = replicated
    out = tmp_path / "never.db"
    proc = run(["restore", "--store", url, "-s", "/no/such/db.sqlite", "-o", str(out)])
    assert_one_line_error(proc, "no such replicated database")
    assert not out.exists()
    assert_one_line_error(run(["manifest", "--store", url, "--hostname", "elsewhere", "-s", "/x"]),
                          "no such replicated database")
    assert_one_line_error(run(["restore", "--store", url, "-o", "-"]), "source-path")


def test_restore_output_is_checked_before_any_download(replicated, tmp_path):
    """-o names a file to create: a directory, a missing parent or an
    existing file (without --force) is refused at once, with exit 2."""
    w, spool, url = replicated
    outdir = tmp_path / "outdir"
    outdir.mkdir()
    existing = tmp_path / "existing.db"
    existing.write_bytes(b"keep me")
    target = tmp_path / "target.db"
    target.write_bytes(b"link target")
    link = tmp_path / "link.db"
    link.symlink_to(target)
    for out, needle in ((outdir, "is a directory"), (existing, "--force"), (link, "--force"),
                        (tmp_path / "nodir" / "x.db", "no directory")):
        proc = run(["restore", "--store", url, "-s", w.path, "-o", str(out)])
        assert_one_line_error(proc, needle)
        assert proc.returncode == 2
    assert existing.read_bytes() == b"keep me" and target.read_bytes() == b"link target"
    assert os.listdir(outdir) == []
    # --force replaces a file, and a symlink itself (its target is left alone).
    for out in (existing, link):
        proc = run(["restore", "--store", url, "-s", w.path, "-o", str(out), "--force"])
        assert proc.returncode == 0, proc.stderr
        assert not out.is_symlink() and out.read_bytes() == w.data()
    assert target.read_bytes() == b"link target"


def test_corrupt_manifest_and_chunk_never_write_a_wrong_file(replicated, tmp_path):
    w, spool, url = replicated
    root = url[len("file://"):]
    out = tmp_path / "out.db"
    out.write_bytes(b"previous contents")
    # a corrupt chunk
    m = fmt.decode_and_validate(open(os.path.join(root, "manifests", w.name), "rb").read())
    victim = next(fp for i, fp in enumerate(m.chunks) if i not in m.bundled
                  and fp != fmt.ZERO_CHUNK_FPRINT)
    chunk_path = os.path.join(root, "chunks", victim.name)
    with open(chunk_path, "wb") as f:
        f.write(fmt.compress_chunk(os.urandom(65536)))
    proc = run(["restore", "--store", url, "-s", w.path, "-o", str(out), "--force"])
    assert_one_line_error(proc, "corrupt chunk")
    assert out.read_bytes() == b"previous contents"
    assert [p for p in os.listdir(tmp_path) if p.startswith(".out.db")] == []
    proc = run(["restore", "--store", url, "-s", w.path, "-o", "-"])
    assert_one_line_error(proc, "corrupt chunk")
    assert proc.stdout == b""
    # a missing chunk
    os.unlink(chunk_path)
    assert_one_line_error(run(["restore", "--store", url, "-s", w.path, "-o", str(out), "--force"]),
                          "missing")
    # a corrupt manifest
    with open(os.path.join(root, "manifests", w.name), "wb") as f:
        f.write(fmt.compress_manifest(b"\x0a\x05hello"))
    for args in (["restore", "-o", str(out), "--force"], ["manifest"]):
        proc = run(args[:1] + ["--store", url, "-s", w.path] + args[1:])
        assert_one_line_error(proc, "corrupt manifest")
    assert out.read_bytes() == b"previous contents"
    # ls still lists it, with a warning
    proc = run(["ls", "--store", url])
    assert proc.returncode == 0 and "ERROR" in proc.stdout.decode()


def test_not_a_spool_and_bad_specs(tmp_path):
    url = "file://%s/store" % tmp_path
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("hello")
    for cmd in ("flush", "lag", "copier"):
        assert_one_line_error(run([cmd, "--store", url, "--spool", str(junk)]), "not a spool")
    assert_one_line_error(run(["flush", "--store", url, "--spool", str(junk / "notes.txt")]),
                          "not a directory")
    assert_one_line_error(run(["flush", "--store", url, "--spool", str(tmp_path / "nope")]),
                          "no such spool")
    assert_one_line_error(run(["ls", "--store", "nonsense"]), "not a store")
    assert_one_line_error(run(["ls"]), "VERNEUIL_CONFIG")
    assert_one_line_error(run(["flush", "--store", url]), "spool")
    assert_one_line_error(run(["ls", "--store", "file://%s/missing" % tmp_path]), "does not exist")
    assert_one_line_error(run(["manifest-name", "--hostname", "h", "relative.db"]), "absolute")
    assert_one_line_error(run(["manifest-name", ""]), "PATH is empty")
    spool = tmp_path / "spool"
    spool.mkdir()
    assert_one_line_error(run(["flush", "--store", "file://%s/notes.txt" % junk, "--spool", str(spool)]),
                          "%s is not a directory" % (junk / "notes.txt"))
    assert_one_line_error(run(["fingerprint", "--key", "x" * 40, "/dev/null"]), "32 bytes")
    assert_one_line_error(run(["fingerprint", str(tmp_path / "missing")]), "cannot read")
    assert_one_line_error(run(["manifest", "--store", url, "-m", "not-a-manifest"]),
                          "not a manifest name")


# -- S3 ----------------------------------------------------------------------------------

@pytest.mark.s3
def test_s3_round_trip_wrong_bucket_and_outage(s3_server, tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    store = s3_server.make_store()
    w = Writer("py", str(spool), str(tmp_path / "app.db"))
    w.bump()
    assert run(["flush", "--store", store.url, "--spool", str(spool)]).returncode == 0
    proc = run(["restore", "--store", store.url, "-s", w.path, "-o", "-"])
    assert proc.returncode == 0 and proc.stdout == w.data()
    listing = json.loads(run(["ls", "--store", store.url, "--json"]).stdout)
    assert [e["path"] for e in listing] == [w.path]
    # wrong bucket
    bad = s3_server.url("no-such-bucket-here", "nor-this-one")
    assert_one_line_error(run(["ls", "--store", bad]), "bucket")
    assert_one_line_error(run(["restore", "--store", bad, "-s", w.path, "-o", "-"]), "bucket")
    w.bump()
    assert_one_line_error(run(["flush", "--store", bad, "--spool", str(spool)]), "bucket")
    # endpoint down: flush gives up after its timeout, exit non-zero; with
    # no --timeout (the default), once nothing was uploaded for --stall-timeout
    s3_server.stop()
    try:
        proc = run(["flush", "--store", store.url, "--spool", str(spool), "--timeout", "2"])
        assert_one_line_error(proc)
        start = time.monotonic()
        proc = run(["flush", "--store", store.url, "--spool", str(spool), "--stall-timeout", "2"])
        assert_one_line_error(proc, "nothing was uploaded for 2s (--stall-timeout)")
        assert time.monotonic() - start < 30
    finally:
        s3_server.start()
    assert run(["flush", "--store", store.url, "--spool", str(spool)]).returncode == 0
    proc = run(["restore", "--store", store.url, "-s", w.path, "-o", "-"])
    assert proc.stdout == w.data()
    store.close()


@pytest.mark.s3
def test_refused_credentials(aws_env, tmp_path):
    from support.s3server import S3Server
    with S3Server(auth=True, log_dir=str(tmp_path)) as server:
        url = server.url("some-bucket", "other-bucket")
        assert_one_line_error(run(["ls", "--store", url]), "denied")
        spool = tmp_path / "spool"
        spool.mkdir()
        w = Writer("py", str(spool), str(tmp_path / "app.db"))
        w.bump()
        assert_one_line_error(run(["flush", "--store", url, "--spool", str(spool),
                                   "--timeout", "5"]), "denied")
        w.close()


def test_version_and_the_commands_listed_when_none_is_given():
    from verneuil_fuse import __version__

    out = run(["--version"])
    assert out.returncode == 0 and out.stdout.decode().strip() == "verneuilctl " + __version__
    out = run([])
    assert out.returncode == 2
    err = out.stderr.decode()
    for command in ("copier", "flush", "sync", "restore", "repair", "ls", "manifest", "lag", "query"):
        assert command in err, command
    assert "Traceback" not in err


@pytest.mark.s3
def test_ls_says_where_it_looked_when_the_store_is_empty(s3_server, tmp_path):
    """An S3 URL without manifest_bucket names one bucket for both: an empty
    listing says so, instead of an empty table alone."""
    chunks = s3_server.new_bucket("chunks")
    manifests = s3_server.new_bucket("manifests", versioned=True)
    out = run(["ls", "--store", s3_server.url(chunks)])
    assert out.returncode == 0
    err = out.stderr.decode()
    assert "no replicated databases in s3://%s/" % chunks in err and "manifest_bucket=" in err, err
    out = run(["ls", "--store", s3_server.url(chunks, manifests)])
    assert out.returncode == 0
    err = out.stderr.decode()
    assert "no replicated databases in s3://%s" % manifests in err and "manifest_bucket=" not in err, err


def test_query_needs_paths_and_sql():
    out = run(["query", "only-one-thing"])
    assert out.returncode == 2
    err = out.stderr.decode()
    assert "needs databases and SQL" in err and "--sql" in err and "Traceback" not in err, err


def test_lag_follows_a_wal_database(replicated):
    """A database switched to WAL stays replicated: lag says WAL mode, and
    in sync once flushed, its last commit still in the WAL."""
    import writer_vfs

    w, spool, url = replicated
    writer_vfs.register(spool)
    conn = writer_vfs.connect(w.path, isolation_level=None)
    assert conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    conn.execute("INSERT INTO big VALUES (randomblob(1000))")
    assert writer_vfs.wait_staged(conn)  # WAL commits are staged off the commit path
    text = run(["lag", "--store", url, "--spool", spool]).stdout.decode()
    assert "[WAL mode]" in text and "in sync" not in text and "source changed" not in text, text
    assert run(["flush", "--store", url, "--spool", spool]).returncode == 0
    (db,) = json.loads(run(["lag", "--store", url, "--spool", spool, "--json"]).stdout)
    assert db["wal"] is True and db["in_sync"] is True and db["source_changed"] is False, db
    conn.close()


def test_sqlite_extension_path_loads_in_the_shell(tmp_path):
    """README: `.load $(verneuilctl sqlite-extension)` works from any directory."""
    import shutil

    path = run(["sqlite-extension"]).stdout.decode().strip()
    assert os.path.isfile(path), path
    if shutil.which("sqlite3") is None:
        pytest.skip("the sqlite3 shell is not installed")
    out = subprocess.run(["sqlite3", "-cmd", ".load %s" % path, ":memory:", "PRAGMA verneuil_stats;"],
                         capture_output=True, text=True, cwd=str(tmp_path), timeout=60)
    assert out.returncode == 0, out.stderr
