"""The packed layout's bookkeeping for copiers (docs/COPIER.md, "The packed
layout"): where a database's chunks are, how packs are built, when a
database's packs need compacting, and which packs may be deleted.

- `Journal`: the places of the chunks packed from one database's spool
  directory, one small record per pack in `<db>/copier.packs/`, written
  after the pack is in the store and before its chunk files are unlinked,
  so that a copier (this process or another) always finds out where a
  chunk that left the spool went;
- `Ledger`: where each chunk of one database is, newest first: the journal,
  the last manifest uploaded from this spool (`<db>/copier.last`), and,
  when there is none (a spool made since the last reboot), the store's
  current manifest;
- `PackBuilder`: chunk blobs into packs of about `PACK_TARGET_BYTES`;
- `plan_compaction`: which chunks to pack again so that a cold scan stays
  within `COMPACT_AT` times the range reads of a fresh pack, and the packs
  a manifest needs within `LIVE_BOUND` times its live bytes;
- `collect_garbage`: deletes the packs of a database that no kept version
  of its manifest, no journal record and no recent upload needs;
  `GcState` (`<db>/copier.gc`) remembers, for every copier of the spool,
  when it last ran and the packs each version names.

Pure bookkeeping and planning, with the store reached only through the
callables passed in; `packer.Packer` runs it for the copier.
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
from typing import Callable, Iterable, Optional

from verneuil_fuse import format as fmt
from verneuil_fuse.store import NotFound, Reads, Store
from verneuil_fuse.copier import spool as sp

log = logging.getLogger(__name__)

# A chunk's place in a pack: (pack fingerprint, offset, length).
Place = tuple[fmt.Fprint, int, int]

# The size a pack is closed at (a pack ends with the first blob that
# reaches it, so packs are at most this plus one chunk blob).  16 MiB: an
# initial sync behind moto reaches the same speed with 8, 16 or 32 MiB packs
# (docs/BENCHMARKS.md, "Packed layout"), a pack is the unit a repair or a GC
# handles whole, and a reader's range reads (1 MiB) never need more.
PACK_TARGET_BYTES = 16 << 20
# Packs one database's pass uploads at once: 4 keep an S3 endpoint's
# connections busy (a pack is one PUT of 16 MiB) for 64 MiB of memory.
PACKS_IN_FLIGHT = 4
# Journal records younger than this are never pruned: a writer stages a
# snapshot's chunks moments before the manifest naming them, and a copier
# may pack them in between; ten minutes is the writer's own grace for
# its scratch files.
JOURNAL_GRACE = 600.0
# A cold scan of a version may take at most this many times the range
# reads a fresh pack of it would need before its most scattered windows
# are packed again, down to COMPACT_GOAL times.  Each changed chunk costs a
# scan about two reads until its window is packed again; between the two
# bounds a compaction picks the windows most changes hit.
COMPACT_AT = 1.75
COMPACT_GOAL = 1.5
# ... and a few reads more than that before anything is packed again: for
# a small database, 8 reads cost less than writing it again.
COMPACT_SLACK = 8
# The packs a version needs may hold at most this many times its live
# bytes (the rest: blobs later versions replaced) before the chunks of
# its least live packs are packed again, down to LIVE_GOAL times; with GC,
# a store holds about LIVE_BOUND times the live bytes plus kept history.
LIVE_BOUND = 1.4
LIVE_GOAL = 1.2
# ... and a few MiB more than that: a small database's small packs are not
# packed again for every commit that makes some of their blobs dead.
LIVE_SLACK = 4 << 20
# Packs younger than this are never deleted: a pack is in the store a
# moment before the journal record that names it (the record then spares
# it), so a young pack nothing names yet may be about to be named.  Ten
# minutes covers a copier stalled between the two by far.
GC_GRACE = 600.0
# How often a copier looks for a database's garbage packs (after an upload):
# each look lists the database's packs and reads the versions of its
# manifest it has not read yet (once each).  Compaction under steady small
# commits can write several MiB a commit (docs/BENCHMARKS.md), so garbage
# is collected every ten minutes rather than daily.
GC_INTERVAL = 600.0

# A journal record's name: its time in ns (20 digits) and random hex.
_RECORD_RE = re.compile(r"\A([0-9]{20})-[0-9a-f]{8}\.json\Z")


def space_of(manifest_name: str) -> fmt.Fprint:
    """The name space of a database's packs: the fingerprint of its
    manifest name, so that each database's packs share a key prefix."""
    return fmt.fingerprint(manifest_name.encode("utf-8", "surrogateescape"), fmt.CHUNK_KEY)


def _hex_fprint(text: str) -> fmt.Fprint:
    if len(text) != 32:
        raise ValueError("not a fingerprint: %r" % text)
    return fmt.Fprint(int(text[:16], 16), int(text[16:], 16))


class Journal:
    """The places of chunks packed from one database directory's spool, in
    records under `path` (see the module's docstring)."""

    def __init__(self, path: str):
        self.path = path
        self._records: dict[str, tuple[dict[fmt.Fprint, Place], dict[fmt.Fprint, int]]] = {}

    def write(self, places: dict[fmt.Fprint, Place], sizes: dict[fmt.Fprint, int]) -> None:
        """A new record: `places` of chunks, `sizes` of the packs made."""
        os.makedirs(self.path, exist_ok=True)
        name = "%020d-%s.json" % (time.time_ns(), secrets.token_hex(4))
        body = json.dumps({"packs": {fp.hex(): n for fp, n in sizes.items()},
                           "chunks": [[fp.hex(), p.hex(), off, n] for fp, (p, off, n) in places.items()]})
        tmp = os.path.join(self.path, ".%s.tmp" % name)
        with open(tmp, "w") as f:
            f.write(body)
        os.rename(tmp, os.path.join(self.path, name))

    def _read(self, name: str) -> tuple[dict[fmt.Fprint, Place], dict[fmt.Fprint, int]]:
        try:
            doc = json.loads(sp.read_regular(os.path.join(self.path, name), 64 << 20))
            places = {_hex_fprint(c): (_hex_fprint(p), int(off), int(n)) for c, p, off, n in doc["chunks"]}
            sizes = {_hex_fprint(p): int(n) for p, n in doc["packs"].items()}
        except FileNotFoundError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("%s: unreadable journal record %s (%s): ignored", self.path, name, e)
            return {}, {}
        return places, sizes

    def load(self) -> tuple[dict[fmt.Fprint, Place], dict[fmt.Fprint, int]]:
        """Every record's places (a later record's win) and pack sizes."""
        names = sorted(n for n in sp.listdir_or_empty(self.path) if _RECORD_RE.match(n))
        for gone in set(self._records) - set(names):
            del self._records[gone]
        places: dict[fmt.Fprint, Place] = {}
        sizes: dict[fmt.Fprint, int] = {}
        for name in names:
            record = self._records.get(name)
            if record is None:
                try:
                    record = self._records[name] = self._read(name)
                except FileNotFoundError:  # pruned meanwhile
                    continue
            places.update(record[0])
            sizes.update(record[1])
        return places, sizes

    def prune(self, before_ns: int, grace: float = JOURNAL_GRACE) -> int:
        """Delete the records made before `before_ns` (time.time_ns()) and
        more than `grace` seconds ago, and temporary files as old; how many
        records went."""
        horizon = min(before_ns, time.time_ns() - int(grace * 1e9))
        removed = 0
        for name in sp.listdir_or_empty(self.path):
            match = _RECORD_RE.match(name)
            if match is not None:
                if int(match.group(1)) < horizon and sp.unlink_quiet(os.path.join(self.path, name)):
                    removed += 1
            elif name.startswith(".") and name.endswith(".tmp"):
                path = os.path.join(self.path, name)
                try:
                    if os.lstat(path).st_mtime_ns < horizon:
                        sp.unlink_quiet(path)
                except FileNotFoundError:
                    pass
        return removed


class Ledger:
    """Where each chunk of one database is (see the module's docstring).
    `space` is the database's pack name space; places found in a manifest
    of another name space are not used.  `max_db_size` bounds the manifests
    it reads (the copier's)."""

    def __init__(self, db_path: str, space: fmt.Fprint, max_db_size: int = fmt.MAX_REPLICATED_DB_SIZE):
        self.space = space
        self.max_db_size = max_db_size
        self.journal = Journal(os.path.join(db_path, sp.PACKS_DIR))
        self.last_path = os.path.join(db_path, sp.LAST_FILE)
        self.places: dict[fmt.Fprint, Place] = {}
        self.sizes: dict[fmt.Fprint, int] = {}
        self.last: Optional[fmt.Manifest] = None
        self.store_manifest: Optional[fmt.Manifest] = None
        self._last_ident: Optional[sp.Identity] = None
        self._indexes: list[tuple[fmt.Manifest, dict[fmt.Fprint, int]]] = []

    def refresh(self) -> None:
        """Read the journal's new records and a changed `copier.last`."""
        self.places, sizes = self.journal.load()
        self.sizes.update(sizes)
        try:
            ident = sp.identity_of_path(self.last_path)
        except FileNotFoundError:
            self.last, self._last_ident = None, None
            return
        if ident != self._last_ident:
            try:
                m = fmt.decode_and_validate(sp.read_regular(self.last_path), max_db_size=self.max_db_size)
            except (OSError, fmt.ManifestError) as e:
                log.warning("%s: unreadable (%s): ignored", self.last_path, e)
                m = None
            self.last, self._last_ident = (m if m is not None and self._usable(m) else None), ident
        if self.last is not None:
            # An older version's places are no longer safe to give: GC may
            # delete what no kept version, journal record or copier.last needs.
            self.store_manifest = None

    def _usable(self, m: Optional[fmt.Manifest]) -> bool:
        return m is not None and m.layout is not None and m.layout.space == self.space

    def set_last(self, raw: bytes, m: fmt.Manifest) -> None:
        """Record `raw`, the packed manifest just uploaded (decoded: `m`), as
        `copier.last`, atomically."""
        tmp = "%s.%d.tmp" % (self.last_path, os.getpid())
        with open(tmp, "wb") as f:
            f.write(raw)
        os.rename(tmp, self.last_path)
        self.last, self._last_ident = m, sp.identity_of_path(self.last_path)
        self.store_manifest = None

    def needs_store_manifest(self) -> bool:
        """Whether the store's current manifest should be read for places:
        only when this spool has uploaded none (since the last reboot)."""
        return self.last is None and self.store_manifest is None

    def use_store_manifest(self, m: Optional[fmt.Manifest]) -> None:
        self.store_manifest = m if self._usable(m) else None

    def _index(self, m: fmt.Manifest) -> dict[fmt.Fprint, int]:
        """Chunk -> its first placed index in `m` (kept for the last two
        manifests asked about: `last` and the store's)."""
        for known, index in self._indexes:
            if known is m:
                return index
        index = {}
        for i, fp in enumerate(m.chunks):
            if m.layout.locations[3 * i]:
                index.setdefault(fp, i)
        self._indexes = [(m, index)] + self._indexes[:1]
        return index

    def locate(self, fp: fmt.Fprint) -> Optional[Place]:
        """Where chunk `fp` is, or None."""
        place = self.places.get(fp)
        if place is not None:
            return place
        for m in (self.last, self.store_manifest):
            if m is not None:
                i = self._index(m).get(fp)
                if i is not None:
                    return m.layout.place(i)
        return None

    def protected(self) -> set[str]:
        """The keys of the packs this spool may still name: those of the
        journal and of `copier.last`."""
        keys = {fmt.pack_key(self.space, p) for p, _, _ in self.places.values()}
        if self.last is not None:
            keys.update(self.last.layout.keys())
        return keys

    def pack_size(self, pack: fmt.Fprint) -> Optional[int]:
        return self.sizes.get(pack)


class PackBuilder:
    """Chunk blobs appended into one pack, closed at `target` bytes."""

    def __init__(self, target: int = PACK_TARGET_BYTES):
        self.target = target
        self.parts: list[tuple[fmt.Fprint, bytes]] = []
        self.size = 0

    def add(self, fp: fmt.Fprint, blob: bytes) -> None:
        self.parts.append((fp, blob))
        self.size += len(blob)

    @property
    def full(self) -> bool:
        return self.size >= self.target

    def take(self) -> tuple[fmt.Fprint, bytes, dict[fmt.Fprint, Place]]:
        """(the pack's fingerprint, its bytes, each chunk's place), and the
        builder empty again."""
        data = b"".join(blob for _, blob in self.parts)
        pack = fmt.fingerprint(data, fmt.CHUNK_KEY)
        places: dict[fmt.Fprint, Place] = {}
        offset = 0
        for fp, blob in self.parts:
            places[fp] = (pack, offset, len(blob))
            offset += len(blob)
        self.parts, self.size = [], 0
        return pack, data, places


# -- compaction ----------------------------------------------------------------


def stored_chunks(m: fmt.Manifest) -> list[int]:
    """The chunks whose blobs the store holds for `m`, in file order, each
    fingerprint once: all but chunk 0 (bundled) and the zero chunk."""
    seen: set[fmt.Fprint] = set()
    out = []
    for i, fp in enumerate(m.chunks):
        if i == 0 or fp == fmt.ZERO_CHUNK_FPRINT or fp in seen:
            continue
        seen.add(fp)
        out.append(i)
    return out


def scanned_chunks(m: fmt.Manifest) -> list[int]:
    """The chunks a cold scan of `m` reads from the store, in file order:
    neither bundled nor the zero chunk, each fingerprint once."""
    seen: set[fmt.Fprint] = set()
    out = []
    for i, fp in enumerate(m.chunks):
        if i in m.bundled or fp == fmt.ZERO_CHUNK_FPRINT or fp in seen:
            continue
        seen.add(fp)
        out.append(i)
    return out


def scan_reads(m: fmt.Manifest) -> int:
    """The store reads of a cold scan of `m`: one per run of adjacent
    chunks of a pack (up to `fmt.MAX_RUN_BYTES`), one per chunk object."""
    return len(fmt.chunk_runs(m, scanned_chunks(m)))


def fresh_windows(lengths: list[int], target: int = PACK_TARGET_BYTES,
                  limit: int = fmt.MAX_RUN_BYTES) -> list[tuple[int, int]]:
    """The runs [start, end) of a fresh pack of blobs of `lengths` laid out
    in order: packs closed at `target` bytes, runs at `limit`."""
    out: list[tuple[int, int]] = []
    start = pack = run = 0
    for k, n in enumerate(lengths):
        new_pack = pack > 0 and pack + n > target
        if new_pack or (run > 0 and run + n > limit):
            out.append((start, k))
            start, run = k, 0
        if new_pack:
            pack = 0
        pack += n
        run += n
    if lengths:
        out.append((start, len(lengths)))
    return out


def fresh_reads(m: fmt.Manifest) -> int:
    """The store reads of a cold scan of `m` freshly packed."""
    lengths = [(fmt.chunk_source(m, i).max_bytes) for i in scanned_chunks(m)]
    return len(fresh_windows(lengths))


def _reads(places: list[Optional[Place]]) -> int:
    """Reads of a window's blobs: one more at each place that does not
    follow the one before in the same pack."""
    reads = 1 if places else 0
    for a, b in zip(places, places[1:]):
        if a is None or b is None or a[0] != b[0] or a[1] + a[2] != b[1]:
            reads += 1
    return reads


class _Liveness:
    """Bytes the packs a version needs hold, as windows get packed again."""

    def __init__(self, places: list[Optional[Place]], windows: list[tuple[int, int]],
                 sizes: Callable[[fmt.Fprint], Optional[int]]):
        self.left: dict[fmt.Fprint, int] = {}
        live: dict[fmt.Fprint, int] = {}
        ends: dict[fmt.Fprint, int] = {}
        self.windows_of: dict[fmt.Fprint, set[int]] = {}
        for w, (a, b) in enumerate(windows):
            for place in places[a:b]:
                if place is None:
                    continue
                pack, off, n = place
                self.left[pack] = self.left.get(pack, 0) + 1
                live[pack] = live.get(pack, 0) + n
                ends[pack] = max(ends.get(pack, 0), off + n)
                self.windows_of.setdefault(pack, set()).add(w)
        self.size = {p: max(sizes(p) or 0, ends[p]) for p in live}
        self.fraction = {p: live[p] / self.size[p] for p in live}
        self.live = sum(live.values())
        self.stored = sum(self.size.values())
        self.places, self.windows = places, windows

    def drop(self, w: int) -> None:
        """Window `w` is packed again: its blobs leave their packs."""
        a, b = self.windows[w]
        for place in self.places[a:b]:
            if place is not None:
                self.stored += place[2]
                self.left[place[0]] -= 1
                if not self.left[place[0]]:
                    self.stored -= self.size[place[0]]


def plan_compaction(places: list[Optional[Place]], sizes: Callable[[fmt.Fprint], Optional[int]],
                    target: int = PACK_TARGET_BYTES) -> list[tuple[int, int]]:
    """The stretches [start, end) of `places` (the places of a version's
    stored chunks, in file order: `stored_chunks`) to pack again: none while a cold scan
    takes at most COMPACT_AT times the reads of a fresh pack (and
    COMPACT_SLACK more) and the packs hold at most LIVE_BOUND times the live
    bytes (and LIVE_SLACK more); else the most scattered windows (down to
    COMPACT_GOAL), then those of the least live packs (down to LIVE_GOAL).
    `sizes(pack)`: a pack's size when known."""
    lengths = [p[2] if p is not None else fmt.MAX_CHUNK_BLOB_BYTES for p in places]
    windows = fresh_windows(lengths, target)
    reads = [_reads(places[a:b]) for a, b in windows]
    fresh, total = len(windows), sum(reads)
    chosen: set[int] = set()
    if total > COMPACT_AT * fresh + COMPACT_SLACK:
        for w in sorted(range(fresh), key=lambda w: -reads[w]):
            if total <= COMPACT_GOAL * fresh or reads[w] <= 1:
                break
            chosen.add(w)
            total -= reads[w] - 1
    live = _Liveness(places, windows, sizes)
    for w in chosen:
        live.drop(w)
    if live.stored > LIVE_BOUND * live.live + LIVE_SLACK:
        for pack in sorted(live.fraction, key=live.fraction.get):
            if live.stored <= LIVE_GOAL * live.live:
                break
            for w in sorted(live.windows_of[pack] - chosen):
                chosen.add(w)
                live.drop(w)
    return [windows[w] for w in sorted(chosen)]


# -- garbage ---------------------------------------------------------------------


def collect_garbage(store: Store, reads: Reads, key: str, space: fmt.Fprint, protected: Iterable[str], *,
                    request: Callable = lambda fn, what: fn(), grace: float = GC_GRACE,
                    known: Optional[dict[str, set[str]]] = None, now: Optional[float] = None) -> list[str]:
    """Delete the packs of name space `space` that no kept version of
    manifest `key` names, that are not `protected` (the spool's), and that
    are older than `grace` seconds; the keys deleted.  `request(fn, what)`
    makes a store request (the copier's pacing and retries), and `reads`
    reads the versions (with the same `request`); `known` caches each
    version's packs by version id (versions never change).  Nothing is
    deleted when a version cannot be read."""
    known = {} if known is None else known
    now = time.time() if now is None else now
    protected = set(protected)
    prefix = fmt.space_prefix(space)
    packs = request(lambda: list(store.chunks.list(prefix)), "list packs")
    candidates = [o.key for o in packs if o.key not in protected and now - o.mtime >= grace]
    if not candidates:
        return []
    needed: set[str] = set()
    listed: set[str] = set()
    for info in reads.versions(key):
        listed.add(info.version_id)
        keys = known.get(info.version_id)
        if keys is None:
            try:
                m = reads.manifest(key, info.version_id)  # one that cannot be read raises: GC must not guess
            except NotFound:  # expired meanwhile: it needs nothing any more
                continue
            keys = set(m.layout.keys()) if m.layout is not None else set()
            if info.version_id != "null":  # a "null" version is whatever is current
                known[info.version_id] = keys
        needed |= keys
    for gone in set(known) - listed:  # expired versions need nothing any more
        del known[gone]
    deleted = []
    for pack in candidates:
        if pack not in needed:
            request(lambda: store.chunks.delete(pack), "delete pack")
            deleted.append(pack)
    return deleted


class GcState:
    """What garbage collection keeps between runs for one database, shared
    by every copier of the spool: when it last ran (the file's mtime) and
    the packs each version of the manifest names (a version never changes,
    so it is read once), in `path` (JSON, written by temp + rename)."""

    def __init__(self, path: str):
        self.path = path

    def last_run(self) -> float:
        """time.time() of the last run, 0 if none."""
        try:
            return os.stat(self.path).st_mtime
        except FileNotFoundError:
            return 0.0

    def load(self) -> dict[str, set[str]]:
        """Each version id's pack keys ({} when unreadable)."""
        try:
            doc = json.loads(sp.read_regular(self.path, 64 << 20))
            packs = doc["packs"]
            return {vid: {packs[i] for i in indices} for vid, indices in doc["versions"].items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            log.warning("%s: unreadable (%s): versions are read again", self.path, e)
            return {}

    def save(self, known: dict[str, set[str]]) -> None:
        """Record `known` and that GC ran now."""
        packs = sorted(set().union(*known.values())) if known else []
        number = {key: i for i, key in enumerate(packs)}
        body = json.dumps({"packs": packs,
                           "versions": {vid: sorted(number[k] for k in keys) for vid, keys in known.items()}})
        tmp = "%s.%d.tmp" % (self.path, os.getpid())
        with open(tmp, "w") as f:
            f.write(body)
        os.rename(tmp, self.path)
