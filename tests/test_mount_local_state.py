"""Local state never wins over the store, real names never lose to the
past-state syntax, and no time makes a handler fail (issue 36, cases 5, 6
and 8; docs/GUARANTEES.md).

Real mounts of a directory store:
- a zeroed 4 KiB block in the manifest cache's value file (what a crash
  with delayed allocation leaves) makes the next mount drop that entry, log
  it and read the manifest from the store: the database stays, byte-exact;
- a real database named like another one's past state, published after the
  mount's last poll, opens as itself;
- times outside what 64-bit nanoseconds hold are ENOENT, with no handler
  error counted; a writer's clock that stepped back (versions at +10, +30,
  +20, +40 s) gives, at +22 and +35, the +20 version (the newest in the
  store's order that is that old).
"""
from __future__ import annotations

import errno
import glob
import os
import time

import pytest

from support.replicas import HOST, Mount, fuse_unavailable, publish
from verneuil_fuse.history import NS, format_time
from verneuil_fuse.store import open_store

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(180)]
if fuse_unavailable():
    pytestmark.append(pytest.mark.skip(reason=fuse_unavailable()))

T0 = 1_790_000_000  # 2026-09-21: the clock-step database's versions are at T0 + 10, 30, 20, 40


def _data(tag: int, size: int = 3 * 65536 + 1000) -> bytes:
    """A database-looking file whose chunk 0 does not compress (so the
    manifest cache keeps its blob in a value file of its own)."""
    body = bytearray(os.urandom(size))
    body[:16] = b"SQLite format 3\x00"
    body[100] = tag
    return bytes(body)


def _age_manifests(root: str) -> None:
    """The manifests' listed times an hour back: settled, so that a mount
    takes them from its manifest cache (tree.SETTLE_SECONDS)."""
    old = time.time() - 3600
    for path in glob.glob(os.path.join(root, "manifests", "*")):
        os.utime(path, (old, old))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _errno_of_open(path: str) -> int:
    try:
        os.open(path, os.O_RDONLY)
    except OSError as e:
        return e.errno
    return 0


def test_local_state_names_and_times(tmp_path):
    root = str(tmp_path / "store")
    store = open_store("file://" + root)
    app = _data(1)
    publish(store, app, "/data/app.db", hostname=HOST)
    z = _data(2)
    publish(store, z, "/data/z.db", hostname=HOST, ctime=T0)
    clock = [_data(10 + k) for k in range(4)]
    for data, offset in zip(clock, (10, 30, 20, 40)):
        publish(store, data, "/data/clock.db", hostname=HOST, ctime=T0 + offset)
    _age_manifests(root)
    base = "cache_dir=%s,log_level=info,refresh=3600" % (tmp_path / "cache")
    d = "/%s/data" % HOST

    # 1. A first mount reads app.db: its manifest lands in the manifest cache.
    with Mount(store.url, str(tmp_path / "mnt"), base + ",log_file=%s" % (tmp_path / "one.log")) as m:
        assert _read(m.path(d, "app.db")) == app
    values = [p for p in glob.glob(str(tmp_path / "cache" / "manifests" / "**" / "*.val"), recursive=True)
              if os.path.getsize(p) > len(app) // 4]
    assert values, "no manifest value file in the cache"
    for path in values:  # 2. a zeroed 4 KiB block in the middle of each (a crash's delayed allocation)
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2 // 4096 * 4096)
            f.write(bytes(4096))

    log = tmp_path / "two.log"
    with Mount(store.url, str(tmp_path / "mnt"), base + ",log_file=%s" % log) as m:
        # Case 5: the database is still there, read from the store, byte-exact.
        assert _read(m.path(d, "app.db")) == app
        text = log.read_text()
        assert "does not decode" in text and "dropped" in text, text
        assert "gone from the store" not in text, text
        catalog = m.stats()["catalog"]
        assert catalog["cache_dropped"] >= 1, catalog

        # Case 6: a real database named like z.db's past state, published
        # after the mount's (only) poll, opens as itself.
        name = "z.db@" + format_time((T0 + 5) * NS)
        assert _read(m.path(d, "z.db@" + format_time(T0 * NS))) == z  # the past state, before it exists
        real = _data(3)
        publish(store, real, "/data/" + name, hostname=HOST)
        assert _read(m.path(d, name)) == real

        # Case 8: times out of range are ENOENT, no handler error.
        for text in ("-99999999999999999999w", "-300000000w", "9999-12-31T23:59:59-23:59", "0001-01-01"):
            assert _errno_of_open(m.path(d, "app.db@" + text)) == errno.ENOENT, text
        # ... and the clock stepped back: the newest version in the store's order that is that old.
        at = {k: _read(m.path(d, "clock.db@" + format_time((T0 + k) * NS))) for k in (10, 22, 29, 35, 40)}
        assert at[10] == clock[0] and at[22] == clock[2] and at[29] == clock[2] and at[35] == clock[2]
        assert at[40] == clock[3]
        assert _errno_of_open(m.path(d, "clock.db@" + format_time((T0 + 9) * NS))) == errno.ENOENT
        mount = m.stats()["mount"]
        assert mount["handler_errors"] == 0, mount
