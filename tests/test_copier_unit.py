"""Copier mechanics on hand-built spools and a directory store (fast)."""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import threading
import time
import uuid

import pytest

from verneuil_fuse import format as fmt
from support.pyspoolwriter import SpoolWriter
from verneuil_fuse.copier import Backoff, Copier, NotASpool, Stopped, TokenBucket
from verneuil_fuse.readback import fetch_manifest, restore_bytes
from verneuil_fuse.copier import spool as sp
from verneuil_fuse.copier.pacing import RecentSet, retry
from verneuil_fuse.store import TransientError, open_store


# -- pacing -------------------------------------------------------------------

class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_token_bucket_rate_and_burst():
    clock = FakeClock()
    b = TokenBucket(30, 100, clock=clock)
    assert all(b.try_acquire() == 0 for _ in range(100))
    wait = b.try_acquire()
    assert wait == pytest.approx(1 / 30)
    clock.t += 1.0
    assert sum(1 for _ in range(100) if b.try_acquire() == 0) == 30
    assert TokenBucket(0).try_acquire() == 0  # unpaced


def test_token_bucket_real_pace():
    b = TokenBucket(200, 5)
    start = time.monotonic()
    for _ in range(45):
        b.acquire()
    assert time.monotonic() - start >= 0.18  # 40 tokens past the burst at 200/s


def test_retry_transient_then_success_and_bounded():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise TransientError("boom")
        return "ok"

    assert retry(flaky, transient=(TransientError,), backoff=Backoff(0.001, 0.01, 5)) == "ok"
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(TransientError):
        retry(lambda: calls.append(1) or (_ for _ in ()).throw(TransientError("x")),
              transient=(TransientError,), backoff=Backoff(0.001, 0.01, 4))
    assert len(calls) == 4
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        retry(lambda: (_ for _ in ()).throw(TransientError("x")), transient=(TransientError,),
              backoff=Backoff(1, 1, 5), stop=stop)


def test_recent_set_is_bounded_and_expires():
    clock = FakeClock()
    r = RecentSet(3, max_age=10, clock=clock)
    for k in "abcd":
        r.add(k)
    assert "a" not in r and len(r) == 3
    assert "b" in r  # refreshes b
    r.add("e")
    assert "c" not in r and "b" in r
    clock.t += 11
    assert "b" not in r


# -- spool fixtures ----------------------------------------------------------------

@pytest.fixture
def env(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    store = open_store("file://%s/store" % tmp_path)
    db = tmp_path / "db.bin"
    db.write_bytes(os.urandom(5 * 65536 + 1000))
    w = SpoolWriter(str(spool), str(db))
    yield tmp_path, str(spool), store, db, w
    store.close()


@pytest.fixture
def env_any(tmp_path, any_store):
    """`env` on a directory store and on S3 (moto): unpaced, the S3
    copier uploads chunks on the store's HTTP engine (`put_async`)."""
    spool = tmp_path / "spool"
    spool.mkdir()
    db = tmp_path / "db.bin"
    db.write_bytes(os.urandom(5 * 65536 + 1000))
    w = SpoolWriter(str(spool), str(db))
    yield tmp_path, str(spool), any_store, db, w


def rewrite(db, chunk: int) -> None:
    data = bytearray(db.read_bytes())
    data[chunk * 65536:chunk * 65536 + 16] = os.urandom(16)
    db.write_bytes(bytes(data))


_copiers: list[Copier] = []


@pytest.fixture(autouse=True)
def close_copiers():
    """Every copier a test makes (through `copier`) is closed after it,
    passed or failed: no worker threads are left idling."""
    try:
        yield
    finally:
        while _copiers:
            _copiers.pop().close()


def copier(spool, store, **kw):
    kw.setdefault("rate", 0)
    kw.setdefault("lock_timeout", 1.0)
    c = Copier(spool, store, **kw)
    _copiers.append(c)
    return c


def restored(store, w) -> bytes:
    return restore_bytes(store, fetch_manifest(store, w.name))


def test_ready_then_staging_round_trip(env_any):
    tmp, spool, store, db, w = env_any
    on_engine = []
    puts = store.chunks.capabilities().async_puts
    put_async = puts.put_async if puts is not None else None
    if put_async is not None:  # S3: an unpaced copier's chunk PUTs go on the engine

        def counted(key, data, done):
            on_engine.append(key)
            return put_async(key, data, done)

        store.chunks.put_async = counted
    w.snapshot()
    c = copier(spool, store)
    assert c.run_once() is False
    assert restored(store, w) == db.read_bytes()
    if put_async is not None:
        assert len(on_engine) == c.stats.chunks_uploaded > 0
    # ready was consumed, staging chunks uploaded, nothing left behind
    assert not os.path.exists(w.db.sub("ready")) and not os.path.exists(w.db.sub("consuming"))
    assert os.listdir(w.db.sub("staging", "chunks")) == []
    for i in (1, 3):
        rewrite(db, i)
        w.snapshot()
    c.run_once()
    assert restored(store, w) == db.read_bytes()


def test_staged_manifest_uploaded_once(env):
    tmp, spool, store, db, w = env
    w.snapshot()
    c = copier(spool, store)
    c.run_once()
    uploads = c.stats.manifests_uploaded
    requests = c.stats.requests
    for _ in range(5):
        c.run_once()
    assert c.stats.manifests_uploaded == uploads and c.stats.requests == requests
    # a fresh copier (another process) checks the store once and skips it
    c2 = copier(spool, store)
    c2.run_once()
    c2.run_once()
    assert c2.stats.manifests_uploaded == 0 and c2.stats.manifests_skipped == 1
    assert c2.stats.requests == 1


def test_seqlock_waits_for_staged_chunks_and_ready(env):
    tmp, spool, store, db, w = env
    w.snapshot()
    c = copier(spool, store)
    c.run_once()
    first = db.read_bytes()
    assert restored(store, w) == first
    rewrite(db, 2)
    w.snapshot()  # new ready + staged
    name = w.name
    staged = fmt.decode_and_validate(open(w.db.sub("staging", "meta", name), "rb").read())
    assert staged != fmt.decode_and_validate(store.manifests.get(name))
    ready = w.db.sub("ready")
    snap = os.listdir(ready)[0]
    # Upload staging only while ready exists: the staged manifest must wait,
    # and the store still serves the first snapshot.
    assert not c._sync_staged_manifest(w.db, w.db.sub("staging", "meta"), name, 0)
    assert fmt.decode_and_validate(store.manifests.get(name)) != staged
    assert restored(store, w) == first
    assert os.path.isdir(os.path.join(ready, snap))
    c.run_once()
    assert fmt.decode_and_validate(store.manifests.get(name)) == staged
    assert restored(store, w) == db.read_bytes() != first


def test_staging_chunks_are_uploaded_before_manifest(env):
    tmp, spool, store, db, w = env
    w.snapshot()
    c = copier(spool, store)
    c.run_once()
    rewrite(db, 4)
    w.snapshot()
    shutil.rmtree(w.db.sub("ready"))  # consumed elsewhere (without upload!)
    # The new chunk is only in staging/chunks (the writer deleted its copy in
    # staging when it published ready; put it back as if ready had failed).
    m = fmt.decode_and_validate(open(w.db.sub("staging", "meta", w.name), "rb").read())
    data = db.read_bytes()
    fp = m.chunks[4]
    path = w.db.sub("staging", "chunks", fp.name)
    with open(path, "wb") as f:
        f.write(data[4 * 65536:5 * 65536])
    c.run_once()
    assert store.chunks.exists(fp.name)
    assert restored(store, w) == data


def test_chunk_restaged_while_read_is_not_dead_lettered(env, monkeypatch):
    """A staged chunk can vanish between a copier's listing and its open (an
    upload by another copier, the writer's GC) and be staged again before
    the copier looks why the open failed: that new copy is a live chunk, not
    junk. It stays in staging, is sent at the next pass, and the manifest
    naming it goes only after it."""
    tmp, spool, store, db, w = env
    w.snapshot()                     # the first snapshot goes to `ready`
    rewrite(db, 2)
    w.snapshot()                     # `ready` is busy: this one stays staged
    fp = fmt.decode_and_validate(open(w.db.sub("staging", "meta", w.name), "rb").read()).chunks[2]
    victim = w.db.sub("staging", "chunks", fp.name)
    assert os.path.exists(victim)
    real_read = sp.read_regular
    raced = []

    def read_after_the_race(path, limit=-1):
        if path == victim and not raced:
            raced.append(path)       # open() lost the race; the new copy is there
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return real_read(path, limit)

    monkeypatch.setattr(sp, "read_regular", read_after_the_race)
    c = copier(spool, store)
    c.run_once()
    assert raced and os.path.exists(victim)
    assert not os.path.exists(os.path.join(w.db.root, "dead-letter"))
    assert not store.chunks.exists(fp.name)
    assert fmt.decode_and_validate(store.manifests.get(w.name)).chunks[2] != fp  # the first one
    c.run_once()
    assert store.chunks.exists(fp.name) and not os.path.exists(victim)
    assert restored(store, w) == db.read_bytes()


def test_leftover_consuming_is_finished_and_busy_one_left(env):
    tmp, spool, store, db, w = env
    w.snapshot()
    os.rename(w.db.sub("ready"), w.db.sub("consuming"))  # a copier died here
    snap = os.listdir(w.db.sub("consuming"))[0]
    # A live consumer holds the snapshot's flock: leave it alone.
    fd = os.open(w.db.sub("consuming", snap), os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    c = copier(spool, store)
    assert c.run_once() is True  # still pending
    assert os.path.isdir(w.db.sub("consuming", snap))
    assert not store.manifests.exists(w.name)
    os.close(fd)  # the consumer died
    assert c.run_once() is False
    assert not os.path.exists(w.db.sub("consuming"))
    assert restored(store, w) == db.read_bytes()


@pytest.mark.parametrize("kind", ["dangling", "to-a-directory", "file"])
def test_a_consuming_that_is_not_a_directory_is_moved_aside(env, kind):
    """Junk named `consuming` (a symlink, dangling or to a directory, or a
    file) is dead-lettered, never followed; the ready snapshot then goes up."""
    tmp, spool, store, db, w = env
    w.snapshot()
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not the copier's")
    cons = w.db.sub("consuming")
    if kind == "dangling":
        os.symlink(str(tmp / "nothing-here"), cons)
    elif kind == "to-a-directory":
        os.symlink(str(elsewhere), cons)
    else:
        open(cons, "w").close()
    c = copier(spool, store)
    c.flush(10)
    assert not os.path.lexists(cons) and not os.path.exists(w.db.sub("ready"))
    assert restored(store, w) == db.read_bytes()
    assert os.listdir(elsewhere) == ["keep.txt"]
    dead = os.listdir(os.path.join(w.db.root, sp.DEAD_LETTER))
    assert any(name.startswith("%s.consuming-file." % w.db.name) for name in dead), dead


def test_unexpected_files_are_dead_lettered(env_any):
    tmp, spool, store, db, w = env_any
    w.snapshot()
    ready = w.db.sub("ready")
    snap = os.listdir(ready)[0]
    open(os.path.join(ready, snap, "chunks", "not-a-chunk"), "w").close()
    os.mkdir(os.path.join(ready, snap, "extra"))
    open(os.path.join(ready, "junk"), "w").close()
    c = copier(spool, store)
    c.flush(5)
    dead = os.listdir(os.path.join(w.db.root, "dead-letter"))
    assert len(dead) == 3, dead
    assert c.stats.dead_letters == 3
    assert restored(store, w) == db.read_bytes()


def test_mismatched_chunk_blocks_its_manifest(env_any):
    tmp, spool, store, db, w = env_any
    w.snapshot()
    ready = w.db.sub("ready")
    snap = os.listdir(ready)[0]
    chunks = os.path.join(ready, snap, "chunks")
    victim = sorted(os.listdir(chunks))[0]
    os.chmod(os.path.join(chunks, victim), 0o644)
    with open(os.path.join(chunks, victim), "r+b") as f:
        f.write(b"corrupt!")
    # Also drop the staged manifest, so that only the ready one could be
    # uploaded (staging/chunks is empty: the writer moved them to ready).
    os.unlink(w.db.sub("staging", "meta", w.name))
    assert os.listdir(w.db.sub("staging", "chunks")) == []
    c = copier(spool, store)
    c.run_once()
    assert not store.manifests.exists(w.name)
    assert not store.chunks.exists(victim)
    dead = os.listdir(os.path.join(w.db.root, "dead-letter"))
    assert any("mismatch" in d for d in dead) and any("manifest" in d for d in dead)


def test_invalid_staged_manifest_is_skipped_not_deleted(env):
    tmp, spool, store, db, w = env
    meta = w.db.sub("staging", "meta", w.name)
    os.makedirs(os.path.dirname(meta), exist_ok=True)
    with open(meta, "wb") as f:
        f.write(b"\x0a\x03garbage")
    c = copier(spool, store)
    c.run_once()
    c.run_once()
    assert os.path.exists(meta)
    assert not store.manifests.exists(w.name)
    assert c.db_pending(w.db) is False


def test_recent_chunks_are_not_sent_again(env):
    tmp, spool, store, db, w = env
    w.snapshot()
    c = copier(spool, store)
    c.run_once()
    sent = c.stats.chunks_uploaded
    # The writer stages the same chunk again (e.g. after a full rebuild).
    m = fmt.decode_and_validate(open(w.db.sub("staging", "meta", w.name), "rb").read())
    data = db.read_bytes()
    with open(w.db.sub("staging", "chunks", m.chunks[1].name), "wb") as f:
        f.write(data[65536:131072])
    c.run_once()
    assert c.stats.chunks_uploaded == sent and c.stats.chunks_skipped == 1
    assert os.listdir(w.db.sub("staging", "chunks")) == []


def test_transient_errors_are_retried(env):
    tmp, spool, store, db, w = env
    w.snapshot()
    real_put = store.chunks.put
    failures = {"n": 0}

    def flaky_put(key, data):
        if failures["n"] < 3:
            failures["n"] += 1
            raise TransientError("503 SlowDown")
        return real_put(key, data)

    store.chunks.put = flaky_put
    c = copier(spool, store, workers=1, backoff=Backoff(0.001, 0.01, 6))
    c.run_once()
    assert failures["n"] == 3
    assert restored(store, w) == db.read_bytes()


def test_touch_about_once_a_day(env):
    tmp, spool, store, db, w = env
    w.bundle = (4,)  # a b-tree top: bundled, and uploaded and touched like any chunk
    w.snapshot()
    c = copier(spool, store, touch_interval=3600)
    c.run_once()
    touched = w.db.sub(sp.TOUCHED_FILE)
    assert os.path.exists(touched) and c.stats.touches == 0  # fresh spool: no touch
    old = time.time() - 7200
    for name in os.listdir(os.path.join(tmp, "store", "chunks")):
        os.utime(os.path.join(tmp, "store", "chunks", name), (old, old))
    os.utime(touched, (old, old))
    c.recent = type(c.recent)(16)  # forget uploads, as a long-running copier would
    rewrite(db, 2)
    w.snapshot()
    c.run_once()
    c.run_once()
    m = fetch_manifest(store, w.name)
    assert set(m.bundled) == {0, 4}
    live = {fp.name for i, fp in enumerate(m.chunks) if i != 0}
    assert c.stats.touches + c.stats.chunks_uploaded >= len(live)
    for name in live:
        assert os.stat(os.path.join(tmp, "store", "chunks", name)).st_mtime > old + 3000
    assert os.stat(touched).st_mtime > old + 3000
    before = c.stats.touches
    rewrite(db, 3)
    w.snapshot()
    c.run_once()
    assert c.stats.touches == before  # not again within the interval


def test_old_boot_roots_are_removed(env):
    tmp, spool, store, db, w = env
    old = os.path.join(spool, "%s.%d" % (uuid.uuid4(), 12345))
    os.makedirs(os.path.join(old, "0123456789abcdef.1.2", "staging", "chunks"))
    c = copier(spool, store)
    c.run_once()
    assert not os.path.exists(old)
    assert os.path.isdir(w.db.root)


def test_not_a_spool(tmp_path):
    store = open_store("file://%s/store" % tmp_path)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotASpool):
        Copier(str(f), store)
    with pytest.raises(NotASpool):
        Copier(str(tmp_path / "missing"), store)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("x")
    with pytest.raises(NotASpool):
        Copier(str(tmp_path / "home"), store)
    copier(str(tmp_path / "new"), store, create_spool=True)
    assert (tmp_path / "new").is_dir()
    store.close()


def test_identity_changes_on_republish(tmp_path):
    p = tmp_path / "m"
    p.write_bytes(b"a")
    a = sp.identity_of_path(str(p))
    fd = os.open(str(p), os.O_RDONLY)
    assert sp.identity_of_fd(fd) == a
    os.close(fd)
    q = tmp_path / "n"
    q.write_bytes(b"a")
    os.rename(str(q), str(p))
    assert sp.identity_of_path(str(p)) != a


def test_manifest_lock_serialises_uploads(env):
    """While one copier holds a database's lock, another's manifest upload
    waits for it (up to lock_timeout)."""
    tmp, spool, store, db, w = env
    w.snapshot()
    c = copier(spool, store, lock_timeout=3)
    fd = os.open(w.db.sub(sp.LOCK_FILE), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    t = threading.Timer(0.5, os.close, (fd,))
    t.start()
    try:
        start = time.monotonic()
        c.run_once()
        assert time.monotonic() - start >= 0.4
        assert store.manifests.exists(w.name)
    finally:
        t.join(10)
    assert not t.is_alive()


def test_idle_database_chunks_are_touched(env):
    tmp, spool, store, db, w = env
    w.snapshot()
    c = copier(spool, store, touch_interval=3600)
    c.run_once()
    c.recent = type(c.recent)(16)
    touched = w.db.sub(sp.TOUCHED_FILE)
    old = time.time() - 7200
    chunk_dir = os.path.join(tmp, "store", "chunks")
    for name in os.listdir(chunk_dir):
        os.utime(os.path.join(chunk_dir, name), (old, old))
    os.utime(touched, (old, old))
    for st in c._states.values():
        st.next_touch_check = 0
    c.run_once()  # no write at all: the idle database is still touched
    assert c.stats.touches == len(os.listdir(chunk_dir)) > 0
    for name in os.listdir(chunk_dir):
        assert os.stat(os.path.join(chunk_dir, name)).st_mtime > old + 3000


def test_many_databases_in_parallel_and_config_defaults(tmp_path, monkeypatch):
    import json
    from verneuil_fuse.copier import start_background
    spool = tmp_path / "spool"
    spool.mkdir()
    writers, dbs = [], []
    shared = os.urandom(4 * 65536)
    for i in range(6):
        db = tmp_path / ("db%d.bin" % i)
        db.write_bytes(shared + os.urandom(65536 + i))
        w = SpoolWriter(str(spool), str(db))
        w.snapshot()
        writers.append(w)
        dbs.append(db)
    monkeypatch.setenv("VERNEUIL_CONFIG", json.dumps({
        "replication_spooling_dir": str(spool),
        "replication_targets": [{"directory": {"path": str(tmp_path / "store")}}]}))
    bg = start_background(rate=0, db_workers=3)  # spool and store from VERNEUIL_CONFIG
    try:
        bg.flush(20)
    finally:
        bg.stop()
    store = open_store("file://%s/store" % tmp_path)
    for w, db in zip(writers, dbs):
        assert restored(store, w) == db.read_bytes()
    # the shared chunks are stored once
    # 3 shared chunks (chunk 0 is bundled), then per database a random full chunk
    # and (but for db0) a short last one.
    assert len(os.listdir(tmp_path / "store" / "chunks")) == 3 + 6 + 5


def test_same_boot_other_boot_time_is_copied_not_deleted(env):
    """/proc/1's ctime may change within one boot: a root with the current
    boot id is still this boot's, so it is copied from, never deleted."""
    tmp, spool, store, db, w = env
    w.snapshot()
    other = os.path.join(spool, "%s.%d" % (sp.boot_id(), 1))
    os.rename(w.db.root, other)
    c = copier(spool, store)
    c.flush(5)
    assert os.path.isdir(other)
    assert restored(store, w) == db.read_bytes()
