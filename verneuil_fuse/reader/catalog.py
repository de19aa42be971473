"""The tree of replicas in a store, kept fresh by polling (no pyfuse3 here).

Layout: ``/<hostname>/<absolute path of the source database>``, from the
manifest names in the store, with directories synthesised; plus
``/.verneuil/stats`` (JSON, see `Catalog.stats`) and ``/.verneuil/metrics``
(the same numbers in Prometheus' text format, see `verneuil_fuse.metrics`).
Directory listings are
sorted by name, so readdir is stable.

Names (`paths.display_path`): a key that is no manifest name, a mangled one,
path components that cannot be directory entries; see that module.

Names first, manifests on demand: a poll lists the manifest keys (with
each blob's size and mtime) and builds the tree from the names alone. A
database known only by name is a `DbEntry` with an inode of its own and no
size: `ls` and `find` cost nothing more, and its attributes are handed to
the kernel uncached. Its manifest is fetched and decoded when its name is
looked up (a ``stat``, an ``open``), once, however many lookups wait on it.
A name that is not in the tree, in a directory that is, is looked up in the
store directly (its manifest name follows from the path), so a database
written after the last poll opens at once.

Versions: every manifest version that differs (chunk list or length) is a new
`Replica` with a new inode; a lookup finds the newest. An older version stays
reachable by inode while the kernel remembers it or a handle is open.

Memory: per database known by name, a `DbEntry` (its names, the listed size
and mtime, an inode: ~0.6 KB). At most ``decoded_limit`` manifests stay
decoded (`Replica`): past that bound the least recently used versions that
no handle has open are *parked*, down to a `Parked` record (size, mtime,
version, counters), their blob left in the manifest cache on disk
(`manifests.ManifestCache`); an open decodes it again, with no GET while the
cache holds it. A parked version the store no longer serves opens with
ESTALE (the kernel then looks the name up again).

A store of at most ``decoded_limit`` databases is read whole at each poll
(its manifests would all stay decoded anyway), so that a first query after a
mount or a new database costs no manifest GET; past that bound, manifests are
read on demand.

Polling: each poll lists the manifest bucket. A decoded database whose
listed size or mtime changed, or whose manifest was fetched less than
``SETTLE_SECONDS`` after its listed mtime (two uploads within one second of
the same size must not be missed), is fetched again at once; any other
database only forgets its manifest, fetched again at its next lookup. An
unchanged store costs one listing and no GET.

Past states: ``<database>@<time>`` (``app.db@2026-11-26T19:00:00Z``, any
time `history.parse_time` reads) in a database's directory is resolved on
lookup only (never listed) to a pinned replica of the version current at that
time (`past.PastStates`); an unknown database, a time no version is as old
as, or a name that is not a time is ENOENT. Real entries win: a database
whose own name holds an ``@`` is found as itself, also before a poll listed
it (the name is looked up in the store first, as any unlisted name).

Hydration (``hydrate``): each database's newest version is fetched into the
disk cache in the background; one that could not fetch every chunk is tried
again after ``HYDRATE_RETRY_SECONDS``; its progress is in the stats.

`Catalog` owns the tree (its nodes are in `tree`), lookups, and the versions
installed and dropped; its other jobs are parts in modules of their own:
`manifest_loads` (manifests read outside a poll, versions parked and
decoded again), `polling`, `handles` (open handles, what the follow loop
watches), `hydration` and `catalog_stats`.
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Any, Callable

import trio

from verneuil_fuse import metrics
from verneuil_fuse.history import BadTime, parse_time
from verneuil_fuse.reader.catalog_stats import CatalogStats
from verneuil_fuse.reader.fetcher import Fetcher
from verneuil_fuse.reader.handles import Handles
from verneuil_fuse.reader.hydration import HYDRATE_AT_ONCE, CatalogHydration, _Hydration
from verneuil_fuse.reader.manifest_loads import ManifestLoads
from verneuil_fuse.reader.manifests import ManifestCache
from verneuil_fuse.reader.past import PastStates, split_name
from verneuil_fuse.reader.paths import display_path
from verneuil_fuse.reader.polling import Polling
from verneuil_fuse.reader.replica import PrefetchConfig, Replica
from verneuil_fuse.reader.tree import CONTROL_DIR, DbEntry, Directory, Parked, StatsFile, mtime_ns_of

log = logging.getLogger(__name__)

ROOT_INODE = 1
# How often the store is listed (`refresh=`): a new database, a removed one
# and a new version of a database not in use (the follow loop checks those in
# use every half second) show within 10 s, and an unchanged store costs one
# listing per poll and no GET.
DEFAULT_REFRESH_INTERVAL = 10.0
STATS_NAME = "stats"
METRICS_NAME = "metrics"
# Decoded manifests kept in memory (see "Memory" above): a decoded small
# database costs ~90 KB (its bundled chunk 0 is most of it), a 1 GiB one
# ~0.5 MB more for its chunk list, so 256 stay within ~25-150 MB; versions
# open in a handle are never parked, whatever the bound.
DECODED_MANIFESTS = 256
# Bounds of the end-to-end lag histograms, in seconds (a version's commit,
# its manifest's ctime, to the moment new opens see it and to the moment an
# open handle moves to it): the follow loop's half second and the copier's
# pass are its usual share; a store outage or a slow copier shows past 10 s.
LAG_BUCKETS_S = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)


class Catalog(ManifestLoads, Polling, Handles, CatalogHydration, CatalogStats):
    """The tree of replicas (see the module's docstring): its inodes and
    nodes, lookups, versions installed and dropped; its parts, each in a
    module of its own, read manifests outside polls and park versions
    (`manifest_loads`), poll (`polling`), count open handles (`handles`),
    hydrate (`hydration`) and render the stats (`catalog_stats`)."""

    def __init__(
        self,
        fetcher: Fetcher,
        *,
        refresh_interval: float = DEFAULT_REFRESH_INTERVAL,
        prefetch: PrefetchConfig | None = None,
        hydrate: bool = False,
        on_invalidate: Callable[[int, str], None] | None = None,
        clock: Callable[[], float] = time.time,
        manifest_cache: ManifestCache | None = None,
        decoded_limit: int = DECODED_MANIFESTS,
        extra_stats: Callable[[], dict] | None = None,
        subdir: str = "",
    ):
        self.fetcher = fetcher
        # The directory of the whole tree (/<host>/<path...>) this catalog
        # shows as its root, as components; [] for the whole tree.
        self.subdir = [p for p in subdir.split("/") if p]
        self.refresh_interval = refresh_interval
        self.prefetch = prefetch or PrefetchConfig()
        self.hydrate = hydrate
        self.on_invalidate = on_invalidate
        self.clock = clock
        self.manifest_cache = manifest_cache
        self.decoded_limit = max(1, decoded_limit)
        self.extra_stats = extra_stats
        self._next_inode = ROOT_INODE + 1
        now_ns = time.time_ns()
        self.root = Directory(ROOT_INODE, "", None, mtime_ns=now_ns)
        self.inodes: dict[int, Any] = {ROOT_INODE: self.root}
        self.entries: dict[str, DbEntry] = {}
        self.polls = 0
        self.poll_errors = 0
        # Manifests that did not decode, by key: (size, mtime, fetched_at) of
        # the listed blob, not read again until it changes or its retry time
        # (polling.BAD_RETRY_S, doubling at each of `_bad_tries`) passed.
        self._bad: dict[str, tuple[int, float, float]] = {}
        self._bad_tries: dict[str, int] = {}
        self.last_poll = 0.0
        self.versions_seen = 0
        self.counts = dict.fromkeys(("loads", "unparks", "parks", "stale", "direct_lookups", "direct_found",
                                    "cache_dropped"), 0)
        # Per database (manifest key), since the mount started: opens, and
        # [reads, read bytes, preloaded bytes] of the versions no longer held
        # (`_retire`); the stats add those of the versions held.
        self._opens_total: dict[str, int] = {}
        self._retired: dict[str, list[int]] = {}
        # Decoded versions, least recently used first (see `decoded_limit`).
        self._decoded: OrderedDict[int, Replica] = OrderedDict()
        # Loads under way, by inode: later lookups wait for the first.
        self._loading: dict[int, trio.Event] = {}
        # Manifest keys looked up directly and absent from the store, until
        # the next poll (see `_lookup_unlisted`).
        self._absent: set[str] = set()
        # Keys found by name since the running poll began listing: that
        # listing may predate them, so it does not remove them.
        self._found_while_listing: set[str] = set()
        # Called with a DbEntry when a new version of it is installed (the
        # followers re-point or mark their inodes, see `follow.py`).
        self.on_new_version: Callable[[DbEntry], None] | None = None
        # Lag of new versions (`LAG_BUCKETS_S`): "visible" at install,
        # "switched" when an open handle moves to one (`follow.py`).
        self.lag = {"visible": metrics.Histogram(LAG_BUCKETS_S), "switched": metrics.Histogram(LAG_BUCKETS_S)}
        # Handles open per database key, and when each was last opened
        # (time.monotonic()): what the follow loop watches (`in_use`).
        self._open_keys: dict[str, int] = {}
        self._last_opened: dict[str, float] = {}
        self._hydrations: dict[str, _Hydration] = {}
        self._hydrate_slots = trio.Semaphore(HYDRATE_AT_ONCE)
        self._warned_cache_size = False
        self._nursery: trio.Nursery | None = None
        control = self._mkdir(self.root, CONTROL_DIR)
        self.stats_file = StatsFile(self._alloc(), self.render_stats)
        control.entries[STATS_NAME] = self.stats_file  # type: ignore[assignment]
        self.inodes[self.stats_file.inode] = self.stats_file
        self.metrics_file = StatsFile(self._alloc(), self.render_metrics)
        control.entries[METRICS_NAME] = self.metrics_file  # type: ignore[assignment]
        self.inodes[self.metrics_file.inode] = self.metrics_file
        self._control = control
        self.past = PastStates(fetcher, self._alloc, prefetch=self.prefetch)

    # ------------------------------------------------------------------ inodes
    def _alloc(self) -> int:
        inode = self._next_inode
        self._next_inode += 1
        return inode

    def _mkdir(self, parent: Directory, name: str) -> Directory:
        node = parent.entries.get(name)
        if isinstance(node, Directory):
            return node
        d = Directory(self._alloc(), name, parent, mtime_ns=time.time_ns())
        parent.entries[name] = d
        parent.mtime_ns = d.mtime_ns
        self.inodes[d.inode] = d
        return d

    def add_node(self, make: Callable[[int], Any]) -> Any:
        """A node of another module (a follower, `follow.py`), made by
        ``make`` with a new inode of the tree and found by `get`."""
        node = make(self._alloc())
        self.inodes[node.inode] = node
        return node

    def drop_node(self, node: Any) -> None:
        """Forget a node of `add_node`."""
        if self.inodes.get(node.inode) is node:
            del self.inodes[node.inode]

    def get(self, inode: int) -> Any:
        """What ``inode`` is: a Directory, a StatsFile, a Replica, a Parked
        version, or a DbEntry not read yet (see `materialize`)."""
        return self.inodes.get(inode)

    async def lookup(self, parent_inode: int, name: str) -> Any:
        """The node ``name`` in directory ``parent_inode``, its manifest read
        if it is a database known by name only; None if there is none (or its
        manifest is not valid). Store failures raise FetchError."""
        parent = self.inodes.get(parent_inode)
        if not isinstance(parent, Directory):
            return None
        node = parent.entries.get(name)
        if node is None:
            node = await self._lookup_unlisted(parent, name)
        if isinstance(node, DbEntry):
            return await self.materialize(node)
        return node

    async def materialize(self, node: Any) -> Any:
        """A node with its attributes known: a DbEntry's newest version
        (read now if need be; None if it is not valid), anything else as is."""
        if not isinstance(node, DbEntry):
            if isinstance(node, Replica) and node.inode in self._decoded:
                self._decoded.move_to_end(node.inode)
            return node
        entry = node
        while entry.current is None:
            if self.entries.get(entry.key) is not entry:
                return None  # gone from the store meanwhile
            waiting = self._loading.get(entry.inode)
            if waiting is not None:
                await waiting.wait()
                continue
            if not await self._single_flight(entry.inode, self._load_entry(entry)):
                return None
        return entry.current

    async def decoded(self, node: Any) -> Any:
        """``node`` ready to be opened: a parked version decoded again (Stale
        if the store no longer has it), a DbEntry read; others as is."""
        node = await self.materialize(node)
        while isinstance(node, Parked):
            if self.inodes.get(node.inode) is not node:
                node = self.inodes.get(node.inode)
                continue
            waiting = self._loading.get(node.inode)
            if waiting is not None:
                await waiting.wait()
            else:
                await self._single_flight(node.inode, self._unpark(node))
            node = self.inodes.get(node.inode)
        return node

    async def _single_flight(self, inode: int, work) -> Any:
        done = self._loading[inode] = trio.Event()
        try:
            return await work
        finally:
            del self._loading[inode]
            done.set()

    async def lookup_past(self, parent_inode: int, name: str) -> Replica | None:
        """The past state ``name`` (``<database>@<time>``) in directory
        ``parent_inode``, or None. Store failures raise FetchError."""
        parent = self.inodes.get(parent_inode)
        parts = split_name(name)
        if not isinstance(parent, Directory) or parts is None:
            return None
        entry = parent.entries.get(parts[0])
        if not isinstance(entry, DbEntry):
            return None
        try:
            at_ns = parse_time(parts[1], now_ns=int(self.clock() * 1e9))
        except BadTime:
            return None
        current = await self.materialize(entry)
        live = current.version if current is not None else ""
        replica = await self.past.resolve(entry.key, os.path.join(parent.path, name), at_ns, live=live)
        if replica is not None:
            self.inodes[replica.inode] = replica
        return replica

    def listdir(self, inode: int) -> list[tuple[str, Any]]:
        d = self.inodes.get(inode)
        if not isinstance(d, Directory):
            return []
        out = []
        for name in sorted(d.entries):
            node = d.entries[name]
            if isinstance(node, DbEntry) and node.current is not None:
                node = node.current
            out.append((name, node))
        return out

    def remember(self, node: Any) -> None:
        """The kernel learnt an inode (lookup/readdirplus)."""
        if isinstance(node, (Replica, Parked, DbEntry)):
            node.lookups += 1

    def forget(self, inode: int, nlookup: int) -> None:
        node = self.inodes.get(inode)
        if isinstance(node, DbEntry):
            node.lookups = max(0, node.lookups - nlookup)
            if node.lookups == 0 and self.entries.get(node.key) is not node:
                self.inodes.pop(inode, None)
        elif isinstance(node, (Replica, Parked)):
            node.lookups = max(0, node.lookups - nlookup)
            self._maybe_drop(node)

    def _is_current(self, node: Any) -> bool:
        entry = self.entries.get(node.key)
        return entry is not None and entry.current is node

    def _maybe_drop(self, node: Any) -> None:
        if node.lookups <= 0 and node.opens <= 0 and not self._is_current(node):
            if self.inodes.get(node.inode) is node:
                del self.inodes[node.inode]
                self._retire(node)
            self._decoded.pop(node.inode, None)
            if isinstance(node, Replica):
                self.past.forget(node)

    def _retire(self, node: Replica | Parked) -> None:
        """A version leaves the catalog: its counters join its database's
        running totals (`stats`' ``since_mount``), and start again from 0
        should it come back (a past state held again)."""
        total = self._retired.setdefault(node.key, [0, 0, 0])
        total[0] += node.reads
        total[1] += node.read_bytes
        total[2] += node.preloaded
        node.reads = node.read_bytes = node.preloaded = 0

    # ------------------------------------------------------ names and versions
    def _place(self, key: str) -> tuple[Directory, str] | None:
        """The directory and name where `key` is shown, or None: outside
        ``subdir`` (silently), or a key that cannot be shown (warned)."""
        where = display_path(key)
        if where is None:
            if self.subdir:
                return None
            other = self._mkdir(self._control, "other")
            return other, key
        host, parts = where
        if not parts:
            log.warning("manifest %s names no file; skipped", key)
            return None
        parts = [host] + parts
        if self.subdir:
            n = len(self.subdir)
            if parts[:n] != self.subdir or len(parts) == n or parts[n] == CONTROL_DIR:
                return None
            parts = parts[n:]
        d = self.root
        for part in parts[:-1]:
            node = d.entries.get(part)
            if isinstance(node, DbEntry):
                log.warning("%s: %s is a database, cannot also be a directory; skipped", key, part)
                return None
            d = self._mkdir(d, part)
        return d, parts[-1]

    def _add(self, key: str, size: int, mtime: float) -> DbEntry | None:
        """A database known by name only joins the tree."""
        placed = self._place(key)
        if placed is None:
            return None
        parent, name = placed
        if name in parent.entries:
            log.warning("%s: %s already names another entry; skipped", key, os.path.join(parent.path, name))
            return None
        entry = DbEntry(key, name, parent, size, mtime, self._alloc())
        self.entries[key] = entry
        parent.entries[name] = entry
        self.inodes[entry.inode] = entry
        parent.mtime_ns = time.time_ns()
        if self.hydrate and self._nursery is not None:
            self._start_hydration(key)
        return entry

    def bind(self, nursery: trio.Nursery) -> None:
        """Background work (hydration) runs in this nursery."""
        self._nursery = nursery

    def _install(self, entry: DbEntry, manifest, fetched_at: float) -> None:
        """``manifest`` is the newest version of ``entry``: a new Replica
        unless it equals the current one."""
        entry.fetched_at = fetched_at
        old = entry.current
        if old is not None:
            old_version = old.version if isinstance(old, Parked) else old.manifest.contents_fprint.hex()
            if (old_version == manifest.contents_fprint.hex() and old.size == manifest.len
                    and (isinstance(old, Parked) or old.manifest.header_fprint == manifest.header_fprint)):
                return
        parent, name = entry.parent, entry.name
        inode = entry.inode if old is None else self._alloc()
        replica = Replica(
            key=entry.key,
            path=os.path.join(parent.path, name),
            manifest=manifest,
            fetcher=self.fetcher,
            inode=inode,
            mtime_ns=mtime_ns_of(manifest, entry.listed_mtime if entry.listed_mtime >= 0 else fetched_at),
            prefetch=self.prefetch,
        )
        self.inodes[inode] = replica
        self.versions_seen += 1
        entry.current = replica
        if old is None:
            replica.lookups, entry.lookups = entry.lookups, 0
            log.debug("database %s: %d bytes, version %s", replica.path, replica.size, replica.version[:16])
        else:
            entry.inode = inode
            self._maybe_drop(old)
            log.info("new version of %s (%d bytes, version %s)", replica.path, replica.size, replica.version[:16])
            self.lag["visible"].observe(max(0.0, self.clock() - replica.mtime_ns / 1e9))
            if self.on_invalidate is not None:
                self.on_invalidate(parent.inode, name)
            parent.mtime_ns = time.time_ns()
            if self.hydrate and self._nursery is not None:
                self._start_hydration(entry.key)
        self._keep_decoded(replica)
        if old is not None and self.on_new_version is not None:
            self.on_new_version(entry)

    def _remove(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:  # removed meanwhile (a poll, another lookup)
            return
        parent = entry.parent
        if parent.entries.get(entry.name) is entry:
            del parent.entries[entry.name]
        log.info("database %s is gone from the store", os.path.join(parent.path, entry.name))
        h = self._hydrations.pop(key, None)
        if h is not None:
            h.scope.cancel()
        if entry.current is not None:
            self._maybe_drop(entry.current)
        elif entry.lookups <= 0:
            self.inodes.pop(entry.inode, None)
        parent.mtime_ns = time.time_ns()
        if self.on_invalidate is not None:
            self.on_invalidate(parent.inode, entry.name)
        # Prune directories left empty (never the root or the control dir).
        d = parent
        while d.parent is not None and not d.entries and d is not self._control:
            up = d.parent
            if up.entries.get(d.name) is d:
                del up.entries[d.name]
                if self.on_invalidate is not None:
                    self.on_invalidate(up.inode, d.name)
            d = up

