"""The `verneuil` command line: --help, and one-line errors (no traceback)
with distinct exit codes for bad options, sources and mount points."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from verneuil_fuse import mount


def run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "verneuil_fuse.mount", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_own_options():
    out = run("--help")
    assert out.returncode == 0
    for name in ("cache_dir=", "cache_size=", "refresh=", "readahead_max=", "cache_readahead_max=", "btree_prefetch=",
                 "concurrency=", "hydrate", "allow_other", "deadline=", "max_db_size="):
        assert name in out.stdout


def test_version():
    from verneuil_fuse import __version__

    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip() == "verneuil " + __version__
    assert __version__ != "0+unknown"  # the installed package's version


@pytest.mark.parametrize("args, code, words", [
    (["file:///tmp", "/tmp", "-o", "bogus=1"], 2, "unknown mount option: bogus=1"),
    (["file:///tmp", "/tmp", "-o", "cache_size=lots"], 2, "bad value for option cache_size"),
    (["file:///tmp", "/tmp", "-o", "concurrency=0"], 2, "bad value for option concurrency"),
    (["file:///tmp", "/nonexistent-mnt"], 2, "mount point /nonexistent-mnt is not a directory"),
    (["file:///nonexistent-store", "/tmp"], 3, "no such directory"),
    (["ftp://nope", "/tmp"], 3, "bad source"),
    (["only-one-arg"], 2, "required"),
    (["file:///tmp", "/tmp", "-o", "log_file=/nonexistent-dir/log"], 2, "cannot write log_file"),
    (["file:///tmp", "/tmp", "-o", "log_file=/tmp"], 2, "Is a directory"),
    (["file:///tmp", "/tmp", "-o", "concurrency=50000000"], 2, "at most 256"),
    (["file:///tmp", "/tmp", "-o", "cache_size=1"], 2, "at least 16M"),
    (["file:///tmp", "/tmp", "-o", "cache_dir="], 2, "an empty path"),
    (["file:///tmp", "/tmp", "-o", "hydrate,cache_size=0"], 2, "option hydrate needs a disk cache"),
    (["file:///tmp", "/tmp", "-o", "fsname="], 2, "option fsname needs a value"),
    (["s3://user:secret@bucket", "/tmp"], 3, "s3://***@bucket"),
])
def test_errors_are_one_line(args, code, words):
    out = run(*args)
    assert out.returncode == code, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("verneuil: error: ") and words in lines[0], out.stderr
    assert "secret" not in out.stderr


def test_a_directory_that_is_not_a_store_is_refused_untouched(tmp_path):
    src = tmp_path / "typo"
    src.mkdir()
    (src / "x.txt").write_text("x")
    out = run("file://%s" % src, str(tmp_path))
    assert out.returncode == 3 and "is not a store" in out.stderr, out.stderr
    assert sorted(os.listdir(src)) == ["x.txt"]  # no chunks/ or manifests/ made


def test_interrupt_before_the_mount_is_made(tmp_path):
    """Ctrl-C while the store does not answer: one line, exit 130, in the
    background mode (the parent waits for its child) and with -f."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # accepts connections, never answers
    url = "s3://chunks?manifest_bucket=m&endpoint=http://127.0.0.1:%d" % listener.getsockname()[1]
    env = dict(os.environ, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y")
    try:
        for extra in ([], ["-f"]):
            p = subprocess.Popen([sys.executable, "-m", "verneuil_fuse.mount", url, str(tmp_path),
                                  "-o", "cache_size=0,timeout=30", *extra],
                                 stderr=subprocess.PIPE, text=True, env=env)
            try:
                time.sleep(1.5)  # imports done, waiting on the store
                p.send_signal(signal.SIGINT)
                err = p.communicate(timeout=30)[1]
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
            assert p.returncode == 130, (extra, err)
            assert err.strip() == "verneuil: error: interrupted: not mounted", (extra, err)
    finally:
        listener.close()


def test_option_parsing():
    opts = mount.parse_args(["s", "m", "-o", "ro,allow_other,dev,suid,_netdev,nofail,defaults,rw,x-systemd.automount",
                             "-o", r"cache_dir=/var/c\,x,cache_size=1.5G,refresh=2,hydrate,readahead=off"])
    assert opts.cache_dir == "/var/c,x" and opts.cache_size == int(1.5 * (1 << 30))
    assert opts.refresh == 2.0 and opts.hydrate and not opts.readahead
    assert set(opts.fuse) == {"ro", "allow_other", "dev", "suid", "default_permissions",
                              "fsname=s", "subtype=verneuil"}
    assert mount.parse_size("64M") == 64 << 20 and mount.parse_size("100") == 100
