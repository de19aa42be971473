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

from verneuil_fuse.cli import mount, mount_options
from verneuil_fuse.errors import UserError


def run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "verneuil_fuse.cli.mount", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_own_options():
    out = run("--help")
    assert out.returncode == 0
    for name in ("cache_dir=", "cache_size=", "refresh=", "readahead_max=", "btree_prefetch=",
                 "concurrency=", "hydrate", "allow_other", "deadline=", "max_db_size=", "follow=", "follow_interval="):
        assert name in out.stdout


def test_one_table_of_options_for_the_parser_the_help_and_the_docs():
    """Every mount option of the code's table is parsed, its default is the
    Options' default, --help says it with its default, and docs/READER.md's
    table is the table the code makes (scripts/mount_options_doc.py writes
    it again)."""
    defaults = mount.parse_args(["s", "m"])
    out = run("--help").stdout
    for o in mount_options.MOUNT_OPTIONS:
        assert vars(defaults)[o.name] == o.default, o.name
        assert o.spelled in out and "(default %s" % o.default_text.split()[0] in " ".join(out.split()), o.name
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "READER.md")) as f:
        docs = f.read()
    table = mount_options.docs_table()
    assert table in docs, "docs/READER.md's table of mount options differs: run scripts/mount_options_doc.py"
    assert docs.count("| option | default | meaning |") == 1


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
    (["file:///tmp", "/tmp", "-o", "concurrency=50000000"], 2, "at most 1024"),
    (["file:///tmp", "/tmp", "-o", "cache_size=1"], 2, "at least 16M"),
    (["file:///tmp", "/tmp", "-o", "cache_dir="], 2, "an empty path"),
    (["file:///tmp", "/tmp", "-o", "hydrate,cache_size=0"], 2, "option hydrate needs a disk cache"),
    (["file:///tmp", "/tmp", "-o", "fsname="], 2, "option fsname needs a value"),
    (["s3://user:secret@bucket", "/tmp"], 3, "s3://***@bucket"),
    (["file:///tmp", "/tmp", "-o", "uid=no-such-user-here"], 2, "no user 'no-such-user-here' on this host"),
    (["file:///tmp", "/tmp", "-o", "gid=no-such-group-here"], 2, "no group 'no-such-group-here' on this host"),
    (["file:///tmp", "/tmp", "-o", "umask=999"], 2, "bad value for option umask: an octal mode"),
    (["file:///tmp", "/tmp", "-o", "umask=01777"], 2, "an octal mode from 0 to 0777"),
    (["file:///tmp", "/tmp", "-o", "subdir=web1/data"], 2, "bad value for option subdir: a directory of the tree"),
    (["file:///tmp", "/tmp", "-o", "subdir=/web1/../x"], 2, "bad value for option subdir"),
    (["file:///tmp", "/tmp", "-o", "metrics_port=70000"], 2, "a TCP port, 0 to 65535"),
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
            p = subprocess.Popen([sys.executable, "-m", "verneuil_fuse.cli.mount", url, str(tmp_path),
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
    assert mount_options.parse_size("64M") == 64 << 20 and mount_options.parse_size("100") == 100
    opts = mount.parse_args(["s", "m", "-o", "uid=root,gid=0,umask=027,subdir=/web1//srv/data/,metrics_port=9464"])
    assert (opts.uid, opts.gid, opts.umask, opts.subdir) == (0, 0, 0o27, "/web1/srv/data")
    assert (opts.metrics_port, opts.metrics_address) == (9464, "127.0.0.1")
    assert mount.parse_args(["s", "m", "-o", "uid=1000,umask=0"]).uid == 1000
    defaults = mount.parse_args(["s", "m"])
    assert defaults.follow and defaults.follow_interval == 0.5  # the follow loop's default
    opts = mount.parse_args(["s", "m", "-o", "follow=off,follow_interval=0"])
    assert not opts.follow and opts.follow_interval == 0
    for bad in ("follow=maybe", "follow_interval=-1", "follow_interval=soon"):
        with pytest.raises(UserError) as e:
            mount.parse_args(["s", "m", "-o", bad])
        assert bad.split("=")[0] in str(e.value)



def test_a_metrics_port_in_use_is_one_line(tmp_path):
    """metrics_port= that cannot be had fails the mount before it is made."""
    (tmp_path / "store" / "manifests").mkdir(parents=True)
    (tmp_path / "mnt").mkdir()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        out = run(str(tmp_path / "store"), str(tmp_path / "mnt"), "-o",
                  "cache_size=0,metrics_port=%d,log_file=%s" % (port, tmp_path / "log"))
        _last_line_error(out, 2, "cannot serve metrics on 127.0.0.1:%d: Address already in use" % port)
    finally:
        taken.close()


# ------------------------------------------- profile=, credentials_file=, start_retry=
def _last_line_error(out, code, words):
    assert out.returncode == code, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("verneuil: error: ") and words in lines[0], out.stderr


def test_s3_only_options_and_credentials_file_errors(tmp_path, aws_env):
    store = tmp_path / "store"
    (store / "manifests").mkdir(parents=True)
    log = "log_file=%s" % (tmp_path / "log")
    _last_line_error(run(str(store), str(tmp_path), "-o", "profile=replicas," + log), 2,
                     "option profile applies to S3 stores only")
    _last_line_error(run(str(store), str(tmp_path), "-o", "credentials_file=/etc/hostname,profile=p," + log), 2,
                     "options profile and credentials_file apply to S3 stores only")
    url = "s3://chunks?manifest_bucket=m&endpoint=http://127.0.0.1:9"
    _last_line_error(run(url, str(tmp_path), "-o", "credentials_file=%s/nope,%s" % (tmp_path, log)), 2,
                     "cannot read credentials_file %s/nope: No such file or directory" % tmp_path)
    _last_line_error(run(url, str(tmp_path), "-o", "profile=,%s" % log), 2, "bad value for option profile")
    _last_line_error(run(url, str(tmp_path), "-o", "start_retry=-1," + log), 2, "bad value for option start_retry")


def test_unknown_profile_is_one_line(tmp_path, aws_env):
    creds = tmp_path / "credentials"
    creds.write_text("[replicas]\naws_access_key_id = a\naws_secret_access_key = b\n")
    url = "s3://chunks?manifest_bucket=m&endpoint=http://127.0.0.1:9"
    for extra in ("", ",credentials_file=%s" % creds):
        out = run(url, str(tmp_path), "-o", "profile=nope,log_file=%s%s" % (tmp_path / "log", extra))
        _last_line_error(out, 3, "AWS profile 'nope' not found")


def _mount_class():
    from support.replicas import Mount, fuse_unavailable

    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    return Mount


def test_profile_from_a_credentials_file_mounts(s3_server, tmp_path):
    """No credentials in the environment (as for fstab at boot): the mount
    signs with the profile of the given credentials file."""
    Mount = _mount_class()
    if not s3_server.running:
        s3_server.start()
    from support.s3server import FAKE_ACCESS_KEY, FAKE_SECRET_KEY

    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n"
                     "[replicas]\naws_access_key_id = %s\naws_secret_access_key = %s\n"
                     % (FAKE_ACCESS_KEY, FAKE_SECRET_KEY))
    url = s3_server.url(s3_server.new_bucket("chunks"), s3_server.new_bucket("manifests", versioned=True))

    class NoEnvCredentials(Mount):
        def env(self):
            return {k: v for k, v in os.environ.items()
                    if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE")}

    with NoEnvCredentials(url, str(tmp_path / "mnt"),
                          "cache_size=0,profile=replicas,credentials_file=%s" % creds) as m:
        os.listdir(m.mountpoint)
        stats = m.stats()
        assert stats["mount"]["ready"] and stats["mount"]["source"].startswith("s3://")
    # Without the file, the profile is nowhere (the environment's files are
    # /dev/null): the credentials above came from credentials_file.
    env = NoEnvCredentials(url, str(tmp_path / "mnt")).env()
    out = subprocess.run([sys.executable, "-m", "verneuil_fuse.cli.mount", url, str(tmp_path / "mnt"),
                          "-o", "profile=replicas,log_file=%s" % (tmp_path / "log")],
                         capture_output=True, text=True, timeout=60, env=env)
    _last_line_error(out, 3, "AWS profile 'replicas' not found")


def test_start_retry_gives_up_after_its_time(tmp_path, aws_env):
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there: connections are refused
    url = "s3://chunks?manifest_bucket=m&endpoint=http://127.0.0.1:%d" % port
    log = tmp_path / "log"
    t0 = time.monotonic()
    out = run(url, str(tmp_path), "-o", "cache_size=0,start_retry=3,log_file=%s" % log)
    elapsed = time.monotonic() - t0
    _last_line_error(out, 3, "cannot list s3://chunks")
    assert 2.8 <= elapsed < 15, elapsed
    assert log.read_text().count("trying again") == 2  # after 1 s, then 2 s


def test_start_retry_waits_for_the_store(s3_server, tmp_path):
    import threading

    Mount = _mount_class()
    url = s3_server.url(s3_server.new_bucket("chunks"), s3_server.new_bucket("manifests", versioned=True))
    s3_server.stop()
    timer = threading.Timer(1.5, s3_server.start)
    timer.start()
    m = Mount(url, str(tmp_path / "mnt"), "cache_size=0,start_retry=20")
    try:
        t0 = time.monotonic()
        m.start(timeout=30)
        assert time.monotonic() - t0 >= 1.4
        assert m.stats()["mount"]["ready"]
        assert "trying again" in m.log_tail(20000)
    finally:
        timer.cancel()
        timer.join()
        if not s3_server.running:
            s3_server.start()
        m.stop()


def test_help_lists_start_up_options():
    out = run("--help")
    assert out.returncode == 0
    for name in ("profile=NAME", "credentials_file=PATH", "start_retry=SECONDS", "metrics_port=PORT",
                 "metrics_address=ADDRESS", "uid=USER", "gid=GROUP", "umask=MODE", "subdir=/HOST[/PATH]"):
        assert name in out.stdout
    opts = mount.parse_args(["s", "m", "-o", "profile=replicas,credentials_file=c,start_retry=2.5"])
    assert (opts.profile, opts.credentials_file, opts.start_retry) == ("replicas", "c", 2.5)
    assert mount.parse_args(["s", "m"]).start_retry == 0


def test_stats_hold_the_mount_section(tmp_path):
    """The layers a mount serves from, built and torn down without FUSE:
    the catalog's stats carry the mount's own section, read fresh each time."""
    pytest.importorskip("pyfuse3")
    (tmp_path / "store" / "manifests").mkdir(parents=True)
    (tmp_path / "mnt").mkdir()
    opts = mount.parse_args([str(tmp_path / "store"), str(tmp_path / "mnt"), "-o", "cache_size=0"])
    layers = mount._build_layers(opts, mount.check_source(opts))
    try:
        assert layers.cache is None
        section = layers.catalog.stats()["mount"]
        assert abs(section.pop("started") - time.time()) < 60
        assert section == {
            "source": "file://%s/store?create=false" % tmp_path, "mountpoint": str(tmp_path / "mnt"),
            "pid": os.getpid(), "read_errors": 0, "handler_errors": 0, "ready": False,
            "cache_dir": None, "metrics_url": None}
        layers.ready = True
        assert layers.catalog.stats()["mount"]["ready"] is True
    finally:
        mount._tear_down(opts, layers)
