"""The `verneuil` command line: --help, and one-line errors (no traceback)
with distinct exit codes for bad options, sources and mount points."""
from __future__ import annotations

import subprocess
import sys

import pytest

from verneuil_fuse import mount


def run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "verneuil_fuse.mount", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_own_options():
    out = run("--help")
    assert out.returncode == 0
    for name in ("cache_dir=", "cache_size=", "refresh=", "readahead_max=", "cache_readahead_max=", "btree_prefetch=",
                 "concurrency=", "hydrate", "allow_other"):
        assert name in out.stdout


@pytest.mark.parametrize("args, code, words", [
    (["file:///tmp", "/tmp", "-o", "bogus=1"], 2, "unknown mount option: bogus=1"),
    (["file:///tmp", "/tmp", "-o", "cache_size=lots"], 2, "bad value for option cache_size"),
    (["file:///tmp", "/tmp", "-o", "concurrency=0"], 2, "bad value for option concurrency"),
    (["file:///tmp", "/nonexistent-mnt"], 2, "mount point /nonexistent-mnt is not a directory"),
    (["file:///nonexistent-store", "/tmp"], 3, "no such directory"),
    (["ftp://nope", "/tmp"], 3, "bad source"),
    (["only-one-arg"], 2, "required"),
])
def test_errors_are_one_line(args, code, words):
    out = run(*args)
    assert out.returncode == code, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("verneuil: error: ") and words in lines[0], out.stderr


def test_option_parsing():
    opts = mount.parse_args(["s", "m", "-o", "ro,allow_other,dev,suid,_netdev,nofail,defaults,rw,x-systemd.automount",
                             "-o", r"cache_dir=/var/c\,x,cache_size=1.5G,refresh=2,hydrate,readahead=off"])
    assert opts.cache_dir == "/var/c,x" and opts.cache_size == int(1.5 * (1 << 30))
    assert opts.refresh == 2.0 and opts.hydrate and not opts.readahead
    assert set(opts.fuse) == {"ro", "allow_other", "dev", "suid", "default_permissions",
                              "fsname=s", "subtype=verneuil"}
    assert mount.parse_size("64M") == 64 << 20 and mount.parse_size("100") == 100
