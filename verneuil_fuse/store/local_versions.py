"""The history of a directory store (`local.LocalBackend` with
``keep_versions`` > 0; the format is in `local`'s docstring, "History"):
each key's past versions hard-linked under `<dir>/.versions/<key>/`,
listed newest first, read by id, recorded before a `put` publishes and
pruned after it (``keep_versions``, ``keep_seconds``).

Tested by tests/test_store.py (the versioned directory store) and
tests/test_history.py.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import stat
import time

from verneuil_fuse.store.base import (
    RESERVED_KEY_PREFIX,
    BucketNotFound,
    NotFound,
    StoreError,
    VersionInfo,
    check_key,
    check_max_bytes,
)

logger = logging.getLogger(__name__)


# Version id reported for the single version a directory holds, the same
# string S3 uses for objects written while versioning was off.
NULL_VERSION_ID = "null"
# Directory of a versioned backend holding the past versions of each key
# (`<root>/.versions/<key>/<version id>`); it starts with RESERVED_KEY_PREFIX,
# so no key names it and listings skip it.
VERSIONS_DIR = RESERVED_KEY_PREFIX + "versions"
# Version ids of a versioned backend: the time of the put in nanoseconds, 20
# digits so that ids sort by time, and random hex so that two writers in the
# same nanosecond still differ.
VERSION_ID_RE = re.compile(r"\A([0-9]{20})-[0-9a-f]{8}\Z")
VERSION_TOKEN_BYTES = 4


def _new_version_id(time_ns: int) -> str:
    return "%020d-%s" % (max(0, time_ns), secrets.token_hex(VERSION_TOKEN_BYTES))


def _version_time(version_id: str) -> float:
    """The time (seconds since the epoch) a version id records."""
    match = VERSION_ID_RE.match(version_id)
    return int(match.group(1)) / 1e9 if match else 0.0


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class LocalVersions:
    """The history of `local.LocalBackend` (see the module's docstring)."""

    def list_versions(self, key: str) -> list[VersionInfo]:
        path = self._path(key)
        try:
            current: os.stat_result | None = os.lstat(path)
        except FileNotFoundError:
            if self._root_missing():
                raise BucketNotFound(f"directory {self.root} does not exist", key=key) from None
            current = None
        except OSError as err:
            raise self._error(err, "stat", key) from None
        if current is not None and not stat.S_ISREG(current.st_mode):
            current = None  # a symlink or a directory is not a blob
        versions = []
        latest_seen = False
        for version_id, st in self._stored_versions(key):  # newest first
            latest = (not latest_seen and current is not None
                      and (st.st_ino, st.st_dev) == (current.st_ino, current.st_dev))
            latest_seen = latest_seen or latest
            versions.append(VersionInfo(key, version_id, st.st_size, _version_time(version_id), latest))
        if current is not None and not latest_seen:
            versions.insert(0, VersionInfo(key, NULL_VERSION_ID, current.st_size, current.st_mtime, True))
        return versions

    def get_version(self, key: str, version_id: str, max_bytes: int | None = None) -> bytes:
        check_max_bytes(max_bytes)
        if version_id == NULL_VERSION_ID:
            return self.get(key, max_bytes)
        path = self._path(key)
        if self._root_missing():
            raise BucketNotFound(f"directory {self.root} does not exist", key=key)
        if not isinstance(version_id, str) or VERSION_ID_RE.match(version_id) is None:
            raise NotFound(f"read {path}: no version {version_id!r}", key=key)
        try:
            return self._read(os.path.join(self._versions_dir(key), version_id), key, max_bytes)
        except NotFound:
            raise NotFound(f"read {path}: no version {version_id!r}", key=key) from None

    def _versions_dir(self, key: str) -> str:
        return os.path.join(self.root, VERSIONS_DIR, check_key(key))

    def _stored_versions(self, key: str) -> list[tuple[str, os.stat_result]]:
        """(version id, lstat) of the key's version files, newest first."""
        directory = self._versions_dir(key)
        try:
            names = os.listdir(directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as err:
            raise self._error(err, "list versions of", key) from None
        out = []
        for name in sorted(names, reverse=True):
            if VERSION_ID_RE.match(name) is None:
                continue
            try:
                st = os.lstat(os.path.join(directory, name))
            except FileNotFoundError:  # pruned while listing
                continue
            except OSError as err:
                raise self._error(err, "stat", key) from None
            if stat.S_ISREG(st.st_mode):
                out.append((name, st))
        return out

    def _record_version(self, key: str, path: str, temp: str) -> None:
        """Link the complete temporary file `temp` into the key's history
        (before it is published), first adopting a current file that no
        version holds.  Raises OSError."""
        directory = self._versions_dir(key)
        os.makedirs(directory, exist_ok=True)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            try:
                os.link(path, os.path.join(directory, _new_version_id(st.st_mtime_ns)))
            except (FileNotFoundError, FileExistsError):
                pass  # replaced meanwhile: its writer recorded it
        os.link(temp, os.path.join(directory, _new_version_id(time.time_ns())))
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        except OSError as err:
            if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
        finally:
            os.close(fd)

    def _prune_versions(self, key: str) -> None:
        """Delete the key's past versions that retention does not keep.  A
        failure is logged, never raised: the put it follows succeeded."""
        try:
            versions = self._stored_versions(key)
            current = os.lstat(self._path(key))
        except (OSError, StoreError) as err:
            logger.warning("cannot prune the versions of %s: %s", key, err)
            return
        now = time.time()
        past = 0
        newer_time: float | None = None  # when the next newer version was written
        for version_id, st in versions:
            if (st.st_ino, st.st_dev) == (current.st_ino, current.st_dev):
                newer_time = _version_time(version_id)
                continue
            past += 1
            too_old = (self.keep_seconds and newer_time is not None
                       and now - newer_time > self.keep_seconds)
            newer_time = _version_time(version_id)
            if past > self.keep_versions or too_old:
                _unlink_quietly(os.path.join(self._versions_dir(key), version_id))
