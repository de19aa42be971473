"""Helpers for tests that look inside a spool (docs/SPOOL.md).

Shared by the writer tests and the copier tests: locate a database's spool
directory, rebuild a database file from a staged or ready snapshot, check
that every published manifest names only chunks that exist with the right
bytes, and measure a spool's disk footprint.  Uses verneuil_fuse.format only
(not writer_vfs), so it also cross-checks the C writer's names.
"""
from __future__ import annotations

import os
import sqlite3
import subprocess
from typing import Iterable, Optional

from verneuil_fuse.format import (CHUNK_SIZE, PATH_KEY, ZERO_CHUNK_FPRINT,
                                  Fprint, decode_and_validate,
                                  fingerprint, hash64, manifest_name)

ZERO_CHUNK = bytes(CHUNK_SIZE)


def boot_root_name() -> str:
    """`<boot_id>.<boot_time>` of SPOOL.md."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    return "%s.%d" % (boot_id, int(os.stat("/proc/1").st_ctime))


def db_spool_dir(spool: str, db_path: str) -> str:
    """`<spool>/<boot root>/<dbdir>` of the database at db_path."""
    canon = os.path.realpath(db_path)
    st = os.stat(canon)
    h = hash64(os.fsencode(canon), PATH_KEY)
    return os.path.join(spool, boot_root_name(),
                        "%016x.%x.%x" % (h, st.st_dev, st.st_ino))


def read_manifest_dir(meta_dir: str, expect_name: Optional[str] = None):
    """(name, Manifest) of the one manifest in a `meta` directory."""
    names = sorted(os.listdir(meta_dir))
    assert len(names) == 1, "expected one manifest in %s, found %r" % (meta_dir, names)
    name = names[0]
    if expect_name is not None:
        assert name == expect_name, (name, expect_name)
    with open(os.path.join(meta_dir, name), "rb") as f:
        return name, decode_and_validate(f.read())


def snapshot_dirs(db_dir: str) -> list[str]:
    """Every `<uuid>` directory of ready/ and consuming/."""
    out = []
    for kind in ("ready", "consuming"):
        top = os.path.join(db_dir, kind)
        if os.path.isdir(top):
            out.extend(os.path.join(top, u) for u in sorted(os.listdir(top)))
    return out


def chunk_dirs(db_dir: str, extra: Iterable[str] = ()) -> list[str]:
    """Where a chunk named by a staged manifest may live: staging/chunks,
    then ready/*/chunks and consuming/*/chunks, then `extra` (e.g. a store)."""
    dirs = [os.path.join(db_dir, "staging", "chunks")]
    dirs += [os.path.join(d, "chunks") for d in snapshot_dirs(db_dir)]
    dirs += list(extra)
    return dirs


def find_chunk(fp: Fprint, dirs: Iterable[str]) -> Optional[bytes]:
    for d in dirs:
        path = os.path.join(d, fp.name)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            continue
    return None


def rebuild(manifest, dirs: Iterable[str]) -> bytes:
    """The file a manifest describes: bundled chunk 0, the zero chunk, and
    chunk files found in `dirs`, each checked against its fingerprint.  Other
    bundled chunks (b-tree tops) must also be chunk files, with the same
    bytes: a later manifest may stop bundling them."""
    dirs = list(dirs)
    out = bytearray()
    for index, fp in enumerate(manifest.chunks):
        want = manifest.chunk_length(index)
        if index == 0 and 0 in manifest.bundled:
            data = manifest.bundled[index]
        elif fp == ZERO_CHUNK_FPRINT:
            data = ZERO_CHUNK
        else:
            data = find_chunk(fp, dirs)
            assert data is not None, "chunk %d (%s) is missing from %r" % (index, fp.name, dirs)
            assert manifest.bundled.get(index, data) == data, "bundled chunk %d differs" % index
        assert len(data) == want, "chunk %d has %d bytes, expected %d" % (index, len(data), want)
        assert fingerprint(data) == fp, "chunk %d (%s) has other bytes" % (index, fp.name)
        out += data
    assert len(out) == manifest.len
    return bytes(out)


def rebuild_from_staging(db_dir: str, extra_chunk_dirs: Iterable[str] = (),
                         db_path: Optional[str] = None) -> bytes:
    """Rebuilds the database from `staging` (manifest + bundled chunk 0 +
    chunk files + zero chunk); chunks not in staging are looked up in ready,
    consuming and extra_chunk_dirs.  With db_path, the manifest name is
    checked too."""
    expect = manifest_name(db_path) if db_path is not None else None
    _, m = read_manifest_dir(os.path.join(db_dir, "staging", "meta"), expect)
    return rebuild(m, chunk_dirs(db_dir, extra_chunk_dirs))


def check_published(db_dir: str, store_chunks: Iterable[str] = ()) -> int:
    """Every published manifest names only chunks that exist with the right
    bytes: the staged one in staging, ready, consuming or `store_chunks`
    (where a copier put what it consumed); a ready/consuming one in its own
    chunks/ or `store_chunks`.  Returns the number of manifests checked."""
    store_chunks = list(store_chunks)
    checked = 0
    meta = os.path.join(db_dir, "staging", "meta")
    if os.path.isdir(meta) and os.listdir(meta):
        _, m = read_manifest_dir(meta)
        rebuild(m, chunk_dirs(db_dir, store_chunks))
        checked += 1
    for snap in snapshot_dirs(db_dir):
        smeta = os.path.join(snap, "meta")
        if not os.path.isdir(smeta) or not os.listdir(smeta):
            continue  # a copier already uploaded (and removed) the manifest
        _, m = read_manifest_dir(smeta)
        rebuild(m, [os.path.join(snap, "chunks")] + store_chunks)
        checked += 1
    return checked


def committed_image(db_path: str, scratch: str) -> bytes:
    """The database's committed state as its snapshots have it: for a WAL
    database, the file with the WAL's committed frames, as SQLite itself
    (the unix VFS) checkpoints them into a copy of the two files; bytes 18
    and 19 of the header (2: WAL) read as 1.  Call it while no writer runs.

    The copy is made by `cp`, in another process: closing a descriptor of the
    database in this one would drop every POSIX lock this process holds on
    it, SQLite's included (another process could then take this process's
    WAL for its own and delete it)."""
    os.makedirs(scratch, exist_ok=True)
    copy = os.path.join(scratch, "committed.db")
    for suffix in ("", "-wal", "-shm", "-journal"):
        if os.path.exists(copy + suffix):
            os.unlink(copy + suffix)
    subprocess.run(["cp", db_path, copy], check=True, timeout=60)
    if os.path.exists(db_path + "-wal"):
        subprocess.run(["cp", db_path + "-wal", copy + "-wal"], check=True, timeout=60)
        con = sqlite3.connect(copy)
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        con.close()
    with open(copy, "rb") as f:
        data = bytearray(f.read())
    for i in (18, 19):
        if len(data) > i and data[i] == 2:
            data[i] = 1
    return bytes(data)


def disk_usage(root: str) -> int:
    """Bytes of regular files under root, each inode counted once (ready
    chunks are hard links of staged ones)."""
    seen = set()
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total
