"""The production install (scripts/install.sh) from a clean clone of this
repository's committed state, into a temporary prefix: a venv without the
test tools, `verneuil` and `verneuilctl` linked, the copier's unit and its
settings; the unit passes `systemd-analyze verify` (where systemd is
installed), its ExecStart ships a database the installed writer wrote, and
`--uninstall` removes what the install put in place (`--purge` the settings
too). About 20 s: pip builds the project from the clone (its dependencies
come from pip's cache after scripts/setup.sh)."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess

import pytest

from support.replicas import stop_pid, wait_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT = "verneuil-copier.service"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
if shutil.which("git") is None or not os.path.exists(os.path.join(REPO, ".git")):
    pytestmark.append(pytest.mark.skip(reason="not a git checkout: nothing to clone"))


def _run(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=kw.pop("timeout", 400), **kw)


def _unit_settings(path: str) -> dict:
    """Key=value lines of a unit or an environment file (comments left out)."""
    out = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith(("#", "[")) and "=" in line:
                key, value = line.split("=", 1)
                out[key] = value
    return out


def test_install_from_a_clean_clone_runs_and_uninstalls(tmp_path):
    clone = tmp_path / "clone"
    cloned = _run(["git", "clone", "-q", "--shared", REPO, str(clone)])
    assert cloned.returncode == 0, cloned.stderr
    where = {name: tmp_path / name for name in ("opt", "sbin", "bin", "units", "etc")}
    dirs = ["--prefix", str(where["opt"]), "--sbin-dir", str(where["sbin"]), "--bin-dir", str(where["bin"]),
            "--unit-dir", str(where["units"]), "--etc-dir", str(where["etc"])]
    installed = _run(["bash", str(clone / "scripts" / "install.sh")] + dirs)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    venv = where["opt"] / "venv"

    # Runtime only: no test or benchmark tool in the venv, none of the clone's files needed.
    listed = _run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"]).stdout.lower()
    assert "verneuil_fuse==" in listed.replace("-", "_") and "boto3==" in listed
    for tool in ("pytest", "moto", "hypothesis", "matplotlib", "pyspark"):
        assert tool + "==" not in listed, tool
    shutil.rmtree(clone)
    for program in (where["bin"] / "verneuilctl", where["sbin"] / "verneuil"):
        version = _run([str(program), "--version"])
        assert version.returncode == 0 and version.stdout.strip().endswith("0.1.0"), version

    # The unit: verified by systemd where it is installed, its paths filled in.
    unit = str(where["units"] / UNIT)
    service = _unit_settings(unit)
    assert service["ExecStart"] == "%s/bin/verneuilctl copier $VERNEUIL_COPIER_ARGS" % venv
    assert service["EnvironmentFile"] == str(where["etc"] / "copier.env")
    if shutil.which("systemd-analyze"):
        for path in (unit, where["opt"] / "share" / "examples" / "mnt-replicas.mount",
                     where["opt"] / "share" / "examples" / "mnt-replicas.automount"):
            verified = _run(["systemd-analyze", "verify", str(path)])
            assert verified.returncode == 0 and not verified.stderr.strip(), (path, verified.stderr)

    # What systemd would run: the environment file, then ExecStart, with a
    # spool and a store of this test's; a database written by the installed
    # writer reaches the store, and SIGTERM stops the copier with exit 0.
    spool, store = tmp_path / "spool", tmp_path / "store"
    (where["etc"] / "config.json").write_text('{"replication_spooling_dir": "%s", "replication_targets": '
                                              '[{"directory": {"path": "%s"}}]}' % (spool, store))
    env = dict(os.environ, **_unit_settings(str(where["etc"] / "copier.env")))
    env["VERNEUIL_COPIER_ARGS"] = "--metrics-port 0 --poll-interval 0.05"
    db = tmp_path / "app.db"
    write = ("import writer_vfs, os; writer_vfs.register(os.environ['SPOOL']); c = writer_vfs.connect(%r); "
             "c.execute('CREATE TABLE t(x)'); c.execute('INSERT INTO t VALUES (42)'); c.commit(); c.close()" % str(db))
    written = _run([str(venv / "bin" / "python"), "-c", write], env=dict(env, SPOOL=str(spool)))
    assert written.returncode == 0, written.stderr
    command = shlex.split(service["ExecStart"].replace("$VERNEUIL_COPIER_ARGS", env["VERNEUIL_COPIER_ARGS"]))
    copier = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        restore = [str(where["bin"] / "verneuilctl"), "restore", "-s", str(db), "-o", str(tmp_path / "back.db")]
        back = tmp_path / "back.db"
        # The copier may ship the first commit's snapshot before the last's:
        # the store converges to the newest.
        wait_for(lambda: _run(restore, env=env, timeout=60).returncode == 0 and back.read_bytes() == db.read_bytes(),
                 60, "the copier to ship the database's last commit")
        copier.terminate()
        assert copier.wait(30) == 0
    finally:
        if copier.poll() is None:
            stop_pid(copier.pid, 5)
        log = copier.stderr.read()
        copier.stderr.close()
    assert "copier started: spool %s" % spool in log and "Traceback" not in log, log
    assert (tmp_path / "back.db").read_bytes() == db.read_bytes()

    # --uninstall: the install's files go, the settings stay; --purge takes them.
    removed = _run(["bash", os.path.join(REPO, "scripts", "install.sh"), "--uninstall"] + dirs)
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert not where["opt"].exists() and not os.path.lexists(unit)
    assert not os.path.lexists(where["bin"] / "verneuilctl") and not os.path.lexists(where["sbin"] / "verneuil")
    assert sorted(os.listdir(where["etc"])) == ["config.json", "copier.env"]
    assert db.exists() and store.exists()  # data is never touched
    purged = _run(["bash", os.path.join(REPO, "scripts", "install.sh"), "--uninstall", "--purge"] + dirs)
    assert purged.returncode == 0 and not where["etc"].exists(), purged.stdout + purged.stderr
    # A prefix this script did not make is left alone.
    (where["opt"] / "venv").mkdir(parents=True)
    refused = _run(["bash", os.path.join(REPO, "scripts", "install.sh"), "--uninstall"] + dirs)
    assert refused.returncode == 1 and "holds no install of this script: left alone" in refused.stderr
    assert (where["opt"] / "venv").is_dir()
