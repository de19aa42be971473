"""Prefetch policies of a replica: which chunks a read hints at.

Every policy here is only a hint: it never decides which bytes are served,
and the fetcher skips chunks already cached or under way. A `Replica` asks
each policy that applies for the chunk indices a read makes worth fetching
ahead (`Hints`), and hands them to the fetcher.

- `SequentialReadahead`: reads of one open handle in file order (a full
  scan, ``cat``, a backup) fetch the next chunks ahead, in a window that
  grows while the reads stay in order.
- `CacheWindow`: an option of the sequential readahead, off by default
  (``cache_readahead_max`` = 0): chunks already in the disk cache are
  advised to the kernel in a wider window of their own.
- `BtreeReadahead`: reads that go from one child of a b-tree page to the
  next (a table or index scan in key order, whatever the pages' file order)
  fetch the chunks of the following siblings.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from verneuil_fuse.format import CHUNK_SIZE
from verneuil_fuse.reader import btree

log = logging.getLogger(__name__)


@dataclass
class PrefetchConfig:
    readahead: bool = True
    btree: bool = True
    readahead_initial: int = 2  # chunks
    # Chunks (16 MiB): what keeps the fetcher's prefetch slots (3/4 of its
    # 256 GETs in flight on S3) busy on a sequential read, enough to hide
    # 20-26 ms per request at ~6,000 chunks/s (docs/BENCHMARKS.md, the
    # nginx rig).
    readahead_max: int = 256
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

    @property
    def advising(self) -> bool:
        """Whether cached chunks are advised to the kernel (`CacheWindow`)."""
        return self.cache_readahead_max > 0


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


@dataclass(slots=True)
class Hints:
    """Chunk indices one read hints at, by what the fetcher may do with
    each, in the order the policies gave them."""

    both: list[int] = field(default_factory=list)  # fetch if not cached, advise if cached
    fetch_only: list[int] = field(default_factory=list)  # fetch if not cached, else nothing
    advise_only: list[int] = field(default_factory=list)  # advise if cached, else nothing

    def __bool__(self) -> bool:
        return bool(self.both or self.fetch_only or self.advise_only)


def _grow(window: int, initial: int, largest: int) -> int:
    """A readahead window after one more read in order: doubled, at least
    ``initial``, at most ``largest``."""
    return min(max(window * 2, initial), largest)


class SequentialReadahead:
    """Applies to reads of one open handle (its `Cursor`) in file order:
    once reads have entered two new chunks in order, the next chunks are
    fetched ahead; the window doubles on every sequential read up to
    ``readahead_max`` chunks and drops to nothing on a random read. Chunks
    already in the disk cache cost no GET and are left to the kernel's
    readahead of the cache's files, or to `CacheWindow` when it is on."""

    __slots__ = ("config", "last_index", "cache_window")

    def __init__(self, config: PrefetchConfig, nchunks: int):
        self.config = config
        self.last_index = nchunks - 1
        self.cache_window = CacheWindow(config, nchunks) if config.advising else None

    def hint(self, cursor: Cursor, off: int, end: int, first: int, last: int, hints: Hints) -> None:
        """Note a read of chunks ``first``..``last`` (bytes ``off``..``end``)
        and add to ``hints`` the chunks it makes worth fetching."""
        if not self._in_order(cursor, off, end, first, last):
            return
        cfg = self.config
        cursor.window = _grow(cursor.window, cfg.readahead_initial, cfg.readahead_max)
        fetch_stop = min(last + cursor.window, self.last_index)
        if self.cache_window is not None:
            self.cache_window.hint(cursor, last, fetch_stop, hints)
        else:
            hints.fetch_only.extend(range(max(last, cursor.ahead) + 1, fetch_stop + 1))
        cursor.ahead = max(cursor.ahead, fetch_stop)

    @staticmethod
    def _in_order(cursor: Cursor, off: int, end: int, first: int, last: int) -> bool:
        """Follow the handle's position; whether its reads are in order long
        enough for a readahead (a read out of order resets the windows)."""
        sequential = cursor.next_off >= 0 and (
            off == cursor.next_off or cursor.last_chunk <= first <= cursor.last_chunk + 1
        )
        if not sequential:
            cursor.streak = 0
            cursor.window = cursor.cache_window = 0
            cursor.ahead = cursor.advised = -1
        elif last > cursor.last_chunk:
            # Counted in chunks entered in order, so that a few small reads
            # inside one chunk (SQLite's header, the kernel's first
            # readahead) do not start a readahead.
            cursor.streak += 1
        cursor.next_off = end
        cursor.last_chunk = last
        return cursor.streak >= 2


class CacheWindow:
    """Applies to a sequential read when ``cache_readahead_max`` is set (off
    by default, see `PrefetchConfig`): chunks already in the disk cache are
    advised to the kernel up to that many chunks ahead, a wider window than
    the GETs'. Chunks new to both windows are prefetched as usual; those
    new to one window only are fetched only if not in the disk cache, or
    advised only if in it."""

    __slots__ = ("config", "last_index")

    def __init__(self, config: PrefetchConfig, nchunks: int):
        self.config = config
        self.last_index = nchunks - 1

    def hint(self, cursor: Cursor, last: int, fetch_stop: int, hints: Hints) -> None:
        cfg = self.config
        cursor.cache_window = _grow(cursor.cache_window, cfg.readahead_initial,
                                    max(cfg.cache_readahead_max, cfg.readahead_max))
        advise_stop = min(last + cursor.cache_window, self.last_index)
        if cursor.advised - last >= cursor.cache_window // 2:
            # Still half a window ahead: advise in steps of at least half a
            # window (8 MiB at most), not one step per read request, since
            # each step is a thread hop.
            advise_stop = cursor.advised
        for i in range(max(last, min(cursor.ahead, cursor.advised)) + 1, max(fetch_stop, advise_stop) + 1):
            fetch = cursor.ahead < i <= fetch_stop
            advise = cursor.advised < i <= advise_stop
            if fetch and advise:
                hints.both.append(i)
            elif fetch:
                hints.fetch_only.append(i)
            elif advise:
                hints.advise_only.append(i)
        cursor.advised = max(cursor.advised, advise_stop)


@dataclass(slots=True)
class _Scan:
    """Where reads among the children of one interior page are."""

    last_idx: int = -10
    window: int = 0
    ahead: int = -1  # highest child position already handed to the prefetcher


class BtreeReadahead:
    """Applies to a replica whose chunk 0 is a SQLite header: every chunk
    read on demand is parsed for interior b-tree pages (`btree.py`), which
    gives each child page its parent (its position among the siblings is
    looked up when it is read). When reads go from one child to the next
    of the same parent (a table or index scan in key order, whatever the
    pages' file order), the chunks of the following siblings are fetched in
    parallel, with a window that grows the same way as the sequential one.
    A point query (one child per level) prefetches nothing, so it costs one
    GET per b-tree level outside chunk 0."""

    __slots__ = ("config", "page_size", "max_page", "children", "parent", "scans", "parsed")

    def __init__(self, config: PrefetchConfig, page_size: int, max_page: int):
        self.config = config
        self.page_size = page_size
        self.max_page = max_page
        self.children: dict[int, list[int]] = {}  # interior page -> its children, in key order
        self.parent: dict[int, int] = {}  # child page -> interior page
        self.scans: dict[int, _Scan] = {}  # interior page -> reads among its children
        self.parsed: set[int] = set()  # chunk indices already parsed

    @classmethod
    def for_replica(cls, config: PrefetchConfig, first_chunk: bytes | None, size: int) -> BtreeReadahead | None:
        """The policy for a database of ``size`` bytes whose chunk 0 is
        ``first_chunk`` (None: not at hand), or None: off, or not SQLite."""
        header = btree.parse_header(first_chunk) if first_chunk is not None else None
        if header is None or not config.btree:
            return None
        return cls(config, header.page_size, max(1, -(-size // header.page_size)))

    def learn(self, index: int, data: bytes, path: str = "") -> None:
        """Record the interior b-tree pages of chunk ``index``, once."""
        if index in self.parsed:
            return
        self.parsed.add(index)
        try:
            for page_no, children in btree.interior_pages(data, index * CHUNK_SIZE, self.page_size, self.max_page):
                if page_no in self.children:
                    continue
                self.children[page_no] = children
                self.parent.update(dict.fromkeys(children, page_no))
        except Exception:  # noqa: BLE001 - hints only; never fail a read for them
            log.debug("cannot parse chunk %d of %s for prefetch", index, path, exc_info=True)

    def hint(self, off: int, first: int, last: int, hints: Hints) -> None:
        """Note a read at ``off`` (chunks ``first``..``last``) and add to
        ``hints`` the chunks of the siblings a scan reads next."""
        page = off // self.page_size + 1
        parent = self.parent.get(page)
        if parent is None:
            return
        # The position in the parent, looked up only for pages read (a
        # C-level search of a few hundred numbers) rather than stored for
        # every child of every interior page parsed.
        siblings = self.children[parent]
        idx = siblings.index(page)
        scan = self.scans.get(parent)
        if scan is None:
            scan = self.scans[parent] = _Scan()
        step = idx - scan.last_idx
        if 0 < step <= 2:
            scan.window = _grow(scan.window, self.config.readahead_initial, self.config.btree_max)
            chunks = self._next_chunks(siblings, max(idx + 1, scan.ahead + 1), scan, first, last)
            (hints.both if self.config.advising else hints.fetch_only).extend(chunks)
        elif step != 0:
            scan.window = 0
            scan.ahead = -1
        scan.last_idx = idx

    def _next_chunks(self, siblings: list[int], start: int, scan: _Scan, first: int, last: int) -> list[int]:
        """The chunks of up to a window of siblings from position ``start``,
        not counting those of the read itself."""
        chunks: list[int] = []
        seen = set(range(first, last + 1))
        pos = start
        while pos < len(siblings) and len(chunks) < scan.window:
            c = (siblings[pos] - 1) * self.page_size // CHUNK_SIZE
            if c not in seen:
                seen.add(c)
                chunks.append(c)
            pos += 1
        scan.ahead = pos - 1
        return chunks
