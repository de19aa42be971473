"""The spool as copiers see it (docs/SPOOL.md): paths, names, identities.

Nothing here talks to a store.  Everything is a plain POSIX operation on the
tree the writer VFS maintains; the only state copiers add is `copier.lock`,
`copier.touched`, `copier.store`, `copier.stopped` and, in the packed layout,
`copier.packs/`, `copier.last` and `copier.gc` in each database's directory, and
`dead-letter/` in the boot root (bounded: `DEAD_LETTER_MAX_ENTRIES` entries and
`DEAD_LETTER_MAX_BYTES`, the oldest dropped first and counted in
`dead-letter/.dropped`). `spool_databases` lists the databases a spool
holds with their manifest names (`verneuilctl repair --all`).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import re
import shutil
import stat
import struct
import threading
import time
import uuid
from typing import NamedTuple, Optional

from verneuil_fuse import format as fmt

log = logging.getLogger(__name__)

STAGING = "staging"
READY = "ready"
CONSUMING = "consuming"
CHUNKS = "chunks"
META = "meta"
SCRATCH = "scratch"
SOURCE = "source"
LOCK_FILE = "copier.lock"
TOUCHED_FILE = "copier.touched"
STORE_FILE = "copier.store"  # identity of the chunk store this database is shipped to
PACKS_DIR = "copier.packs"  # packed layout: where the chunks packed from this directory went
LAST_FILE = "copier.last"  # packed layout: the last manifest uploaded (raw, with its layout)
GC_FILE = "copier.gc"  # packed layout: when GC last ran, and the packs each version names
DEAD_LETTER = "dead-letter"
STOPPED_FILE = "copier.stopped"  # a database the copier refuses to ship (past max_db_size)
# dead-letter/ keeps at most this many entries and bytes; past either, the
# oldest are deleted (a writer past the copier's bound used to leave one
# manifest of 16 MiB or more per commit there, forever).
DEAD_LETTER_MAX_ENTRIES = 100
DEAD_LETTER_MAX_BYTES = 256 << 20
DROPPED_FILE = ".dropped"  # in dead-letter/: how many entries were deleted so far

# "<boot_id>.<boot_time>": a UUID, a dot, the ctime of /proc/1 in seconds.
BOOT_ROOT_RE = re.compile(r"\A[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                          r"[0-9a-fA-F]{12}\.[0-9]+\Z")
# "%016llx.%llx.%llx": hash64(path), st_dev, st_ino.
DBDIR_RE = re.compile(r"\A[0-9a-f]{16}\.[0-9a-f]+\.[0-9a-f]+\Z")


class NotASpool(Exception):
    """A path that is not (and does not look like) a spool directory."""


def boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def boot_time() -> int:
    return int(os.stat("/proc/1").st_ctime)


def current_boot_root_name() -> str:
    return "%s.%d" % (boot_id(), boot_time())


def dbdir_name(path: str) -> str:
    """The per-database directory name the writer uses for `path`."""
    from verneuil_fuse.format import PATH_KEY, hash64
    real = os.path.realpath(path)
    st = os.stat(real)
    return "%016x.%x.%x" % (hash64(os.fsencode(real), PATH_KEY), st.st_dev, st.st_ino)


def check_spool(spool: str, create: bool = False) -> None:
    """Raise NotASpool unless `spool` is a directory holding only boot roots
    (an empty directory is an empty spool).  With `create`, a missing
    directory is made (0700)."""
    try:
        st = os.stat(spool)
    except FileNotFoundError:
        if not create:
            raise NotASpool("%s: no such spool directory" % spool) from None
        os.makedirs(spool, mode=0o700, exist_ok=True)
        return
    except OSError as e:
        raise NotASpool("%s: %s" % (spool, e.strerror)) from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotASpool("%s is not a directory, so not a spool" % spool)
    try:
        entries = os.listdir(spool)
    except OSError as e:
        raise NotASpool("%s: %s" % (spool, e.strerror)) from None
    for name in entries:
        if not BOOT_ROOT_RE.match(name) or not os.path.isdir(os.path.join(spool, name)):
            raise NotASpool("%s is not a spool directory (unexpected entry %r)" % (spool, name))


class DbDir(NamedTuple):
    """One database's directory in the current boot root."""

    root: str   # the boot root
    name: str   # the dbdir name

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.name)

    def sub(self, *parts: str) -> str:
        return os.path.join(self.root, self.name, *parts)

    def source(self) -> Optional[str]:
        try:
            return os.fsdecode(read_regular(self.sub(SOURCE), 65536).rstrip(b"\n"))
        except OSError:
            return None


def list_dbdirs(root: str) -> list[DbDir]:
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return [DbDir(root, n) for n in sorted(names) if DBDIR_RE.match(n)]


def boot_roots(spool: str) -> tuple[list[str], list[str]]:
    """(roots of this boot, roots of earlier boots) in `spool`.

    A root belongs to this boot when its boot id is the current one.  Its
    boot time normally matches too, but the ctime of /proc/1 can change
    within one boot (procfs inodes are rebuilt when evicted), and a writer
    that computed another one still writes there: it is copied, not deleted.
    """
    try:
        names = os.listdir(spool)
    except FileNotFoundError:
        return [], []
    prefix = boot_id() + "."
    current_name = current_boot_root_name()
    mine, earlier = [], []
    for n in sorted(names):
        if not BOOT_ROOT_RE.match(n):
            continue
        (mine if n.startswith(prefix) else earlier).append(os.path.join(spool, n))
    # The canonical root first (dead letters and new state go there).
    mine.sort(key=lambda p: os.path.basename(p) != current_name)
    return mine, earlier


def listdir_or_empty(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


# --- file identity (the seqlock's "version" of a staged manifest) -----------

class Identity(NamedTuple):
    dev: int
    ino: int
    btime_ns: int   # 0 where the filesystem records no birth time
    ctime_ns: int
    size: int


_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_STATX_BASIC_STATS = 0x7FF
_STATX_BTIME = 0x800
_statx = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _statx = _libc.statx
    _statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                       ctypes.c_void_p]
    _statx.restype = ctypes.c_int
except (OSError, AttributeError):  # no libc statx: fall back to stat(2)
    _statx = None


def _identity_statx(dirfd: int, path: bytes, flags: int) -> Identity:
    buf = ctypes.create_string_buffer(256)
    if _statx(dirfd, path, flags, _STATX_BASIC_STATS | _STATX_BTIME, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(path))
    raw = buf.raw
    mask, = struct.unpack_from("<I", raw, 0)
    ino, size = struct.unpack_from("<QQ", raw, 32)
    b_sec, b_nsec = struct.unpack_from("<qI", raw, 80)
    c_sec, c_nsec = struct.unpack_from("<qI", raw, 96)
    dev_major, dev_minor = struct.unpack_from("<II", raw, 136)
    btime = b_sec * 1_000_000_000 + b_nsec if mask & _STATX_BTIME else 0
    return Identity(os.makedev(dev_major, dev_minor), ino, btime,
                    c_sec * 1_000_000_000 + c_nsec, size)


def identity_of_path(path: str) -> Identity:
    """(dev, ino, birth time, ctime, size) of the file at `path`."""
    if _statx is not None:
        return _identity_statx(_AT_FDCWD, os.fsencode(path), 0)
    st = os.stat(path)
    return Identity(st.st_dev, st.st_ino, 0, st.st_ctime_ns, st.st_size)


def identity_of_fd(fd: int) -> Identity:
    if _statx is not None:
        return _identity_statx(fd, b"", _AT_EMPTY_PATH)
    st = os.fstat(fd)
    return Identity(st.st_dev, st.st_ino, 0, st.st_ctime_ns, st.st_size)


# --- dead letters ------------------------------------------------------------

def dead_letter(root: str, path: str, label: str) -> Optional[str]:
    """Move `path` (a file or directory copiers did not expect) into
    `<root>/dead-letter/`, under a unique name built from `label`.  Returns
    the new path, or None if `path` vanished meanwhile."""
    target_dir = os.path.join(root, DEAD_LETTER)
    os.makedirs(target_dir, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9._%-]", "_", label)[:180]
    target = os.path.join(target_dir, "%s.%d.%s" % (safe, int(time.time()), uuid.uuid4().hex[:8]))
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return None
    log.warning("moved unexpected %s to %s", path, target)
    prune_dead_letters(target_dir)
    return target


def _entry_size(path: str) -> int:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    return tree_size(path)[1] if stat.S_ISDIR(st.st_mode) else st.st_size


def dead_letters(target_dir: str) -> dict:
    """What `dead-letter/` holds: entries, bytes, and how many were dropped."""
    names = [n for n in listdir_or_empty(target_dir) if not n.startswith(DROPPED_FILE)]
    try:
        with open(os.path.join(target_dir, DROPPED_FILE)) as f:
            dropped = int(f.read().strip() or 0)
    except (OSError, ValueError):
        dropped = 0
    return {"entries": len(names), "bytes": sum(_entry_size(os.path.join(target_dir, n)) for n in names),
            "dropped": dropped}


def _drop(path: str) -> bool:
    """Delete a dead letter (a file, or a directory and all it holds);
    False when it cannot be (logged)."""
    remove = shutil.rmtree if os.path.isdir(path) and not os.path.islink(path) else os.unlink
    try:
        with contextlib.suppress(FileNotFoundError):
            remove(path)
    except OSError as e:
        log.warning("cannot drop dead letter %s: %s", path, e)
        return False
    return True


def prune_dead_letters(target_dir: str) -> int:
    """Delete the oldest entries of `dead-letter/` (by the time they were
    moved there) until at most `DEAD_LETTER_MAX_ENTRIES` entries and
    `DEAD_LETTER_MAX_BYTES` remain; how many were deleted (added to its
    `.dropped` count, logged)."""
    entries = []
    for name in listdir_or_empty(target_dir):
        if name.startswith(DROPPED_FILE):
            continue
        path = os.path.join(target_dir, name)
        try:
            moved = os.lstat(path).st_ctime_ns  # a rename sets it
        except FileNotFoundError:
            continue
        entries.append((moved, name, _entry_size(path)))
    entries.sort()
    total = sum(size for _, _, size in entries)
    dropped = 0
    while entries and (len(entries) > DEAD_LETTER_MAX_ENTRIES or total > DEAD_LETTER_MAX_BYTES):
        _, name, size = entries.pop(0)
        if not _drop(os.path.join(target_dir, name)):
            break
        total -= size
        dropped += 1
    if dropped:
        count = dead_letters(target_dir)["dropped"] + dropped
        write_atomic(os.path.join(target_dir, DROPPED_FILE), b"%d\n" % count)
        log.warning("%s: dropped the %d oldest dead letter(s) (%d in all): at most %d entries and %s are kept",
                    target_dir, dropped, count, DEAD_LETTER_MAX_ENTRIES, "%d MiB" % (DEAD_LETTER_MAX_BYTES >> 20))
    return dropped


class NotRegular(IsADirectoryError):
    """A directory, FIFO, socket or device where a spool file belongs."""


def open_regular(path: str) -> int:
    """A descriptor of the regular file at `path`; NotRegular for anything
    else.  Opened with O_NONBLOCK, so a FIFO planted in a spool cannot block
    a copier (the flag changes nothing for regular files)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegular(errno.EISDIR, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str, limit: int = -1) -> bytes:
    """The bytes (at most `limit`) of the regular file at `path` (see
    open_regular)."""
    with os.fdopen(open_regular(path), "rb") as f:
        return f.read(limit)


def write_new(path: str, data: bytes) -> bool:
    """Create `path` holding `data`, atomically (a temporary file linked into
    place): readers see nothing or all of it. False if it already exists."""
    tmp = "%s.%d.%d.tmp" % (path, os.getpid(), threading.get_ident())
    with open(tmp, "wb") as f:
        f.write(data)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        unlink_quiet(tmp)


def write_atomic(path: str, data: bytes) -> None:
    """Replace `path` with `data`, atomically (a temporary file renamed
    into place, named `path` plus a suffix)."""
    tmp = "%s.%d.%d.tmp" % (path, os.getpid(), threading.get_ident())
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def unlink_quiet(path: str, dir_fd: Optional[int] = None) -> bool:
    """Unlink; True if we removed it, False if it was already gone."""
    try:
        os.unlink(path, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return False


def rmdir_quiet(path: str) -> Optional[int]:
    """rmdir; None if the directory is gone now, else the errno (ENOTEMPTY...)."""
    try:
        os.rmdir(path)
        return None
    except FileNotFoundError:
        return None
    except OSError as e:
        return e.errno


def tree_size(path: str) -> tuple[int, int]:
    """(number of files, bytes) under `path` (0, 0 if absent)."""
    files = size = 0
    for dirpath, _dirs, names in os.walk(path):
        for n in names:
            try:
                size += os.lstat(os.path.join(dirpath, n)).st_size
                files += 1
            except FileNotFoundError:
                pass
    return files, size


def is_enotempty(err: Optional[int]) -> bool:
    return err in (errno.ENOTEMPTY, errno.EEXIST)


UUID_RE = re.compile(r"\A[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\Z")


def spool_databases(spool_dir: str, hostname: Optional[str] = None) -> list[tuple[str, str]]:
    """(source path, manifest name) of every database of this boot in the
    spool, sorted.  The manifest name is the one the writer staged (so the
    host name it used), or made from the source path and `hostname` (default
    this host) when given or when nothing is staged."""
    check_spool(spool_dir)
    found: dict[str, str] = {}
    for root in boot_roots(spool_dir)[0]:
        for db in list_dbdirs(root):
            source = db.source()
            if source is None:
                log.warning("%s: no source file recorded, skipped", db.path)
                continue
            names = []
            if hostname is None:
                names = [n for n in listdir_or_empty(db.sub(STAGING, META))
                         if fmt.parse_manifest_name(n) is not None]
            if not names:
                names = [fmt.manifest_name(source, hostname)]
            for name in names:
                found.setdefault(name, source)
    return sorted((source, name) for name, source in found.items())
