"""One replicated database at one manifest version: reads and prefetch hints.

A `Replica` never changes: a new manifest for the same database is a new
`Replica` (and a new inode), so an open handle keeps reading the bytes of the
version it opened. Reads assemble the verified chunks that cover the range:
bundled chunks (in the manifest) and the zero chunk are served without any
fetch; everything else comes from the `Fetcher`.

Prefetch, two kinds, both only hints (they never decide which bytes are
served, and the fetcher skips chunks already cached or under way):
- sequential readahead per open handle (`Cursor`): once reads in file order
  have entered two new chunks, fetch the next chunks ahead; the window doubles on every sequential
  read up to ``readahead_max`` chunks and drops to nothing on a random read;
  chunks already in the disk cache cost no GET and are left to the kernel's
  readahead of the cache's files, or, with ``cache_readahead_max`` set, are
  advised to the kernel in a wider window of their own;
- b-tree readahead per replica: every chunk read on demand is parsed for
  interior b-tree pages (`btree.py`), which gives each child page its parent
  (its position among the siblings is looked up when it is read). When reads go from one child to the next of the same parent
  (a table or index scan in key order, whatever the pages' file order), the
  chunks of the following siblings are fetched in parallel, with a window
  that grows the same way. A point query (one child per level) prefetches
  nothing, so it costs one GET per b-tree level outside chunk 0.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from verneuil_fuse.reader import btree
from verneuil_fuse.reader.fetcher import FetchError, Fetcher
from verneuil_fuse.format import CHUNK_SIZE, ZERO_CHUNK_FPRINT, Fprint, Manifest

log = logging.getLogger(__name__)

_ZERO_CHUNK = bytes(CHUNK_SIZE)


@dataclass
class PrefetchConfig:
    readahead: bool = True
    btree: bool = True
    readahead_initial: int = 2  # chunks
    # Chunks (4 MiB): what keeps 64 GETs in flight (the fetcher's default
    # concurrency) on a sequential read, enough to hide 20 ms per request
    # at ~3,000 chunks/s (docs/BENCHMARKS.md, the nginx rig).
    readahead_max: int = 64
    btree_max: int = 32  # chunks
    # Chunks already in the disk cache cost no GET: up to this many ahead of
    # a sequential read (and those the b-tree prefetch predicts) the kernel
    # is advised (fadvise WILLNEED) to read them from the cache's segment
    # files, many reads in flight. 0 (the default) leaves it to the kernel's
    # own readahead of the segments: fewer, larger reads. Since the cache lays
    # a sequential read's chunks out in file order, the kernel's
    # readahead follows them, in large folios, where the advice reads page by
    # page in a thread of ours: a warm SQL scan of 475 MiB from a cache the
    # VM's host holds took 0.37 s with 0 and 0.56 s with 256 (the mount's CPU
    # 0.27 against 0.43 s; 0.38 against 0.62 s with the disk's readahead at
    # 128 KiB), and from a cache just written 0.95 against 0.98 s at 1 GiB
    # (docs/READER.md "Prefetch", docs/BENCHMARKS.md).
    cache_readahead_max: int = 0  # chunks


@dataclass
class Cursor:
    """Sequential-readahead state of one open handle."""

    next_off: int = -1
    last_chunk: int = -1
    streak: int = 0
    window: int = 0
    ahead: int = -1  # highest chunk index already handed to the prefetcher
    cache_window: int = 0
    advised: int = -1  # highest chunk index for which cached chunks were advised


@dataclass
class _Scan:
    last_idx: int = -10
    window: int = 0
    ahead: int = -1  # highest child position already handed to the prefetcher


@dataclass
class _BtreeMap:
    page_size: int
    max_page: int
    children: dict[int, list[int]] = field(default_factory=dict)
    parent: dict[int, int] = field(default_factory=dict)  # child page -> interior page
    scans: dict[int, _Scan] = field(default_factory=dict)
    parsed: set[int] = field(default_factory=set)


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
        self.version = manifest.contents_fprint.hex()
        self.nchunks = len(manifest.chunks)
        self.lookups = 0  # kernel lookup count (FUSE forget)
        self.opens = 0  # open handles
        self.reads = 0
        self.read_bytes = 0
        self.preloaded = 0  # bytes handed to the kernel's page cache at first open
        self._opened_before = False
        self._local: dict[Fprint, bytes] = {manifest.chunks[i]: data for i, data in manifest.bundled.items()}
        self._btree: _BtreeMap | None = None
        first = manifest.bundled.get(0)
        header = btree.parse_header(first) if first is not None else None
        if header is not None and self.prefetch_config.btree:
            max_page = max(1, -(-self.size // header.page_size))
            self._btree = _BtreeMap(header.page_size, max_page)
            for index in sorted(manifest.bundled):
                self._learn(index, manifest.bundled[index])

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
        bundled = self.manifest.bundled
        return [(i * CHUNK_SIZE, bundled[i]) for i in sorted(bundled) if bundled[i]]

    def chunk_fprint(self, index: int) -> Fprint:
        return self.manifest.chunks[index]

    def is_local(self, index: int) -> bool:
        fp = self.manifest.chunks[index]
        return fp in self._local or fp == ZERO_CHUNK_FPRINT

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
        data = await self.fetcher.get_waiting(self.manifest.chunks[index])
        self._note(index, data)
        return data

    def _note(self, index: int, data: bytes) -> None:
        """Learn the b-tree pages of a chunk read on demand, once."""
        if self._btree is not None and index not in self._btree.parsed:
            self._learn(index, data)

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
        # Several chunks (the kernel's readahead asks for up to 1 MiB): read
        # them into one buffer, the cached ones straight from the disk
        # cache's segments (`Fetcher.read_into`), and reply with a view of it.
        buf = bytearray((last - first) * CHUNK_SIZE + self.manifest.chunk_length(last))
        view = memoryview(buf)
        fps: list[Fprint] = []
        dests: list[memoryview] = []
        indices: list[int] = []
        chunks = self.manifest.chunks
        for i in range(first, last + 1):
            fp = chunks[i]
            at = (i - first) * CHUNK_SIZE
            if fp == ZERO_CHUNK_FPRINT:
                continue  # the buffer starts zeroed
            data = self._local.get(fp)
            if data is not None:
                view[at : at + len(data)] = data
                continue
            fps.append(fp)
            dests.append(view[at : at + self.manifest.chunk_length(i)])
            indices.append(i)
        if fps:
            await self.fetcher.read_into(fps, dests)
            if self._btree is not None:
                for i, dest in zip(indices, dests):
                    self._note(i, dest)
        return view[off - base : end - base]

    # --------------------------------------------------------------- prefetch
    def _remote(self, indices) -> list[Fprint]:
        out = []
        for i in indices:
            if 0 <= i < self.nchunks and not self.is_local(i):
                out.append(self.manifest.chunks[i])
        return out

    def _hint(self, off: int, end: int, first: int, last: int, cursor: Cursor | None) -> None:
        cfg = self.prefetch_config
        advising = cfg.cache_readahead_max > 0
        wanted: list[int] = []
        fetch_only: list[int] = []
        advise_only: list[int] = []
        if cursor is not None and cfg.readahead:
            sequential = cursor.next_off >= 0 and (
                off == cursor.next_off or cursor.last_chunk <= first <= cursor.last_chunk + 1
            )
            if not sequential:
                cursor.streak = 0
                cursor.window = cursor.cache_window = 0
                cursor.ahead = cursor.advised = -1
            elif last > cursor.last_chunk:
                # Counted in chunks entered in order, so that a few small
                # reads inside one chunk (SQLite's header, the kernel's first
                # readahead) do not start a readahead.
                cursor.streak += 1
            cursor.next_off = end
            cursor.last_chunk = last
            if cursor.streak >= 2:
                cursor.window = min(max(cursor.window * 2, cfg.readahead_initial), cfg.readahead_max)
                fetch_stop = min(last + cursor.window, self.nchunks - 1)
                if not advising:
                    fetch_only.extend(range(max(last, cursor.ahead) + 1, fetch_stop + 1))
                    cursor.ahead = max(cursor.ahead, fetch_stop)
                else:
                    cursor.cache_window = min(
                        max(cursor.cache_window * 2, cfg.readahead_initial),
                        max(cfg.cache_readahead_max, cfg.readahead_max),
                    )
                    advise_stop = min(last + cursor.cache_window, self.nchunks - 1)
                    if cursor.advised - last >= cursor.cache_window // 2:
                        # Still half a window ahead: advise in steps of at least
                        # half a window (8 MiB at most), not one step per read
                        # request, since each step is a thread hop.
                        advise_stop = cursor.advised
                    # Chunks new to both windows are prefetched as usual; those
                    # new to one window only are fetched only if not in the disk
                    # cache, or advised only if in it.
                    for i in range(max(last, min(cursor.ahead, cursor.advised)) + 1, max(fetch_stop, advise_stop) + 1):
                        fetch = cursor.ahead < i <= fetch_stop
                        advise = cursor.advised < i <= advise_stop
                        if fetch and advise:
                            wanted.append(i)
                        elif fetch:
                            fetch_only.append(i)
                        elif advise:
                            advise_only.append(i)
                    cursor.ahead = max(cursor.ahead, fetch_stop)
                    cursor.advised = max(cursor.advised, advise_stop)
        bt = self._btree
        if bt is not None:
            page = off // bt.page_size + 1
            parent = bt.parent.get(page)
            if parent is not None:
                # The position in the parent, looked up only for pages read
                # (a C-level search of a few hundred numbers) rather than
                # stored for every child of every interior page parsed.
                idx = bt.children[parent].index(page)
                scan = bt.scans.get(parent)
                if scan is None:
                    scan = bt.scans[parent] = _Scan()
                step = idx - scan.last_idx
                if 0 < step <= 2:
                    scan.window = min(max(scan.window * 2, cfg.readahead_initial), cfg.btree_max)
                    siblings = bt.children[parent]
                    start = max(idx + 1, scan.ahead + 1)
                    chunks: list[int] = []
                    seen = set(range(first, last + 1))
                    pos = start
                    while pos < len(siblings) and len(chunks) < scan.window:
                        c = (siblings[pos] - 1) * bt.page_size // CHUNK_SIZE
                        if c not in seen:
                            seen.add(c)
                            chunks.append(c)
                        pos += 1
                    scan.ahead = pos - 1
                    (wanted if advising else fetch_only).extend(chunks)
                elif step != 0:
                    scan.window = 0
                    scan.ahead = -1
                scan.last_idx = idx
        if wanted:
            self.fetcher.prefetch(self._remote(wanted))
        if fetch_only:
            self.fetcher.prefetch(self._remote(fetch_only), advise=False)
        if advise_only:
            self.fetcher.prefetch(self._remote(advise_only), fetch=False)

    def _learn(self, index: int, data: bytes) -> None:
        """Record the interior b-tree pages of chunk ``index``."""
        bt = self._btree
        assert bt is not None
        bt.parsed.add(index)
        try:
            for page_no, children in btree.interior_pages(
                data, index * CHUNK_SIZE, bt.page_size, bt.max_page
            ):
                old = bt.children.get(page_no)
                if old is not None:
                    continue
                bt.children[page_no] = children
                bt.parent.update(dict.fromkeys(children, page_no))
        except Exception:  # noqa: BLE001 - hints only; never fail a read for them
            log.debug("cannot parse chunk %d of %s for prefetch", index, self.path, exc_info=True)

    def all_remote_chunks(self) -> list[Fprint]:
        """Every chunk that would need a fetch (for eager hydration)."""
        return self._remote(range(self.nchunks))

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
            "btree_pages_known": len(self._btree.children) if self._btree else 0,
        }
