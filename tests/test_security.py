"""Security: paths, permissions and secrets.

- No key or manifest name leads outside a directory store, the chunk cache
  or the mount tree: `..`, `/`, NUL, long names, reserved names and symlinks
  planted in the store are refused or kept inside (hypothesis too).
- The mount is read-only and honours permissions: `default_permissions`
  always, `allow_other` only when asked (a non-root user, uid 65534 through
  `setpriv`, cannot even look into the mount without it, and can read but
  never write with it).
- Credentials (distinctive fake secrets in the environment) never appear in
  anything the copier, `verneuilctl` or the mount print or log, at their
  most verbose, on success and on refused credentials.
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from support.replicas import HOST, Mount, fuse_unavailable, make_db, publish, wait_for
from support.s3server import S3Server, moto_available
from verneuil_fuse import format as fmt
from verneuil_fuse.store import InvalidKey, LocalBackend, StoreError, open_store

CTL = [sys.executable, "-m", "verneuil_fuse.cli"]
NOBODY = 65534

BAD_KEYS = ["..", ".", "../x", "../../etc/passwd", "/etc/passwd", "a/../../b", "a/b", "x\0y",
            "\0", "", "k" * 256, "é" * 128, ".tmp-1-abc", ".hidden", "..%2F..", "%2F/.."]


def _tree(root: str) -> dict[str, tuple]:
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            st_ = os.lstat(p)
            out[p] = (st_.st_mode, st_.st_size, st_.st_mtime_ns)
    return out


def _every_op(backend, key):
    ops = [lambda: backend.get(key), lambda: backend.get_range(key, 0, 5),
           lambda: backend.put(key, b"data"), lambda: backend.put_if_absent(key, b"data"),
           lambda: backend.exists(key), lambda: backend.delete(key),
           lambda: backend.list_versions(key), lambda: backend.get_version(key, "null"),
           lambda: backend.touch(key)]
    for op in ops:
        try:
            op()
        except StoreError:
            pass


def _check_inside(base, root, outside_before):
    """Nothing outside `root` changed, and everything inside is a plain
    file directly in it (no subdirectory, no symlink)."""
    assert _tree(os.path.join(base, "outside")) == outside_before
    for name in os.listdir(root):
        assert stat.S_ISREG(os.lstat(os.path.join(root, name)).st_mode), name
    assert set(os.listdir(base)) <= {"outside", "store"}


def _layout(base):
    outside = os.path.join(base, "outside")
    os.makedirs(os.path.join(outside, "etc"), exist_ok=True)
    with open(os.path.join(outside, "etc", "passwd"), "wb") as f:
        f.write(b"secret\n")
    with open(os.path.join(base, "outside", "b"), "wb") as f:
        f.write(b"b\n")
    root = os.path.join(base, "store", "chunks")
    return LocalBackend(root), root, _tree(outside)


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_refused_by_every_operation(tmp_path, key):
    backend, root, before = _layout(str(tmp_path))
    for op in ("get", "put", "put_if_absent", "exists", "delete", "list_versions", "touch"):
        with pytest.raises(InvalidKey):
            fn = getattr(backend, op)
            fn(key, b"x") if op.startswith("put") else fn(key)
    _check_inside(str(tmp_path), root, before)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.text(max_size=300), st.sampled_from(BAD_KEYS),
                 st.lists(st.sampled_from(["..", ".", "/", "a", "\0", "%2F", "\\"]), max_size=8).map("".join)))
@example("../../outside/etc/passwd")
@example("a\\..\\b")
def test_no_key_escapes_a_local_store(tmp_path_factory, key):
    base = str(tmp_path_factory.mktemp("keys"))
    backend, root, before = _layout(base)
    _every_op(backend, key)
    _check_inside(base, root, before)
    shutil.rmtree(base)


def test_symlinks_planted_in_a_store_are_not_followed(tmp_path):
    """A symlink sitting where a blob belongs: reads refuse it, writes
    replace it (never write through it), touch and delete leave its target
    alone, listings skip it."""
    backend, root, before = _layout(str(tmp_path))
    target = os.path.join(str(tmp_path), "outside", "etc", "passwd")
    old = os.stat(target)
    name = "0123456789abcdef%2F0123456789abcdef"
    for key in (name, "k2", "k3"):
        os.symlink(target, os.path.join(root, key))
    with pytest.raises(StoreError):
        backend.get(name)
    with pytest.raises(StoreError):
        backend.get_range(name, 0, 3)
    assert backend.exists(name) is False
    assert [o.key for o in backend.list()] == []
    with pytest.raises(StoreError):
        backend.touch(name)
    assert backend.put_if_absent("k2", b"new") is False
    backend.put("k3", b"new")
    assert backend.get("k3") == b"new" and not os.path.islink(os.path.join(root, "k3"))
    backend.delete(name)
    assert not os.path.lexists(os.path.join(root, name))
    with open(target, "rb") as f:
        assert f.read() == b"secret\n"
    st_ = os.stat(target)
    assert (st_.st_mtime_ns, st_.st_size) == (old.st_mtime_ns, old.st_size)
    # Through the restore path too: a symlinked chunk is an error, never bytes.
    from verneuil_fuse.readback import fetch_manifest, restore_bytes
    from verneuil_fuse.store import ReadError
    store = open_store("file://" + os.path.join(str(tmp_path), "store"))
    data = b"SQLite format 3\x00" + os.urandom(2 * fmt.CHUNK_SIZE)
    pub = publish(store, data, "/db/x.db")
    fp = pub.manifest.chunks[1]
    os.unlink(os.path.join(root, fp.name))
    os.symlink(target, os.path.join(root, fp.name))
    with pytest.raises(ReadError):
        restore_bytes(store, fetch_manifest(store, pub.key))


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=120), st.binary(max_size=120).map(os.fsdecode)),
       st.one_of(st.text(max_size=40),
                 st.lists(st.sampled_from(["..", ".", "/", "a", "\0", "%2F", ":"]), max_size=8).map("".join)))
@example("/../../etc/passwd", "..")
@example("/a/\0/b", "h/o/s/t")
@example("/x", "")
def test_no_manifest_name_escapes_the_mount_tree(path, host):
    """Whatever a manifest name says, it becomes names of entries inside the
    mount: never "", ".", "..", never a "/" or NUL inside one."""
    from verneuil_fuse.reader.paths import display_path

    if not path.startswith("/"):
        path = "/" + path
    for key in (fmt.manifest_name(path, host), fmt.percent_encode(os.fsencode(path))):
        shown = display_path(key)
        if shown is None:
            continue  # not a manifest name: shown (if valid) under /.verneuil/other/<key>
        h, parts = shown
        for name in [h] + parts:
            assert name not in ("", ".", "..") and "/" not in name and "\0" not in name, (key, name)


def test_cache_stays_in_its_directory(tmp_path):
    from verneuil_fuse.reader.cache import ChunkCache

    cache_dir = str(tmp_path / "cache")
    cache = ChunkCache(cache_dir, 1 << 20)
    for i in range(20):
        data = os.urandom(100 + i)
        fp = fmt.chunk_fingerprint(data)
        cache.put(fp, data)
        assert cache.get(fp) == data
    cache.close()
    assert os.listdir(str(tmp_path)) == ["cache"]
    for d, _, files in os.walk(cache_dir):
        for n in files:
            assert os.path.realpath(os.path.join(d, n)).startswith(os.path.realpath(cache_dir) + "/")


# --------------------------------------------------------------------- the mount

fuse_skip = pytest.mark.skipif(bool(fuse_unavailable()), reason=str(fuse_unavailable()))


def _as_nobody(code: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run Python code as uid/gid 65534 with no groups."""
    return subprocess.run(["setpriv", "--reuid=%d" % NOBODY, "--regid=%d" % NOBODY, "--clear-groups",
                           "/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=timeout)


def _probe(mnt: str, file_path: str) -> dict:
    code = (
        "import json, os\n"
        "out = {}\n"
        "def t(name, fn):\n"
        "    try:\n"
        "        r = fn(); out[name] = 'ok' if r is None else r\n"
        "    except OSError as e:\n"
        "        out[name] = 'errno %%d' %% e.errno\n"
        "t('listdir', lambda: len(os.listdir(%r)))\n"
        "t('read', lambda: open(%r, 'rb').read().hex()[:64])\n"
        "t('write', lambda: os.close(os.open(%r, os.O_WRONLY)))\n"
        "t('create', lambda: os.close(os.open(%r + '.new', os.O_WRONLY | os.O_CREAT, 0o644)))\n"
        "print(json.dumps(out))\n" % (mnt, file_path, file_path, file_path))
    out = _as_nobody(code)
    assert out.returncode == 0, out.stderr
    import json
    return json.loads(out.stdout)


@fuse_skip
@pytest.mark.fuse
@pytest.mark.timeout(180)
@pytest.mark.parametrize("allow_other", [False, True])
def test_mount_read_only_and_permissions(allow_other):
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv")
    # A tree other users can reach (pytest's tmp_path is 0700).
    base = tempfile.mkdtemp(prefix="verneuil-sec-", dir="/tmp")
    os.chmod(base, 0o755)
    m = None
    try:
        src = os.path.join(base, "s.db")
        make_db(src, 500, seed=3)
        data = open(src, "rb").read()
        store = open_store("file://" + os.path.join(base, "store"))
        publish(store, data, "/data/s.db")
        store.close()
        opts = "cache_dir=%s,log_file=%s" % (os.path.join(base, "cache"), os.path.join(base, "m.log"))
        if allow_other:
            opts += ",allow_other"
        m = Mount("file://" + os.path.join(base, "store"), os.path.join(base, "mnt"), opts,
                  log_path=os.path.join(base, "mount.out"))
        os.makedirs(m.mountpoint, mode=0o755)
        m.start()
        line = [l for l in open("/proc/self/mountinfo") if " %s " % m.mountpoint in l][0]
        assert " ro," in line or " ro " in line, line
        assert "default_permissions" in line, line
        assert ("allow_other" in line) == allow_other, line
        f = m.path(HOST, "data", "s.db")
        # Root: reads right, writes refused whatever the call.
        assert open(f, "rb").read() == data
        refused = [lambda: os.open(f, os.O_WRONLY), lambda: os.open(f, os.O_RDWR | os.O_TRUNC),
                   lambda: os.open(m.path("x"), os.O_WRONLY | os.O_CREAT, 0o644),
                   lambda: os.truncate(f, 0), lambda: os.chmod(f, 0o666), lambda: os.chown(f, 1, 1),
                   lambda: os.utime(f, (0, 0)), lambda: os.unlink(f), lambda: os.rename(f, f + "2"),
                   lambda: os.link(f, m.path("l")), lambda: os.symlink("/etc/passwd", m.path("s")),
                   lambda: os.mkdir(m.path("d")), lambda: os.rmdir(m.path(HOST)),
                   lambda: os.mknod(m.path("n")), lambda: os.setxattr(f, "user.x", b"1")]
        for op in refused:
            with pytest.raises(OSError) as err:
                op()
            assert err.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTSUP), err.value
        assert open(f, "rb").read() == data
        # Another user.
        got = _probe(m.mountpoint, f)
        if allow_other:
            assert got["listdir"] == 2  # .verneuil and testhost
            assert got["read"] == data[:32].hex()
            assert got["write"] in ("errno %d" % errno.EACCES, "errno %d" % errno.EROFS)
            assert got["create"] in ("errno %d" % errno.EACCES, "errno %d" % errno.EROFS)
        else:
            for what in ("listdir", "read", "write", "create"):
                assert got[what] == "errno %d" % errno.EACCES, got
    finally:
        if m is not None:
            m.stop()
        shutil.rmtree(base, ignore_errors=True)


@fuse_skip
@pytest.mark.fuse
@pytest.mark.timeout(180)
def test_hostile_manifest_names_stay_inside_the_mount(tmp_path):
    """Manifest keys spelling `..`, `/`, NUL, empty and long paths: every
    entry is inside the mount, reads right, and the cache holds only its
    own files."""
    store = open_store("file://%s/store" % tmp_path)
    published = {}
    for host, path in (("..", "/../../../../etc/x.db"), ("h/o", "/a/b.db"), ("h", "/a/\0/c.db"),
                       ("", "/z.db"), ("h", "/" + "d" * 200 + "/" + "e" * 200 + ".db"), ("h", "/x/../y.db")):
        data = b"SQLite format 3\x00" + os.urandom(fmt.CHUNK_SIZE + 100)
        pub = publish(store, data, path, hostname=host)
        published[pub.key] = data
    store.close()
    before = set(os.listdir(str(tmp_path)))
    m = Mount("file://%s/store" % tmp_path, str(tmp_path / "mnt"),
              "cache_dir=%s,log_file=%s" % (tmp_path / "cache", tmp_path / "m.log"))
    m.start()
    try:
        found = {}
        for d, dirs, files in os.walk(m.mountpoint):
            for n in dirs + files:
                assert n not in (".", "..") and "\0" not in n
            for n in files:
                p = os.path.join(d, n)
                if p in (os.path.join(m.mountpoint, ".verneuil", "stats"),
                         os.path.join(m.mountpoint, ".verneuil", "metrics")):
                    continue  # the mount's own files, not replicas
                assert os.path.realpath(p).startswith(m.mountpoint + "/")
                with open(p, "rb") as f:
                    found[p] = f.read()
        assert sorted(found.values()) == sorted(published.values())
    finally:
        m.stop()
    assert set(os.listdir(str(tmp_path))) - before <= {"mnt", "cache", "m.log", "mnt.log"}
    for d, _, files in os.walk(str(tmp_path / "cache")):
        for n in files:
            assert os.path.realpath(os.path.join(d, n)).startswith(str(tmp_path / "cache") + "/")


# ------------------------------------------------------------------- credentials

SECRETS = {
    "AWS_ACCESS_KEY_ID": "AKIAVERNEUILFAKEKEY42",
    "AWS_SECRET_ACCESS_KEY": "vErNeUiLsEcReT/0123456789+abcdefghijKLMNOPq",
    "AWS_SESSION_TOKEN": "VerneuilFakeSessionToken0123456789ThisMustNeverBeLogged",
}
# Pieces of the secrets, so that a truncated or re-encoded leak is found too.
NEEDLES = [v for v in SECRETS.values()] + ["AKIAVERNEUILFAKE", "vErNeUiLsEcReT", "VerneuilFakeSession",
                                           "0123456789ThisMust"]


def _secret_env(extra=None):
    env = dict(os.environ)
    env.pop("VERNEUIL_CONFIG", None)
    env.update(SECRETS)
    env.update(extra or {})
    return env


def _assert_clean(texts: dict[str, str]) -> None:
    for where, text in texts.items():
        for needle in NEEDLES:
            assert needle not in text, "%s leaked into %s" % (needle, where)


def _run(args, env, timeout=90):
    p = subprocess.run(CTL + args, capture_output=True, text=True, env=env, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.s3
@pytest.mark.timeout(300)
@pytest.mark.skipif(not moto_available(), reason="moto[server] is not installed")
def test_credentials_never_logged(s3_server, tmp_path):
    from support.pyspoolwriter import SpoolWriter

    outputs: dict[str, str] = {}
    env = _secret_env()
    # A store that accepts them (moto without auth): everything at its most verbose.
    if not s3_server.running:
        s3_server.start()
    store = s3_server.make_store()
    url = store.url
    spool = str(tmp_path / "spool")
    os.makedirs(spool)
    db = str(tmp_path / "app.db")
    make_db(db, 300, seed=1)
    w = SpoolWriter(spool, db)
    w.snapshot()
    code, outputs["flush -vv"] = _run(["-vv", "flush", "--store", url, "--spool", spool, "--rate", "0"], env)
    assert code == 0, outputs["flush -vv"]
    flushed = store.manifests.get(w.name)
    copier = subprocess.Popen(CTL + ["-vv", "copier", "--store", url, "--spool", spool, "--rate", "0",
                                     "--poll-interval", "0.05"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        with open(db, "r+b") as f:
            f.seek(2 * fmt.CHUNK_SIZE)
            f.write(os.urandom(100))
        w.snapshot()
        # The copier itself ships this snapshot (so it has something to log).
        wait_for(lambda: store.manifests.get(w.name) != flushed, 60, "the copier's upload")
    finally:
        copier.send_signal(signal.SIGTERM)
        try:
            outputs["copier -vv"] = copier.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            copier.kill()
            outputs["copier -vv"] = copier.communicate(timeout=30)[0]
    assert copier.returncode == 0, outputs["copier -vv"]
    for args in (["ls", "--json"], ["manifest", "-s", w.db_path], ["restore", "-s", w.db_path, "-o",
                                                                     str(tmp_path / "r.db")],
                 ["lag", "--spool", spool], ["restore", "-s", "/nope.db", "-o", str(tmp_path / "n.db")]):
        code, out = _run(["-vvv"] + args[:1] + ["--store", url] + args[1:], env)
        outputs[" ".join(args[:1])] = out
    # A spec holding credentials is refused without echoing them.
    code, out = _run(["ls", "--store", "s3://%s:%s@bucket?endpoint=%s" % (
        SECRETS["AWS_ACCESS_KEY_ID"], SECRETS["AWS_SECRET_ACCESS_KEY"], s3_server.endpoint)], env)
    assert code == 2
    outputs["credentials in the URL"] = out
    code, out = _run(["ls", "--store", "s3://b?endpoint=http://%s:%s@127.0.0.1:1" % (
        SECRETS["AWS_ACCESS_KEY_ID"], SECRETS["AWS_SECRET_ACCESS_KEY"])], env)
    assert code == 2
    outputs["credentials in the endpoint"] = out
    # The mount at log_level=debug, reading everything, and its stats file.
    if not fuse_unavailable():
        log = str(tmp_path / "mount-debug.log")
        mnt = str(tmp_path / "mnt")
        os.makedirs(mnt)
        proc = subprocess.Popen([sys.executable, "-m", "verneuil_fuse.cli.mount", url, mnt, "-f", "-o",
                                 "cache_dir=%s,log_level=debug,log_file=%s" % (tmp_path / "cache", log)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            from support.replicas import is_mounted, unmount
            wait_for(lambda: is_mounted(mnt) or proc.poll() is not None, 30, "the mount")
            for d, _, files in os.walk(mnt):
                for n in files:
                    with open(os.path.join(d, n), "rb") as f:
                        content = f.read()
                    if n == "stats":
                        outputs["mount stats"] = content.decode()
        finally:
            from support.replicas import unmount
            unmount(mnt)
            try:
                outputs["mount stdout"] = proc.communicate(timeout=20)[0]
            except subprocess.TimeoutExpired:
                proc.kill()
                outputs["mount stdout"] = proc.communicate(timeout=30)[0]
        outputs["mount debug log"] = open(log).read()
        assert "] DEBUG " in outputs["mount debug log"]  # it really logged at debug level
    store.close()
    # A store that refuses them (moto with auth enforced): the error paths.
    with S3Server(auth=True, log_dir=str(tmp_path)) as refusing:
        bad = refusing.url("chunks", "manifests")
        for args in (["flush", "--spool", spool, "--timeout", "5"], ["ls"], ["restore", "-s", w.db_path,
                                                                             "-o", str(tmp_path / "x.db")]):
            code, out = _run(["-vv"] + args[:1] + ["--store", bad] + args[1:], env)
            assert code != 0, out
            outputs["refused " + args[0]] = out
        p = subprocess.run([sys.executable, "-m", "verneuil_fuse.cli.mount", bad, str(tmp_path)],
                           capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode != 0
        outputs["refused mount"] = p.stdout + p.stderr
    # The verbose runs really logged their uploads, so what was searched for
    # secrets below is their debug output, not an empty string.
    assert "uploaded manifest %s" % w.name in outputs["copier -vv"], outputs["copier -vv"]
    assert "uploaded manifest %s" % w.name in outputs["flush -vv"], outputs["flush -vv"]
    _assert_clean(outputs)
