"""The Python face of the `verneuil` SQLite VFS (C in csrc/).

`register()` makes `sqlite3.connect("file:x.db?vfs=verneuil", uri=True)`
stage a snapshot of x.db in the spool after every write transaction;
`loadable_extension_path()` is the same VFS for the `sqlite3` shell
(`.load PATH` then `.open 'file:x.db?vfs=verneuil'`, configured from
VERNEUIL_CONFIG).  Nothing here imports verneuil_fuse.
"""
from __future__ import annotations

import glob
import logging
import os
import sqlite3
import urllib.parse
from typing import Optional, Tuple

from writer_vfs._vfs import ffi, lib

VFS_NAME = "verneuil"

log = logging.getLogger("writer_vfs")

_LIBVERSION = ffi.string(lib.sqlite3_libversion()).decode()
if _LIBVERSION != sqlite3.sqlite_version:
    # Registering in another libsqlite3 than the one Python's sqlite3 uses
    # would silently leave the VFS invisible to it.
    raise ImportError(
        "writer_vfs._vfs is linked with SQLite %s but Python's sqlite3 uses %s"
        % (_LIBVERSION, sqlite3.sqlite_version))


# Room for a spool directory's path on the first try (PATH_MAX); a longer
# one is read again with room enough.
_SPOOL_CAP = 4096
# Room for the sentence about an unusable config (csrc/config.h,
# VN_CONFIG_WHY_MAX).
_WHY_CAP = 1024


def _config_from_env() -> Tuple[Optional[str], bool, Optional[bool], int]:
    """VERNEUIL_CONFIG as the loadable extension reads it (csrc/config.c, the
    writer's one reader of it: JSON, or "@/path/to/file.json"):
    (replication_spooling_dir or None, make_default, warn_stderr or None when
    absent, max_db_size or 0 when absent).  An unusable config is logged and
    replicates nothing."""
    spool_len = ffi.new("size_t *")
    make_default = ffi.new("int *")
    warn_stderr = ffi.new("int *")
    max_db_size = ffi.new("unsigned long long *")
    why = ffi.new("char[]", _WHY_CAP)
    cap = _SPOOL_CAP
    while True:
        spool = ffi.new("char[]", cap)
        rc = lib.verneuil_vfs_config_from_env(spool, cap, spool_len, make_default, warn_stderr,
                                              max_db_size, why, _WHY_CAP)
        if spool_len[0] < cap:
            break
        cap = spool_len[0] + 1
    if rc != 0:  # the sentence the loadable extension logs too
        log.error("%s", ffi.string(why).decode("utf-8", "replace"))
    if rc < 0:  # an unreadable @file, bad JSON, not an object: no key applies
        return None, False, None, 0
    spool_dir = os.fsdecode(ffi.string(spool)) if spool_len[0] else None
    return (spool_dir, bool(make_default[0]), None if warn_stderr[0] < 0 else bool(warn_stderr[0]),
            int(max_db_size[0]))


def register(spool_dir: Optional[str] = None, make_default: bool = False) -> Optional[str]:
    """Registers the `verneuil` VFS in the SQLite that Python's sqlite3 uses.

    The spool comes from `spool_dir`, else from VERNEUIL_CONFIG's
    `replication_spooling_dir` (whose `make_default` also counts).  Calling
    again changes the spool for files opened afterwards.  Returns the spool
    directory (None: the VFS passes everything through, no replication).

    Like the loadable extension, it never fails the application because of
    replication: an unusable VERNEUIL_CONFIG is logged and replicates
    nothing; a spool directory that cannot be created now is logged, and
    commits go on (counted as failed snapshots until it can be).
    """
    if spool_dir is None:
        spool_dir, config_default, warn_stderr, max_db_size = _config_from_env()
        make_default = make_default or config_default
        if warn_stderr is False:
            set_warn_stderr(False)
        if max_db_size and not set_max_db_size(max_db_size):
            log.warning("VERNEUIL_CONFIG: max_db_size %d is out of range (1 to %d bytes): ignored",
                        max_db_size, MAX_DB_SIZE)
    if spool_dir is not None:
        spool_dir = os.path.abspath(os.fspath(spool_dir))
        try:
            os.makedirs(spool_dir, exist_ok=True)
        except OSError as e:
            log.warning("cannot create the spool directory %s (%s): snapshots fail until it can be",
                        spool_dir, e.strerror or e)
    rc = lib.verneuil_vfs_register(
        os.fsencode(spool_dir) if spool_dir is not None else ffi.NULL,
        1 if make_default else 0)
    if rc != 0:
        raise RuntimeError("cannot register the verneuil VFS (SQLite error %d)" % rc)
    return spool_dir


def loadable_extension_path() -> str:
    """Path of the loadable extension (for `.load` in the sqlite3 shell)."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "libverneuil_vfs*.so")))
    if not found:
        raise FileNotFoundError("libverneuil_vfs*.so is not built in %s" % here)
    return found[0]


def set_gc_weight(weight: float) -> None:
    """GC probability per snapshot = weight * staged chunks / db chunks.

    0 disables GC, a huge value forces it after any snapshot that staged a
    chunk (tests; `verneuilctl sync`)."""
    lib.verneuil_vfs_set_gc_weight(float(weight))


def set_bundle_chunks(n: int) -> int:
    """Most chunks besides chunk 0 bundled in each manifest (0 to 16, default
    4): those holding the upper levels of the b-trees, so that cold lookups on
    a reader take fewer GETs (docs/WRITER.md, "Bundled b-tree tops").
    Returns the previous count."""
    old = lib.verneuil_vfs_set_bundle_chunks(int(n))
    if old < 0:
        raise ValueError("bundle chunks must be between 0 and 16, not %r" % (n,))
    return old


# The largest database the writer replicates, and the most `set_max_db_size`
# allows (csrc/tracker.h, VN_MAX_DB_SIZE: about 1.5 TiB).
MAX_DB_SIZE = int(lib.verneuil_vfs_max_db_size_limit())


def set_max_db_size(n: int) -> int:
    """A database past ``n`` bytes is not replicated (said once, counted as
    ``too_large``; VERNEUIL_CONFIG's ``max_db_size`` sets it too). Returns
    the previous bound, or 0 (nothing changed) for a bound out of range
    (0, or past `MAX_DB_SIZE`)."""
    return int(lib.verneuil_vfs_set_max_db_size(int(n)))


def set_log_stderr(on: bool) -> None:
    """Also print the VFS's log messages on stderr (debugging)."""
    lib.verneuil_vfs_set_log_stderr(1 if on else 0)


def set_warn_stderr(on: bool) -> None:
    """Print on stderr (on by default) when a database is not replicated: a
    spool that keeps failing its snapshots (at most once a minute), a WAL
    database whose shared memory another VFS above `verneuil` implements
    (once); VERNEUIL_CONFIG's ``"warn_stderr": false`` turns it off too."""
    lib.verneuil_vfs_set_warn_stderr(1 if on else 0)


def db_spool_dir(db_path, spool_dir) -> str:
    """The spool directory of one database (it must exist) under `spool_dir`."""
    out = ffi.new("char[]", 4096)
    rc = lib.verneuil_vfs_db_spool_dir(os.fsencode(os.path.abspath(spool_dir)),
                                       os.fsencode(db_path), out, 4096)
    if rc != 0:
        raise OSError(rc, os.strerror(rc), db_path)
    return os.fsdecode(ffi.string(out))


def uri(db_path, **params) -> str:
    """A `file:` URI opening db_path through the verneuil VFS."""
    query = {"vfs": VFS_NAME}
    query.update({k: str(v) for k, v in params.items()})
    return "file:%s?%s" % (urllib.parse.quote(os.path.abspath(os.fspath(db_path))),
                           urllib.parse.urlencode(query))


def connect(db_path, **kwargs) -> sqlite3.Connection:
    """sqlite3.connect through the verneuil VFS (register() first)."""
    return sqlite3.connect(uri(db_path), uri=True, **kwargs)


def stats(conn: sqlite3.Connection) -> dict:
    """This connection's replication counters (PRAGMA verneuil_stats), once
    its stager thread staged every WAL commit handed to it."""
    row = conn.execute("PRAGMA verneuil_stats").fetchone()
    text = row[0] if row else ""
    out = {}
    for item in text.split():
        key, _, value = item.partition("=")
        out[key] = int(value)
    return out


# The longest wait_staged() waits by default: far more than one snapshot.
WAIT_STAGED_TIMEOUT = 60.0


def wait_staged(conn: Optional[sqlite3.Connection] = None,
                timeout: float = WAIT_STAGED_TIMEOUT) -> bool:
    """Waits until the WAL commits handed to a stager thread are staged: the
    connection's (PRAGMA verneuil_wait_staged), or every connection's in this
    process (conn None).  True when they are, False after `timeout` seconds
    (at most a minute for a connection).  A rollback-journal commit, or a WAL
    commit with the stager off (`set_wal_async`), is staged before the
    commit returns: nothing to wait for."""
    ms = max(0, int(timeout * 1000))
    if conn is not None:
        row = conn.execute("PRAGMA verneuil_wait_staged=%d" % ms).fetchone()
        return bool(row) and row[0] in ("ok", "not replicated")
    return lib.verneuil_vfs_wait_staged(ms) == 0


def set_wal_async(on: bool) -> bool:
    """Stage WAL commits on a thread of each connection, off the commit path
    (on by default), or on the commit path, before the WAL write lock is
    released (connections already staging keep their thread).  Returns the
    previous setting."""
    return bool(lib.verneuil_vfs_set_wal_async(1 if on else 0))


def force_snapshot(db_path) -> dict:
    """Rebuilds db_path's staged snapshot from a full scan now (an empty
    write transaction after PRAGMA verneuil_full_snapshot); returns the
    connection's counters.  Also publishes `ready` if it is missing."""
    conn = connect(db_path, isolation_level=None)
    try:
        conn.execute("PRAGMA verneuil_full_snapshot")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("COMMIT")
        return stats(conn)
    finally:
        conn.close()
