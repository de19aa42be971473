"""The copier's packed path (docs/COPIER.md, "The packed layout"): what a
`Copier` does instead of uploading one object per chunk when its store says
``layout=packed``.

- `pack_chunk_dir`: the chunk files of a snapshot (or of `staging`) go into
  packs in file order; chunks the database already has in a pack keep their
  place; each pack is uploaded, then journaled, then its files unlinked;
- `prepare`: before a manifest's upload (outside the database's lock),
  packs again the chunks of its most scattered windows and least live
  packs (`packing.plan_compaction`), reading them from the source database
  file (checked against their fingerprints) or, failing that, the store;
- `upload_manifest`: the manifest the writer staged, with the place of
  every chunk added (`format.with_layout`), uploaded, and kept as
  `copier.last`; a chunk with no known place is looked for in the store's
  current manifest, then in the source file, else the upload is refused
  (`Unplaced`) and the writer's next commit made a full snapshot;
- `after_staged_upload`: journal records the uploaded manifest covers are
  pruned; `collect`: the database's garbage packs deleted every
  GC_INTERVAL by one copier of the spool (`packing.GcState`).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

from verneuil_fuse import format as fmt
from verneuil_fuse.store import NotFound, StoreError
from verneuil_fuse.copier import spool as sp
from verneuil_fuse.copier.packing import (GC_INTERVAL, PACK_TARGET_BYTES, PACKS_IN_FLIGHT, GcState, Ledger,
                                          PackBuilder, Place, collect_garbage, plan_compaction, space_of,
                                          stored_chunks)

log = logging.getLogger(__name__)

# Chunk files read, checked and compressed at a time while filling packs:
# enough to keep the prepare threads busy, few enough to bound memory.
READ_BATCH = 64
# The writer's extended attribute (docs/FORMAT.md, "Change detection on the
# writer"): removing it makes the next commit a full snapshot.
VERSION_XATTR = "user.verneuil.version_id"


class Unplaced(Exception):
    """A manifest names chunks that are neither in the spool nor in any pack
    this copier can find: it cannot be uploaded."""


class Packer:
    """The packed path of one `Copier` (see the module's docstring): it uses
    the copier's store, pools, pacing (`_request`), counters and dead
    letters."""

    def __init__(self, copier, target: int = PACK_TARGET_BYTES):
        self.c = copier
        self.target = target
        self._ledgers: dict[str, Ledger] = {}

    def ledger(self, db: sp.DbDir, name: str) -> Ledger:
        """The ledger of `db`, whose manifest is `name`, up to date."""
        space = space_of(name)
        ledger = self._ledgers.get(db.path)
        if ledger is None or ledger.space != space:
            ledger = self._ledgers[db.path] = Ledger(db.path, space, self.c.max_db_size)
        ledger.refresh()
        if ledger.needs_store_manifest():
            ledger.use_store_manifest(self._store_manifest(name))
        return ledger

    def _store_manifest(self, name: str) -> Optional[fmt.Manifest]:
        """The store's current manifest `name`, or None (none, unreadable)."""
        try:
            return self.c.reads.manifest(name)
        except NotFound:
            return None
        except (StoreError, fmt.ManifestError, fmt.ChunkError) as e:
            log.warning("cannot read the places in the store's manifest %s: %s", name, e)
            return None

    # -- packing chunk files -------------------------------------------------------

    def pack_chunk_dir(self, db: sp.DbDir, dirpath: str, name: str, order: Optional[fmt.Manifest]) -> int:
        """Pack the chunk files of `dirpath` (their manifest: `name`; `order`,
        when readable, gives their file order); the number of bad files."""
        names = sp.listdir_or_empty(dirpath)
        if not names:
            return 0
        ledger = self.ledger(db, name)
        kept: dict[fmt.Fprint, Place] = {}
        kept_files, fresh = [], []
        for n in names:
            try:
                fp = fmt.parse_chunk_name(n)
            except fmt.BadName:
                fresh.append(n)  # `_chunk_blob` moves it aside
                continue
            place = ledger.locate(fp)
            if place is not None:
                kept[fp] = place
                kept_files.append(n)
            else:
                fresh.append(n)
        if kept:  # restaged chunks keep their place: journaled, not uploaded again
            ledger.journal.write(kept, {})
            for n in kept_files:
                sp.unlink_quiet(os.path.join(dirpath, n))
            self.c._count(chunks_skipped=len(kept_files))
        return self._pack_files(db, dirpath, ledger, _in_file_order(fresh, order))

    def _pack_files(self, db: sp.DbDir, dirpath: str, ledger: Ledger, names: list[str]) -> int:
        """Read, check and compress the chunk files `names` into packs,
        PACKS_IN_FLIGHT uploaded at a time; the number of bad files."""
        builder = PackBuilder(self.target)
        files: list[tuple[str, int]] = []
        ready: list = []
        bad = 0
        for at in range(0, len(names), READ_BATCH):
            batch = names[at:at + READ_BATCH]
            for n, (ok, got) in zip(batch, self.c._prepare_pool.map(
                    lambda n: self.c._chunk_blob(db, dirpath, n), batch)):
                if not ok:
                    raise got
                if got is False:
                    bad += 1
                if isinstance(got, bool):
                    continue
                builder.add(fmt.parse_chunk_name(n), got[1])
                files.append((n, got[0]))
                if builder.full:
                    ready.append(builder.take() + (files,))
                    files = []
            if len(ready) >= PACKS_IN_FLIGHT:
                self._upload_packs(ledger, dirpath, ready)
                ready = []
        if builder.parts:
            ready.append(builder.take() + (files,))
        if ready:
            self._upload_packs(ledger, dirpath, ready)
        return bad

    def _upload_packs(self, ledger: Ledger, dirpath: Optional[str], packs: list) -> None:
        """Upload packs (fingerprint, bytes, places, [(file, raw length)]) in
        parallel; each is journaled once stored, then its files unlinked."""
        def put(item) -> None:
            pack, data, places, files = item
            key = fmt.pack_key(ledger.space, pack)
            self.c._request(lambda: self.c.store.chunks.put(key, data), "put pack")
            ledger.journal.write(places, {pack: len(data)})
            if dirpath is not None:
                for n, _ in files:
                    sp.unlink_quiet(os.path.join(dirpath, n))
            self.c._count(packs_uploaded=1, chunks_uploaded=len(places), chunk_bytes_sent=len(data),
                          chunk_bytes_raw=sum(raw for _, raw in files))

        first_error = None
        for ok, value in self.c._pool.map(put, packs):
            if not ok and first_error is None:
                first_error = value
        if first_error is not None:
            raise first_error
        ledger.refresh()

    # -- compaction ----------------------------------------------------------------

    def prepare(self, db: sp.DbDir, name: str, m: fmt.Manifest) -> None:
        """Before `m`'s upload: pack again what `plan_compaction` picks.
        Best effort: a failure is logged and the upload goes on as it is."""
        try:
            ledger = self.ledger(db, name)
            order = stored_chunks(m)
            places = [ledger.locate(m.chunks[i]) for i in order]
            if any(p is None for p in places):
                return  # `upload_manifest` finds them first
            stretches = plan_compaction(places, ledger.pack_size, self.target)
            if stretches:
                indices = [order[k] for a, b in stretches for k in range(a, b)]
                self._repack(db, ledger, m, dict(zip(order, places)), indices)
        except (StoreError, fmt.ChunkError, OSError) as e:
            log.warning("%s: compaction skipped: %s", db.source() or db.path, e)

    def _repack(self, db: sp.DbDir, ledger: Ledger, m: fmt.Manifest, where: dict[int, Place],
                indices: list[int]) -> None:
        """Pack the chunks `indices` of `m` again, in file order."""
        start = time.monotonic()
        current = fmt.Manifest(len=m.len, chunks=m.chunks, header_fprint=m.header_fprint,
                               contents_fprint=m.contents_fprint, bundled=m.bundled,
                               layout=fmt.PackedLayout.build(ledger.space, [where.get(i) for i in range(len(m.chunks))]))
        builder = PackBuilder(self.target)
        ready: list = []
        with _Source(db.source(), m) as source:
            for at in range(0, len(indices), READ_BATCH):
                batch = indices[at:at + READ_BATCH]
                for i, data in self._chunk_bytes(source, current, batch):
                    builder.add(m.chunks[i], fmt.compress_chunk(data))
                    if builder.full:
                        ready.append(builder.take() + ([],))
                if len(ready) >= PACKS_IN_FLIGHT:
                    self._upload_packs(ledger, None, ready)
                    ready = []
        if builder.parts:
            ready.append(builder.take() + ([],))
        if ready:
            self._upload_packs(ledger, None, ready)
        self.c._count(chunks_repacked=len(indices))
        log.info("%s: packed %d scattered chunks again in %.1fs", db.source() or db.path, len(indices),
                 time.monotonic() - start)

    def _chunk_bytes(self, source: "_Source", current: fmt.Manifest, batch: list[int]) -> list[tuple[int, bytes]]:
        """The verified bytes of chunks `batch` of `current`: from the source
        file where it still holds them, else read from the store by runs."""
        got = {i: data for i in batch if (data := source.chunk(i)) is not None}
        missing = [i for i in batch if i not in got]
        if missing:
            fps = {i: current.chunks[i] for i in missing}
            runs = self.c.reads.runs(current, missing)
            for ok, value in self.c._pool.map(lambda run: self.c.reads.run(run, fps), runs):
                if not ok:
                    raise value
                got.update(value)
        return [(i, got[i]) for i in batch]

    # -- manifests -----------------------------------------------------------------

    def upload_manifest(self, db: sp.DbDir, name: str, raw: bytes, m: fmt.Manifest) -> fmt.Manifest:
        """Upload `raw` (the staged manifest `m`) with the place of each of
        its chunks; `m` with its layout.  Unplaced if chunks have none."""
        ledger = self.ledger(db, name)
        places = self._places(db, ledger, name, m)
        m.layout = fmt.PackedLayout.build(ledger.space, places)
        packed = fmt.with_layout(raw, m.layout)
        if len(packed) > fmt.MAX_MANIFEST_BYTES:  # past what any reader reads (Verneuil's cap)
            m.layout = None
            raise Unplaced("its manifest with the places of its %d chunks would be %d bytes, more than "
                           "the %d a manifest may be: a database this large needs layout=chunks"
                           % (len(m.chunks), len(packed), fmt.MAX_MANIFEST_BYTES))
        blob = fmt.compress_manifest(packed)
        self.c._request(lambda: self.c.store.manifests.put(name, blob), "put manifest")
        ledger.set_last(packed, m)
        return m

    def _places(self, db: sp.DbDir, ledger: Ledger, name: str, m: fmt.Manifest) -> list[Optional[Place]]:
        """The place of every chunk of `m` (None: the zero chunk, or a
        bundled chunk no pack holds); the fallbacks for chunks the ledger
        does not know: the store's manifest, read now, then the source."""
        places: list[Optional[Place]] = [None] * len(m.chunks)
        missing: list[int] = []
        for i, fp in enumerate(m.chunks):
            if fp != fmt.ZERO_CHUNK_FPRINT:
                places[i] = ledger.locate(fp)
                if places[i] is None and i != 0 and i not in m.bundled:
                    missing.append(i)
        if missing:
            ledger.use_store_manifest(self._store_manifest(name))
            missing = self._fill(places, missing, ledger.locate, m)
        if missing:
            found = self._pack_from_source(db, ledger, m, missing)
            missing = self._fill(places, missing, found.get, m)
        if missing:
            self._force_full_snapshot(db)
            raise Unplaced("%d chunks it names (%s...) are in neither the spool nor a pack of the store; "
                           "the writer's next commit publishes a full snapshot"
                           % (len(missing), m.chunks[missing[0]].name))
        return places

    @staticmethod
    def _fill(places: list, missing: list[int], locate, m: fmt.Manifest) -> list[int]:
        """Place what `locate` now knows; the indices still missing."""
        left = []
        for i in missing:
            places[i] = locate(m.chunks[i])
            if places[i] is None:
                left.append(i)
        return left

    def _pack_from_source(self, db: sp.DbDir, ledger: Ledger, m: fmt.Manifest,
                          missing: list[int]) -> dict[fmt.Fprint, Place]:
        """Pack the chunks `missing` from the source file, those it still
        holds (checked against their fingerprints); their places."""
        builder = PackBuilder(self.target)
        with _Source(db.source(), m) as source:
            for i in missing:
                data = source.chunk(i)
                if data is not None and m.chunks[i] not in (fp for fp, _ in builder.parts):
                    builder.add(m.chunks[i], fmt.compress_chunk(data))
        if not builder.parts:
            return {}
        log.warning("%s: %d chunks of manifest %s were found in no pack; packed from the "
                    "database file", db.source() or db.path, len(builder.parts), m.contents_fprint.name)
        pack = builder.take()
        self._upload_packs(ledger, None, [pack + ([],)])
        return pack[2]

    @staticmethod
    def _force_full_snapshot(db: sp.DbDir) -> None:
        """Remove the writer's version attribute from the source file, so
        that its next commit stages every chunk again."""
        source = db.source()
        if source is None:
            return
        try:
            os.removexattr(source, VERSION_XATTR)
        except OSError as e:
            log.debug("%s: cannot remove %s: %s", source, VERSION_XATTR, e)

    # -- after an upload --------------------------------------------------------------

    def after_staged_upload(self, db: sp.DbDir, name: str, staged_ctime_ns: int) -> None:
        """A staged manifest passed the sequence-lock check and is in the
        store: the journal records made before it was staged are covered by
        it (or name chunks no later manifest can name without staging them
        again)."""
        ledger = self._ledgers.get(db.path)
        if ledger is not None:
            ledger.journal.prune(staged_ctime_ns)

    def collect(self, db: sp.DbDir, name: str, force: bool = False, **kw) -> list[str]:
        """Delete `db`'s garbage packs, at most every GC_INTERVAL seconds
        by any copier of the spool (always with `force`); the keys deleted.
        Failures are logged."""
        state = GcState(db.sub(sp.GC_FILE))
        if not force and time.time() - state.last_run() < GC_INTERVAL:
            return []
        known = state.load()
        try:
            state.save(known)  # claims this round for the spool's other copiers
            ledger = self.ledger(db, name)
            deleted = collect_garbage(self.c.store, self.c.reads, name, ledger.space, ledger.protected(),
                                      request=self.c._request, known=known, **kw)
            state.save(known)
        except (StoreError, fmt.ManifestError, fmt.ChunkError, OSError) as e:
            log.warning("%s: no garbage collection this time: %s", db.source() or db.path, e)
            return []
        if deleted:
            self.c._count(packs_deleted=len(deleted))
            log.info("%s: deleted %d packs no kept version needs", db.source() or db.path, len(deleted))
        return deleted


def _in_file_order(names: list[str], order: Optional[fmt.Manifest]) -> list[str]:
    """Chunk file names sorted by the first place their chunk has in the
    file (`order`'s chunk list), the others after them by name."""
    if order is None:
        return sorted(names)
    wanted = {}
    for n in names:
        try:
            wanted[fmt.parse_chunk_name(n)] = n
        except fmt.BadName:
            pass
    first: dict[str, int] = {}
    for i, fp in enumerate(order.chunks):
        n = wanted.get(fp)
        if n is not None and n not in first:
            first[n] = i
    return sorted(names, key=lambda n: (first.get(n, len(order.chunks)), n))


class _Source:
    """The source database file, read for chunks that still match `m`
    (each checked against its fingerprint; nothing when it cannot be
    opened)."""

    def __init__(self, path: Optional[str], m: fmt.Manifest):
        self.path, self.m = path, m
        self.fd: Optional[int] = None

    def __enter__(self) -> "_Source":
        if self.path is not None:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self.fd = None
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)

    def chunk(self, index: int) -> Optional[bytes]:
        if self.fd is None:
            return None
        want = self.m.chunk_length(index)
        try:
            data = os.pread(self.fd, want, index * fmt.CHUNK_SIZE)
        except OSError:
            return None
        return data if len(data) == want and fmt.chunk_fingerprint(data) == self.m.chunks[index] else None
