"""The pyfuse3 `Operations`: FUSE requests in, calls on the catalog and
replicas out, errors translated to errno. The only module that raises
``FUSEError``; it holds no state beyond open handles.

- Read-only: opening for writing fails with EROFS, every modifying call too.
- Database files: ``keep_cache=True``, never ``direct_io``; their
  attributes may be cached long. Entries are cached for ``entry_timeout`` and
  invalidated when a new version replaces them.
- Following (the default, `follow.Followers`): a live name is looked up to
  a follower, an inode of its own per open handle, which moves to the newest
  version at a READ at offset 0 (SQLite's transaction start); an open of a
  follower that has a handle, or that a lookup of another thread holds, is
  answered ESTALE, and the kernel then looks the name up again and opens
  another. A follower's page cache is dropped through its attributes (a new
  mtime after an attribute-only invalidation), never by touching pages from
  a request. Without following (``follow=off``), a live name is looked up to
  its newest version's inode, which an open handle reads until it is closed
  (a version is an inode whose bytes never change, so the page cache stays
  valid); past states are always such pinned inodes.
- At a version's first open (a follower's: once per generation of its page
  cache), its bundled chunks (chunk 0, and the chunks of the upper b-tree
  levels a writer may bundle) are stored in the kernel's page cache, before
  any read.
- Past states (``app.db@<time>``, see `catalog`) are looked up like any
  name, with a store request or a few when not cached; a store that fails
  then answers ``EREMOTEIO``.
- ``/.verneuil/stats`` is rendered at open (``direct_io``, so its size does
  not matter).
- Errors: a read whose chunk cannot be obtained from the store (unreachable,
  timed out, missing or failing verification) fails with ``EREMOTEIO``, not
  ``EIO``: SQLite turns ``EIO`` into "database disk image is malformed"
  (SQLITE_IOERR_CORRUPTFS) but any other errno into "disk I/O error", and a
  store outage is not a corrupt database. Every handler is guarded: an
  unexpected exception is logged and becomes ``EIO`` for that one request,
  never the end of the mount.
- Values from the store (times, sizes) are clamped to what the kernel's
  attributes can hold before they reach it.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

import pyfuse3

from verneuil_fuse.reader.catalog import Catalog
from verneuil_fuse.reader.fetcher import FetchError
from verneuil_fuse.reader.follow import Follower, Followers
from verneuil_fuse.format import CHUNK_SIZE
from verneuil_fuse.reader.replica import Cursor, Replica
from verneuil_fuse.reader.tree import DbEntry, Directory, Parked, Stale, StatsFile

log = logging.getLogger(__name__)

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_CREAT | os.O_APPEND

# The errno of a read whose chunk the store could not give (see the module
# docstring for why not EIO).
STORE_ERRNO = errno.EREMOTEIO
# Largest time and size handed to the kernel: pyfuse3 takes times as unsigned
# 64-bit nanoseconds and sizes as a signed 64-bit off_t; anything outside
# (a manifest is written by whoever can write the store) would raise inside
# the handler instead of answering.
MAX_TIME_NS = (1 << 63) - 1
# What SQLite appends to a database's name for its rollback journal, whose
# existence it checks at every read transaction's start (with ``stat``).
JOURNAL_SUFFIX = "-journal"
MAX_SIZE = (1 << 63) - 1

_F = TypeVar("_F", bound=Callable[..., Awaitable[Any]])


def _guarded(method: _F) -> _F:
    """A request handler whose unexpected exceptions become EIO for that
    request (logged with the traceback, counted), never the end of the mount:
    pyfuse3 ends its main loop on any exception that is not a FUSEError."""

    @functools.wraps(method)
    async def handler(self: "VerneuilFS", *args: Any, **kwargs: Any) -> Any:
        try:
            return await method(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception:  # noqa: BLE001 - one request fails, the mount stays
            self.handler_errors += 1
            log.exception("%s%r failed; answered EIO", method.__name__, args[:3])
            raise pyfuse3.FUSEError(errno.EIO) from None

    return handler  # type: ignore[return-value]


def _clamp(value: int, top: int) -> int:
    return max(0, min(int(value), top))


@dataclass
class _Handle:
    node: Any
    cursor: Cursor = field(default_factory=Cursor)
    data: bytes = b""  # rendered stats


class VerneuilFS(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(
        self,
        catalog: Catalog,
        *,
        entry_timeout: float,
        attr_timeout: float = 3600.0,
        dir_timeout: float = 1.0,
        uid: int | None = None,
        gid: int | None = None,
        umask: int = 0,
        followers: Followers | None = None,
    ):
        super().__init__()
        self.catalog = catalog
        self.followers = followers
        if followers is not None:
            followers.invalidate_attrs = self.invalidate_attrs
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        self.dir_timeout = dir_timeout
        # Owner and permissions of every entry: the mounting user's, read
        # for all, unless the mount's uid=, gid=, umask= say otherwise.
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.file_mode = 0o444 & ~umask
        self.dir_mode = 0o555 & ~umask
        self._handles: dict[int, _Handle] = {}
        self._dir_handles: dict[int, list[tuple[str, Any]]] = {}
        self._next_fh = 1
        self.read_errors = 0  # reads answered STORE_ERRNO or EIO
        self.handler_errors = 0  # unexpected exceptions answered EIO
        self.preload = True  # off once the kernel refuses notify_store
        self.mounted = False
        catalog.on_invalidate = self.invalidate

    # ---------------------------------------------------------------- helpers
    def invalidate(self, parent_inode: int, name: str) -> None:
        if self.mounted:
            pyfuse3.invalidate_entry_async(parent_inode, os.fsencode(name), ignore_enoent=True)

    def invalidate_attrs(self, inode: int) -> None:
        """Make the kernel ask for ``inode``'s attributes at its next use
        (attributes only: no page is touched, so no request can wait on it)."""
        if self.mounted:
            try:
                pyfuse3.invalidate_inode(inode, attr_only=True)
            except OSError as e:  # an inode the kernel already forgot
                log.debug("invalidate inode %d: %s", inode, e)

    def _live_entry(self, node: Any) -> DbEntry | None:
        """The database whose newest version ``node`` is, if it is one."""
        if not isinstance(node, (Replica, Parked)):
            return None
        entry = self.catalog.entries.get(node.key)
        return entry if entry is not None and entry.current is node else None

    def _follower_of(self, node: Any, tid: int | None) -> Any:
        """With following, the follower a live version's name is handed out
        as (`Followers.acquire`); anything else as is."""
        entry = self._live_entry(node) if self.followers is not None else None
        return node if entry is None else self.followers.acquire(entry, tid)

    def _transaction_starts(self, parent_inode: int, name: str) -> None:
        """SQLite looks for ``name``'s hot journal: one of its connections
        starts a read transaction (`Followers.transaction_starts`)."""
        parent = self.catalog.get(parent_inode)
        entry = parent.entries.get(name) if isinstance(parent, Directory) else None
        if isinstance(entry, DbEntry):
            self.followers.transaction_starts(entry)

    def _remember(self, node: Any) -> None:
        if isinstance(node, Follower):
            self.followers.remember(node)
        else:
            self.catalog.remember(node)

    def _node(self, inode: int) -> Any:
        node = self.catalog.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def attributes(self, node: Any) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_uid, a.st_gid = self.uid, self.gid
        a.generation = 0
        a.st_blksize = CHUNK_SIZE
        if isinstance(node, Directory):
            a.st_ino = node.inode
            a.st_mode = stat.S_IFDIR | self.dir_mode
            a.st_nlink = 2 + sum(isinstance(n, Directory) for n in node.entries.values())
            a.st_size = 0
            t = node.mtime_ns
            a.entry_timeout = a.attr_timeout = self.dir_timeout
        elif isinstance(node, DbEntry):
            # Known by name only (a listing): no size yet. Handed to the
            # kernel uncached, so that a stat looks it up (and reads it).
            a.st_ino = node.inode
            a.st_mode = stat.S_IFREG | self.file_mode
            a.st_nlink = 1
            a.st_size = 0
            t = int(max(0.0, node.listed_mtime) * 1e9)
            a.entry_timeout = a.attr_timeout = 0
        elif isinstance(node, (Replica, Parked, Follower)):
            a.st_ino = node.inode
            a.st_mode = stat.S_IFREG | self.file_mode
            a.st_nlink = 1
            if isinstance(node, Follower):
                a.st_size, t = self.followers.attributes(node)
            else:
                a.st_size, t = node.size, node.mtime_ns
            a.entry_timeout = self.entry_timeout
            a.attr_timeout = self.attr_timeout
        elif isinstance(node, StatsFile):
            a.st_ino = node.inode
            a.st_mode = stat.S_IFREG | self.file_mode
            a.st_nlink = 1
            a.st_size = 0
            t = self.catalog.root.mtime_ns
            a.entry_timeout = self.dir_timeout
            a.attr_timeout = 0
        else:  # pragma: no cover - the catalog holds nothing else
            raise pyfuse3.FUSEError(errno.EIO)
        a.st_size = _clamp(a.st_size, MAX_SIZE)
        a.st_blocks = -(-a.st_size // 512)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = _clamp(t, MAX_TIME_NS)
        return a

    # ------------------------------------------------------------ namespace
    @_guarded
    async def lookup(self, parent_inode, name, ctx=None):
        text = os.fsdecode(name)
        if text == ".":
            node = self._node(parent_inode)
        elif text == "..":
            node = self._node(parent_inode)
            node = node.parent or node if isinstance(node, Directory) else node
        else:
            if self.followers is not None and text.endswith(JOURNAL_SUFFIX):
                self._transaction_starts(parent_inode, text[: -len(JOURNAL_SUFFIX)])
            try:
                node = await self.catalog.lookup(parent_inode, text)
                if node is None and "@" in text:
                    node = await self.catalog.lookup_past(parent_inode, text)
            except FetchError as e:
                log.error("lookup %s: %s", text, e)
                raise pyfuse3.FUSEError(STORE_ERRNO) from None
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        node = self._follower_of(node, ctx.pid if ctx is not None else 0)
        self._remember(node)
        return self.attributes(node)

    @_guarded
    async def forget(self, inode_list):
        for inode, nlookup in inode_list:
            node = self.catalog.get(inode)
            if isinstance(node, Follower):
                self.followers.forget(node, nlookup)
            else:
                self.catalog.forget(inode, nlookup)

    @_guarded
    async def getattr(self, inode, ctx=None):
        try:
            node = self._node(inode)
            if isinstance(node, Follower):
                await self.followers.refresh(node)
            else:
                node = await self.catalog.materialize(node)
        except FetchError as e:
            log.error("getattr of inode %d: %s", inode, e)
            raise pyfuse3.FUSEError(STORE_ERRNO) from None
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.attributes(node)

    @_guarded
    async def access(self, inode, mode, ctx):
        self._node(inode)
        if mode & os.W_OK:
            raise pyfuse3.FUSEError(errno.EROFS)
        return True

    @_guarded
    async def opendir(self, inode, ctx):
        node = self._node(inode)
        if not isinstance(node, Directory):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        fh = self._fh()
        # A snapshot, so offsets stay meaningful while the catalog changes;
        # "." and ".." first, as `ls -a` and friends expect (the root's ".."
        # is itself: the kernel resolves what lies above the mount).
        self._dir_handles[fh] = [(".", node), ("..", node.parent or node)] + self.catalog.listdir(inode)
        return fh

    @_guarded
    async def readdir(self, fh, start_id, token):
        entries = self._dir_handles.get(fh)
        if entries is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        for i in range(start_id, len(entries)):
            name, node = entries[i]
            if i >= 2:
                node = self._follower_of(node, None)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self.attributes(node), i + 1):
                break
            if i >= 2:  # the kernel takes no reference for "." and ".."
                self._remember(node)

    @_guarded
    async def releasedir(self, fh):
        self._dir_handles.pop(fh, None)

    @_guarded
    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        total = self.catalog.known_bytes()
        s.f_bsize = s.f_frsize = CHUNK_SIZE
        s.f_blocks = -(-total // CHUNK_SIZE)
        s.f_bfree = s.f_bavail = 0
        s.f_files = len(self.catalog.inodes)
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    # ------------------------------------------------------------------ files
    @_guarded
    async def open(self, inode, flags, ctx):
        node = self._node(inode)
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        if isinstance(node, Directory):
            raise pyfuse3.FUSEError(errno.EISDIR)
        if isinstance(node, Follower):
            return await self._open_follower(node, ctx.pid if ctx is not None else 0)
        fh = self._fh()
        if isinstance(node, StatsFile):
            self._handles[fh] = _Handle(node, data=node.render())
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)
        node = await self._decoded_for_open(self.catalog.decoded(node), "inode %d" % inode)
        if not isinstance(node, Replica):
            raise pyfuse3.FUSEError(errno.ENOENT)
        if node.inode != inode:  # a newer version replaced what this inode named
            raise pyfuse3.FUSEError(errno.ESTALE)
        self.catalog.opened(node)
        self._handles[fh] = _Handle(node)
        self._preload(inode, node, node.take_preload() if self.preload else [])
        node.fetch_if_small()
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=False)

    @staticmethod
    async def _decoded_for_open(decoding: Awaitable[Any], what: str) -> Any:
        """The version an open reads (``decoding`` it); a version the store
        no longer has is ESTALE (the kernel looks the name up again), a
        store failure EREMOTEIO."""
        try:
            return await decoding
        except Stale as e:
            log.info("open: %s", e)
            raise pyfuse3.FUSEError(errno.ESTALE) from None
        except FetchError as e:
            log.error("open of %s: %s", what, e)
            raise pyfuse3.FUSEError(STORE_ERRNO) from None

    async def _open_follower(self, f: Follower, tid: int) -> pyfuse3.FileInfo:
        """Open a follower (`Followers.may_open`, else ESTALE) on its
        database's newest version."""
        if not self.followers.may_open(f, tid):
            raise pyfuse3.FUSEError(errno.ESTALE)
        replica = await self._decoded_for_open(self.followers.newest_decoded(f), f.path)
        if replica is None or not self.followers.may_open(f, tid):  # gone, or taken while it was read
            raise pyfuse3.FUSEError(errno.ESTALE)
        preload = self.followers.opened(f, replica)
        fh = self._fh()
        self._handles[fh] = _Handle(f)
        self._preload(f.inode, replica, replica.preload_chunks() if preload and self.preload else [])
        replica.fetch_if_small()
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=False)

    def _preload(self, inode: int, replica: Replica, chunks: list[tuple[int, bytes]]) -> None:
        """Store ``chunks`` of ``replica`` in ``inode``'s page cache, in an
        open, before any READ of it (`notify_store`)."""
        for off, data in chunks:
            try:
                pyfuse3.notify_store(inode, off, data)
            except OSError as e:
                self.preload = False
                log.info("the kernel does not take page-cache stores (%s): bundled chunks are read on demand", e)
                break
            replica.preloaded += len(data)

    async def _follower_replica(self, handle: _Handle, off: int) -> Replica:
        """The version a READ of a follower's handle is answered from,
        after moving the handle to the newest version when this READ may
        (`Followers.read_version`)."""
        f = handle.node
        current, target = self.followers.read_version(f, off)
        if target is None:
            return current
        try:
            newest = await self.catalog.decoded(target)
        except (Stale, FetchError) as e:
            log.info("%s: stays on version %s: %s", current.path, current.version[:16], e)
            newest = None
        if not isinstance(newest, Replica) or not self.followers.still_clean(f, current):
            self.followers.touched(f)
            return f.replica
        self.followers.switch(f, newest)
        handle.cursor = Cursor()
        return newest

    @_guarded
    async def read(self, fh, off, size):
        handle = self._handles.get(fh)
        if handle is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        node = handle.node
        if isinstance(node, StatsFile):
            return handle.data[off : off + size]
        try:
            if isinstance(node, Follower):
                node = await self._follower_replica(handle, off)
            log.debug("read %s [%d, +%d)", node.path, off, size)
            return await node.read(off, size, handle.cursor)
        except FetchError as e:
            self.read_errors += 1
            log.error("read %s [%d, +%d): %s", node.path, off, size, e)
            raise pyfuse3.FUSEError(STORE_ERRNO) from None
        except Exception:  # noqa: BLE001 - never a wrong byte, never a dead mount
            self.read_errors += 1
            log.exception("read %s [%d, +%d) failed", node.path, off, size)
            raise pyfuse3.FUSEError(errno.EIO) from None

    @_guarded
    async def release(self, fh):
        handle = self._handles.pop(fh, None)
        if handle is not None and isinstance(handle.node, Follower):
            self.followers.released(handle.node)
        elif handle is not None and isinstance(handle.node, Replica):
            self.catalog.released(handle.node)

    @_guarded
    async def flush(self, fh):
        return None

    # -------------------------------------------------------------- read-only
    async def _erofs(self, *args, **kwargs):
        raise pyfuse3.FUSEError(errno.EROFS)

    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _erofs
    create = write = setxattr = removexattr = _erofs
