"""Convert a database's current version from one store layout to the other
(`verneuilctl convert`): to ``packed`` (its chunks into packs, read by
range) or back to ``chunks`` (Verneuil's layout, an object per chunk, so
that a Verneuil reader can be given the store again).

`convert_database` reads the current manifest, reads every chunk it needs
(verified against its fingerprint), writes the objects of the other layout,
then uploads the manifest of the other layout as a new version; readers of
either layout read the result.  It is resumable: a database already in the
target layout is left alone, a chunk object already there is not written
again, and a pack is named after its bytes (the same chunks in the same
order make the same pack), so one already stored is not uploaded again.
Objects of the old layout are left in place (older versions may name them;
the store's expiry or the packed layout's GC removes them in time).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

from verneuil_fuse import format as fmt
from verneuil_fuse.copier.packing import PACK_TARGET_BYTES, PackBuilder, Place, space_of, stored_chunks
from verneuil_fuse.pool import DaemonPool
from verneuil_fuse.store import LAYOUT_CHUNKS, LAYOUT_PACKED, NotFound, ReadError, Reads, Store
from verneuil_fuse.store.retry import retried

log = logging.getLogger(__name__)

# Store requests in flight at once, as restore's and repair's: some hundred
# chunks a second on S3 without looking like a flood to a small server.
DEFAULT_WORKERS = 8
# Called as progress(phase, done, total); the phase is READING.
Progress = Callable[[str, int, int], None]

# Chunks read per step: their reads go out in parallel, then they are
# written in file order; 256 chunks are 16 MiB at most in memory.
WINDOW = 256
# The phase `progress(phase, done, total)` reports (`repair.Progress`).
READING = "reading"


@dataclasses.dataclass
class ConvertReport:
    """What `convert_database` did for one database."""

    manifest: str
    layout: str  # the target
    converted: bool = False  # False: it already was in that layout
    chunks: int = 0  # chunk blobs it needs
    written: int = 0  # objects written (chunk objects or packs)
    skipped: int = 0  # objects already in the store (a resumed conversion)
    bytes_written: int = 0


def in_layout(m: fmt.Manifest, layout: str) -> bool:
    """Whether every stored chunk of `m` is where `layout` puts it."""
    if layout == LAYOUT_CHUNKS:
        return m.layout is None
    return m.layout is not None and all(fmt.chunk_source(m, i).ranged for i in stored_chunks(m))


def _read(reads: Reads, m: fmt.Manifest, indices: list[int], pool: DaemonPool) -> dict[int, bytes]:
    """The verified bytes of chunks `indices` of `m`, read by runs."""
    fps = {i: m.chunks[i] for i in indices}

    def fetch(run: fmt.Run) -> list[tuple[int, bytes]]:
        try:
            return reads.load_run(run, fps)
        except ReadError as e:
            raise ReadError("%s: the database cannot be converted (`verneuilctl repair` may put it back)"
                            % e) from None

    got: dict[int, bytes] = {}
    for ok, value in pool.map(fetch, reads.runs(m, indices)):
        if not ok:
            raise value
        got.update(value)
    return got


def _to_chunks(store: Store, reads: Reads, m: fmt.Manifest, report: ConvertReport, pool: DaemonPool,
               progress: Optional[Progress]) -> None:
    """Write a chunk object for every stored chunk of `m` the store lacks."""
    order = stored_chunks(m)
    for at in range(0, len(order), WINDOW):
        window = order[at:at + WINDOW]
        present = pool.map(lambda i: retried(lambda: store.chunks.exists(m.chunks[i].name), "check chunk"),
                           window)
        todo = []
        for i, (ok, value) in zip(window, present):
            if not ok:
                raise value
            if value:
                report.skipped += 1
            else:
                todo.append(i)
        got = _read(reads, m, todo, pool)

        def put(i: int) -> int:
            blob = fmt.compress_chunk(got[i])
            retried(lambda: store.chunks.put_if_absent(m.chunks[i].name, blob), "put chunk")
            return len(blob)

        for ok, value in pool.map(put, todo):
            if not ok:
                raise value
            report.written += 1
            report.bytes_written += value
        if progress is not None:
            progress(READING, at + len(window), len(order))


def _to_packs(store: Store, reads: Reads, name: str, m: fmt.Manifest, report: ConvertReport, pool: DaemonPool,
              progress: Optional[Progress], target: int) -> fmt.PackedLayout:
    """Pack every stored chunk of `m`, in file order; the new layout."""
    space = space_of(name)
    order = stored_chunks(m)
    builder = PackBuilder(target)
    places: dict[fmt.Fprint, Place] = {}

    def flush() -> None:
        pack, data, where = builder.take()
        key = fmt.pack_key(space, pack)
        if retried(lambda: store.chunks.exists(key), "check pack"):
            report.skipped += 1
        else:
            retried(lambda: store.chunks.put(key, data), "put pack")
            report.written += 1
            report.bytes_written += len(data)
        places.update(where)

    for at in range(0, len(order), WINDOW):
        window = order[at:at + WINDOW]
        got = _read(reads, m, window, pool)
        for i in window:
            builder.add(m.chunks[i], fmt.compress_chunk(got[i]))
            if builder.full:
                flush()
        if progress is not None:
            progress(READING, at + len(window), len(order))
    if builder.parts:
        flush()
    return fmt.PackedLayout.build(space, [places.get(fp) if fp != fmt.ZERO_CHUNK_FPRINT else None
                                          for fp in m.chunks])


def convert_database(store: Store, name: str, layout: str, *, workers: int = DEFAULT_WORKERS,
                     progress: Optional[Progress] = None, target: int = PACK_TARGET_BYTES) -> ConvertReport:
    """Convert the current version of manifest `name` to `layout` ("packed"
    or "chunks"); see the module's docstring.  ReadError (no such
    database, a chunk missing or corrupt), StoreError."""
    if layout not in (LAYOUT_CHUNKS, LAYOUT_PACKED):
        raise ValueError("unknown layout %r" % layout)
    reads = Reads(store, request=retried)
    with reads.explained("manifest %s" % name):
        blob = reads.manifest_blob(name)
        m = reads.decode(blob)
    report = ConvertReport(manifest=name, layout=layout, chunks=len(stored_chunks(m)))
    if in_layout(m, layout):
        return report
    pool = DaemonPool(max(1, workers), name="convert")
    try:
        if layout == LAYOUT_CHUNKS:
            _to_chunks(store, reads, m, report, pool, progress)
            new_layout = None
        else:
            new_layout = _to_packs(store, reads, name, m, report, pool, progress, target)
    finally:
        pool.close()
    # The version read at the start, in the other layout: a new version.
    converted = fmt.compress_manifest(fmt.with_layout(fmt.raw_manifest(blob), new_layout))
    retried(lambda: store.manifests.put(name, converted), "put manifest")
    report.converted = True
    log.info("%s: converted to the %s layout (%d objects written, %d already there)",
             name, layout, report.written, report.skipped)
    return report
