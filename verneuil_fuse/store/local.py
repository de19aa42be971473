"""Directory blob store: `LocalBackend`, one directory of blob files.

This module owns the embedded default store (`file:///dir`): a `Store` made of
`<dir>/chunks/` and `<dir>/manifests/`, each a `LocalBackend`, holding exactly
the bytes S3 would hold, one file per key.

Durability and atomicity (this is durable storage, unlike the spool):
- every write goes to a temporary file in the same directory, named
  `.tmp-...` (keys may not start with "."), is written in full and fsynced,
  then published with rename() (`put`) or link() (`put_if_absent`, which must
  not replace), and the directory is fsynced so the new name survives a crash;
- readers therefore see either no file or a complete one;
- listings skip temporary files (and anything else that is not a valid key).

A crash can leave `.tmp-*` files behind; they are never listed and may be
removed by hand (or by a future sweeper) once older than any write in flight.

History (`keep_versions` > 0, what `open_store` gives a store's manifests):
every `put` also hard-links what it publishes as
`<dir>/.versions/<key>/<version id>`, the version id being
`<20-digit time in ns>-<8 hex>` (so ids sort by time), and the current file is
one of those links.  `list_versions` lists them newest first, the one sharing
the current file's inode marked latest; a current file that no version holds
(written before history was on, or by `put_if_absent`) is listed first as
version "null", and is linked into the history by the next `put`.  After each
`put`, the key's past versions beyond `keep_versions`, and those that stopped
being current (the time of the next version) more than `keep_seconds` ago, are
deleted; the current one never is.  `delete` removes the current file only,
as a delete marker would on S3: past versions stay readable by id.  Nothing
here deletes chunks, so every chunk a kept version names stays as long as the
chunk directory keeps it.  The history is `local_versions.LocalVersions`, a
part of `LocalBackend` in a module of its own.
"""
from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from typing import Iterator

from verneuil_fuse.store.base import (
    NO_CAPABILITIES,
    RESERVED_KEY_PREFIX,
    AccessDenied,
    BucketNotFound,
    Capabilities,
    InvalidKey,
    NotFound,
    ObjectInfo,
    StoreError,
    Tagged,
    TransientError,
    check_key,
    check_max_bytes,
    check_prefix,
    check_range,
    too_large,
)
from verneuil_fuse.store.local_versions import LocalVersions, _unlink_quietly

logger = logging.getLogger(__name__)

# Prefix of temporary file names; starts with RESERVED_KEY_PREFIX so that no
# key can collide with a temporary file and listings can skip them cheaply.
TEMP_PREFIX = RESERVED_KEY_PREFIX + "tmp-"

# Random bytes in a temporary name (hex-encoded): with the pid, enough that
# concurrent writers (threads or processes) never pick the same name.
TEMP_TOKEN_BYTES = 8

# Mode for published files, before the umask: blobs are read by other
# processes (mounts, Spark executors) that may run as other users.
FILE_MODE = 0o666

# errno values worth a retry: flaky or full storage (a replicator should keep
# its data and retry later rather than drop it), interrupted or stale (NFS)
# operations.
TRANSIENT_ERRNOS = frozenset(
    {
        errno.EIO,
        errno.EAGAIN,
        errno.EINTR,
        errno.EBUSY,
        errno.ETIMEDOUT,
        errno.ESTALE,
        errno.ENOSPC,
        errno.EDQUOT,
        errno.ENOMEM,
    }
)

# errno values meaning "not allowed", reported as AccessDenied.
DENIED_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})

# errno values from link() meaning "this file system has no hard links";
# put_if_absent then falls back to an O_EXCL create of the final name.
NO_LINK_ERRNOS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK})


class LocalBackend(LocalVersions):
    """A directory of blobs, one regular file per key.  Thread-safe.

    `create`: make the directory (and its parents) now and again whenever a
    write finds it gone; otherwise a missing directory is `BucketNotFound`.
    `keep_versions`: past versions kept per key besides the current one (0:
    no history); `keep_seconds`: past versions no longer current for longer
    are deleted (0: no age bound).  See the module docstring.
    """

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True,
                 keep_versions: int = 0, keep_seconds: float = 0.0) -> None:
        if keep_versions < 0 or keep_seconds < 0:
            raise ValueError("keep_versions and keep_seconds must not be negative")
        self.root = os.path.abspath(os.fspath(root))
        self.create = create
        self.keep_versions = keep_versions
        self.keep_seconds = keep_seconds
        self._link_supported = True
        if create:
            self._make_root()

    # -- helpers ---------------------------------------------------------

    def describe(self) -> str:
        return f"directory {self.root}"

    def identity(self) -> str:
        return "file://" + os.path.realpath(self.root)

    def capabilities(self) -> Capabilities:
        """None beyond `Backend`'s calls: reads and writes are file system
        calls in the caller's thread."""
        return NO_CAPABILITIES

    def close(self) -> None:
        """Nothing to release."""

    def __repr__(self) -> str:
        return f"LocalBackend({self.root!r})"

    def _path(self, key: str) -> str:
        return os.path.join(self.root, check_key(key))

    def _make_root(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as err:
            raise self._error(err, "create directory", None) from None

    def _root_missing(self) -> bool:
        return not os.path.isdir(self.root)

    def _non_directory_on_path(self) -> str | None:
        """The deepest existing component of the root's path, if it is not a
        directory (a store URL naming a file, say)."""
        path = self.root
        while path != os.path.dirname(path):
            if os.path.lexists(path):
                return None if os.path.isdir(path) else path
            path = os.path.dirname(path)
        return None

    def _error(self, err: OSError, op: str, key: str | None) -> StoreError:
        """Map an OSError from operation `op` on `key` to a StoreError."""
        where = self.root if key is None else os.path.join(self.root, key)
        reason = err.strerror or type(err).__name__
        message = f"{op} {where}: {reason}"
        code = err.errno
        if code in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):  # ELOOP: a symlink, not a blob
            if self._root_missing():
                blocker = self._non_directory_on_path()
                if blocker is not None:
                    return BucketNotFound(f"{op} {where}: {blocker} is not a directory", key=key)
                return BucketNotFound(
                    f"{op} {where}: directory {self.root} does not exist", key=key
                )
            return NotFound(message, key=key)
        if code in DENIED_ERRNOS:
            return AccessDenied(message, key=key)
        if code in TRANSIENT_ERRNOS:
            return TransientError(message, key=key)
        if code == errno.EISDIR:
            return StoreError(f"{op} {where}: is a directory, not a blob", key=key)
        return StoreError(message, key=key)

    def _fsync_dir(self) -> None:
        """Make a rename/link in the root durable; file systems that cannot
        fsync a directory (EINVAL) are tolerated."""
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as err:
            raise self._error(err, "open directory", None) from None
        try:
            os.fsync(fd)
        except OSError as err:
            if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise self._error(err, "fsync directory", None) from None
        finally:
            os.close(fd)

    @staticmethod
    def _write_all(fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]

    def _write_new(self, path: str, data: bytes) -> None:
        """Create `path` exclusively, write `data` and fsync it; on failure
        remove the partial file."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            self._write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        os.close(fd)

    def _write_temp(self, key: str, data: bytes) -> str:
        """A complete, fsynced temporary file holding `data`; its path."""
        for attempt in (1, 2):
            temp = os.path.join(
                self.root, f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(TEMP_TOKEN_BYTES)}"
            )
            try:
                self._write_new(temp, data)
                return temp
            except FileNotFoundError as err:
                if self.create and attempt == 1:
                    logger.info("recreating missing store directory %s", self.root)
                    self._make_root()
                    continue
                raise self._error(err, "write", key) from None
            except OSError as err:
                raise self._error(err, "write", key) from None
        raise AssertionError("unreachable")

    # -- Backend ---------------------------------------------------------

    def _open_blob(self, path: str, key: str):
        """The blob file itself, open for reading.  A symlink planted under a
        key is refused (ELOOP), so no key reads a file outside the directory;
        so is anything but a regular file (a FIFO would block its readers:
        it is opened non-blocking and refused)."""
        f = open(path, "rb",
                 opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW | os.O_NONBLOCK))
        try:
            st = os.fstat(f.fileno())
        except BaseException:
            f.close()
            raise
        if not stat.S_ISREG(st.st_mode):
            f.close()
            raise StoreError(f"read {path}: not a regular file, not a blob", key=key)
        return f, st

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        check_max_bytes(max_bytes)
        return self._read(self._path(key), key, max_bytes)

    def _read(self, path: str, key: str, max_bytes: int | None) -> bytes:
        """The whole blob file at `path` (the key's, or one of its versions)."""
        return self._read_stat(path, key, max_bytes)[0]

    def _read_stat(self, path: str, key: str, max_bytes: int | None) -> tuple[bytes, os.stat_result]:
        """`_read`, with the stat of the file read."""
        try:
            f, st = self._open_blob(path, key)
            with f:
                if max_bytes is None:
                    return f.read(), st
                if st.st_size > max_bytes:
                    raise too_large("read", path, key, st.st_size, max_bytes)
                # Never more than the bound + 1, even if the file grew since.
                data = f.read(max_bytes + 1)
        except OSError as err:
            raise self._error(err, "read", key) from None
        if len(data) > max_bytes:
            raise too_large("read", path, key, None, max_bytes)
        return data, st

    def get_if_changed(self, key: str, tag: str | None, max_bytes: int | None = None) -> Tagged | None:
        check_max_bytes(max_bytes)
        path = self._path(key)
        if tag is not None:
            try:
                st = os.lstat(path)
            except OSError as err:
                raise self._error(err, "stat", key) from None
            if _file_tag(st) == tag:
                return None
        data, st = self._read_stat(path, key, max_bytes)
        # The tag of the file read (its descriptor's stat), whatever the
        # name points at now: a write since gives the next call a change.
        return Tagged(data, _file_tag(st))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        path = self._path(key)
        check_range(start, end)
        try:
            f, _ = self._open_blob(path, key)
            with f:
                if start == end:
                    return b""
                f.seek(start)
                return f.read(end - start)
        except OSError as err:
            raise self._error(err, "read", key) from None

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        temp = self._write_temp(key, data)
        try:
            if self.keep_versions:
                self._record_version(key, path, temp)
            os.replace(temp, path)
        except OSError as err:
            _unlink_quietly(temp)
            raise self._error(err, "publish", key) from None
        except BaseException:
            _unlink_quietly(temp)
            raise
        self._fsync_dir()
        logger.debug("put %s (%d bytes)", path, len(data))
        if self.keep_versions:
            self._prune_versions(key)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        if not self._link_supported:
            return self._put_if_absent_excl(key, path, data)
        temp = self._write_temp(key, data)
        try:
            os.link(temp, path)
        except FileExistsError:
            return False
        except OSError as err:
            if err.errno in NO_LINK_ERRNOS:
                logger.warning(
                    "%s: hard links unsupported (%s); publishing with O_EXCL instead",
                    self.root,
                    err.strerror,
                )
                self._link_supported = False
                return self._put_if_absent_excl(key, path, data)
            raise self._error(err, "publish", key) from None
        finally:
            _unlink_quietly(temp)
        self._fsync_dir()
        logger.debug("put_if_absent %s (%d bytes)", path, len(data))
        return True

    def _put_if_absent_excl(self, key: str, path: str, data: bytes) -> bool:
        """Fallback without link(): create the final name exclusively.  A
        concurrent reader may see a partial file until the write completes;
        content-addressed readers verify fingerprints and retry."""
        try:
            self._write_new(path, data)
        except FileExistsError:
            return False
        except OSError as err:
            raise self._error(err, "write", key) from None
        self._fsync_dir()
        return True

    def exists(self, key: str) -> bool:
        path = self._path(key)
        try:
            st = os.lstat(path)  # a symlink is not a blob (as in listings)
        except FileNotFoundError:
            if self._root_missing():
                raise BucketNotFound(f"directory {self.root} does not exist", key=key) from None
            return False
        except OSError as err:
            raise self._error(err, "stat", key) from None
        return stat.S_ISREG(st.st_mode)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            if self._root_missing():
                raise BucketNotFound(f"directory {self.root} does not exist", key=key) from None
        except OSError as err:
            raise self._error(err, "delete", key) from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        return self._list(prefix)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        try:
            entries = os.scandir(self.root)
        except OSError as err:
            raise self._error(err, "list", None) from None
        with entries:
            for entry in entries:
                name = entry.name
                if not name.startswith(prefix) or name.startswith(RESERVED_KEY_PREFIX):
                    continue
                try:
                    check_key(name)
                    st = entry.stat(follow_symlinks=False)
                except InvalidKey:
                    continue
                except FileNotFoundError:  # deleted while listing
                    continue
                except OSError as err:
                    raise self._error(err, "stat", name) from None
                if stat.S_ISREG(st.st_mode):
                    yield ObjectInfo(name, st.st_size, st.st_mtime)

    # -- history ---------------------------------------------------------

    def touch(self, key: str) -> None:
        path = self._path(key)
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):  # never through a symlink
                raise FileNotFoundError(errno.ENOENT, "not a blob", path)
            os.utime(path, None)
        except OSError as err:
            raise self._error(err, "touch", key) from None


def _file_tag(st: os.stat_result) -> str:
    """A blob file's version tag: every put publishes a new file (a rename
    or a link of a new inode), so the inode tells versions apart; size and
    mtime guard against an inode number reused after a delete."""
    return "%d-%d-%d" % (st.st_ino, st.st_size, st.st_mtime_ns)


