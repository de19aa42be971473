"""The tree of replicas in a store, kept fresh by polling (no pyfuse3 here).

Layout: ``/<hostname>/<absolute path of the source database>``, from the
manifest names in the store, with directories synthesised; plus
``/.verneuil/stats`` (JSON, see `Catalog.stats`) and ``/.verneuil/metrics``
(the same numbers in Prometheus' text format, see `verneuil_fuse.metrics`).
Directory listings are
sorted by name, so readdir is stable.

Names that do not read back as a whole path:
- a *mangled* manifest name (docs/FORMAT.md: names of 230 encoded bytes or more
  keep their first and last 104 encoded bytes around a fingerprint) is shown
  under ``/<hostname>/`` as ``<leading dirs>/…<12 hex>…/<trailing dirs and
  file>``: the whole path components that survive at each end (a cut may
  split a component, an escape or a UTF-8 sequence; partial components are
  dropped), with a directory named after the first 12 hex digits of the
  mangling fingerprint standing for the missing middle, so that two long paths
  sharing both ends still get distinct, stable names (when the kept end holds
  no ``/``, the mark prefixes what is left of the file name);
- a manifest key that is not a manifest name at all (but whose blob is a valid
  manifest) is shown as ``/.verneuil/other/<key>``.
Path components ``.``, ``..`` and empty ones cannot be directory entries:
empty and ``.`` are dropped, ``..`` becomes ``%2E%2E``. A database whose path
is also a directory of another one keeps the directory and is left out, with
a warning.

Versions: every manifest version that differs (chunk list or length) is a new
`Replica` with a new inode; a lookup finds the newest. An older version stays
reachable by inode while the kernel remembers it or a handle is open.

Polling: each poll lists the manifest bucket; a manifest is fetched again only
when its listed size or mtime changed, or when it was fetched less than
``SETTLE_SECONDS`` after its listed mtime (so that two uploads within one
second of the same size are not missed).

Past states: ``<database>@<time>`` (``app.db@2026-11-26T19:00:00Z``, any
time `history.parse_time` reads) in a database's directory is resolved on
lookup only (never listed) to a pinned replica of the version current at that
time (`past.PastStates`); an unknown database, a time no version is as old
as, or a name that is not a time is ENOENT. Real entries win: a database
whose own name holds an ``@`` is found as itself.

Hydration (``hydrate``): each database's newest version is fetched into the
disk cache in the background; one that could not fetch every chunk is tried
again after ``HYDRATE_RETRY_SECONDS``; its progress is in the stats.
"""
from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import trio
from urllib.parse import unquote

from verneuil_fuse import __version__, metrics
from verneuil_fuse.reader.fetcher import Fetcher, HydrateProgress
from verneuil_fuse.format import ManifestError, parse_manifest_name
from verneuil_fuse.format.names import MANGLE_KEEP
from verneuil_fuse.history import BadTime, parse_time
from verneuil_fuse.reader.past import PastStates, split_name
from verneuil_fuse.reader.replica import PrefetchConfig, Replica
from verneuil_fuse.store import StoreError, TooLarge

log = logging.getLogger(__name__)

ROOT_INODE = 1
# Latest ctime taken from a manifest, in seconds: 2**63 - 1 nanoseconds
# (year 2262), the most a file time can hold in the kernel's attributes.
MAX_CTIME_S = ((1 << 63) - 1) // 1_000_000_000 - 1
SETTLE_SECONDS = 5.0
CONTROL_DIR = ".verneuil"
_MANGLED_HEAD = re.compile(r"\A[0-9a-f]{4}-verneuil%3A.*?%3A[0-9a-f]{4}%2F(%2F.*)\Z", re.S)
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


@dataclass
class DbEntry:
    """A database in the tree: its manifest key and its newest version."""

    key: str
    name: str
    parent: Directory = field(repr=False)
    current: Replica
    size: int  # listed size of the manifest blob
    listed_mtime: float
    fetched_at: float

    @property
    def inode(self) -> int:
        return self.current.inode


@dataclass
class StatsFile:
    inode: int
    render: Callable[[], bytes]


def _clean(components: list[str]) -> list[str]:
    out = []
    for c in components:
        if c in ("", "."):
            continue
        # A NUL cannot be in a file name (the kernel would cut it there).
        out.append("%2E%2E" if c == ".." else c.replace("\0", "%00"))
    return out


def display_path(key: str) -> tuple[str, list[str]] | None:
    """(hostname, path components) where manifest ``key`` is shown, or None
    for a key that is not a manifest name."""
    parsed = parse_manifest_name(key)
    if parsed is None:
        return None
    host = parsed.hostname
    if host in ("", ".", ".."):
        host = host.replace(".", "%2E") or "%2E"
    # The host is one directory name: no "/" (nor NUL) may split it.
    host = host.replace("/", "%2F").replace("\0", "%00")
    if not parsed.mangled:
        return host, _clean(parsed.path.split("/"))
    # Mangled: <first 104 encoded bytes><32 hex><last 104 encoded bytes>.
    # Keep the whole path components on each side (a cut may split a
    # component, a %XX escape or a UTF-8 sequence), and name the missing
    # middle after the mangling fingerprint.
    head, tail = key[:MANGLE_KEEP], key[MANGLE_KEEP + 32 :]
    m = _MANGLED_HEAD.match(head)
    if m is None:
        return None
    prefix = m.group(1)
    prefix = prefix[: prefix.rfind("%2F")] if "%2F" in prefix else ""
    cut = tail.find("%2F")
    suffix = tail[cut + 3 :] if cut >= 0 else tail
    middle = "\u2026" + key[MANGLE_KEEP : MANGLE_KEEP + 12] + "\u2026"
    parts = _clean(unquote(prefix, errors="replace").split("/"))
    if cut < 0:  # the end of one long file name: the mark and the end make one name
        end = unquote(suffix, errors="replace").replace("/", "%2F").replace("\0", "%00")
        return host, parts + [middle + end]
    parts.append(middle)
    parts.extend(_clean(unquote(suffix, errors="replace").split("/")))
    return host, parts


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
    ):
        self.fetcher = fetcher
        self.refresh_interval = refresh_interval
        self.prefetch = prefetch or PrefetchConfig()
        self.hydrate = hydrate
        self.on_invalidate = on_invalidate
        self.clock = clock
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
        self.extra_stats: Callable[[], dict] | None = None

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

    def get(self, inode: int) -> Any:
        return self.inodes.get(inode)

    def lookup(self, parent_inode: int, name: str) -> Any:
        parent = self.inodes.get(parent_inode)
        if not isinstance(parent, Directory):
            return None
        node = parent.entries.get(name)
        if isinstance(node, DbEntry):
            return node.current
        return node

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
        replica = await self.past.resolve(entry.key, os.path.join(parent.path, name), at_ns,
                                          live=entry.current.version)
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
            out.append((name, node.current if isinstance(node, DbEntry) else node))
        return out

    def remember(self, node: Any) -> None:
        """The kernel learnt an inode (lookup/readdirplus)."""
        if isinstance(node, Replica):
            node.lookups += 1

    def forget(self, inode: int, nlookup: int) -> None:
        node = self.inodes.get(inode)
        if isinstance(node, Replica):
            node.lookups = max(0, node.lookups - nlookup)
            self._maybe_drop(node)

    def opened(self, replica: Replica) -> None:
        replica.opens += 1

    def released(self, replica: Replica) -> None:
        replica.opens -= 1
        self._maybe_drop(replica)

    def _is_current(self, replica: Replica) -> bool:
        entry = self.entries.get(replica.key)
        return entry is not None and entry.current is replica

    def _maybe_drop(self, replica: Replica) -> None:
        if replica.lookups <= 0 and replica.opens <= 0 and not self._is_current(replica):
            self.inodes.pop(replica.inode, None)
            self.past.forget(replica)

    # ----------------------------------------------------------------- refresh
    def _place(self, key: str) -> tuple[Directory, str] | None:
        where = display_path(key)
        if where is None:
            other = self._mkdir(self._control, "other")
            return other, key
        host, parts = where
        if not parts:
            log.warning("manifest %s names no file; skipped", key)
            return None
        d = self._mkdir(self.root, host)
        for part in parts[:-1]:
            node = d.entries.get(part)
            if isinstance(node, DbEntry):
                log.warning("%s: %s is a database, cannot also be a directory; skipped", key, part)
                return None
            d = self._mkdir(d, part)
        return d, parts[-1]

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
        try:
            infos = await self.fetcher.list_manifests()
        except StoreError as e:
            self.poll_errors += 1
            if raise_errors:
                raise
            log.warning("cannot list manifests: %s", e)
            return
        now = self.clock()
        self.last_poll = now
        listed = {info.key: info for info in infos}
        todo = []
        for key, info in listed.items():
            bad = self._bad.get(key)
            if bad is not None and bad[:2] == (info.size, info.mtime) and bad[2] - info.mtime >= SETTLE_SECONDS:
                continue  # the same broken blob as last time
            entry = self.entries.get(key)
            if (
                entry is None
                or entry.size != info.size
                or entry.listed_mtime != info.mtime
                or entry.fetched_at - info.mtime < SETTLE_SECONDS
            ):
                todo.append(info)
        results: dict[str, Any] = {}

        async def load(info) -> None:
            fetched_at = self.clock()
            try:
                blob = await self.fetcher.get_manifest_blob(info.key)
                fetched_at = self.clock()
                manifest = await self.fetcher.decode_manifest(blob)
                results[info.key] = (info, manifest, fetched_at)
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
            for info in todo:
                nursery.start_soon(load, info)
        for key in sorted(results):
            info, manifest, fetched_at = results[key]
            self._install(key, info, manifest, fetched_at)
        for key in [k for k in self.entries if k not in listed]:
            self._remove(key)
        for key in [k for k in self._bad if k not in listed]:
            del self._bad[key]
        if self.hydrate and self._nursery is not None:
            self._after_poll_hydration()

    def _install(self, key: str, info, manifest, fetched_at: float) -> None:
        entry = self.entries.get(key)
        if entry is not None:
            old = entry.current.manifest
            same = (
                old.contents_fprint == manifest.contents_fprint
                and old.len == manifest.len
                and old.header_fprint == manifest.header_fprint
            )
            entry.size, entry.listed_mtime, entry.fetched_at = info.size, info.mtime, fetched_at
            if same:
                return
        placed = (entry.parent, entry.name) if entry is not None else self._place(key)
        if placed is None:
            return
        parent, name = placed
        existing = parent.entries.get(name)
        if entry is None and existing is not None:
            log.warning("%s: %s already names another entry; skipped", key, os.path.join(parent.path, name))
            return
        replica = Replica(
            key=key,
            path=os.path.join(parent.path, name),
            manifest=manifest,
            fetcher=self.fetcher,
            inode=self._alloc(),
            mtime_ns=mtime_ns_of(manifest, info.mtime),
            prefetch=self.prefetch,
        )
        self.inodes[replica.inode] = replica
        self.versions_seen += 1
        if entry is None:
            entry = DbEntry(key, name, parent, replica, info.size, info.mtime, fetched_at)
            self.entries[key] = entry
            parent.entries[name] = entry
            log.info("new database %s (%d bytes, version %s)", replica.path, replica.size, replica.version[:16])
        else:
            previous = entry.current
            entry.current = replica
            self._maybe_drop(previous)
            log.info("new version of %s (%d bytes, version %s)", replica.path, replica.size, replica.version[:16])
            if self.on_invalidate is not None:
                self.on_invalidate(parent.inode, name)
        parent.mtime_ns = time.time_ns()
        if self.hydrate and self._nursery is not None:
            self._start_hydration(key)

    def _remove(self, key: str) -> None:
        entry = self.entries.pop(key)
        parent = entry.parent
        if parent.entries.get(entry.name) is entry:
            del parent.entries[entry.name]
        log.info("database %s is gone from the store", entry.current.path)
        h = self._hydrations.pop(key, None)
        if h is not None:
            h.scope.cancel()
        self._maybe_drop(entry.current)
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
        self._hydrations[key] = h = _Hydration(self.entries[key].current.version)
        self._nursery.start_soon(self._hydrate, key, h)

    async def _hydrate(self, key: str, h: _Hydration) -> None:
        with h.scope:  # cancelled when the database leaves the store
            async with self._hydrate_slots:
                while True:
                    entry = self.entries.get(key)
                    if entry is None:
                        return
                    replica = entry.current
                    h.state = "running"
                    start = time.monotonic()
                    try:
                        n = await self.fetcher.hydrate(replica.all_remote_chunks(), progress=h.progress)
                        h.state = "done"
                        log.info("hydrated %s: %d chunks in %.1fs", replica.path, n, time.monotonic() - start)
                    except Exception as e:  # noqa: BLE001 - hydration is best effort
                        h.state = "incomplete"
                        log.warning("hydration of %s is incomplete: %s (tried again in %.0fs)",
                                    replica.path, e, HYDRATE_RETRY_SECONDS)
                    h.finished_at = self.clock()
                    entry = self.entries.get(key)
                    if entry is None or entry.current is replica or self._hydrations.get(key) is not h:
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
        cache = self.fetcher.cache
        if cache is not None and not self._warned_cache_size:
            total = sum(e.current.size for e in self.entries.values())
            if total > cache.capacity:
                self._warned_cache_size = True
                log.warning("hydration: the databases (%.1f MiB) do not fit in the disk cache (%.1f MiB: cache_size, "
                            "or less if its disk is smaller): it will evict chunks it hydrated",
                            total / (1 << 20), cache.capacity / (1 << 20))

    # ------------------------------------------------------------------- stats
    def stats(self) -> dict:
        dbs = {}
        for entry in sorted(self.entries.values(), key=lambda e: e.current.path):
            d = entry.current.describe()
            d["old_versions_open"] = sum(
                1
                for n in self.inodes.values()
                if isinstance(n, Replica) and n.key == entry.key and n is not entry.current
            )
            h = self._hydrations.get(entry.key)
            if h is not None:
                d["hydration"] = h.describe()
            dbs[entry.current.path] = d
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
            "databases": dbs,
        }
        if self.extra_stats is not None:
            out.update(self.extra_stats())
        return out

    def render_stats(self) -> bytes:
        return (json.dumps(self.stats(), indent=1, sort_keys=True) + "\n").encode()

    def render_metrics(self) -> bytes:
        """`stats` in Prometheus' text format: one series per number, the
        databases labelled by path, ``verneuil_mount_info`` naming the mount."""
        stats = self.stats()
        mount = stats.get("mount", {})
        info = {"version": __version__, "source": str(mount.get("source", "")),
                "mountpoint": str(mount.get("mountpoint", ""))}
        return metrics.render(metrics.families("verneuil", stats, metrics.MOUNT_GAUGES,
                                               {"databases": "path"}, ("mount", info)))


def mode_of(node: Any) -> int:
    if isinstance(node, Directory):
        return stat.S_IFDIR | 0o555
    return stat.S_IFREG | 0o444
