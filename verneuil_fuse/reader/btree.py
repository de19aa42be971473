"""Just enough of SQLite's file format to guide prefetching.

Everything here reads bytes that were already verified against their
fingerprint, but a database file also holds free pages, overflow pages and
pointer-map pages whose bytes may look like anything: the results are *hints*
for prefetching and are never used to decide which bytes to serve.

File format reference: https://www.sqlite.org/fileformat2.html
- The database header is the first 100 bytes of page 1; the page size is the
  big-endian u16 at offset 16 (the value 1 means 65 536).
- A b-tree page starts with a header (at offset 100 on page 1, 0 elsewhere).
  Its first byte is the page type: 2 = interior index, 5 = interior table,
  10 = leaf index, 13 = leaf table. Interior pages have a 12-byte header whose
  last 4 bytes are the right-most child; the cell pointer array follows (one
  big-endian u16 per cell, ``ncells`` from header bytes 3..5), and every
  interior cell starts with the big-endian u32 page number of its left child.
"""
from __future__ import annotations

import struct
from typing import Iterator, NamedTuple

SQLITE_MAGIC = b"SQLite format 3\x00"
INTERIOR_INDEX = 2
INTERIOR_TABLE = 5
LEAF_INDEX = 10
LEAF_TABLE = 13
INTERIOR_INDEX_BYTE = bytes((INTERIOR_INDEX,))
INTERIOR_TABLE_BYTE = bytes((INTERIOR_TABLE,))

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")


class DbHeader(NamedTuple):
    page_size: int
    reserved: int  # bytes reserved at the end of each page
    page_count: int  # "in-header database size"; 0 when not trustworthy


def parse_header(first_bytes: bytes) -> DbHeader | None:
    """The page size (and friends) from the first 100 bytes, or None if they are
    not a SQLite database header."""
    if len(first_bytes) < 100 or not first_bytes.startswith(SQLITE_MAGIC):
        return None
    (raw,) = _U16.unpack_from(first_bytes, 16)
    page_size = 65536 if raw == 1 else raw
    if page_size < 512 or page_size & (page_size - 1):
        return None
    reserved = first_bytes[20]
    (count,) = _U32.unpack_from(first_bytes, 28)
    return DbHeader(page_size, reserved, count)


def interior_children(page: bytes, page_no: int, max_page: int) -> list[int] | None:
    """Child page numbers of an interior b-tree page, in key order (left to
    right, the right-most child last), or None if ``page`` does not look like an
    interior b-tree page. ``page`` is the whole page; ``page_no`` is 1-based."""
    hdr = 100 if page_no == 1 else 0
    if len(page) < hdr + 12:
        return None
    kind = page[hdr]
    if kind != INTERIOR_TABLE and kind != INTERIOR_INDEX:
        return None
    (ncells,) = _U16.unpack_from(page, hdr + 3)
    (right,) = _U32.unpack_from(page, hdr + 8)
    ptrs = hdr + 12
    if ncells == 0 or ptrs + 2 * ncells > len(page) or not 1 <= right <= max_page:
        return None
    cells = struct.unpack_from(">%dH" % ncells, page, ptrs)
    if min(cells) < ptrs + 2 * ncells or max(cells) > len(page) - 4:
        return None
    unpack = _U32.unpack_from
    children = [unpack(page, cell)[0] for cell in cells]
    if min(children) < 1 or max(children) > max_page:
        return None
    children.append(right)
    return children


def interior_pages(
    data: bytes, first_offset: int, page_size: int, max_page: int
) -> Iterator[tuple[int, list[int]]]:
    """(page number, children) for every interior b-tree page wholly inside
    ``data``, which starts at file offset ``first_offset``."""
    start = -first_offset % page_size  # first page boundary inside data
    count = (len(data) - start) // page_size
    if count <= 0:
        return
    view = memoryview(data)  # pages are parsed in place, not copied
    first_no = (first_offset + start) // page_size + 1
    # Every page's type byte in one strided copy, so that a chunk of leaves
    # (nearly all of them) costs two searches, not a Python loop per page.
    kinds = view[start : start + count * page_size : page_size].tobytes()
    if first_no == 1:  # page 1's b-tree header follows the database header
        kinds = bytes((data[start + 100],)) + kinds[1:]
    if INTERIOR_TABLE_BYTE not in kinds and INTERIOR_INDEX_BYTE not in kinds:
        return
    for j, kind in enumerate(kinds):
        if kind != INTERIOR_TABLE and kind != INTERIOR_INDEX:
            continue
        off = start + j * page_size
        children = interior_children(view[off : off + page_size], first_no + j, max_page)
        if children is not None:
            yield first_no + j, children
