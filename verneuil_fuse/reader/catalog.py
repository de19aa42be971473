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
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import trio

from verneuil_fuse import __version__, metrics
from verneuil_fuse.format import ManifestError
from verneuil_fuse.history import BadTime, parse_time
from verneuil_fuse.reader.fetcher import FetchError, Fetcher, HydrateProgress
from verneuil_fuse.reader.manifests import Cached, ManifestCache
from verneuil_fuse.reader.past import PastStates, split_name
from verneuil_fuse.reader.paths import display_path, key_of
from verneuil_fuse.reader.replica import PrefetchConfig, Replica
from verneuil_fuse.store import NotFound, StoreError, TooLarge

log = logging.getLogger(__name__)

ROOT_INODE = 1
# Latest ctime taken from a manifest, in seconds: 2**63 - 1 nanoseconds
# (year 2262), the most a file time can hold in the kernel's attributes.
MAX_CTIME_S = ((1 << 63) - 1) // 1_000_000_000 - 1
SETTLE_SECONDS = 5.0
CONTROL_DIR = ".verneuil"
STATS_NAME = "stats"
METRICS_NAME = "metrics"
# An eager hydration that could not fetch every chunk (a store outage, a
# missing chunk) is started again at the first poll this many seconds after
# it ended: the database does not stay half-hydrated until its next version,
# and a store that is down is not asked for every chunk at every poll.
HYDRATE_RETRY_SECONDS = 60.0
# Databases hydrated at the same time; the others wait their turn ("queued").
# Each one keeps `prefetch_concurrency` GETs busy already: more at once would
# only queue flights ahead of the readahead of the files being read (whose
# prefetches are dropped past the fetcher's bound on prefetch flights).
HYDRATE_AT_ONCE = 2
# Decoded manifests kept in memory (see "Memory" above): a decoded small
# database costs ~90 KB (its bundled chunk 0 is most of it), a 1 GiB one
# ~0.5 MB more for its chunk list, so 256 stay within ~25-150 MB; versions
# open in a handle are never parked, whatever the bound.
DECODED_MANIFESTS = 256
# Manifests read at once when a poll reads every one of a small store
# (`Catalog._read_all`): more than the fetcher's threads for manifests
# (META_THREADS), so that they never wait on this bound, few enough that a
# lookup's own manifest read queues behind at most this many.
READ_ALL_AT_ONCE = 8
# Names SQLite looks for beside a database at every transaction (hot journal
# and WAL checks): never looked up in the store by name, since a writer never
# replicates them and each lookup would be a GET.
SQLITE_SIDE_FILES = ("-journal", "-wal", "-shm")
# Names remembered as absent from the store between two polls: beyond this
# many (a scan of a directory for many random names), all are forgotten at
# once, so the set stays small.
ABSENT_NAMES_MAX = 10_000
# Bounds of the end-to-end lag histograms, in seconds (a version's commit,
# its manifest's ctime, to the moment new opens see it and to the moment an
# open handle moves to it): the follow loop's half second and the copier's
# pass are its usual share; a store outage or a slow copier shows past 10 s.
LAG_BUCKETS_S = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
# The listed mtime of a database found by name before any listing showed it:
# no real mtime, so the next listing counts as a change (one more GET).
UNLISTED_MTIME = -1.0


@dataclass
class Directory:
    inode: int
    name: str
    parent: "Directory | None" = field(repr=False)
    entries: dict[str, "Directory | DbEntry"] = field(default_factory=dict, repr=False)
    mtime_ns: int = 0

    @property
    def path(self) -> str:
        parts = []
        node: Directory | None = self
        while node is not None and node.parent is not None:
            parts.append(node.name)
            node = node.parent
        return "/" + "/".join(reversed(parts))


@dataclass
class _Hydration:
    """The eager hydration of one database (its newest version)."""

    version: str
    progress: HydrateProgress = field(default_factory=HydrateProgress)
    state: str = "queued"  # queued, running, done, incomplete
    finished_at: float = 0.0
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)

    def describe(self) -> dict:
        p = self.progress
        out = {"state": self.state, "version": self.version, "chunks": p.chunks, "fetched": p.done,
               "failed": p.failed}
        if p.error is not None:
            out["error"] = p.error
        return out


@dataclass(slots=True, eq=False)
class DbEntry:
    """A database in the tree, known by name from the listing.

    ``current`` is its newest version when its manifest was read since the
    listing last changed (a decoded `Replica` or a `Parked` one), else None:
    then ``inode`` is the inode its next version gets, the catalog maps it
    to this entry, and ``lookups`` counts the kernel's references to it."""

    key: str
    name: str
    parent: Directory = field(repr=False)
    size: int  # listed size of the manifest blob
    listed_mtime: float
    inode: int
    fetched_at: float = 0.0  # when its manifest was last fetched (0: not since listed)
    current: "Replica | Parked | None" = field(default=None, repr=False)
    lookups: int = 0


@dataclass(slots=True, eq=False)
class Parked:
    """A version whose decoded manifest left memory (see the module
    docstring): what its attributes and the stats need."""

    key: str
    path: str
    inode: int
    size: int
    mtime_ns: int
    version: str
    nchunks: int
    lookups: int
    reads: int
    read_bytes: int
    preloaded: int
    opens: int = 0

    @classmethod
    def of(cls, r: Replica) -> "Parked":
        return cls(r.key, r.path, r.inode, r.size, r.mtime_ns, r.version, r.nchunks, r.lookups, r.reads,
                   r.read_bytes, r.preloaded)


class Stale(Exception):
    """A parked version the store no longer serves (ESTALE)."""


@dataclass
class StatsFile:
    inode: int
    render: Callable[[], bytes]


def mtime_ns_of(manifest, listed_mtime: float) -> int:
    """A replica's mtime: the source's ctime the manifest carries when it is
    a plausible time (from 1970 to `MAX_CTIME_S`, nanoseconds below one
    second), else the listed mtime of the manifest blob. A manifest is
    written by whoever can write the store; its times must not reach the
    kernel unchecked."""
    seconds, nanos = manifest.ctime, manifest.ctime_ns
    if 0 < seconds <= MAX_CTIME_S and 0 <= nanos < 1_000_000_000:
        return seconds * 1_000_000_000 + nanos
    listed = listed_mtime if 0 <= listed_mtime <= MAX_CTIME_S else 0
    return int(listed * 1e9)


class Catalog:
    def __init__(
        self,
        fetcher: Fetcher,
        *,
        refresh_interval: float = 10.0,
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
        # the listed blob. Not fetched (nor logged) again until it changes.
        self._bad: dict[str, tuple[int, float, float]] = {}
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

    def opened(self, replica: Replica) -> None:
        replica.opens += 1
        self._opens_total[replica.key] = self._opens_total.get(replica.key, 0) + 1
        self._open_keys[replica.key] = self._open_keys.get(replica.key, 0) + 1
        self._last_opened[replica.key] = time.monotonic()
        if replica.inode in self._decoded:
            self._decoded.move_to_end(replica.inode)

    def released(self, replica: Replica) -> None:
        replica.opens -= 1
        left = self._open_keys.get(replica.key, 0) - 1
        if left > 0:
            self._open_keys[replica.key] = left
        else:
            self._open_keys.pop(replica.key, None)
        self._maybe_drop(replica)
        if replica.opens <= 0:
            self._trim()

    def in_use(self, recent: float, limit: int) -> list[DbEntry]:
        """At most ``limit`` databases of the tree, those with an open
        handle first, then those opened within the last ``recent`` seconds,
        the most recently opened first (past states excluded: their
        versions never change)."""
        now = time.monotonic()
        for key, at in list(self._last_opened.items()):
            if now - at > recent and key not in self._open_keys:
                del self._last_opened[key]
        keys = sorted(self._last_opened, key=lambda k: (k not in self._open_keys, -self._last_opened[k]))
        out = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None:
                out.append(entry)
                if len(out) >= limit:
                    break
        return out

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

    # ------------------------------------------------------- decoded versions
    def _keep_decoded(self, replica: Replica) -> None:
        self._decoded[replica.inode] = replica
        self._decoded.move_to_end(replica.inode)
        self._trim()

    def _trim(self) -> None:
        """Park the least recently used decoded versions that no handle has
        open, down to ``decoded_limit`` (open ones stay, whatever the bound)."""
        if len(self._decoded) <= self.decoded_limit:
            return
        for inode in list(self._decoded):
            if len(self._decoded) <= self.decoded_limit:
                break
            replica = self._decoded[inode]
            if replica.opens > 0:
                continue
            del self._decoded[inode]
            if self.inodes.get(inode) is not replica:
                continue
            parked = Parked.of(replica)
            self.inodes[inode] = parked
            entry = self.entries.get(replica.key)
            if entry is not None and entry.current is replica:
                entry.current = parked
            self.counts["parks"] += 1

    async def _unpark(self, parked: Parked) -> None:
        """Decode a parked version again (from the manifest cache, else the
        store); Stale when neither has that version any more."""
        self.counts["unparks"] += 1
        cached = await self._cache_get(parked.key)
        manifest = None
        if cached is not None and cached.version == parked.version:
            manifest = await self._decode_cached(parked.key, parked.path, cached.blob)
        if manifest is None:
            try:
                blob = await self._fetch_blob(parked.key)
                manifest = await self.fetcher.decode_manifest(blob)
            except (ManifestError, TooLarge, NotFound) as e:
                raise Stale("%s: version %s is gone (%s)" % (parked.path, parked.version[:16], e)) from None
        if manifest.contents_fprint.hex() != parked.version:
            self.counts["stale"] += 1
            raise Stale("%s: version %s is no longer in the store" % (parked.path, parked.version[:16]))
        if self.inodes.get(parked.inode) is not parked:
            return  # forgotten meanwhile
        replica = Replica(key=parked.key, path=parked.path, manifest=manifest, fetcher=self.fetcher,
                          inode=parked.inode, mtime_ns=parked.mtime_ns, prefetch=self.prefetch)
        replica.lookups, replica.reads = parked.lookups, parked.reads
        replica.read_bytes, replica.preloaded = parked.read_bytes, parked.preloaded
        self.inodes[parked.inode] = replica
        entry = self.entries.get(parked.key)
        if entry is not None and entry.current is parked:
            entry.current = replica
        self._keep_decoded(replica)

    # ---------------------------------------------------------- reading names
    async def _load_entry(self, entry: DbEntry) -> bool:
        """Read and decode the manifest of ``entry`` (known by name only),
        from the manifest cache when it holds the listed blob; install it as
        the entry's newest version. False when it is not valid."""
        self.counts["loads"] += 1
        path = os.path.join(entry.parent.path, entry.name)
        cached = await self._cache_get(entry.key)
        manifest = None
        blob = None
        fetched_at = 0.0
        if (cached is not None and (cached.size, cached.mtime) == (entry.size, entry.listed_mtime)
                and cached.fetched_at - cached.mtime >= SETTLE_SECONDS):
            manifest = await self._decode_cached(entry.key, path, cached.blob)
            if manifest is not None:
                blob, fetched_at = cached.blob, cached.fetched_at
        try:
            if manifest is None:
                blob = await self._fetch_blob(entry.key)
                fetched_at = self.clock()
                manifest = await self.fetcher.decode_manifest(blob)
        except NotFound:
            log.info("database %s is gone from the store", path)
            self._remove(entry.key)
            return False
        except (ManifestError, TooLarge) as e:
            self.poll_errors += 1
            if not (isinstance(e, ManifestError) and e.rule == "base-chunk"):
                self._bad[entry.key] = (entry.size, entry.listed_mtime, fetched_at or self.clock())
            log.warning("cannot load manifest %s: %s", entry.key, e)
            self._remove(entry.key)
            return False
        if self.entries.get(entry.key) is not entry:
            return False
        await self._cache_put(entry, fetched_at, manifest, blob)
        self._install(entry, manifest, fetched_at)
        return True

    async def offer(self, entry: DbEntry, blob: bytes, fetched_at: float) -> bool:
        """A manifest blob of ``entry`` read outside a poll (the follow
        loop's checks): installed through the same path as a poll's, a new
        version unless it equals the current one. False when it does not
        decode (logged, counted; the next poll decides about the entry) or
        the entry left the tree meanwhile."""
        try:
            manifest = await self.fetcher.decode_manifest(blob)
        except (ManifestError, TooLarge) as e:
            self.poll_errors += 1
            log.warning("cannot load manifest %s: %s", entry.key, e)
            return False
        if self.entries.get(entry.key) is not entry:
            return False
        await self._cache_put(entry, fetched_at, manifest, blob)
        if self.entries.get(entry.key) is not entry:
            return False
        self._install(entry, manifest, fetched_at)
        return True

    async def _fetch_blob(self, key: str) -> bytes:
        try:
            return await self.fetcher.get_manifest_blob(key)
        except (NotFound, TooLarge):
            raise
        except StoreError as e:
            raise FetchError("manifest %s: %s" % (key, e)) from None

    async def _decode_cached(self, key: str, path: str, blob: bytes) -> Any:
        """The manifest a blob of the manifest cache decodes to; None when
        it does not (a damaged local copy, never the store's answer): the
        entry is dropped and logged, and the caller asks the store."""
        try:
            return await self.fetcher.decode_manifest(blob)
        except (ManifestError, TooLarge) as e:
            self.counts["cache_dropped"] += 1
            log.warning("manifest cache: the copy of %s does not decode (%s): dropped, read from the store",
                        path, e)
            assert self.manifest_cache is not None
            await trio.to_thread.run_sync(self.manifest_cache.drop, key)
            return None

    async def _cache_get(self, key: str) -> Cached | None:
        if self.manifest_cache is None:
            return None
        return await trio.to_thread.run_sync(self.manifest_cache.get, key)

    async def _cache_put(self, entry: DbEntry, fetched_at: float, manifest, blob: bytes) -> None:
        if self.manifest_cache is None:
            return
        record = Cached(entry.size, entry.listed_mtime, fetched_at, manifest.contents_fprint.hex(), bytes(blob))
        await trio.to_thread.run_sync(self.manifest_cache.put, entry.key, record)

    async def _lookup_unlisted(self, parent: Directory, name: str) -> DbEntry | None:
        """A database not in the tree, looked up by its manifest name (one
        GET): found, it joins the tree at once. Only in a host's directories,
        not for SQLite's own side files (a writer never replicates them,
        and a reader asks for them at every transaction), and once per name
        between two polls. A name with an ``@`` is looked up too, before
        it may be read as a past state (a real database always wins): a
        store failure then raises FetchError rather than let the past
        state of another database answer."""
        parts = []
        node: Directory | None = parent
        while node is not None and node.parent is not None:
            parts.append(node.name)
            node = node.parent
        parts.reverse()
        if (parts and parts[0] == CONTROL_DIR) or name.endswith(SQLITE_SIDE_FILES):
            return None
        parts = self.subdir + parts
        if not parts:
            return None
        path = "/" + "/".join(parts[1:] + [name])
        key = key_of(parts[0], parts[1:] + [name])
        if key is None or key in self._absent or key in self.entries or key in self._bad:
            return None
        if len(self._absent) >= ABSENT_NAMES_MAX:
            self._absent.clear()
        self.counts["direct_lookups"] += 1
        try:
            blob = await self._fetch_blob(key)
        except NotFound:
            self._absent.add(key)
            return None
        except TooLarge as e:
            self._bad[key] = (-1, UNLISTED_MTIME, self.clock())
            log.warning("cannot load manifest %s: %s", key, e)
            return None
        except FetchError as e:
            log.warning("lookup of %s in the store: %s", path, e)
            if "@" in name:
                raise
            return None
        entry = self._add(key, len(blob), UNLISTED_MTIME)
        if entry is None:
            return None
        self.counts["direct_found"] += 1
        self._found_while_listing.add(key)
        log.info("new database %s (found by name)", os.path.join(parent.path, name))
        try:
            manifest = await self.fetcher.decode_manifest(blob)
        except (ManifestError, TooLarge) as e:
            self._bad[key] = (entry.size, entry.listed_mtime, self.clock())
            log.warning("cannot load manifest %s: %s", key, e)
            self._remove(key)
            return None
        self._install(entry, manifest, self.clock())
        return entry

    # ----------------------------------------------------------------- refresh
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

    async def run(self) -> None:
        """Poll forever, every ``refresh_interval`` seconds."""
        while True:
            await trio.sleep(self.refresh_interval)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - keep serving what we have
                self.poll_errors += 1
                log.exception("refresh failed")

    async def refresh(self, raise_errors: bool = False) -> None:
        """One poll. A listing error is logged and counted, or raised (as a
        StoreError) with ``raise_errors`` (for the first poll at mount)."""
        self.polls += 1
        self._found_while_listing = set()
        try:
            infos = await self.fetcher.list_manifests()
        except StoreError as e:
            self.poll_errors += 1
            if raise_errors:
                raise
            log.warning("cannot list manifests: %s", e)
            return
        self.last_poll = self.clock()
        self._absent.clear()
        listed = set()
        added = 0
        todo = []
        for info in infos:
            key = info.key
            listed.add(key)
            entry = self.entries.get(key)
            if entry is None:
                bad = self._bad.get(key)
                if bad is None or bad[:2] != (info.size, info.mtime) or bad[2] - info.mtime < SETTLE_SECONDS:
                    self._bad.pop(key, None)
                    added += self._add(key, info.size, info.mtime) is not None
                continue
            if (entry.size == info.size and entry.listed_mtime == info.mtime
                    and (entry.current is None or entry.fetched_at - info.mtime >= SETTLE_SECONDS)):
                continue
            if isinstance(entry.current, Replica):
                todo.append((entry, info))
            else:
                self._relist(entry, info.size, info.mtime)
        if added:
            log.info("%d new database(s) in the store (%d in all)", added, len(self.entries))
        await self._reload(todo)
        for key in self.entries.keys() - listed - self._found_while_listing:
            self._remove(key)
        for key in self._bad.keys() - listed:
            del self._bad[key]
        if len(self.entries) <= self.decoded_limit:
            await self._read_all()
        if self.hydrate and self._nursery is not None:
            self._after_poll_hydration()

    async def _read_all(self) -> None:
        """A store whose databases all fit in ``decoded_limit``: read every
        manifest not read yet, now (in parallel, ``READ_ALL_AT_ONCE`` at a
        time), so that a first query costs no manifest GET, as a mount of
        such a store can keep them all decoded anyway."""
        todo = [e for e in self.entries.values() if e.current is None and e.inode not in self._loading]
        if not todo:
            return
        slots = trio.Semaphore(READ_ALL_AT_ONCE)

        async def read(entry: DbEntry) -> None:
            async with slots:
                try:
                    await self.materialize(entry)
                except FetchError as e:
                    self.poll_errors += 1
                    log.warning("cannot load manifest %s: %s", entry.key, e)

        async with trio.open_nursery() as nursery:
            for entry in todo:
                nursery.start_soon(read, entry)

    def _relist(self, entry: DbEntry, size: int, mtime: float) -> None:
        """The listing of a database not decoded changed: it forgets its
        version, read again at its next lookup under a new inode."""
        entry.size, entry.listed_mtime, entry.fetched_at = size, mtime, 0.0
        old = entry.current
        if old is None:
            return
        entry.current, entry.lookups = None, 0
        entry.inode = self._alloc()
        self.inodes[entry.inode] = entry
        self._maybe_drop(old)
        if self.on_invalidate is not None:
            self.on_invalidate(entry.parent.inode, entry.name)

    async def _reload(self, todo: list[tuple[DbEntry, Any]]) -> None:
        """Fetch again the manifests of decoded databases whose listing
        changed, in parallel; install the new versions."""
        results: dict[str, Any] = {}

        async def load(entry: DbEntry, info) -> None:
            fetched_at = self.clock()
            try:
                blob = await self.fetcher.get_manifest_blob(info.key)
                fetched_at = self.clock()
                manifest = await self.fetcher.decode_manifest(blob)
                results[info.key] = (entry, info, manifest, fetched_at, blob)
                self._bad.pop(info.key, None)
            except ManifestError as e:
                self.poll_errors += 1
                if e.rule == "base-chunk":  # its base chunk may be fetched next time
                    log.warning("cannot load manifest %s: %s", info.key, e)
                    return
                self._bad[info.key] = (info.size, info.mtime, fetched_at)
                log.warning("cannot load manifest %s: %s (not tried again until it changes)", info.key, e)
            except TooLarge as e:
                self.poll_errors += 1
                self._bad[info.key] = (info.size, info.mtime, fetched_at)
                log.warning("cannot load manifest %s: %s (not tried again until it changes)", info.key, e)
            except StoreError as e:
                self.poll_errors += 1
                log.warning("cannot load manifest %s: %s", info.key, e)
            except Exception:  # noqa: BLE001 - one bad manifest must not stop the poll
                self.poll_errors += 1
                log.exception("cannot load manifest %s", info.key)

        async with trio.open_nursery() as nursery:
            for entry, info in todo:
                nursery.start_soon(load, entry, info)
        for key in sorted(results):
            entry, info, manifest, fetched_at, blob = results[key]
            if self.entries.get(key) is not entry:
                continue
            if key in self._bad:
                self._remove(key)
                continue
            entry.size, entry.listed_mtime = info.size, info.mtime
            await self._cache_put(entry, fetched_at, manifest, blob)
            self._install(entry, manifest, fetched_at)
        for entry, info in todo:  # a reload that failed for good: out of the tree until it changes
            if info.key in self._bad and self.entries.get(info.key) is entry:
                self._remove(info.key)

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

    def _start_hydration(self, key: str) -> None:
        """Hydrate database ``key`` in the background, unless under way (a
        hydration under way goes on with the newest version when it ends)."""
        h = self._hydrations.get(key)
        if h is not None and h.state in ("queued", "running"):
            return
        assert self._nursery is not None
        self._hydrations[key] = h = _Hydration("")
        self._nursery.start_soon(self._hydrate, key, h)

    async def _hydrate(self, key: str, h: _Hydration) -> None:
        with h.scope:  # cancelled when the database leaves the store
            async with self._hydrate_slots:
                while True:
                    entry = self.entries.get(key)
                    if entry is None:
                        return
                    h.state = "running"
                    start = time.monotonic()
                    version = ""
                    try:
                        replica = await self.decoded(entry)
                        if not isinstance(replica, Replica):
                            return
                        h.version = version = replica.version
                        fps, sources = replica.all_remote_chunks()
                        n = await self.fetcher.hydrate(fps, progress=h.progress, sources=sources)
                        h.state = "done"
                        log.info("hydrated %s: %d chunks in %.1fs", replica.path, n, time.monotonic() - start)
                    except Exception as e:  # noqa: BLE001 - hydration is best effort
                        h.state = "incomplete"
                        log.warning("hydration of %s is incomplete: %s (tried again in %.0fs)",
                                    os.path.join(entry.parent.path, entry.name), e, HYDRATE_RETRY_SECONDS)
                    h.finished_at = self.clock()
                    entry = self.entries.get(key)
                    if (entry is None or entry.current is None or entry.current.version == version
                            or self._hydrations.get(key) is not h):
                        return
                    # A newer version arrived meanwhile: it is hydrated next.
                    h = self._hydrations[key] = _Hydration(entry.current.version, scope=h.scope)

    def _after_poll_hydration(self) -> None:
        """Once per poll: start again the hydrations left incomplete long
        enough ago; warn (once) when the databases exceed the disk cache."""
        now = self.clock()
        for key, h in list(self._hydrations.items()):
            if h.state == "incomplete" and now - h.finished_at >= HYDRATE_RETRY_SECONDS and key in self.entries:
                self._start_hydration(key)
        capacity = self.fetcher.cache_capacity()
        if capacity is not None and not self._warned_cache_size:
            total = self.known_bytes()
            if total > capacity:
                self._warned_cache_size = True
                log.warning("hydration: the databases (%.1f MiB) do not fit in the disk cache (%.1f MiB: cache_size, "
                            "or less if its disk is smaller): it will evict chunks it hydrated",
                            total / (1 << 20), capacity / (1 << 20))

    # ------------------------------------------------------------------- stats
    def known_bytes(self) -> int:
        """The sizes of the databases whose manifest was read."""
        return sum(e.current.size for e in self.entries.values() if e.current is not None)

    def stats(self) -> dict:
        """The numbers of /.verneuil/stats. Per database, only the decoded
        versions (at most ``decoded_limit``, and the open ones) and those
        under hydration: a mount of 100,000 databases renders its stats in
        milliseconds, not seconds."""
        old_open: dict[str, int] = {}
        held: dict[str, list[int]] = {}  # reads, read bytes, preloaded bytes of the versions held
        for node in self.inodes.values():
            if isinstance(node, (Replica, Parked)):
                counts = held.setdefault(node.key, [0, 0, 0])
                counts[0] += node.reads
                counts[1] += node.read_bytes
                counts[2] += node.preloaded
                if not self._is_current(node):
                    old_open[node.key] = old_open.get(node.key, 0) + 1
        served: dict[str, list[Replica]] = {}
        for replica in self._decoded.values():
            if replica.opens > 0:
                served.setdefault(replica.key, []).append(replica)
        dbs = {}
        for entry in self.entries.values():
            h = self._hydrations.get(entry.key)
            if isinstance(entry.current, Replica):
                d = entry.current.describe()
            elif h is not None or entry.key in served:  # hydrated, queued for it, parked since, or open
                d = {"path": os.path.join(entry.parent.path, entry.name), "key": entry.key}
            else:  # known by name, or parked: counted in "catalog" only
                continue
            d["old_versions_open"] = old_open.get(entry.key, 0)
            totals = [a + b for a, b in zip(held.get(entry.key, (0, 0, 0)), self._retired.get(entry.key, (0, 0, 0)))]
            d["since_mount"] = {"opens": self._opens_total.get(entry.key, 0), "reads": totals[0],
                                "read_bytes": totals[1], "preloaded": totals[2]}
            d.update(self._versions_served(entry, served.get(entry.key, [])))
            if h is not None:
                d["hydration"] = h.describe()
            dbs[d["path"]] = d
        read = sum(1 for e in self.entries.values() if e.current is not None)
        catalog = {"databases": len(self.entries), "read": read, "decoded": len(self._decoded),
                   "decoded_limit": self.decoded_limit, **self.counts}
        if self.manifest_cache is not None:
            catalog["manifest_cache"] = self.manifest_cache.stats()
        out = {
            "fetch": self.fetcher.snapshot(),
            "refresh": {
                "interval": self.refresh_interval,
                "polls": self.polls,
                "errors": self.poll_errors,
                "bad_manifests": sorted(self._bad),
                "last_poll": self.last_poll,
                "versions_seen": self.versions_seen,
            },
            "catalog": catalog,
            "databases": dict(sorted(dbs.items())),
        }
        if self.extra_stats is not None:
            out.update(self.extra_stats())
        return out

    def _versions_served(self, entry: DbEntry, open_versions: list[Replica]) -> dict:
        """What a database's open handles read against its newest version:
        the versions served (how many handles each, and the age of each:
        now minus its commit time, the manifest's ctime), the newest's age."""
        now = self.clock()
        current = entry.current

        def age(mtime_ns: int) -> float:
            return round(max(0.0, now - mtime_ns / 1e9), 3)

        rows = [{"version": r.version, "handles": r.opens, "age_s": age(r.mtime_ns)}
                for r in sorted(open_versions, key=lambda r: r.mtime_ns)]
        behind = sum(r.opens for r in open_versions if r is not current)
        return {"newest_age_s": age(current.mtime_ns) if current is not None else 0.0,
                "handles": sum(r.opens for r in open_versions), "handles_behind": behind,
                "served": rows, "oldest_served_age_s": rows[0]["age_s"] if rows else 0.0}

    def render_stats(self) -> bytes:
        return (json.dumps(self.stats(), indent=1, sort_keys=True) + "\n").encode()

    def render_metrics(self) -> bytes:
        """`stats` in Prometheus' text format (`metrics.MOUNT_SERIES`), the
        databases labelled by host and source path; ``verneuil_mount_info``
        names the mount, ``verneuil_mount_settings_info`` holds its settings."""
        stats = self.stats()
        mount = stats.get("mount", {})
        info = {"version": __version__, "source": mount.get("source"), "mountpoint": mount.get("mountpoint"),
                "pid": mount.get("pid"), "cache_dir": mount.get("cache_dir")}
        store = stats["fetch"]["store"]
        follow = stats.get("follow", {})
        settings = {"refresh_interval_seconds": self.refresh_interval, "deadline_seconds": store["deadline"],
                    "max_db_size_bytes": store["max_db_size"], "decoded_limit": self.decoded_limit,
                    "disk_cache_limit_bytes": stats["fetch"].get("disk_cache", {}).get("limit", 0),
                    "follow": follow.get("enabled"), "follow_interval_seconds": follow.get("interval")}
        labels = {"databases": lambda path, d: metrics.database_labels(d.get("key", ""), path)}
        lag = metrics.histogram_family(
            "verneuil_follow_lag_seconds", "commit (the manifest's ctime) to a version visible to new opens "
            "(event=visible) or read by an open handle that moved to it (event=switched)", "event", self.lag)
        return metrics.render([metrics.info_family("verneuil_mount_info", "what this mount is", info),
                               metrics.info_family("verneuil_mount_settings_info", "the mount's settings", settings)]
                              + metrics.families(stats, metrics.MOUNT_SERIES, labels) + [lag])
