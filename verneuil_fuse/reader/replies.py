"""Buffers for replies of several chunks, reused from one read request to
the next.

A read request that spans several chunks (the kernel's readahead asks for
up to 1 MiB) is answered from one buffer the chunks are copied into. A new
`bytearray` of that size costs a memset and, often, the page faults of
fresh memory, on trio's thread, for every request: 7 % of that thread's
time in a cold scan of a packed store. `ReplyBuffers` keeps a few buffers
and hands out one that nothing refers to any more.

When is a buffer free again? pyfuse3 sends a read's reply as soon as the
handler returns, in the same task, and then drops it; the views of the
buffer the read made (its destinations, the reply's slice) die with their
last reference. So a buffer is free exactly when the pool's own list is all
that holds it, which CPython's reference count says (`sys.getrefcount`). A
buffer still held (a read waiting for its chunks, a view kept by a
traceback) is skipped, never written while in use.

Tested by tests/test_reader_catalog.py (test_reply_buffers_are_reused_only_when_free).
"""
from __future__ import annotations

import sys

from verneuil_fuse.format import CHUNK_SIZE

# Chunks one pooled buffer holds: a 1 MiB request (the largest the kernel
# sends: FUSE's 256 pages) that does not start on a chunk's boundary spans
# 17 chunks. A larger request gets a buffer of its own.
REPLY_CHUNKS = 17
# Buffers kept: more than the read requests the kernel has in flight at once
# on a mount (its FUSE max_background, 12 by default, plus the requests
# being answered), so that a scan always finds one free; 32 x 1.06 MiB.
REPLY_BUFFERS = 32

# References to a free pooled buffer seen by `sys.getrefcount(buf)` in
# `ReplyBuffers.take`: the pool's list, the loop's name, and the call's own
# argument.
_FREE_REFS = 3


class ReplyBuffers:
    """Up to ``count`` reusable buffers of ``chunks`` chunks each (see the
    module's docstring). For trio's thread only."""

    __slots__ = ("size", "count", "_pool", "_next", "reused", "made")

    def __init__(self, chunks: int = REPLY_CHUNKS, count: int = REPLY_BUFFERS):
        self.size = chunks * CHUNK_SIZE
        self.count = count
        self._pool: list[bytearray] = []
        self._next = 0  # where the search for a free buffer starts
        self.reused = 0
        self.made = 0

    def take(self, size: int) -> bytearray:
        """A buffer of at least ``size`` bytes that nothing else refers to.
        Its bytes are whatever an earlier reply left there: the caller
        writes every byte it replies with."""
        if size > self.size:
            self.made += 1
            return bytearray(size)
        pool = self._pool
        n = len(pool)
        for k in range(n):
            at = (self._next + k) % n
            buf = pool[at]
            if sys.getrefcount(buf) == _FREE_REFS:
                self._next = at + 1
                self.reused += 1
                return buf
        buf = bytearray(self.size)
        self.made += 1
        if n < self.count:
            pool.append(buf)
        return buf
