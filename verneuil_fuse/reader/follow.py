"""Followers: the inodes of live database names, each open handle on one of
its own, which move to the newest version at SQLite's transaction-start read
(no pyfuse3 here: `fs` calls in and gives the attribute invalidation).

Why (docs/DESIGN.md, "Replicas that follow"): a long-lived SQLite connection
must see new versions at its next read transaction, never inside one. SQLite
(``mode=ro``) reads the change counter (16 bytes at offset 24) at every
transaction start and drops its own cache when it changed; it never reads
offset 0 inside a transaction (page 1 stays pinned). So a handle may move to
the newest version at a READ at offset 0, and only there. The kernel's page
cache is per inode, so a handle that moves needs an inode of its own.

- **A follower** is an inode of a live name (``app.db``, not ``app.db@T``)
  that reads one version (a `Replica`) at a time. `acquire` (lookup,
  readdir) hands out a follower with no open handle, the most recently used
  (its page cache is hot: short-lived readers one after another keep their
  speed), else one whose handle reads the newest version (it may be free by
  the time the path is opened), else a new one. `may_open` refuses a
  follower that has a handle: the mount answers ESTALE, the kernel walks
  the path again with a fresh lookup (LOOKUP_REVAL) and opens another
  follower, so concurrent opens get inodes of their own. That retry's
  lookup gets a follower reserved for its thread for `RESERVE_SECONDS`
  (no other thread may open it), so that the retry succeeds and the
  program never sees ESTALE. A plain lookup reserves nothing: a `stat` in
  one thread and an open in another (Spark plans its tasks by the files'
  sizes on the driver, a web server stats before its workers open) share
  the follower and its hot page cache. A follower that the kernel forgot
  and no handle holds is dropped.
- **Generations.** What the kernel may hold in a follower's page cache is
  described by a generation: a version, its size and an mtime. A new
  generation (`_new_generation`) takes a new, larger mtime and invalidates
  the inode's attributes only (no page is touched, so this is safe in any
  request); the kernel asks for the attributes at its next read() or fstat
  (it revalidates them on every read: FUSE_AUTO_INVAL_DATA), sees the mtime
  change and drops the inode's pages there, in the caller's context, before
  that read goes on. `told` says whether the kernel was given the current
  generation's attributes since it began (the drop has happened).
- **A new version arrives** (`new_version`, from the catalog's install
  path): a follower with no handle moves to it (a new generation). One whose
  handle reads an older version is *behind*: it keeps serving that version
  to the handle, which may be inside a transaction, with its page cache.
- **Transaction starts.** SQLite (``mode=ro``, rollback journal) checks for
  a hot journal at the start of every read transaction, a ``stat`` of
  ``<database>-journal`` that reaches the mount as a LOOKUP, just before it
  reads the change counter (`transaction_starts`). The followers of that
  database that are behind are then *armed* for `ARM_SECONDS`, and those
  whose page cache may hold pages of their version start a new generation of
  that version: the counter read that follows drops their pages first, and
  its READ at offset 0 reaches the mount.
- **A READ at offset 0** of a follower that is behind and armed, with a page
  cache that holds nothing of its version (``told`` and no READ answered
  since the drop, ``dirty``), moves the handle to the newest version
  (`read_version`, `switch`) and starts a new generation: the kernel drops
  the pages at the next read() or fstat, before any other page is read
  (SQLite's next read, of the pages its new transaction needs). Every READ is answered
  from one version; READs at other offsets never move a handle.
- **What does not move**: a handle never armed (no transaction start seen:
  ``immutable=1`` connections, which never re-read the counter and trust
  their own cache; `cat`, `dd`, any reader that is not SQLite), so it keeps
  the version it opened and its page cache. A READ at offset 0 that finds pages
  of the old version cached since the drop does not move either: a reader
  could get offset 0 and those pages in one read(2), two versions in one
  buffer; the next transaction start drops them first.
- **Preload**: a follower's page cache is its own, so the bundled chunks
  of a version are stored in it (`opened` says when) at the open of a
  follower whose generation's attributes the kernel has (never inside a
  READ: storing pages of an inode with a READ in flight could deadlock).

Counters and the lag of switches are in `stats` and the catalog's histograms.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from verneuil_fuse.reader.catalog import Catalog
from verneuil_fuse.reader.replica import Replica
from verneuil_fuse.reader.tree import DbEntry, Parked

log = logging.getLogger(__name__)

# How long a transaction start (a LOOKUP of ``<database>-journal``) arms
# the followers of that database that are behind: SQLite reads the change
# counter microseconds after that stat, in the same thread; a second covers
# a loaded machine, and a follower armed by another connection's start
# moves only at a READ at offset 0 with a clean page cache anyway.
ARM_SECONDS = 1.0
# How long the follower handed out to the kernel's retry of an open answered
# ESTALE is kept for the retrying thread: the retry is two LOOKUPs and an
# OPEN from one thread within microseconds; 2 s covers a loaded machine.
RESERVE_SECONDS = 2.0


# Threads remembered as just refused an open (`Followers.may_open`) before
# the expired ones are pruned: a burst of concurrent opens, not a leak.
MAX_REFUSED = 1024


@dataclass(slots=True, eq=False)
class Follower:
    """An inode of a live database name (see the module docstring)."""

    inode: int
    entry: DbEntry
    size: int  # of the current generation's version
    mtime_ns: int  # of the current generation: never reused
    gen_ino: int  # inode of the current generation's version
    replica: Replica | None = None  # the version its open handle reads; None: no handle
    lookups: int = 0  # the kernel's references (FUSE forget)
    reserved_for: int | None = None  # thread id of the lookup it was handed to
    reserved_until: float = 0.0
    last_used: float = 0.0
    armed_until: float = 0.0  # a transaction start was seen (see the module docstring)
    told: bool = False  # the kernel was given this generation's attributes
    dirty: bool = True  # pages of the handle's version may be cached since the last drop
    preloaded: bool = False  # the bundled chunks were stored in this generation

    @property
    def key(self) -> str:
        return self.entry.key

    @property
    def path(self) -> str:
        return os.path.join(self.entry.parent.path, self.entry.name)


Version = Replica | Parked


class Followers:
    """The followers of one mount, by database (see the module docstring)."""

    def __init__(self, catalog: Catalog, *, reserve_seconds: float = RESERVE_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self.catalog = catalog
        self.reserve_seconds = reserve_seconds
        self.clock = clock
        # Invalidates an inode's attributes in the kernel (`fs` sets it).
        self.invalidate_attrs: Callable[[int], None] = lambda inode: None
        self._by_key: dict[str, list[Follower]] = {}
        # Threads whose open was just refused (ESTALE), until when: their
        # next lookup is the kernel's retry.
        self._refused: dict[int, float] = {}
        self.counts = dict.fromkeys(("created", "estale", "switches", "transaction_starts", "generations"), 0)
        catalog.on_new_version = self.new_version

    # ----------------------------------------------------------------- lookup
    def newest(self, f: Follower) -> Version | None:
        """The newest version of the follower's database; None when the
        database left the tree (or is known by name only for now)."""
        entry = f.entry
        return entry.current if self.catalog.entries.get(entry.key) is entry else None

    def acquire(self, entry: DbEntry, tid: int | None) -> Follower:
        """The follower a lookup (``tid``: the caller's thread) or a
        readdir (None) of ``entry``'s name gets; ``entry.current`` is set.

        One reserved for this thread, if any; else a free one (no handle,
        not reserved for another thread), the most recently used first;
        else, unless this thread's open was just refused, the most recently
        used one whose handle reads the newest version (an open through it
        may well find it free: programs that open a database for each query
        keep one follower and its page cache); else a new one. The lookup
        of a thread whose open was just refused (the kernel's retry, which
        must get a follower it can open) reserves what it gets."""
        now = self.clock()
        mine = self._mine(entry)
        chosen = None
        if tid is not None:
            chosen = next((f for f in mine if f.replica is None and f.reserved_for == tid
                           and f.reserved_until > now), None)
        if chosen is None:
            free = [f for f in mine if f.replica is None and (f.reserved_until <= now or f.reserved_for == tid)]
            chosen = max(free, key=lambda f: f.last_used, default=None)
        refused = tid is not None and self._refused.get(tid, 0.0) > now
        if chosen is None and not refused:
            newest = entry.current
            busy = [f for f in mine if f.replica is not None and newest is not None and f.replica.inode == newest.inode]
            chosen = max(busy, key=lambda f: f.last_used, default=None)
            if chosen is not None:
                return chosen
        if chosen is None:
            chosen = self._create(entry)
        if refused:
            chosen.reserved_for, chosen.reserved_until = tid, now + self.reserve_seconds
        return chosen

    def _create(self, entry: DbEntry) -> Follower:
        current = entry.current
        assert current is not None, "a follower of a database not read"
        f = self.catalog.add_node(lambda inode: Follower(inode, entry, current.size, current.mtime_ns, current.inode))
        self._by_key.setdefault(entry.key, []).append(f)
        self.counts["created"] += 1
        return f

    def remember(self, f: Follower) -> None:
        f.lookups += 1

    def forget(self, f: Follower, nlookup: int) -> None:
        f.lookups = max(0, f.lookups - nlookup)
        self._maybe_drop(f)

    def _maybe_drop(self, f: Follower) -> None:
        if f.lookups > 0 or f.replica is not None:
            return
        self.catalog.drop_node(f)
        siblings = self._by_key.get(f.key)
        if siblings is not None and f in siblings:
            siblings.remove(f)
            if not siblings:
                del self._by_key[f.key]

    # ------------------------------------------------------------ attributes
    def attributes(self, f: Follower) -> tuple[int, int]:
        """(size, mtime_ns) to answer the kernel; the kernel is then told
        the current generation (it drops the pages of the one before)."""
        self._sync(f, notify=False)  # these attributes are the news
        if not f.told:
            f.told, f.dirty = True, False
        return f.size, f.mtime_ns

    def _sync(self, f: Follower, notify: bool = True) -> None:
        """A follower with no handle moves to its database's newest version
        (a new generation); one with a handle keeps its generation."""
        newest = self.newest(f)
        if newest is not None and f.replica is None and newest.inode != f.gen_ino:
            self._new_generation(f, newest, notify)

    def _new_generation(self, f: Follower, version: Version, notify: bool = True) -> None:
        """Pages cached for ``f`` until now are to be dropped: new
        attributes, which the kernel is told to ask for (``notify``; not
        when they are being answered: an invalidation while a GETATTR is
        under way makes the kernel drop that answer)."""
        f.gen_ino, f.size = version.inode, version.size
        f.mtime_ns = max(version.mtime_ns, f.mtime_ns + 1)
        f.told = f.preloaded = False
        self.counts["generations"] += 1
        if notify and (f.lookups > 0 or f.replica is not None):
            self.invalidate_attrs(f.inode)

    def new_version(self, entry: DbEntry) -> None:
        """The catalog installed a new version of ``entry``."""
        for f in self._mine(entry):
            self._sync(f)

    def transaction_starts(self, entry: DbEntry) -> None:
        """A LOOKUP of ``<entry's name>-journal``: a SQLite connection of
        this database starts a read transaction. Its followers that are
        behind are armed, and get their pages dropped at their next read()
        unless that already happens (see the module docstring)."""
        self.counts["transaction_starts"] += 1
        until = self.clock() + ARM_SECONDS
        for f in self._mine(entry):
            newest = self.newest(f)
            if f.replica is None or newest is None or newest.inode == f.replica.inode:
                continue
            f.armed_until = until
            if f.told and f.dirty:
                self._new_generation(f, f.replica)

    def _mine(self, entry: DbEntry) -> list[Follower]:
        return [f for f in self._by_key.get(entry.key, ()) if f.entry is entry]

    # ------------------------------------------------------------ open/close
    def may_open(self, f: Follower, tid: int) -> bool:
        """Whether ``tid`` may open ``f`` now; otherwise the mount answers
        ESTALE and the kernel looks the name up again (another follower)."""
        now = self.clock()
        ok = (f.replica is None and self.newest(f) is not None
              and (f.reserved_for in (None, tid) or f.reserved_until <= now))
        if not ok:
            self.counts["estale"] += 1
            if len(self._refused) > MAX_REFUSED:
                self._refused = {t: until for t, until in self._refused.items() if until > now}
            self._refused[tid] = now + self.reserve_seconds
        return ok

    async def newest_decoded(self, f: Follower) -> Replica | None:
        """The newest version, decoded (read or unparked if need be; Stale
        or FetchError from the catalog); None when the database is gone."""
        entry = f.entry
        if self.catalog.entries.get(entry.key) is not entry:
            return None
        node = await self.catalog.decoded(await self.catalog.materialize(entry))
        return node if isinstance(node, Replica) else None

    async def refresh(self, f: Follower) -> None:
        """Read the database's newest version if it is known by name only
        (a listing changed it since), so that attributes are current."""
        entry = f.entry
        if self.catalog.entries.get(entry.key) is entry and entry.current is None:
            await self.catalog.materialize(entry)

    def opened(self, f: Follower, replica: Replica) -> bool:
        """``f`` now has a handle reading ``replica``; True when its bundled
        chunks are to be stored in the page cache now (once per generation,
        and only once the kernel has the generation's attributes)."""
        f.replica, f.reserved_for, f.reserved_until = replica, None, 0.0
        f.last_used, f.armed_until = self.clock(), 0.0
        self.catalog.opened(replica)
        if f.gen_ino != replica.inode:
            self._new_generation(f, replica)
        else:
            self._sync(f)
        preload = f.told and not f.preloaded
        if preload:  # pages of this version in the cache from now on
            f.preloaded = f.dirty = True
        return preload

    def released(self, f: Follower) -> None:
        replica, f.replica = f.replica, None
        f.last_used, f.armed_until = self.clock(), 0.0
        if replica is not None:
            self.catalog.released(replica)
        self._sync(f)
        self._maybe_drop(f)

    # ------------------------------------------------------------------ reads
    def read_version(self, f: Follower, off: int) -> tuple[Replica, Version | None]:
        """The version a READ of ``f``'s handle at ``off`` is answered from,
        and the version to move to first (or None): only at offset 0, armed,
        with a clean page cache (see the module docstring)."""
        current = f.replica
        assert current is not None, "a READ without an open handle"
        newest = self.newest(f)
        if (off == 0 and newest is not None and newest.inode != current.inode and f.told and not f.dirty
                and f.armed_until > self.clock()):
            return current, newest
        self.touched(f)
        return current, None

    def touched(self, f: Follower) -> None:
        """A READ is answered from the handle's version without a move: its
        pages may be cached."""
        f.dirty = True

    def still_clean(self, f: Follower, current: Replica) -> bool:
        """After an await: whether ``f`` may still move from ``current``."""
        return f.replica is current and f.told and not f.dirty

    def switch(self, f: Follower, replica: Replica) -> None:
        """Move ``f``'s handle to ``replica`` (a READ at offset 0 found the
        page cache clean): the next read() or fstat drops the pages."""
        old, f.replica = f.replica, replica
        self.catalog.opened(replica)
        if old is not None:
            self.catalog.released(old)
        f.armed_until = 0.0
        self._new_generation(f, replica)
        f.dirty = True  # this READ's pages, until the drop
        self.counts["switches"] += 1
        self.catalog.lag["switched"].observe(max(0.0, self.catalog.clock() - replica.mtime_ns / 1e9))
        log.debug("%s: a handle moved to version %s", replica.path, replica.version[:16])

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        followers = sum(len(v) for v in self._by_key.values())
        return {"followers": followers, **self.counts}
