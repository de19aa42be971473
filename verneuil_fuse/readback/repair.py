"""Repair a store that lost chunks: upload again, from the source database
file, the chunks that a database's current manifest names and the store no
longer has (`verneuilctl repair`).

Copiers upload what writers stage, and writers stage only the chunks a
commit changed: once the store has lost chunk objects (an S3 bucket that came
back empty, a lifecycle rule that expired live chunks), nothing puts back the
chunks of a database that does not change.  `repair_database` does, for one
database:

1. `find_manifest`: its current manifest in the store.  A lost base chunk
   (Verneuil writers XOR long chunk lists with one) is rebuilt from the
   source file when the file still holds that snapshot's chunks;
2. `format.stored_objects`: the objects that manifest needs, as the
   copier's touch patrol sees them: the object of every chunk but chunk 0
   (always bundled, never uploaded) and the zero chunk (never stored), plus
   the base chunk.  In Verneuil's layout an object is one chunk; in the
   packed layout most are packs.  Other bundled chunks (b-tree tops) are
   included: writers upload them too, and a later manifest may name them
   without bundling them;
3. `find_missing`: which of them the store lacks (parallel `exists`);
4. `read_verified_chunk`: bytes whose fingerprint is the chunk's name, from
   the manifest (bundled chunks, the rebuilt base chunk) or from one of the
   chunk's positions in the source file;
5. `rebuild_object`: a chunk object zstd-compressed as copiers upload it;
   a pack rebuilt with every chunk the manifest places in it at its place
   (`rebuild_pack`); uploaded with `put_if_absent`.

No lock is taken on the source: every byte read is checked against the
chunk's full 128-bit fingerprint, so a write racing with the read makes that
chunk unrepairable from this file, never wrong in the store.  A chunk that no
position of the file holds any more (the file changed since that snapshot)
is reported as unrepairable: a newer snapshot has to be published first.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import struct
from typing import Callable, Optional

from verneuil_fuse import format as fmt
from verneuil_fuse.pool import DaemonPool
from verneuil_fuse.store import NotFound, ReadError, Reads, Store
from verneuil_fuse.store.retry import retried

log = logging.getLogger(__name__)

# Store requests in flight at once: the same as restore's parallel fetches.
# `exists` is one HEAD request; 8 at a time checks some hundred chunks a
# second on S3 without looking like a flood to a small server.
DEFAULT_WORKERS = 8

# Chunks handed to the pool at a time.  Progress is reported after each
# batch (about a second of HEAD requests on S3 at 8 in flight), and results
# are collected per batch, so this also bounds what is held at once.
BATCH = 256

# Called as progress(phase, done, total); phase is CHECKING or REPAIRING.
Progress = Callable[[str, int, int], None]
CHECKING = "checking"
REPAIRING = "repairing"


class NoManifest(ReadError):
    """The store has no manifest for this database: nothing to repair."""


class LostBaseChunk(ReadError):
    """The manifest's base chunk is missing and the source cannot rebuild
    it: without it the manifest's chunk list cannot be read."""

    def __init__(self, message: str, fprint: fmt.Fprint):
        super().__init__(message)
        self.fprint = fprint


@dataclasses.dataclass
class RepairReport:
    """What `repair_database` found and did for one database.  The lists
    hold object names: chunk names, and pack keys in the packed layout
    (`packed`).  `repairable`: missing objects whose verified bytes were
    found (uploaded unless `dry_run`); `repaired`: those uploaded."""

    source: str
    manifest: str
    dry_run: bool = False
    packed: bool = False
    length: int = 0
    checked: int = 0
    missing: list[str] = dataclasses.field(default_factory=list)
    repairable: list[str] = dataclasses.field(default_factory=list)
    repaired: list[str] = dataclasses.field(default_factory=list)
    unrepairable: list[str] = dataclasses.field(default_factory=list)
    base_chunk_unrepairable: bool = False

    @property
    def complete(self) -> bool:
        """Whether the store now holds every chunk the manifest needs."""
        return len(self.repaired) == len(self.missing)

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "manifest": self.manifest,
            "dry_run": self.dry_run,
            "packed": self.packed,
            "len": self.length,
            "checked": self.checked,
            "missing": len(self.missing),
            "repairable": len(self.repairable),
            "repaired": len(self.repaired),
            "unrepairable": len(self.unrepairable),
            "complete": self.complete,
            "base_chunk_unrepairable": self.base_chunk_unrepairable,
            "missing_chunks": list(self.missing),
            "unrepairable_chunks": list(self.unrepairable),
        }


# -- 1. the manifest ----------------------------------------------------------------

def store_reads(store: Store) -> Reads:
    """The reads of `store` repair makes: every request retried while
    transient, a manifest bounded as the writer bounds its database
    (`format.MAX_REPLICATED_DB_SIZE`: any manifest a writer made)."""
    return Reads(store, max_db_size=fmt.MAX_REPLICATED_DB_SIZE, request=retried)


def find_manifest(reads: Reads, name: str, source: Optional[str] = None
                  ) -> tuple[fmt.Manifest, Optional[bytes]]:
    """The store's current manifest `name`, decoded and validated, and the
    bytes of its base chunk when the store has lost that chunk and it was
    rebuilt from `source` (None otherwise).  NoManifest if there is none,
    LostBaseChunk if its base chunk is lost for good, ReadError if it is
    corrupt or past the bound."""
    try:
        blob = reads.manifest_blob(name)
    except NotFound:
        raise NoManifest("no manifest %s in %s" % (name, reads.where_manifests())) from None
    lost: list[fmt.Fprint] = []

    def fetch(fp: fmt.Fprint) -> bytes:
        try:
            return reads.base_chunk(fp)
        except NotFound:
            lost.append(fp)
            raise

    what = "manifest %s" % name
    try:
        with reads.explained(what):
            return reads.decode(blob, base=fetch), None
    except ReadError:
        if not lost:
            raise
    base_fp = lost[0]
    base = rebuild_base_chunk(blob, base_fp, source) if source is not None else None
    if base is None:
        raise LostBaseChunk("the base chunk %s of manifest %s is missing from the store, and "
                            "the source file no longer holds that snapshot's chunks"
                            % (base_fp.name, name), base_fp)
    with reads.explained(what):
        return reads.decode(blob, base=lambda fp: base), base


def source_chunk_list(path: str, length: int) -> Optional[list[fmt.Fprint]]:
    """The chunk fingerprints of the file at `path`, if it is `length` bytes
    long; None otherwise."""
    out = []
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size != length:
            return None
        for index in range(fmt.chunk_count(length)):
            piece = f.read(fmt.CHUNK_SIZE)
            if len(piece) != min(fmt.CHUNK_SIZE, length - index * fmt.CHUNK_SIZE):
                return None  # truncated while being read
            out.append(fmt.chunk_fingerprint(piece))
    return out


def rebuild_base_chunk(blob: bytes, base_fp: fmt.Fprint, source: str) -> Optional[bytes]:
    """The base chunk of the manifest `blob`, rebuilt from the source file:
    when the file still has the snapshot's chunks (its chunk list matches
    the manifest's contents_fprint), the stored list XOR the real one gives
    the base chunk's first words, and the length whose bytes have the base
    chunk's fingerprint is the base chunk.  None when that cannot be done."""
    try:
        stored_fields = fmt.stored_fields(blob)
    except fmt.ManifestError:
        return None
    stored = stored_fields.words
    try:
        real = source_chunk_list(source, stored_fields.len)
    except OSError:
        return None
    if real is None or fmt.contents_fprint_of(real) != stored_fields.contents_fprint:
        return None
    words = [w for fp in real for w in fp]
    if len(words) != len(stored):
        return None
    # A base chunk longer than the list XOR-ed with it has words no
    # manifest records: such a base cannot be rebuilt (and is not tried).
    n = min(len(words), fmt.CHUNK_SIZE // 8)
    xored = struct.pack("<%dQ" % n, *(a ^ b for a, b in zip(stored[:n], words[:n])))
    for size in range(0, 8 * n + 1, 16):
        if fmt.chunk_fingerprint(xored[:size]) == base_fp:
            return xored[:size]
    return None


# -- 2. and 3. which chunks ---------------------------------------------------------

def live_chunks(m: fmt.Manifest) -> dict[fmt.Fprint, list[int]]:
    """The chunks whose blobs the store must hold for `m` (in whatever
    object), each with its positions in the file (none for the base chunk),
    in file order."""
    positions: dict[fmt.Fprint, list[int]] = {}
    if m.base_chunks_fprint is not None and m.base_chunks_fprint != fmt.ZERO_CHUNK_FPRINT:
        positions[m.base_chunks_fprint] = []
    for index, fp in enumerate(m.chunks):
        if index == 0 or fp == fmt.ZERO_CHUNK_FPRINT:
            continue
        positions.setdefault(fp, []).append(index)
    return positions


def find_missing(store, keys: list[str], pool: DaemonPool,
                 progress: Optional[Progress] = None) -> list[str]:
    """The objects of `keys` the store lacks, in the order given."""
    def exists(key: str) -> bool:
        return retried(lambda: store.chunks.exists(key), "check object")

    missing = []
    for start in range(0, len(keys), BATCH):
        batch = keys[start:start + BATCH]
        for key, (ok, value) in zip(batch, pool.map(exists, batch)):
            if not ok:
                raise value
            if not value:
                missing.append(key)
        if progress is not None:
            progress(CHECKING, start + len(batch), len(keys))
    return missing


# -- 4. and 5. bytes and uploads ----------------------------------------------------

def read_verified_chunk(fd: Optional[int], m: fmt.Manifest, fp: fmt.Fprint,
                        positions: list[int], known: Optional[bytes] = None) -> Optional[bytes]:
    """Bytes of chunk `fp` whose fingerprint matches: `known` (the rebuilt
    base chunk), a bundled copy, else the first of `positions` in the source
    file (open at `fd`) that still holds them.  None if nothing matches."""
    if known is not None and fmt.chunk_fingerprint(known) == fp:
        return known
    for index in positions:
        if index in m.bundled:  # verified when the manifest was decoded
            return m.bundled[index]
    if fd is None:
        return None
    for index in positions:
        want = m.chunk_length(index)
        data = os.pread(fd, want, index * fmt.CHUNK_SIZE)
        if len(data) == want and fmt.chunk_fingerprint(data) == fp:
            return data
    return None


def _blob_of_length(data: bytes, length: int) -> Optional[bytes]:
    """A chunk blob of exactly `length` bytes holding `data`: its zstd frame
    as copiers make it (with zero bytes after a shorter frame, which
    decoding ignores), or the raw bytes; None if neither fits."""
    frame = fmt.compress_chunk(data)
    if len(frame) <= length:
        return frame + bytes(length - len(frame))
    return data if len(data) == length else None


def rebuild_pack(fd: Optional[int], m: fmt.Manifest, key: str, indices: list[int],
                 known: Optional[bytes] = None) -> Optional[bytes]:
    """The bytes of a lost pack as far as `m` uses it: the blob of every
    chunk `m` places in it, at its place, from verified bytes; zeros where
    no chunk of `m` is (chunks only older versions placed there stay lost).
    None if one of its chunks cannot be had."""
    places = {}
    for index in indices:
        source = fmt.chunk_source(m, index)
        places[source.start] = (index, source.end - source.start)
    pack = bytearray(max(start + n for start, (_, n) in places.items()))
    for start, (index, length) in places.items():
        data = read_verified_chunk(fd, m, m.chunks[index], [index], known)
        blob = None if data is None else _blob_of_length(data, length)
        if blob is None:
            return None
        pack[start:start + length] = blob
    return bytes(pack)


def rebuild_object(fd: Optional[int], m: fmt.Manifest, key: str, positions: dict[fmt.Fprint, list[int]],
                   indices: list[int], known: Optional[bytes] = None) -> Optional[bytes]:
    """The blob to upload again under `key` (a chunk object, the base chunk
    or a pack of `m`, serving the chunks `indices`), or None when the
    verified bytes it needs cannot be had."""
    if fmt.parse_pack_key(key) is not None:
        return rebuild_pack(fd, m, key, indices, known)
    fp = m.chunks[indices[0]] if indices else fmt.parse_chunk_name(key)
    data = read_verified_chunk(fd, m, fp, positions.get(fp, []), known)
    return None if data is None else fmt.compress_chunk(data)


# -- one database -------------------------------------------------------------------

def _needs_source(m: fmt.Manifest, objects: dict[str, list[int]], missing: list[str],
                  base: Optional[bytes]) -> bool:
    """Whether some missing object needs bytes only the source file has
    (not bundled in the manifest, nor the rebuilt base chunk)."""
    for key in missing:
        if not objects[key]:
            if base is None:
                return True
        elif any(i not in m.bundled for i in objects[key]):
            return True
    return False


def _repair_missing(store, m: fmt.Manifest, report: RepairReport, objects: dict[str, list[int]],
                    missing: list[str], fd: Optional[int], base: Optional[bytes], pool: DaemonPool,
                    progress: Optional[Progress]) -> None:
    """Rebuild and (unless a dry run) upload every missing object, filling
    the report's lists."""
    positions = live_chunks(m)

    def repair_one(key: str) -> str:
        blob = rebuild_object(fd, m, key, positions, objects[key], base)
        if blob is None:
            return "unrepairable"
        if report.dry_run:
            return "repairable"
        retried(lambda: store.chunks.put_if_absent(key, blob), "put object")
        return "repaired"

    for start in range(0, len(missing), BATCH):
        batch = missing[start:start + BATCH]
        for key, (ok, value) in zip(batch, pool.map(repair_one, batch)):
            if not ok:
                raise value
            if value == "unrepairable":
                report.unrepairable.append(key)
            else:
                report.repairable.append(key)
                if value == "repaired":
                    report.repaired.append(key)
        if progress is not None:
            progress(REPAIRING, start + len(batch), len(missing))


def repair_database(store: Store, source: str, name: str, *, dry_run: bool = False,
                    workers: int = DEFAULT_WORKERS,
                    progress: Optional[Progress] = None) -> RepairReport:
    """Check, and unless `dry_run` repair, the objects of manifest `name`
    from the database file `source`.  Raises NoManifest / ReadError (the
    manifest), OSError (the source cannot be read) and StoreError."""
    report = RepairReport(source=source, manifest=name, dry_run=dry_run)
    try:
        m, base = find_manifest(store_reads(store), name, source)
    except LostBaseChunk as e:
        lost = e.fprint.name
        report.base_chunk_unrepairable = True
        report.checked = 1
        report.missing.append(lost)
        report.unrepairable.append(lost)
        return report
    report.length = m.len
    report.packed = m.layout is not None
    objects = fmt.stored_objects(m)
    report.checked = len(objects)
    pool = DaemonPool(workers, name="repair")
    try:
        report.missing = find_missing(store, list(objects), pool, progress)
        if not report.missing:
            return report
        # The file is only opened when the manifest itself cannot give
        # every missing object back (bundled chunks, a rebuilt base chunk).
        fd = (os.open(source, os.O_RDONLY | os.O_CLOEXEC)
              if _needs_source(m, objects, report.missing, base) else None)
        try:
            _repair_missing(store, m, report, objects, report.missing, fd, base, pool, progress)
        finally:
            if fd is not None:
                os.close(fd)
    finally:
        pool.close()
    if report.repaired:
        log.info("%s: uploaded %d missing objects again", source, len(report.repaired))
    return report
