"""One verified, bounded read of a store's replicas: every reader of a
store (the mount's fetcher and catalog, past states, restore, versions,
repair, convert, the copier and verneuilctl) reads manifests and chunks
through `Reads`, so that bounds, verification and the words of a failure
are written once.

`Reads(store, max_db_size=..., request=..., hint=...)`:

- manifests, bounded by what a database of ``max_db_size`` bytes needs
  (`format.manifest_blob_limit`): `names` (the namespace listed),
  `versions` (a manifest's versions, oldest first), `manifest_blob` (the
  stored object, by name and version, refused unread past the bound),
  `manifest_if_changed` (a conditional read), `decode`
  (`format.decode_and_validate` with the same bound, a base chunk read by
  `base_chunk`), `manifest` (both), `holds` (whether the store's manifest is
  the one a writer staged);
- chunks, in either layout: `where` (which object, and which bytes of it,
  hold chunk X: `format.chunk_source`), `runs` (chunks coalesced into reads
  of adjacent blobs: `format.chunk_runs`), `chunk` (one chunk read and
  checked against its full 128-bit fingerprint), `run` (a run read with one
  request, each chunk checked on its own), `base_chunk` (a base chunk,
  bounded by the chunk list it encodes).

`ChunkReads` is the part of it the reader's flights use: where a chunk is
and one verified read of a chunk or a run. A faster transport (the chunk
engine's range GETs in C, a directory store's file reads) goes behind those
four calls, and the flights keep asking them.

Failures are the store's `StoreError`s and the format's `ManifestError` /
`ChunkError`, worded here once: a manifest or chunk that is not there says
which and where (`NotFound`), one past its bound says its size, the bound
and the setting that raises it (`TooLarge`, with ``hint``); a range that
comes back short, or bytes that do not verify, are a `ChunkError`, never
wrong bytes. For people (restore, versions, convert, verneuilctl), `load`,
`load_blob` and `load_run` say the same as one `ReadError` line each.

``request(fn, what)`` makes each store request (the caller's pacing and
retries: the copier's, repair's); by default, once.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Protocol, TypeVar

from verneuil_fuse.format import (DEFAULT_MAX_DB_SIZE, MAX_CHUNK_BLOB_BYTES, MAX_MANIFEST_BYTES, ChunkError,
                                  ChunkSource, Fprint, Manifest, ManifestError, Run, base_chunk_blob_limit,
                                  chunk_runs, chunk_source, decode_and_validate, decode_base_chunk,
                                  decode_chunk, format_size, manifest_blob_limit, raw_manifest,
                                  same_manifest, strip_layout, zstd_frame_bound)
from verneuil_fuse.store.base import NotFound, ObjectInfo, Store, Tagged, TooLarge, VersionInfo
from verneuil_fuse.store.config import LAYOUT_PACKED

T = TypeVar("T")
Request = Callable[[Callable[[], T], str], T]


def _once(fn: Callable[[], T], what: str) -> T:
    return fn()


class ReadError(Exception):
    """What cannot be read from a store as a replica needs it (missing,
    past its bound, corrupt): one line for people; ``missing``: the object
    is not in the store."""

    def __init__(self, message: str, *, missing: bool = False):
        super().__init__(message)
        self.missing = missing


class ChunkReads(Protocol):
    """What the reader's flights ask of the store layer (see the module's
    docstring): `Reads` is the one implementation."""

    def where(self, m: Manifest, index: int) -> ChunkSource:
        ...

    def runs(self, m: Manifest, indices) -> list[Run]:
        ...

    def chunk(self, source: ChunkSource, fp: Fprint) -> tuple[int, bytes]:
        ...

    def run(self, run: Run, fps: dict[int, Fprint]) -> list[tuple[int, bytes]]:
        ...


class Reads:
    """The verified, bounded reads of one store (see the module's
    docstring); ``store`` None: manifests given as bytes are decoded, with
    no store to read a base chunk from. ``hint``: how a user raises
    ``max_db_size``, said after a refusal ("raise max_db_size (verneuilctl
    --max-db-size) if that database is genuine"); None: the setting's name
    alone."""

    def __init__(self, store: Optional[Store], *, max_db_size: int = DEFAULT_MAX_DB_SIZE,
                 request: Request = _once, hint: Optional[str] = None):
        self._store = store
        self.max_db_size = max_db_size
        self.manifest_limit = manifest_blob_limit(max_db_size)
        self.base_limit = base_chunk_blob_limit(max_db_size)
        self._request = request
        self.hint = hint

    def where_manifests(self) -> str:
        """Where the manifests are, for messages."""
        return self._store.manifests.describe()

    # -- manifests -----------------------------------------------------------------

    def names(self) -> list[ObjectInfo]:
        """Every manifest of the store (a listing)."""
        return self._request(lambda: list(self._store.manifests.list("")), "list manifests")

    def versions(self, name: str) -> list[VersionInfo]:
        """The versions of manifest `name`, oldest first (empty: none)."""
        return list(reversed(self._request(lambda: self._store.manifests.list_versions(name), "list versions")))

    def manifest_blob(self, name: str, version_id: Optional[str] = None) -> bytes:
        """The stored object of manifest `name` (or of that version of it),
        at most `manifest_limit` bytes: a larger one is TooLarge, unread."""
        manifests = self._store.manifests
        try:
            if version_id is None:
                return self._request(lambda: manifests.get(name, max_bytes=self.manifest_limit), "get manifest")
            return self._request(lambda: manifests.get_version(name, version_id, max_bytes=self.manifest_limit),
                                 "get manifest version")
        except NotFound:
            what = "manifest %s" % name if version_id is None else "version %s of manifest %s" % (version_id, name)
            raise NotFound("no such replicated database in %s: %s" % (manifests.describe(), what),
                           key=name) from None
        except TooLarge as e:
            raise self.manifest_too_large("manifest %s" % name, e.size) from None

    def manifest_if_changed(self, name: str, tag: Optional[str]) -> Optional[Tagged]:
        """`Backend.get_if_changed` of manifest `name`, bounded as `manifest_blob`."""
        try:
            return self._request(lambda: self._store.manifests.get_if_changed(name, tag, max_bytes=self.manifest_limit),
                                 "check manifest")
        except TooLarge as e:
            raise self.manifest_too_large("manifest %s" % name, e.size) from None

    def manifest_too_large(self, what: str, size: Optional[int]) -> TooLarge:
        """The TooLarge of a manifest (`what`: "manifest NAME", "manifest
        file PATH") of `size` bytes (None: larger than the bound)."""
        shown = "%d bytes" % size if size is not None else "larger"
        return TooLarge("%s is %s, more than the %d-byte limit for databases of up to %s%s"
                        % (what, shown, self.manifest_limit, format_size(self.max_db_size), self._hinted()),
                        size=size, bound=self.manifest_limit)

    def _hinted(self) -> str:
        return " (max_db_size)" + ("; " + self.hint if self.hint else "")

    def decode(self, blob: bytes, base: Optional[Callable[[Fprint], bytes]] = None) -> Manifest:
        """`format.decode_and_validate`, bounded by ``max_db_size``; a base
        chunk comes from ``base`` (default `base_chunk`)."""
        if base is None and self._store is not None:
            base = self.base_chunk
        return decode_and_validate(blob, base, max_db_size=self.max_db_size)

    def manifest(self, name: str, version_id: Optional[str] = None) -> Manifest:
        """Manifest `name` (or that version of it), read and decoded."""
        return self.decode(self.manifest_blob(name, version_id))

    def holds(self, name: str, raw: bytes) -> Optional[bool]:
        """Whether the store's current manifest `name` is the manifest a
        writer staged (`raw`, uncompressed), with or without the packed
        layout a copier adds to it; None when there is none. An object
        larger than any frame of `raw` (with that layout) cannot be it and is
        not read."""
        bound = zstd_frame_bound(len(raw))
        packed = self._store.layout == LAYOUT_PACKED
        if packed:  # the layout adds at most 27 bytes to the 16 of a chunk
            bound = min(MAX_MANIFEST_BYTES, 3 * bound)
        try:
            blob = self._request(lambda: self._store.manifests.get(name, max_bytes=bound), "get manifest")
        except NotFound:
            return None
        except TooLarge:
            return False
        if not packed:
            return same_manifest(blob, raw)
        if blob == raw:
            return True
        try:
            return strip_layout(raw_manifest(blob, self.max_db_size)) == raw
        except Exception:  # noqa: BLE001 - ManifestError, the protobuf runtime's DecodeError
            return False

    # -- chunks ---------------------------------------------------------------------

    @staticmethod
    def where(m: Manifest, index: int) -> ChunkSource:
        """Which object, and which bytes of it, hold chunk `index` of `m`."""
        return chunk_source(m, index)

    @staticmethod
    def runs(m: Manifest, indices) -> list[Run]:
        """The chunks `indices` of `m` as reads of adjacent blobs."""
        return chunk_runs(m, indices)

    def chunk(self, source: ChunkSource, fp: Fprint) -> tuple[int, bytes]:
        """(bytes read, the verified chunk) of chunk `fp` at `source`."""
        blob = self._blob(source)
        return len(blob), decode_chunk(blob, fp)

    def run(self, run: Run, fps: dict[int, Fprint]) -> list[tuple[int, bytes]]:
        """(index, verified chunk) for every chunk of `run` (`fps` gives each
        index's fingerprint), read with one request: the first chunk that
        does not verify is a ChunkError."""
        if run.end is None:
            ((index, _, _),) = run.parts
            return [(index, self.chunk(ChunkSource(run.key), fps[index])[1])]
        data = self._blob(ChunkSource(run.key, run.start, run.end))
        return [(index, decode_chunk(data[lo:hi], fps[index])) for index, lo, hi in run.parts]

    def _blob(self, source: ChunkSource) -> bytes:
        """The bytes `source` names: a whole chunk object of at most
        MAX_CHUNK_BLOB_BYTES (else TooLarge, unread), or exactly the range
        (else ChunkError)."""
        chunks = self._store.chunks
        what = "chunk" if source.end is None else "pack"
        try:
            if source.end is None:
                return self._request(lambda: chunks.get(source.key, max_bytes=MAX_CHUNK_BLOB_BYTES), "get chunk")
            data = self._request(lambda: chunks.get_range(source.key, source.start, source.end), "get chunks")
        except NotFound:
            raise NotFound("%s %s is missing from the store (%s)" % (what, source.key, chunks.describe()),
                           key=source.key) from None
        except TooLarge as e:
            raise TooLarge("corrupt chunk in the store: %s is %s, more than the %d bytes a chunk object may hold"
                           % (source.key, "%d bytes" % e.size if e.size is not None else "larger",
                              MAX_CHUNK_BLOB_BYTES), key=source.key, size=e.size, bound=e.bound) from None
        if len(data) != source.end - source.start:
            raise ChunkError("%s holds %d bytes at [%d, %d), not %d: the pack was cut or replaced"
                             % (source.key, len(data), source.start, source.end, source.end - source.start))
        return data

    def base_chunk(self, fp: Fprint) -> bytes:
        """The verified bytes of base chunk `fp`: as long as the chunk list
        it encodes (docs/FORMAT.md), up to what ``max_db_size`` allows."""
        chunks = self._store.chunks
        try:
            blob = self._request(lambda: chunks.get(fp.name, max_bytes=self.base_limit), "get base chunk")
        except NotFound:
            raise NotFound("base chunk %s is missing from the store (%s)" % (fp.name, chunks.describe()),
                           key=fp.name) from None
        except TooLarge as e:
            raise TooLarge("base chunk %s is larger than the %d bytes a base chunk may hold for databases of up "
                           "to %s%s" % (fp.name, self.base_limit, format_size(self.max_db_size), self._hinted()),
                           key=fp.name, size=e.size, bound=self.base_limit) from None
        return decode_base_chunk(blob, fp, self.max_db_size)

    # -- for people -------------------------------------------------------------------

    @contextlib.contextmanager
    def explained(self, what: str) -> Iterator[None]:
        """Failures to read `what` ("manifest NAME") as one ReadError line:
        missing and past-the-bound objects as worded above, a manifest that
        breaks a rule as corrupt (or too large, with ``hint``), bytes that do
        not verify as a corrupt chunk. Other store errors pass."""
        try:
            yield
        except (NotFound, TooLarge) as e:
            raise ReadError(str(e), missing=isinstance(e, NotFound)) from None
        except ManifestError as e:
            if e.rule == "size-limit":
                raise ReadError("%s is too large: %s%s"
                                % (what, e.detail, "; " + self.hint if self.hint else "")) from None
            raise ReadError("corrupt %s: %s" % (what, e)) from None
        except ChunkError as e:
            raise ReadError("corrupt chunk in the store: %s" % e) from None

    def load(self, name: str, version_id: Optional[str] = None) -> Manifest:
        """`manifest`, a failure as one ReadError line."""
        with self.explained("manifest %s" % name):
            return self.manifest(name, version_id)

    def load_blob(self, blob: bytes, what: str) -> Manifest:
        """`decode` of `blob` (`what` it is, for messages), a failure as
        one ReadError line."""
        with self.explained(what):
            return self.decode(blob)

    def load_run(self, run: Run, fps: dict[int, Fprint]) -> list[tuple[int, bytes]]:
        """`run`, a failure as one ReadError line."""
        with self.explained("chunk"):
            return self.run(run, fps)


