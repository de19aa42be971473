"""The committed state of a database, as the writer's snapshots have it,
read from its files by a process that holds SQLite's write lock (a
rollback-journal database: the file; in WAL mode: the file with, for each
page, its latest frame among the WAL's frames 1..mxFrame, mxFrame being what
the wal-index header in `<db>-shm` names, and header bytes 18-19 (2: WAL)
read as 1).  No writer can move that state while the lock is held; a
checkpoint may run meanwhile, but only copies frames the image reads from
the WAL anyway.

The descriptors stay open for the life of the object, on purpose: closing
one of the database or of its -shm would drop every POSIX lock this process
holds on it, SQLite's included.
"""
from __future__ import annotations

import os
import struct

HEADER = 100
WAL_HEADER = 32
FRAME_HEADER = 24
# SQLite's WalIndexHdr (native byte order): version, unused, change,
# isInit, bigEndCksum, szPage, mxFrame, nPage, frame checksum (2), salts.
_WALINDEX = struct.Struct("=IIIBBHII8x8s")


class CommittedImage:
    def __init__(self, db_path: str):
        self.path = db_path
        self.db = os.open(db_path, os.O_RDONLY)
        self.wal = self.shm = None

    def _fd(self, which: str):
        """The -wal or -shm descriptor, opened once it exists (and again if
        the file was deleted and made anew); None while it does not."""
        fd = getattr(self, which)
        if fd is not None and os.fstat(fd).st_nlink == 0:
            fd = None  # deliberately left open: see the module's docstring
        if fd is None:
            try:
                fd = os.open(self.path + "-" + which, os.O_RDONLY)
            except FileNotFoundError:
                return None
            setattr(self, which, fd)
        return fd

    def _frames(self, mx: int, pgsz: int, salts: bytes) -> dict[int, int]:
        """Page number -> WAL offset of its latest frame's data, frames 1..mx."""
        wal = self._fd("wal")
        assert wal is not None, "the wal-index names frames of a missing WAL"
        frame = FRAME_HEADER + pgsz
        data = os.pread(wal, WAL_HEADER + mx * frame, 0)
        assert len(data) == WAL_HEADER + mx * frame and data[16:24] == salts, "WAL shorter than its index"
        latest = {}
        for f in range(mx):
            at = WAL_HEADER + f * frame
            pgno = struct.unpack(">I", data[at:at + 4])[0]
            assert data[at + 8:at + 16] == salts, "frame %d of another generation" % (f + 1)
            latest[pgno] = at + FRAME_HEADER
        return latest

    def read(self) -> bytes:
        size = os.fstat(self.db).st_size
        head = os.pread(self.db, HEADER, 0)
        shm = self._fd("shm") if len(head) == HEADER and 2 in head[18:20] else None
        if shm is None:  # a rollback journal's file, or a WAL with no index
            data = bytearray(os.pread(self.db, size, 0))
        else:
            hdr = os.pread(shm, 96, 0)
            first, second = hdr[:48], hdr[48:96]
            assert first == second, "wal-index header being written: hold the write lock"
            _, _, _, init, _, szpage, mx, npage, salts = _WALINDEX.unpack(first[:_WALINDEX.size])
            assert init, "wal-index not initialised"
            pgsz = 65536 if szpage == 1 else szpage
            length = npage * pgsz if npage else size
            data = bytearray(os.pread(self.db, length, 0))
            data += bytes(length - len(data))
            if mx:
                wal = self._fd("wal")
                for pgno, at in self._frames(mx, pgsz, salts).items():
                    if pgno <= npage:
                        data[(pgno - 1) * pgsz:pgno * pgsz] = os.pread(wal, pgsz, at)
        for i in (18, 19):
            if len(data) > i and data[i] == 2:
                data[i] = 1
        return bytes(data)
