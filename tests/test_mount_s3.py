"""A real FUSE mount of an S3 store (moto's server): queries, bytes (zstd and
raw chunks) and a new version of a manifest."""
from __future__ import annotations

import os
import sqlite3
import subprocess

import pytest

from replicas import HOST, Mount, fuse_unavailable, make_db, publish, wait_for
from verneuil_fuse.format import CHUNK_SIZE

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(180)]
if fuse_unavailable():
    pytestmark.append(pytest.mark.skip(reason=fuse_unavailable()))


def test_s3_mount(s3_store, tmp_path):
    src = str(tmp_path / "s.db")
    make_db(src, 4000, seed=11)
    data = open(src, "rb").read()
    publish(s3_store, data, "/data/s.db")
    other = os.urandom(3 * CHUNK_SIZE + 17)
    publish(s3_store, other, "/data/blob.db", compress=False)
    m = Mount(s3_store.url, str(tmp_path / "mnt"),
              "cache_dir=%s,refresh=0.5,log_level=info,log_file=%s" % (tmp_path / "cache", tmp_path / "v.log"))
    m.start()
    try:
        path = m.path(HOST, "data", "s.db")
        out = subprocess.run(["sqlite3", "file:%s?mode=ro" % path, "PRAGMA integrity_check; SELECT count(*) FROM t"],
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.split() == ["ok", "4000"], out.stderr
        with open(path, "rb") as f:
            assert f.read() == data
        with open(m.path(HOST, "data", "blob.db"), "rb") as f:
            assert f.read() == other
        stats = m.stats()
        assert stats["fetch"]["gets"] >= len(data) // CHUNK_SIZE - 1
        # A new version through S3 (a new object version of the manifest key).
        new = os.urandom(2 * CHUNK_SIZE)
        publish(s3_store, new, "/data/blob.db")
        def sees_new():
            with open(m.path(HOST, "data", "blob.db"), "rb") as f:
                return f.read() == new
        wait_for(sees_new, 20, "the new version")
        con = sqlite3.connect("file:%s?immutable=1" % path, uri=True)
        try:
            assert con.execute("SELECT count(*) FROM t WHERE id < 100").fetchone() == (100,)
        finally:
            con.close()
    finally:
        m.stop()
