"""The header of a source database as its committed state has it, to tell
whether the writer's staged snapshot is current (`verneuilctl lag`, `sync`).

A rollback-journal database's header is the file's first 100 bytes.  In WAL
mode (bytes 18 and 19 of the file's header are 2), page 1 may have newer
versions in `<db>-wal`: the header is then page 1's latest frame among the
WAL's committed frames (those carrying the WAL header's salts, up to the
last commit frame before the first that does not), else the file's.  Either
way bytes 18 and 19 read 1, as in the writer's snapshots of a WAL database
(docs/WRITER.md, "WAL databases").

`committed_size` is the committed state's size the same way: the file's
size, or in WAL mode the page count of that header times its page size.

The WAL's checksums are not verified here (the writer verifies them): this
is a status for the copier's tools, never bytes of a replica.
"""
from __future__ import annotations

import os
import struct
from typing import Optional

HEADER_BYTES = 100
# Bytes 18 and 19: file format write and read versions, 2 in WAL mode.
_FORMAT_VERSIONS = slice(18, 20)
_WAL_HEADER = 32
_FRAME_HEADER = 24
_WAL_MAGICS = (0x377F0682, 0x377F0683)
# Frames read per pread while looking for page 1 (a few MiB at most).
_FRAMES_PER_READ = 256


def uses_wal(header: bytes) -> bool:
    """Whether a database header (the file's) says WAL mode."""
    return len(header) >= 20 and 2 in header[_FORMAT_VERSIONS]


def _committed_page1(wal_path: str) -> Optional[bytes]:
    """The first HEADER_BYTES of page 1's latest committed frame in the WAL
    (None: none, or no readable WAL)."""
    try:
        f = open(wal_path, "rb")
    except OSError:
        return None
    with f:
        head = f.read(_WAL_HEADER)
        if len(head) < _WAL_HEADER:
            return None
        magic, _, page_size = struct.unpack(">III", head[:12])
        if magic not in _WAL_MAGICS or page_size < 512 or page_size > 65536 \
                or page_size & (page_size - 1):
            return None
        salts, frame = head[16:24], _FRAME_HEADER + page_size
        candidate = committed = None
        offset = _WAL_HEADER
        while True:
            block = f.read(frame * _FRAMES_PER_READ)
            for at in range(0, len(block) - frame + 1, frame):
                pgno, commit = struct.unpack(">II", block[at:at + 8])
                if pgno == 0 or block[at + 8:at + 16] != salts:
                    return committed
                if pgno == 1:
                    candidate = offset + at + _FRAME_HEADER
                if commit and candidate is not None:
                    committed = candidate
            if len(block) < frame * _FRAMES_PER_READ:
                break
            offset += len(block)
        if committed is None:
            return None
        f.seek(committed)
        data = f.read(HEADER_BYTES)
        return data if len(data) == HEADER_BYTES else None


def committed_header(path: str) -> Optional[bytes]:
    """The database's header in its committed state, format versions read as
    1 (None: unreadable, or shorter than a header)."""
    try:
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
    except OSError:
        return None
    if len(header) < HEADER_BYTES:
        return None
    if uses_wal(header):
        header = _committed_page1(path + "-wal") or header
    versions = bytes(1 if b == 2 else b for b in header[_FORMAT_VERSIONS])
    return header[:18] + versions + header[20:]


def committed_size(path: str) -> Optional[int]:
    """The size of the database's committed state (None: unreadable)."""
    try:
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    if len(header) < HEADER_BYTES or not uses_wal(header):
        return size
    header = committed_header(path)
    if header is None:
        return size
    page_size, = struct.unpack(">H", header[16:18])
    pages, = struct.unpack(">I", header[28:32])
    return pages * (65536 if page_size == 1 else page_size)
