"""Tests of verneuil_fuse.store: one body per behaviour, run against both the
directory store and a real S3 endpoint (moto's server, see s3server.py)."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verneuil_fuse.store import (
    AccessDenied,
    Backend,
    BucketNotFound,
    ConfigError,
    InvalidKey,
    LocalBackend,
    NotFound,
    ObjectInfo,
    Store,
    StoreError,
    TooLarge,
    TransientError,
    open_store,
    parse_config,
    store_target,
)

CHUNK = "712dc93b96d4ca86%2F25dce0c3a3ad05b2"
MANIFEST = "7cb1-verneuil%3Atest.com%3A80ad%2F%2Ftmp%2Ftest.db"
BAD_KEYS = ["", ".", "..", "a/b", "/abs", "a\0b", "x" * 256, ".tmp-123", "é" * 128]


def s3_only(store: Store) -> bool:
    return not isinstance(store.chunks, LocalBackend)


def wait_past(mtime: float) -> None:
    """Sleep until the clock is past `mtime` by enough for S3's 1 s resolution."""
    delay = mtime + 1.05 - time.time()
    if delay > 0:
        time.sleep(delay)


# -- the Backend contract, on both backends ------------------------------------


def test_backends_satisfy_protocol(any_store):
    assert isinstance(any_store.chunks, Backend)
    assert isinstance(any_store.manifests, Backend)
    for backend in (any_store.chunks, any_store.manifests):
        text = backend.describe()
        assert text and "testing" not in text


def test_round_trip(any_store):
    blob = bytes(range(256)) * 300
    any_store.chunks.put(CHUNK, blob)
    any_store.manifests.put(MANIFEST, b"manifest v1")
    assert any_store.chunks.get(CHUNK) == blob
    assert any_store.manifests.get(MANIFEST) == b"manifest v1"
    # The two backends are separate namespaces.
    assert not any_store.chunks.exists(MANIFEST)
    assert not any_store.manifests.exists(CHUNK)
    any_store.manifests.put(MANIFEST, b"manifest v2")
    assert any_store.manifests.get(MANIFEST) == b"manifest v2"
    any_store.chunks.put("empty", b"")
    assert any_store.chunks.get("empty") == b""


def test_get_range(any_store):
    data = bytes(range(100))
    c = any_store.chunks
    c.put("k", data)
    assert c.get_range("k", 0, 10) == data[:10]
    assert c.get_range("k", 10, 20) == data[10:20]
    assert c.get_range("k", 90, 200) == data[90:]  # short at EOF
    assert c.get_range("k", 99, 100) == data[99:]
    assert c.get_range("k", 100, 110) == b""  # entirely past EOF
    assert c.get_range("k", 500, 600) == b""
    assert c.get_range("k", 5, 5) == b""
    c.put("e", b"")
    assert c.get_range("e", 0, 10) == b""
    with pytest.raises(NotFound):
        c.get_range("missing", 0, 10)
    with pytest.raises(NotFound):
        c.get_range("missing", 3, 3)
    with pytest.raises(ValueError):
        c.get_range("k", 10, 5)
    with pytest.raises(ValueError):
        c.get_range("k", -1, 5)


def test_put_if_absent(any_store):
    c = any_store.chunks
    assert c.put_if_absent(CHUNK, b"first") is True
    assert c.put_if_absent(CHUNK, b"second") is False
    assert c.get(CHUNK) == b"first"
    c.delete(CHUNK)
    assert c.put_if_absent(CHUNK, b"third") is True
    assert c.get(CHUNK) == b"third"


def test_put_if_absent_race(any_store):
    c = any_store.chunks
    results: list[bool] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(6, timeout=30)

    def racer(i: int) -> None:
        try:
            barrier.wait()
            results.append(c.put_if_absent("raced", b"writer %d" % i))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=racer, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, "put_if_absent racers still running after 60 s: %s" % stuck
    assert not errors, errors
    assert sorted(results) == [False] * 5 + [True]
    assert c.get("raced").startswith(b"writer ")


def test_exists_and_delete(any_store):
    c = any_store.chunks
    assert c.exists(CHUNK) is False
    c.put(CHUNK, b"x")
    assert c.exists(CHUNK) is True
    c.delete(CHUNK)
    assert c.exists(CHUNK) is False
    c.delete(CHUNK)  # missing: no error
    c.delete("never-existed")


def test_not_found(any_store):
    for backend in (any_store.chunks, any_store.manifests):
        with pytest.raises(NotFound) as info:
            backend.get("missing")
        assert isinstance(info.value, StoreError)
        assert info.value.key == "missing"
        assert "missing" in str(info.value)
        with pytest.raises(NotFound):
            backend.touch("missing")
        with pytest.raises(NotFound):
            backend.get_version("missing", "null")
        assert backend.list_versions("missing") == []


def test_list_pagination(any_store):
    c = any_store.chunks
    if s3_only(any_store):
        c.page_size = 2  # force several ListObjectsV2 pages
    keys = [f"{i:016x}%2F{i * 7:016x}" for i in range(7)]
    for i, key in enumerate(keys):
        c.put(key, b"z" * i)
    c.put("other", b"other")
    any_store.manifests.put("aaaa-manifest", b"m")  # other namespace
    before = time.time()
    listed = list(c.list("0000"))
    assert sorted(info.key for info in listed) == keys
    assert all(isinstance(info, ObjectInfo) for info in listed)
    assert {info.key: info.size for info in listed} == {k: i for i, k in enumerate(keys)}
    assert all(abs(info.mtime - before) < 120 for info in listed)
    assert sorted(info.key for info in c.list()) == sorted(keys + ["other"])
    assert list(c.list("nothing-has-this-prefix")) == []
    with pytest.raises(InvalidKey):
        list(c.list("a/b"))


def test_list_is_lazy(any_store):
    c = any_store.chunks
    if s3_only(any_store):
        c.page_size = 1
    for i in range(3):
        c.put(f"lazy{i}", b"x")
    it = c.list("lazy")
    first = next(it)
    assert first.key.startswith("lazy")
    assert len([first, *it]) == 3


def test_versions(any_store):
    m = any_store.manifests
    if s3_only(any_store):
        m.page_size = 2  # several ListObjectVersions pages
    for n in range(3):
        m.put(MANIFEST, b"version %d" % n)
    m.put(MANIFEST + "x", b"longer key sharing the prefix")
    versions = m.list_versions(MANIFEST)
    assert versions, "no versions"
    assert all(v.key == MANIFEST for v in versions)
    assert versions[0].is_latest and not any(v.is_latest for v in versions[1:])
    assert m.get_version(MANIFEST, versions[0].version_id) == b"version 2"
    assert versions[0].size == len(b"version 2")
    # Both kinds keep versions: the bucket's, or the directory store's history.
    assert len(versions) == 3  # newest first
    assert [m.get_version(MANIFEST, v.version_id) for v in versions] == [
        b"version 2",
        b"version 1",
        b"version 0",
    ]
    assert len({v.version_id for v in versions}) == 3
    # A deleted key keeps its old versions (behind a delete marker).
    m.delete(MANIFEST)
    assert not m.exists(MANIFEST)
    assert [v.version_id for v in m.list_versions(MANIFEST)] == [v.version_id for v in versions]
    assert not any(v.is_latest for v in m.list_versions(MANIFEST))
    assert m.get_version(MANIFEST, versions[1].version_id) == b"version 1"
    with pytest.raises(NotFound):
        m.get_version(MANIFEST + "x", "no-such-version-id")


def test_unversioned_bucket_versions(any_store):
    c = any_store.chunks  # the chunk bucket is not versioned
    c.put(CHUNK, b"a")
    c.put(CHUNK, b"b")
    versions = c.list_versions(CHUNK)
    assert [(v.version_id, v.is_latest, v.size) for v in versions] == [("null", True, 1)]
    assert c.get_version(CHUNK, "null") == b"b"


# -- bounded reads (max_bytes) --------------------------------------------------


def test_get_max_bytes(any_store):
    c = any_store.chunks
    blob = bytes(range(256)) * 4  # 1024 bytes
    c.put(CHUNK, blob)
    assert c.get(CHUNK, max_bytes=1024) == blob  # at the bound
    assert c.get(CHUNK, max_bytes=1 << 20) == blob
    assert c.get(CHUNK, None) == blob
    with pytest.raises(TooLarge) as e:
        c.get(CHUNK, max_bytes=1023)  # one byte over
    err = e.value
    assert isinstance(err, StoreError) and not isinstance(err, TransientError)
    assert err.key == CHUNK and err.size == 1024 and err.bound == 1023
    assert CHUNK in str(err) and "1024" in str(err) and "1023" in str(err)
    c.put(CHUNK + "0", b"")
    assert c.get(CHUNK + "0", max_bytes=0) == b""
    with pytest.raises(TooLarge):
        c.get(CHUNK, max_bytes=0)
    with pytest.raises(NotFound):
        c.get(CHUNK + "1", max_bytes=10)
    with pytest.raises(ValueError):
        c.get(CHUNK, max_bytes=-1)


def test_get_if_changed(any_store):
    """A conditional read: the blob and its tag, then None while the key
    holds that version (S3: If-None-Match answered 304, on the engine and
    on boto3), then the new blob once it is written again, even with the
    same length; NotFound and max_bytes as for `get`."""
    m = any_store.manifests
    m.put(MANIFEST, b"first version")
    first = m.get_if_changed(MANIFEST, None)
    assert first is not None and first.data == b"first version" and first.tag
    assert m.get_if_changed(MANIFEST, None).tag == first.tag
    assert m.get_if_changed(MANIFEST, first.tag) is None
    assert m.get_if_changed(MANIFEST, first.tag, max_bytes=1) is None  # nothing read, nothing bounded
    m.put(MANIFEST, b"other version")  # same length
    second = m.get_if_changed(MANIFEST, first.tag)
    assert second is not None and second.data == b"other version" and second.tag != first.tag
    assert m.get_if_changed(MANIFEST, second.tag) is None
    assert m.get_if_changed(MANIFEST, "no such tag").data == b"other version"
    with pytest.raises(TooLarge):
        m.get_if_changed(MANIFEST, first.tag, max_bytes=5)
    with pytest.raises(NotFound):
        m.get_if_changed(MANIFEST + "x", None)
    with pytest.raises(NotFound):
        m.get_if_changed(MANIFEST + "x", second.tag)
    if s3_only(any_store):  # the engine path, then boto3's, give the same answers
        assert m._engine_conditional(MANIFEST, second.tag, None) is None
        m.use_engine = False
        assert m.get_if_changed(MANIFEST, second.tag) is None
        third = m.get_if_changed(MANIFEST, first.tag)
        assert third.data == b"other version" and third.tag == second.tag


def test_get_version_max_bytes(any_store):
    m = any_store.manifests
    m.put(MANIFEST, b"old version, longer")
    m.put(MANIFEST, b"new version")
    versions = m.list_versions(MANIFEST)
    latest = versions[0].version_id
    assert m.get_version(MANIFEST, latest, max_bytes=11) == b"new version"
    with pytest.raises(TooLarge) as e:
        m.get_version(MANIFEST, latest, max_bytes=10)
    assert e.value.size == 11 and e.value.bound == 10 and MANIFEST in str(e.value)
    old = versions[1].version_id
    assert m.get_version(MANIFEST, old, max_bytes=19) == b"old version, longer"
    with pytest.raises(TooLarge):
        m.get_version(MANIFEST, old, max_bytes=18)
    with pytest.raises(NotFound):
        m.get_version(MANIFEST, "no-such-version-id", max_bytes=10)


def test_local_get_never_reads_past_the_bound(tmp_path, monkeypatch):
    """A file that grows between fstat and read (here: fstat reports less)
    is still refused, after reading at most max_bytes + 1 bytes."""
    import io

    backend = LocalBackend(tmp_path / "b")
    backend.put(CHUNK, b"x" * 5000)
    real_fstat = os.fstat

    def shrunk(fd):
        st = real_fstat(fd)
        return os.stat_result((*st[:6], 10, *st[7:]))  # st_size = 10

    reads = []
    real_read = io.BufferedReader.read

    class Reader(io.BufferedReader):
        def read(self, n=-1):
            reads.append(n)
            return real_read(self, n)

    monkeypatch.setattr(os, "fstat", shrunk)
    monkeypatch.setattr(  # the module's `open` only
        "verneuil_fuse.store.local.open",
        lambda path, mode, opener: Reader(io.FileIO(path, "r", opener=opener)),
        raising=False,
    )
    with pytest.raises(TooLarge) as e:
        backend.get(CHUNK, max_bytes=100)
    assert e.value.size is None and "more than 100 bytes" in str(e.value)
    assert reads == [101]


def test_local_special_files_refused(tmp_path):
    """A FIFO planted under a key would block a reader forever: refused."""
    backend = LocalBackend(tmp_path / "b")
    os.mkfifo(os.path.join(backend.root, CHUNK))
    outcome = []

    def read():
        try:
            backend.get(CHUNK, max_bytes=100)
        except StoreError as err:
            outcome.append(err)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert outcome and "not a regular file" in str(outcome[0])
    with pytest.raises(StoreError):
        backend.get_range(CHUNK, 0, 10)


def test_s3_get_max_bytes_does_not_read_a_big_object(s3_server):
    """64 MiB behind a 66 KiB bound: refused on Content-Length, the body
    dropped unread (memory and bytes through the proxy stay far below it)."""
    import tracemalloc

    from support.s3server import Proxy

    store = s3_server.make_store()
    size = 64 << 20
    s3_server.admin.put_object(Bucket=store.chunks.bucket, Key=CHUNK, Body=bytes(size))
    before = s3_server.counts()
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(TooLarge) as e:
            store.chunks.get(CHUNK, max_bytes=66560)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    d = Proxy.delta(before, s3_server.counts())
    print("refused a %d-byte object in %.3f s, traced peak %d KiB, %d bytes through the proxy"
          % (size, elapsed, peak >> 10, d["bytes_down"]))
    assert e.value.size == size and e.value.bound == 66560
    assert d["gets"] == 1
    assert peak < 4 << 20
    assert d["bytes_down"] < size // 2
    # The client (its connection dropped) still works.
    store.chunks.put(CHUNK + "0", b"small")
    assert store.chunks.get(CHUNK + "0", max_bytes=5) == b"small"
    store.close()


def test_s3_bounded_read_without_content_length(s3_store):
    """A response without Content-Length (chunked encoding): at most
    max_bytes + 1 bytes are read, then TooLarge."""
    backend = s3_store.chunks
    backend.put(CHUNK, b"y" * 100_000)
    backend.use_engine = False  # boto3's path (the engine's: test_store_engine.py)
    real = backend.client
    reads = []

    class NoLength:
        def get_object(self, **kw):
            response = real.get_object(**kw)
            response.pop("ContentLength", None)
            body = response["Body"]
            real_read = body.read

            def read(amt=None):
                reads.append(amt)
                return real_read(amt)

            body.read = read
            return response

        def __getattr__(self, name):
            return getattr(real, name)

    backend.client = NoLength()
    try:
        with pytest.raises(TooLarge) as e:
            backend.get(CHUNK, max_bytes=1000)
        assert e.value.size is None and reads == [1001]
        assert backend.get(CHUNK, max_bytes=100_000) == b"y" * 100_000
    finally:
        backend.client = real


def test_touch(any_store):
    c = any_store.chunks
    c.put(CHUNK, b"chunk bytes")
    (before,) = list(c.list(CHUNK))
    wait_past(before.mtime)
    c.touch(CHUNK)
    (after,) = list(c.list(CHUNK))
    assert after.mtime > before.mtime
    assert c.get(CHUNK) == b"chunk bytes"


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_invalid_keys_refused(any_store, key):
    c = any_store.chunks
    for call in (
        lambda: c.put(key, b"x"),
        lambda: c.put_if_absent(key, b"x"),
        lambda: c.get(key),
        lambda: c.get_range(key, 0, 1),
        lambda: c.exists(key),
        lambda: c.delete(key),
        lambda: c.touch(key),
        lambda: c.list_versions(key),
        lambda: c.get_version(key, "null"),
    ):
        with pytest.raises(InvalidKey):
            call()


TRICKY_KEYS = ["a b", "a+b", "ü-ñ", "%2F%25%", "~!*'()&=?#", "x" * 255, "é" * 127, "a..b", "a.."]


def test_tricky_keys_round_trip(any_store):
    c = any_store.chunks
    for key in TRICKY_KEYS:
        c.put(key, key.encode())
    for key in TRICKY_KEYS:
        assert c.get(key) == key.encode()
        assert c.exists(key)
    assert sorted(i.key for i in c.list()) == sorted(TRICKY_KEYS)


def test_s3_listing_through_the_engine(s3_store, monkeypatch):
    """S3 listings go through the curl engine (store/listing.py), a page per
    request, and give what boto3's listing gives, to the microsecond."""
    from verneuil_fuse.store.s3 import S3Backend

    c = s3_store.chunks
    c.page_size = 4
    for key in TRICKY_KEYS:
        c.put(key, key.encode())
    twin = S3Backend(c.client, c.bucket, c.prefix, page_size=4, use_engine=False)
    expected = list(twin.list())
    monkeypatch.setattr(c, "_list_page_boto3", None)  # never called: the engine serves every page
    assert list(c.list()) == expected
    assert sorted(i.key for i in expected) == sorted(TRICKY_KEYS)
    assert list(c.list("a")) == [i for i in expected if i.key.startswith("a")]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.text(st.characters(codec="utf-8"), max_size=80))
def test_local_keys_property(tmp_path, key):
    """Every key is either refused with InvalidKey or stored as exactly one
    file directly inside the directory, and listed back unchanged."""
    root = tmp_path / "prop"
    backend = LocalBackend(root)
    try:
        backend.put(key, b"v")
    except InvalidKey:
        assert sorted(os.listdir(tmp_path)) == ["prop"]
        return
    try:
        assert os.listdir(root) == [key]
        assert [i.key for i in backend.list()] == [key]
        assert backend.get(key) == b"v"
    finally:
        backend.delete(key)


def test_invalid_key_type(any_store):
    with pytest.raises(InvalidKey):
        any_store.chunks.get(b"bytes-key")  # type: ignore[arg-type]


# -- directory store specifics -------------------------------------------------


def test_local_layout_and_temp_files(tmp_path):
    store = open_store(str(tmp_path / "s"))
    store.chunks.put(CHUNK, b"c")
    store.manifests.put(MANIFEST, b"m")
    assert (tmp_path / "s" / "chunks" / CHUNK).read_bytes() == b"c"
    assert (tmp_path / "s" / "manifests" / MANIFEST).read_bytes() == b"m"
    assert store.chunks.put_if_absent(CHUNK, b"again") is False
    # No temporary file survives a write, successful or not.
    assert sorted(os.listdir(tmp_path / "s" / "chunks")) == [CHUNK]
    # Listings skip temp files, directories and other non-keys.
    (tmp_path / "s" / "chunks" / ".tmp-999-deadbeef").write_bytes(b"partial")
    (tmp_path / "s" / "chunks" / "subdir").mkdir()
    assert [i.key for i in store.chunks.list()] == [CHUNK]
    # Nothing outside the store was touched by the refused keys.
    assert sorted(os.listdir(tmp_path)) == ["s"]


def test_local_no_hard_links_fallback(tmp_path, monkeypatch):
    backend = LocalBackend(tmp_path / "b")

    def no_link(src, dst):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    assert backend.put_if_absent("k", b"one") is True
    assert backend.put_if_absent("k", b"two") is False
    assert backend.get("k") == b"one"
    assert os.listdir(tmp_path / "b") == ["k"]


def test_local_recreates_directory(tmp_path):
    backend = LocalBackend(tmp_path / "gone")
    os.rmdir(tmp_path / "gone")
    backend.put("k", b"v")
    assert backend.get("k") == b"v"


NOBODY = 65534
# As in test_security: the interpreter uid 65534 runs (the test's own may live
# under a directory only root can read, /root/.pyenv say).
SYSTEM_PYTHON = "/usr/bin/python3"

# Run as an unprivileged user (root ignores permissions): the two refusals.
_DENIED_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[2])
try:
    from verneuil_fuse.store import AccessDenied, LocalBackend
except Exception as e:  # the checkout is not readable by this user, say
    print(json.dumps({"skip": "cannot import the store as uid 65534: %s" % e}))
    sys.exit(0)
backend = LocalBackend(sys.argv[1], create=False)
out = {}
for name, op in (("put", lambda: backend.put("k2", b"v")), ("get", lambda: backend.get("k"))):
    try:
        op()
        out[name] = "succeeded"
    except AccessDenied as e:
        out[name] = "AccessDenied: %s" % e
    except Exception as e:
        out[name] = "%s: %s" % (type(e).__name__, e)
print(json.dumps(out))
"""


def test_local_access_denied(tmp_path):
    """A directory we may not write to and a blob we may not read are
    refused with AccessDenied (not NotFound, not a bare OSError).  Root
    ignores permissions, so as root the two operations run in a process as
    uid/gid 65534 with no groups (`setpriv`): the refusals are the kernel's."""
    import shutil
    import subprocess
    import tempfile

    if os.geteuid() != 0:
        root = str(tmp_path / "ro")
        backend = LocalBackend(root)
        backend.put("k", b"v")
        os.chmod(os.path.join(root, "k"), 0)
        os.chmod(root, 0o500)
        try:
            with pytest.raises(AccessDenied):
                backend.put("k2", b"v")
            with pytest.raises(AccessDenied):
                backend.get("k")
        finally:
            os.chmod(root, 0o700)
            os.chmod(os.path.join(root, "k"), 0o600)
        assert os.listdir(root) == ["k"]
        return
    if shutil.which("setpriv") is None or not os.path.exists(SYSTEM_PYTHON):
        pytest.skip("running as root, without setpriv or %s to drop privileges" % SYSTEM_PYTHON)
    # A tree uid 65534 can walk into (pytest's tmp_path is 0700).
    base = tempfile.mkdtemp(prefix="verneuil-store-denied-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        root = os.path.join(base, "ro")
        backend = LocalBackend(root)
        backend.put("k", b"v")
        os.chmod(root, 0o755)                      # others may look, not write
        os.chmod(os.path.join(root, "k"), 0o600)   # nor read the blob
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        proc = subprocess.run(["setpriv", "--reuid=%d" % NOBODY, "--regid=%d" % NOBODY,
                               "--clear-groups", SYSTEM_PYTHON, "-c", _DENIED_PROBE, root, repo],
                              capture_output=True, text=True, timeout=60, cwd=base)
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        if "skip" in got:
            pytest.skip(got["skip"])
        assert got["put"].startswith("AccessDenied: ") and "Permission denied" in got["put"], got
        assert got["get"].startswith("AccessDenied: ") and "Permission denied" in got["get"], got
        # Nothing was written, and the blob is intact.
        assert os.listdir(root) == ["k"]
        assert backend.get("k") == b"v"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_local_transient_errors(tmp_path, monkeypatch):
    import errno

    backend = LocalBackend(tmp_path / "full")

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LocalBackend, "_write_new", disk_full)
    with pytest.raises(TransientError, match="No space"):
        backend.put("k", b"v")


# -- missing buckets, credentials, outages -------------------------------------


@pytest.fixture(params=["local", "s3"])
def missing_bucket_store(request, tmp_path):
    if request.param == "local":
        store = open_store(f"file://{tmp_path}/nowhere?create=false")
    else:
        server = request.getfixturevalue("s3_server")
        store = open_store(server.url("no-such-chunks", "no-such-manifests"))
    yield store
    store.close()


def test_missing_bucket(missing_bucket_store):
    for backend in (missing_bucket_store.chunks, missing_bucket_store.manifests):
        for call in (
            lambda: backend.get("k"),
            lambda: backend.get_range("k", 0, 5),
            lambda: backend.put("k", b"x"),
            lambda: backend.put_if_absent("k", b"x"),
            lambda: backend.exists("k"),
            lambda: backend.delete("k"),
            lambda: list(backend.list()),
            lambda: backend.list_versions("k"),
            lambda: backend.touch("k"),
        ):
            with pytest.raises(BucketNotFound):
                call()


def test_create_buckets_on_demand(s3_server):
    chunks, manifests = f"ondemand-c-{os.getpid()}", f"ondemand-m-{os.getpid()}"
    store = open_store(s3_server.url(chunks, manifests, create_buckets_on_demand="true"))
    with store:
        assert "create_buckets_on_demand=true" in store.url
        store.chunks.put(CHUNK, b"c")
        store.manifests.put(MANIFEST, b"m1")
        store.manifests.put(MANIFEST, b"m2")
        assert store.chunks.get(CHUNK) == b"c"
        assert len(store.manifests.list_versions(MANIFEST)) == 2  # versioned


def test_single_bucket_store(s3_server):
    store = s3_server.make_store(single_bucket=True)
    with store:
        assert store.chunks.bucket == store.manifests.bucket
        assert (store.chunks.prefix, store.manifests.prefix) == ("chunks/", "manifests/")
        store.chunks.put(CHUNK, b"c")
        store.manifests.put(MANIFEST, b"m")
        assert [i.key for i in store.chunks.list()] == [CHUNK]
        assert [i.key for i in store.manifests.list()] == [MANIFEST]
        keys = sorted(
            o["Key"] for o in s3_server.admin.list_objects_v2(Bucket=store.chunks.bucket)["Contents"]
        )
        assert keys == [f"chunks/{CHUNK}", f"manifests/{MANIFEST}"]
        again = open_store(store.url)
        assert again.manifests.get(MANIFEST) == b"m"
        again.close()


@pytest.mark.s3
def test_bad_credentials(aws_env, monkeypatch, tmp_path):
    from support.s3server import S3Server, moto_available

    if not moto_available():
        pytest.skip("moto[server] is not installed")

    access, secret = "AKIAEXAMPLESECRETID9", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYSECRETKEY"
    with S3Server(auth=True, log_dir=str(tmp_path)) as server:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", access)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        store = open_store(server.url("some-chunks", "some-manifests"))
        with store:
            for call in (
                lambda: store.chunks.get(CHUNK),
                lambda: store.chunks.exists(CHUNK),
                lambda: store.chunks.put(CHUNK, b"x"),
                lambda: list(store.manifests.list()),
            ):
                with pytest.raises(AccessDenied) as info:
                    call()
                assert access not in str(info.value) and secret not in str(info.value)


def test_no_credentials(s3_server, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    store = s3_server.make_store()
    with store, pytest.raises(AccessDenied, match="credentials"):
        store.chunks.get(CHUNK)


def test_endpoint_down_is_transient(s3_server):
    store = s3_server.make_store()
    with store:
        store.chunks.put(CHUNK, b"kept")
        store.manifests.put(MANIFEST, b"m")
        s3_server.stop()
        try:
            for call in (
                lambda: store.chunks.get(CHUNK),
                lambda: store.chunks.put("k", b"x"),
                lambda: store.manifests.exists(MANIFEST),
                lambda: list(store.chunks.list()),
            ):
                started = time.monotonic()
                with pytest.raises(TransientError) as info:
                    call()
                assert time.monotonic() - started < 10, "outage not detected quickly"
                assert "testing" not in str(info.value)
        finally:
            s3_server.start()
        assert store.chunks.get(CHUNK) == b"kept"  # same buckets after the outage


def test_unreachable_endpoint(aws_env):
    from support.s3server import free_port

    store = open_store(f"s3://chunks?manifest_bucket=manifests&endpoint=http://127.0.0.1:{free_port()}")
    with store:
        started = time.monotonic()
        with pytest.raises(TransientError, match="cannot reach"):
            store.chunks.get(CHUNK)
        assert time.monotonic() - started < 10


def test_shared_client_config(s3_store):
    from verneuil_fuse.store import s3

    assert s3_store.chunks.client is s3_store.manifests.client
    config = s3_store.chunks.client.meta.config
    assert config.max_pool_connections == s3.MAX_POOL_CONNECTIONS
    assert config.retries["total_max_attempts"] == s3.MAX_ATTEMPTS
    assert (config.connect_timeout, config.read_timeout) == (s3.CONNECT_TIMEOUT, s3.READ_TIMEOUT)


# -- open_store / parse_config -------------------------------------------------


def test_open_store_file_forms(tmp_path, monkeypatch):
    root = str(tmp_path / "d")
    config_file = tmp_path / "config.json"
    config = {
        "replication_spooling_dir": "/tmp/spool",
        "replication_targets": [
            {"local": {"directory": "/tmp/cache", "num_shards": 10, "capacity": 100}},
            {"directory": {"path": root}},
        ],
    }
    config_file.write_text(json.dumps(config))
    monkeypatch.setenv("VERNEUIL_CONFIG", f"@{config_file}")
    specs = [
        f"file://{root}",
        f"file://localhost{root}",
        root,
        root + "/",
        f"@{config_file}",
        json.dumps(config),
        config,
        {"directory": {"path": root}},
        None,
    ]
    for spec in specs:
        store = open_store(spec)
        assert isinstance(store.chunks, LocalBackend), spec
        assert store.chunks.root == os.path.join(root, "chunks")
        assert store.manifests.root == os.path.join(root, "manifests")
        assert store.url == f"file://{root}"
    assert parse_config(None)["replication_spooling_dir"] == "/tmp/spool"
    assert parse_config(f"@{config_file}") == config
    assert parse_config(root) == {"replication_targets": [{"directory": {"path": root}}]}
    # A path with characters URLs must escape survives the round trip.
    odd = str(tmp_path / "with space%and#hash")
    store = open_store(odd)
    store.chunks.put("k", b"v")
    assert open_store(store.url).chunks.get("k") == b"v"
    assert not os.path.exists(tmp_path / "x" / "chunks")
    store = open_store(f"file://{tmp_path}/x?create=false")
    assert not os.path.exists(tmp_path / "x")


def test_open_store_s3_forms(aws_env, monkeypatch):
    url = "s3://cb?manifest_bucket=mb&endpoint=http://127.0.0.1:9000&region=us-east-1&addressing=path"
    verneuil = {
        "replication_targets": [
            {
                "s3": {
                    "region": "minio",
                    "endpoint": "http://127.0.0.1:7777",
                    "chunk_bucket": "chunks",
                    "manifest_bucket": "manifests",
                    "domain_addressing": True,
                    "create_buckets_on_demand": False,
                }
            }
        ]
    }
    store = open_store(url)
    assert (store.chunks.bucket, store.chunks.prefix) == ("cb", "")
    assert (store.manifests.bucket, store.manifests.prefix) == ("mb", "")
    assert store.chunks.client.meta.config.s3["addressing_style"] == "path"
    assert store.chunks.client.meta.region_name == "us-east-1"
    assert "s3://cb/" in store.chunks.describe() and "127.0.0.1:9000" in store.chunks.describe()
    again = open_store(store.url)
    assert store_target(parse_config(store.url)) == store_target(parse_config(url))
    again.close()
    store.close()

    for spec in (verneuil, json.dumps(verneuil), verneuil["replication_targets"][0]):
        store = open_store(spec)
        assert (store.chunks.bucket, store.manifests.bucket) == ("chunks", "manifests")
        assert store.chunks.client.meta.config.s3["addressing_style"] == "virtual"
        assert store.chunks.client.meta.region_name == "minio"
        assert "addressing=domain" in store.url and "region=minio" in store.url
        store.close()
    monkeypatch.setenv("VERNEUIL_CONFIG", json.dumps(verneuil))
    assert open_store(None).manifests.bucket == "manifests"

    single = store_target(parse_config("s3://one"))
    assert (single["chunk_bucket"], single["manifest_bucket"]) == ("one", "one")
    assert (single["chunk_prefix"], single["manifest_prefix"]) == ("chunks/", "manifests/")
    assert single["addressing"] == "auto" and single["endpoint"] is None
    custom = store_target(
        parse_config("s3://one?manifest_bucket=one&chunk_prefix=c/&manifest_prefix=m/&addressing=domain")
    )
    assert (custom["chunk_prefix"], custom["manifest_prefix"], custom["addressing"]) == (
        "c/",
        "m/",
        "virtual",
    )
    assert store_target(parse_config(target_url_of(custom))) == custom


def test_layout_in_urls_and_configs(tmp_path):
    """`layout=packed` in a file:// or s3:// URL and in a target of
    VERNEUIL_CONFIG; chunks (Verneuil's) by default, and then absent from
    the canonical URL."""
    d = str(tmp_path / "st")
    for spec in ("file://%s?layout=packed" % d, {"directory": {"path": d, "layout": "packed"}},
                 {"replication_targets": [{"local": {"directory": "/c"}},
                                          {"directory": {"path": d, "layout": "packed"}}]}):
        store = open_store(spec)
        assert store.layout == "packed" and store.url == "file://%s?layout=packed" % d
        assert open_store(store.url).layout == "packed"
    plain = open_store("file://%s" % d)
    assert plain.layout == "chunks" and "layout=" not in plain.url
    assert open_store("file://%s?layout=chunks" % d).url == plain.url
    target = store_target(parse_config("s3://c?manifest_bucket=m&layout=packed"))
    assert target["layout"] == "packed" and "layout=packed" in target_url_of(target)
    assert store_target(parse_config({"s3": {"chunk_bucket": "c", "layout": "packed"}}))["layout"] == "packed"
    assert store_target(parse_config("s3://c"))["layout"] == "chunks"


def target_url_of(target):
    from verneuil_fuse.store import target_url

    return target_url(target)


BAD_SPECS = [
    ("", "empty"),
    ("   ", "empty"),
    ("relative/dir", "not a store"),
    ("http://example.com/x", "not a store"),
    ("file://host/dir", "host"),
    ("file:relative", "absolute"),
    ("file:///d?create=maybe", "true or false"),
    ("file:///d?bogus=1", "unknown file URL parameter"),
    ("s3://", "needs a bucket"),
    ("s3://b/some/path", "path must be empty"),
    ("s3://b?region=us-east-1&region=eu-west-1", "twice"),
    ("s3://b?endpoint=ftp://x", "http"),
    ("s3://b?endpoint=", "empty"),
    ("s3://b?addressing=sideways", "addressing"),
    ("s3://b?colour=blue", "unknown s3 URL parameter"),
    ("s3://b?layout=zip", "layout must be chunks or packed"),
    ("file:///d?layout=", "layout must be chunks or packed"),
    ({"directory": {"path": "/d", "layout": 1}}, "layout must be chunks or packed"),
    ("s3://b?chunk_prefix=x/&manifest_prefix=x/", "share"),
    ("@/nonexistent/config.json", "cannot read"),
    ("@", "followed by"),
    ("{not json", "invalid JSON"),
    ("[1, 2]", "not a store"),
    ({"replication_targets": "s3"}, "must be a list"),
    ({"replication_spooling_dir": "/x"}, "no replication_targets"),
    ({"replication_targets": []}, "no s3 or directory"),
    ({"replication_targets": [{"local": {"directory": "/c"}}]}, "chunk caches"),
    ({"replication_targets": [{"ftp": {}}]}, "unknown target kind"),
    ({"replication_targets": [{"s3": {"manifest_bucket": "m"}}]}, "chunk_bucket is required"),
    ({"replication_targets": [{"s3": {"chunk_bucket": 5}}]}, "non-empty string"),
    ({"s3": {"chunk_bucket": "c", "domain_addressing": "perhaps"}}, "true or false"),
    ({"directory": {"path": "relative"}}, "absolute"),
    ({"directory": {}}, "path is required"),
    ({"directory": "/x"}, "must be an object"),
    (42, "must be a string or a dict"),
]


@pytest.mark.parametrize("spec,message", BAD_SPECS, ids=[repr(s)[:40] for s, _ in BAD_SPECS])
def test_bad_specs(spec, message):
    with pytest.raises(ConfigError, match=message) as info:
        open_store(spec)
    assert "\n" not in str(info.value)


def test_credentials_never_echoed(monkeypatch):
    secret = "SuperSecretValue123"
    for spec in (
        f"s3://AKIAID:{secret}@bucket",
        f"s3://bucket?endpoint=http://user:{secret}@host:9000",
        {"s3": {"chunk_bucket": "b", "endpoint": f"https://u:{secret}@h"}},
    ):
        with pytest.raises(ConfigError, match="credentials") as info:
            open_store(spec)
        assert secret not in str(info.value)


def test_env_var_unset(monkeypatch):
    monkeypatch.delenv("VERNEUIL_CONFIG", raising=False)
    with pytest.raises(ConfigError, match="VERNEUIL_CONFIG"):
        open_store(None)
    monkeypatch.setenv("VERNEUIL_CONFIG", "{bad")
    with pytest.raises(ConfigError, match="VERNEUIL_CONFIG"):
        open_store()


def test_proxy_counts_requests(s3_server):
    """The test proxy's meter (the benchmarks count GETs with it)."""
    from support.s3server import Proxy, classify

    assert classify(b"GET /bucket/some/key HTTP/1.1\r\nHost: x\r\n") == "GET"
    assert classify(b"GET /bucket?list-type=2 HTTP/1.1\r\n") == "LIST"
    assert classify(b"PUT /bucket/key HTTP/1.1\r\n") == "PUT"
    assert classify(b"\x28\xb5\x2f\xfd body bytes") is None
    store = s3_server.make_store()
    before = s3_server.counts()
    store.chunks.put("a" * 32, b"x" * 1000)
    assert store.chunks.get("a" * 32) == b"x" * 1000
    assert list(store.chunks.list("")) != []
    d = Proxy.delta(before, s3_server.counts())
    assert d["gets"] == 1 and d["puts"] == 1 and d["lists"] >= 1
    assert d["bytes_up"] > 1000 and d["bytes_down"] > 1000
