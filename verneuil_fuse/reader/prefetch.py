"""Prefetch policies of a replica: which chunks a read hints at.

Every policy here is only a hint: it never decides which bytes are served,
and the fetcher skips chunks already cached or under way. A `Replica` asks
each policy that applies for the chunk indices a read makes worth fetching
ahead (a list of them, in the order the policies give them), and hands them
to the fetcher.

- `SequentialReadahead`: reads of one open handle in file order (a full
  scan, ``cat``, a backup) fetch the next chunks ahead, in a window that
  grows while the reads stay in order; chunks already in the disk cache
  are left to the kernel's own readahead of the cache's files.
- `BtreeReadahead`: reads that go from one child of a b-tree page to the
  next (a table or index scan in key order, whatever the pages' file order)
  fetch the chunks of the following siblings.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from verneuil_fuse.format import CHUNK_SIZE
from verneuil_fuse.reader import btree

log = logging.getLogger(__name__)


@dataclass
class PrefetchConfig:
    readahead: bool = True
    btree: bool = True
    readahead_initial: int = 2  # chunks
    # Chunks (48 MiB ahead, ~85 ms of a cold scan of a packed store at
    # ~570 MB/s): a run of a pack takes 40-75 ms from its start to its
    # chunks in memory on the nginx rig (20 ms per request; the rest is the
    # engine's turn on two busy cores), and with 512 (56 ms ahead) 30 % of a
    # scan's reads waited for one, with 768 10 %: 1.62-1.65 s against
    # 1.75-1.82 s, 896 alike, 1024 slower (1.87-1.92 s: more runs in flight
    # than the 64 MiB memory cache and the run buffers' pool hold;
    # docs/BENCHMARKS.md). In Verneuil's layout the fetcher's prefetch slots
    # (3/4 of its 256 GETs) bound it.
    readahead_max: int = 768
    btree_max: int = 32  # chunks


@dataclass
class Cursor:
    """Sequential-readahead state of one open handle."""

    next_off: int = -1
    last_chunk: int = -1
    streak: int = 0
    window: int = 0
    ahead: int = -1  # highest chunk index already handed to the prefetcher


def _grow(window: int, initial: int, largest: int) -> int:
    """A readahead window after one more read in order: doubled, at least
    ``initial``, at most ``largest``."""
    return min(max(window * 2, initial), largest)


class SequentialReadahead:
    """Applies to reads of one open handle (its `Cursor`) in file order:
    once reads have entered two new chunks in order, the next chunks are
    fetched ahead; the window starts at ``initial`` chunks (the config's
    ``readahead_initial`` unless given), doubles on every sequential read up
    to ``readahead_max`` chunks and drops to nothing on a random read.
    Chunks already in the disk cache cost no GET (the fetcher skips them)
    and are left to the kernel's readahead of the cache's files."""

    __slots__ = ("config", "last_index", "initial")

    def __init__(self, config: PrefetchConfig, nchunks: int, initial: int | None = None):
        self.config = config
        self.last_index = nchunks - 1
        self.initial = config.readahead_initial if initial is None else initial

    def hint(self, cursor: Cursor, off: int, end: int, first: int, last: int, hints: list[int]) -> None:
        """Note a read of chunks ``first``..``last`` (bytes ``off``..``end``)
        and add to ``hints`` the chunks it makes worth fetching."""
        if not self._in_order(cursor, off, end, first, last):
            return
        cfg = self.config
        cursor.window = _grow(cursor.window, self.initial, cfg.readahead_max)
        stop = min(last + cursor.window, self.last_index)
        hints.extend(range(max(last, cursor.ahead) + 1, stop + 1))
        cursor.ahead = max(cursor.ahead, stop)

    @staticmethod
    def _in_order(cursor: Cursor, off: int, end: int, first: int, last: int) -> bool:
        """Follow the handle's position; whether its reads are in order long
        enough for a readahead (a read out of order resets the windows)."""
        sequential = cursor.next_off >= 0 and (
            off == cursor.next_off or cursor.last_chunk <= first <= cursor.last_chunk + 1
        )
        if not sequential:
            cursor.streak = 0
            cursor.window = 0
            cursor.ahead = -1
        elif last > cursor.last_chunk:
            # Counted in chunks entered in order, so that a few small reads
            # inside one chunk (SQLite's header, the kernel's first
            # readahead) do not start a readahead.
            cursor.streak += 1
        cursor.next_off = end
        cursor.last_chunk = last
        return cursor.streak >= 2


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

    def hint(self, off: int, first: int, last: int, hints: list[int]) -> None:
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
            hints.extend(chunks)
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
