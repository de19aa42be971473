"""One replicated database at one manifest version: reads and prefetch hints.

A `Replica` never changes: a new manifest for the same database is a new
`Replica` (and a new inode), so a handle reading it reads the bytes of one
version (a follower's handle moves to another `Replica` only at offset 0,
`follow.py`). Reads assemble the verified chunks that cover the range:
bundled chunks (in the manifest) and the zero chunk are served without any
fetch; everything else comes from the `Fetcher`, told where each chunk is
when the manifest is of the packed layout (`format.chunk_source`). A read
whose chunks one range read of a pack decoded one after another is a view
of that run's buffer (`Fetcher.span`); any other read of several chunks is
copied into a reply buffer (`replies.py`).

Prefetch is only a hint (it never decides which bytes are served): each read
hands its position to the policies of `prefetch.py` that apply (sequential
readahead per open handle, b-tree readahead per replica) and passes the
chunks they name to the fetcher, which skips those cached or under way.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from verneuil_fuse.format import (CHUNK_SIZE, MAX_RUN_BYTES, ZERO_CHUNK_FPRINT, ChunkSource, Fprint, Manifest,
                                  chunk_source, chunk_sources)
from verneuil_fuse.reader.flights import RUN_BYTES
from verneuil_fuse.reader.prefetch import BtreeReadahead, Cursor, PrefetchConfig, SequentialReadahead
from verneuil_fuse.reader.replies import ReplyBuffers
from verneuil_fuse.reader.store_gets import FetchError

if TYPE_CHECKING:  # the fetcher's hydration (a part of it) knows replicas
    from verneuil_fuse.reader.fetcher import Fetcher

__all__ = ["Cursor", "PrefetchConfig", "Replica"]

_ZERO_CHUNK = bytes(CHUNK_SIZE)
_ZERO_VIEW = memoryview(_ZERO_CHUNK)

# A database no larger than this, in a packed store, is fetched whole when it
# is opened: its chunks are one run of a pack, one request, where a query's
# walk down its b-trees would fetch them a level (a round trip) at a time (the
# Spark fan-out over 100 databases of 864 KiB behind 20 ms: ~5 requests per
# database). In Verneuil's layout that would be a GET per chunk: not done.
OPEN_FETCH_BYTES = MAX_RUN_BYTES

# The first sequential readahead window in a packed store, in chunks: a run
# of a pack (`flights.RUN_BYTES` of blobs), one range GET as two chunks
# would be, so that a scan does not ramp up 2, 4, 8... chunks, a round trip
# each. Cold scan on the nginx rig, alternate mounts: 1.59-1.63 s against
# 1.61-1.68 s starting at 2 (16: 1.59-1.66 s). In Verneuil's layout every
# chunk is a GET: the config's `readahead_initial` there.
PACKED_READAHEAD_INITIAL = RUN_BYTES // CHUNK_SIZE

# The buffers of replies of several chunks, shared by every replica: reads
# are answered on trio's thread only.
_REPLIES = ReplyBuffers()


class Replica:
    """A read-only view of one manifest version of one database."""

    def __init__(
        self,
        *,
        key: str,
        path: str,
        manifest: Manifest,
        fetcher: Fetcher,
        inode: int,
        mtime_ns: int,
        prefetch: PrefetchConfig | None = None,
    ):
        self.key = key  # manifest key in the store
        self.path = path  # path in the mount
        self.manifest = manifest
        self.fetcher = fetcher
        self.inode = inode
        self.size = manifest.len
        self.mtime_ns = mtime_ns
        self.prefetch_config = prefetch or PrefetchConfig()
        self._replies = _REPLIES
        self.version = manifest.contents_fprint.hex()
        self.nchunks = len(manifest.chunks)
        self.packed = manifest.layout is not None
        self.lookups = 0  # kernel lookup count (FUSE forget)
        self.opens = 0  # open handles
        self.reads = 0
        self.read_bytes = 0
        self.preloaded = 0  # bytes handed to the kernel's page cache at first open
        self._opened_before = False
        self._local: dict[Fprint, bytes] = {manifest.chunks[i]: data for i, data in manifest.bundled.items()}
        cfg = self.prefetch_config
        initial = min(PACKED_READAHEAD_INITIAL, cfg.readahead_max) if self.packed else None
        self._sequential = SequentialReadahead(cfg, self.nchunks, initial) if cfg.readahead else None
        self._btree = BtreeReadahead.for_replica(cfg, manifest.bundled.get(0), self.size)
        if self._btree is not None:
            for index in sorted(manifest.bundled):
                self._btree.learn(index, manifest.bundled[index], path)

    # ------------------------------------------------------------------ reads
    def take_preload(self) -> list[tuple[int, bytes]]:
        """(offset, bytes) of the chunks bundled in the manifest (verified when
        it was decoded) the first time this version is opened, else [].

        The caller stores them in the kernel's page cache before the first
        read: SQLite's reads of the header and schema (chunk 0) and of the
        upper b-tree levels the writer bundles never reach the mount, and
        neither does the kernel's readahead window they would open (which at
        1 MiB reaches into the next chunk and costs a GET a point query never
        needed).  Only at the first open: no read of this inode can be holding
        its pages."""
        if self._opened_before:
            return []
        self._opened_before = True
        return self.preload_chunks()

    def preload_chunks(self) -> list[tuple[int, bytes]]:
        """(offset, bytes) of every chunk bundled in the manifest: what
        `take_preload` gives once per version, and a follower's open once per
        page-cache generation (`follow.py`: each follower has a page cache of
        its own)."""
        bundled = self.manifest.bundled
        return [(i * CHUNK_SIZE, bundled[i]) for i in sorted(bundled) if bundled[i]]

    def source(self, index: int) -> ChunkSource | None:
        """Where chunk ``index`` is in a packed store; None in Verneuil's
        layout (its own chunk object, named by its fingerprint)."""
        return chunk_source(self.manifest, index) if self.packed else None

    def _sources(self, indices: list[int]) -> list[ChunkSource] | None:
        return chunk_sources(self.manifest, indices) if self.packed else None

    def chunk_fprint(self, index: int) -> Fprint:
        return self.manifest.chunks[index]

    def chunk_nowait(self, index: int) -> bytes | None:
        """The chunk if it needs no waiting (bundled, zero, in memory, or in
        the disk cache and the page cache), else None."""
        fp = self.manifest.chunks[index]
        data = self._local.get(fp)
        if data is not None:
            return data
        if fp == ZERO_CHUNK_FPRINT:
            return _ZERO_CHUNK
        data = self.fetcher.get_nowait(fp)
        if data is not None:
            self._note(index, data)
        return data

    async def _chunk_waiting(self, index: int) -> bytes:
        """A chunk `chunk_nowait` did not have (raises FetchError)."""
        data = await self.fetcher.get_waiting(self.manifest.chunks[index], self.source(index))
        self._note(index, data)
        return data

    def _streaming(self, cursor: Cursor | None) -> bool:
        """Whether ``cursor``'s reads are a long run in file order, its
        readahead window at its largest: the sequential readahead names
        every chunk ahead already, and parsing each chunk for the b-tree
        readahead (a few us per chunk, 7 % of trio's thread in a cold scan)
        would buy nothing. The chunks it skips are parsed if read again
        outside such a run."""
        return cursor is not None and cursor.window >= self.prefetch_config.readahead_max > 0

    def _note(self, index: int, data: bytes) -> None:
        """Learn the b-tree pages of a chunk read on demand, once."""
        if self._btree is not None:
            self._btree.learn(index, data, self.path)

    async def read(self, off: int, size: int, cursor: Cursor | None = None) -> bytes | memoryview:
        """Exactly ``size`` bytes from ``off`` (a view when one chunk holds them),
        fewer only at end of file. Raises FetchError when a chunk cannot be
        obtained, or has another length than the manifest's length needs."""
        if off >= self.size or size <= 0:
            return b""
        end = min(off + size, self.size)
        first, last = off // CHUNK_SIZE, (end - 1) // CHUNK_SIZE
        self.reads += 1
        self.read_bytes += end - off
        self._hint(off, end, first, last, cursor)
        base = first * CHUNK_SIZE
        if first == last:
            data = self.chunk_nowait(first)
            if data is None:
                data = await self._chunk_waiting(first)
            if len(data) != self.manifest.chunk_length(first) and data is not _ZERO_CHUNK:
                # A manifest whose chunk list contradicts its length: the
                # chunk is verified, but it is not the chunk this offset
                # needs. An error, never a short read mid-file.
                raise FetchError("%s: chunk %d has %d bytes where the manifest's length needs %d"
                                 % (self.path, first, len(data), self.manifest.chunk_length(first)))
            # A view, not a copy: pyfuse3 copies it into the reply.
            return memoryview(data)[off - base : end - base]
        # Several chunks (the kernel's readahead asks for up to 1 MiB): a
        # view of the run buffer they were decoded into one after another,
        # if they were (`Fetcher.span`: a scan of a packed store);
        if self.packed:
            whole = await self._span(first, last, cursor)
            if whole is not None:
                return whole[off - base : end - base]
        # else read them into one buffer (reused: `replies.py`), the cached ones
        # straight from the disk cache's segments (`Fetcher.read_into`), and
        # reply with a view of it.
        view = memoryview(self._replies.take((last - first) * CHUNK_SIZE + self.manifest.chunk_length(last)))
        fps: list[Fprint] = []
        dests: list[memoryview] = []
        indices: list[int] = []
        chunks = self.manifest.chunks
        for i in range(first, last + 1):
            fp = chunks[i]
            at = (i - first) * CHUNK_SIZE
            length = self.manifest.chunk_length(i)
            if fp == ZERO_CHUNK_FPRINT:
                view[at : at + length] = _ZERO_VIEW[:length]  # the buffer holds an earlier reply's bytes
                continue
            data = self._local.get(fp)
            if data is not None:
                if len(data) != length:  # as in the one-chunk case above
                    raise FetchError("%s: chunk %d has %d bytes where the manifest's length needs %d"
                                     % (self.path, i, len(data), length))
                view[at : at + length] = data
                continue
            fps.append(fp)
            dests.append(view[at : at + length])
            indices.append(i)
        if fps:
            await self.fetcher.read_into(fps, dests, self._sources(indices))
            if self._btree is not None and not self._streaming(cursor):
                for i, dest in zip(indices, dests):
                    self._note(i, dest)
        return view[off - base : end - base]

    async def _span(self, first: int, last: int, cursor: Cursor | None) -> memoryview | None:
        """Chunks ``first``..``last`` as one view of the run buffer they
        were decoded into one after another (`Fetcher.span`), once the runs
        under way that bring them are in; None when they are not (the
        caller copies them into a reply)."""
        fetcher = self.fetcher
        fps = self.manifest.chunks[first:last + 1]
        last_length = self.manifest.chunk_length(last)
        whole = fetcher.span(fps, last_length)
        if whole is None:
            whole = await fetcher.span_after_flights(fps, last_length)
        if whole is not None and self._btree is not None and not self._streaming(cursor):
            for i in range(first, last + 1):
                self._note(i, whole[(i - first) * CHUNK_SIZE:(i - first + 1) * CHUNK_SIZE])
        return whole

    # --------------------------------------------------------------- prefetch
    def _hint(self, off: int, end: int, first: int, last: int, cursor: Cursor | None) -> None:
        """Hand the fetcher the chunks the prefetch policies name for this
        read (`prefetch.py`)."""
        hints: list[int] = []
        if cursor is not None and self._sequential is not None:
            self._sequential.hint(cursor, off, end, first, last, hints)
        if self._btree is not None:
            self._btree.hint(off, first, last, hints)
        if hints:
            fps, remote = self._remote_fprints(hints)
            if fps:
                self.fetcher.prefetch(fps, sources=self._sources(remote))

    def _remote_fprints(self, indices: Iterable[int]) -> tuple[list[Fprint], list[int]]:
        """The fingerprints of the chunks of ``indices`` that would need a
        fetch (in the file, not bundled, not the zero chunk), and their
        indices: one pass, for a hint of hundreds of chunks per read."""
        words, local, n = self.manifest.chunks.words, self._local, self.nchunks
        fps: list[Fprint] = []
        remote: list[int] = []
        for i in indices:
            if 0 <= i < n:
                fp = Fprint(words[2 * i], words[2 * i + 1])
                if fp not in local and fp != ZERO_CHUNK_FPRINT:
                    fps.append(fp)
                    remote.append(i)
        return fps, remote

    def fetch_if_small(self) -> None:
        """At an open: the whole database, if it is small and packed
        (`OPEN_FETCH_BYTES`), as a prefetch."""
        if self.size > OPEN_FETCH_BYTES:
            return
        fps, sources = self.all_remote_chunks()
        if fps and sources is not None:
            self.fetcher.prefetch(fps, sources=sources)

    def all_remote_chunks(self) -> tuple[list[Fprint], list[ChunkSource] | None]:
        """Every chunk that would need a fetch (for eager hydration), and
        where each is in a packed store (None in Verneuil's layout)."""
        fps, remote = self._remote_fprints(range(self.nchunks))
        return fps, self._sources(remote)

    def describe(self) -> dict:
        return {
            "path": self.path,
            "key": self.key,
            "version": self.version,
            "len": self.size,
            "chunks": self.nchunks,
            "inode": self.inode,
            "mtime_ns": self.mtime_ns,
            "opens": self.opens,
            "reads": self.reads,
            "read_bytes": self.read_bytes,
            "preloaded": self.preloaded,
            "btree_pages_known": len(self._btree.children) if self._btree is not None else 0,
        }
