"""The reader's chunk path in C (csrc/chunk_engine.c): requests of chunks
many in flight, each request's bytes split into chunk blobs, each blob
decoded, verified against its own fingerprint and written into its place in
the disk cache, none of it holding Python's GIL; trio gets the answers in
batches.

A request (`Read`) reads one object, or bytes [start, end) of one (a run of
adjacent blobs of a pack, `format.Run`), in one of two ways: an HTTP GET on
the engine's thread (libcurl; a Range header for a range), or a read of a
local file (a directory store: pread on the engine's worker threads,
``workers`` of them). Its `Part`s are its chunks: where each blob lies in
the bytes read, its fingerprint, where its verified bytes go in the disk
cache (`CacheSlot.target`) and whether they come back in memory (``keep``):
each in a `bytes` object of its own, or, for a run of several chunks, all
in one run buffer, a chunk's size apart, each handed back as a view of its
place (`RUN_BUFFER_PARTS`, `RunBuffers`).

`ChunkEngine` owns a fixed pool of requests. `submit` starts `Read`s (one
request each; `start` is the one-chunk GET of a chunk object); the GETs'
signing is set once for all (`set_auth`: the headers, and libcurl's own
SigV4 with the credentials the store's boto3 client holds). `answers`
waits in trio (the engine's eventfd) for the next batch of ``(token,
Outcome)``, one per part. `close` stops the engine's threads, then frees
it: after it nothing writes to the cache.

A `format.Run` of a packed store becomes one `Read`, or a few when it
holds more chunks than a request takes (`run_reads`).

Chunks only: every other request of the store (manifests, listings, PUTs)
goes through the store's own engine (store/curl.py) or boto3.
"""
from __future__ import annotations

import ctypes
import errno
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import trio

from verneuil_fuse.format import (CHUNK_KEY, CHUNK_SIZE, MAX_CHUNK_BLOB_BYTES, MAX_PACK_BYTES, ChunkError,
                                  Fprint, Run)
from verneuil_fuse.reader._chunk_engine import ffi, lib
from verneuil_fuse.store.curl import BodyTooLarge, Response, transport_error

# The UMASH key's length (csrc/umash.h): the chunk key, zero-padded.
_KEY_BYTES = 32
assert lib.VN_CE_CHUNK_SIZE == CHUNK_SIZE
assert lib.VN_CE_BLOB_MAX == MAX_CHUNK_BLOB_BYTES
assert lib.VN_CE_PACK_MAX == MAX_PACK_BYTES

# A kept chunk is decoded straight into a new `bytes` object of a chunk's
# size, not into the engine's memory and then copied (a 64 KiB copy per
# chunk on trio's thread): CPython's C API makes a bytes object whose
# contents are left to its maker, which the engine fills before anything
# else can see the object.
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)

# Worker threads for a directory store's reads: with 2 cores, 4 keep the
# disk busy while two of them decode (scripts/bench_chunk_engine.py, 384 MiB
# cold, one chunk file a request: 2.2-3.0 s with 1 worker, 1.2-1.35 s with
# 2, 0.8-1.0 s with 4, 0.8 s with 8).
READ_WORKERS = 4

# A request of at least this many parts, all kept, decodes them into one
# buffer, a chunk's size apart, and hands each chunk back as a view of its
# place there: a read request of the kernel whose chunks are all in one run
# (a scan's 1 MiB reads of 4 MiB runs) is answered with a view of the
# buffer, not a copy (`fetcher.Fetcher.span`). Fewer parts (a point query's,
# a b-tree prefetch's few siblings) get a bytes object each: a small chunk
# kept in memory then holds no larger buffer alive.
RUN_BUFFER_PARTS = 4
# Run buffers of at least this many chunks (a scan's runs: `RUN_BYTES` of
# blobs, 64-80 chunks) are made in sizes of a multiple of it and reused
# once nothing refers to them (`RunBuffers`): a new one of 4-5 MiB costs the
# page faults of fresh memory on the engine's thread as it decodes (+0.15 ms
# of its CPU per GET in a cold scan). Smaller runs (a b-tree prefetch's
# siblings) get a buffer of their own size, so that a few chunks kept in
# memory never hold a buffer much larger than themselves.
RUN_BUFFER_STEP = 16
# Pooled run buffers at most, free or not: the memory LRU's (64 MiB, ~14
# runs), the readahead's requests in flight (~12) and a margin. The free
# ones are let go when no request is under way (`RunBuffers.let_go`).
RUN_BUFFERS = 32

# References to a free pooled run buffer seen by `sys.getrefcount(buf)` in
# `RunBuffers.take`: the pool's list, the loop's name and the call's
# argument.
_FREE_REFS = 3

# A part whose bytes do not go to the disk cache: (data fd, index fd, offset).
_NO_TARGET = (-1, -1, 0)


class Part(NamedTuple):
    """One chunk of a `Read`: ``token`` (the caller's, handed back with its
    `Outcome`), its fingerprint, its blob's place in the bytes read, [lo,
    hi) (a whole object: 0, None), where its verified bytes go in the disk
    cache (``(data fd, index fd, offset)`` or None) and whether they come
    back in `Outcome.data` (``keep``)."""

    token: Any
    fp: Fprint
    lo: int = 0
    hi: int | None = None
    target: tuple[int, int, int] | None = None
    keep: bool = True


class Read(NamedTuple):
    """One request: bytes [start, end) of the object at ``where`` (``end``
    None: all of it, a chunk object, at most MAX_CHUNK_BLOB_BYTES), an HTTP
    URL, or the path of a local file when ``file`` (no symlink, a regular
    file only); ``timeout`` bounds a GET (not a file read)."""

    where: str
    parts: Sequence[Part]
    start: int = 0
    end: int | None = None
    timeout: float = 30.0
    file: bool = False


def address(buffer: Any) -> int:
    """Where ``buffer``'s bytes start in memory: chunks decoded into one run
    buffer are one span of it when each starts where the one before ends
    (`fetcher.Fetcher.span`)."""
    return int(ffi.cast("uintptr_t", ffi.from_buffer(buffer)))


def run_reads(run: Run, where: str, part: Callable[[int], Part], max_parts: int, timeout: float = 30.0,
              file: bool = False) -> list[Read]:
    """The `Read`s of `format.Run` ``run`` of the object at ``where``: one,
    or one per ``max_parts`` chunks of it (a run of many small blobs).
    ``part(index)`` gives chunk ``index``'s `Part` (its ``lo`` and ``hi``
    are set here)."""
    if run.end is None:  # a chunk object of its own
        ((index, _, _),) = run.parts
        return [Read(where, (part(index)._replace(lo=0, hi=None),), timeout=timeout, file=file)]
    reads = []
    for at in range(0, len(run.parts), max_parts):
        group = run.parts[at:at + max_parts]
        base = group[0][1]
        parts = tuple(part(index)._replace(lo=lo - base, hi=hi - base) for index, lo, hi in group)
        reads.append(Read(where, parts, run.start + base, run.start + group[-1][2], timeout, file))
    return reads


@dataclass(slots=True)
class Outcome:
    """How one chunk of a request ended: its verified bytes (``verified``;
    in ``data`` if kept), or what went wrong (``failure``: the store's
    non-2xx answer as a `Response`; an OSError for no answer, a file that
    cannot be read (its errno), or `BodyTooLarge`; a `format.ChunkError`
    for bytes that are not those asked, a Content-Range of other bytes or
    an object that ends before the blob does; ``mismatch``: a blob that is
    not the chunk)."""

    data: bytes | None = None
    size: int = 0  # the blob's bytes
    written: bool = False  # the bytes and their index record are in the cache target
    write_errno: int = 0  # why not, when a target was given
    failure: Response | OSError | ChunkError | None = None
    mismatch: bool = False
    verified: bool = False


class RunBuffers:
    """The buffers of runs of `RUN_BUFFER_STEP` chunks or more, reused once
    nothing refers to them. A chunk decoded into one is handed out as a view
    of its place with a managed buffer of its own (`ChunkEngine._kept`), so
    each such view counts in the buffer's reference count: a buffer whose
    only references are the pool's own is free, and only then written into
    again. Not thread-safe: trio's thread only (the engine writes into a
    buffer only while its request, which holds it, is under way)."""

    __slots__ = ("_pool", "made", "reused")

    def __init__(self) -> None:
        self._pool: list[bytes] = []
        self.made = 0
        self.reused = 0

    def take(self, parts: int) -> bytes:
        """A buffer for ``parts`` chunks (at least)."""
        if parts < RUN_BUFFER_STEP:
            self.made += 1
            return _new_bytes(None, parts * CHUNK_SIZE)
        size = -(-parts // RUN_BUFFER_STEP) * RUN_BUFFER_STEP * CHUNK_SIZE
        pool = self._pool
        for buf in pool:
            if len(buf) == size and sys.getrefcount(buf) == _FREE_REFS:
                self.reused += 1
                return buf
        buf = _new_bytes(None, size)
        self.made += 1
        if len(pool) < RUN_BUFFERS:
            pool.append(buf)
        return buf

    def let_go(self) -> None:
        """Drop the free buffers (no request under way: a scan is over), so
        that an idle mount keeps only those its chunks in memory hold."""
        self._pool = [buf for buf in self._pool if sys.getrefcount(buf) > _FREE_REFS]


class ChunkEngine:
    """A pool of ``slots`` requests in C of up to ``max_parts`` chunks each
    (see the module's docstring), with ``workers`` threads for file reads
    (0: GETs only); a request reads up to ``max_body`` bytes (a range's
    length; a chunk object is bounded by MAX_CHUNK_BLOB_BYTES)."""

    def __init__(self, slots: int, max_body: int, *, max_parts: int = 1, workers: int = 0):
        self.max_body = max_body
        self.max_parts = max_parts
        self.workers = workers
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        box = ffi.new("struct vn_ce_engine **")
        err = lib.vn_ce_open(slots, max_body, max_parts, workers, CHUNK_KEY.ljust(_KEY_BYTES, b"\0"), self._fd, box)
        if err:
            os.close(self._fd)
            raise OSError(err, "cannot start the chunk engine: %s" % os.strerror(err))
        self._engine = box[0]
        self._requests = [lib.vn_ce_request(self._engine, i) for i in range(slots)]
        self._free = list(range(slots))
        self._tokens: list[list[Any] | None] = [None] * slots
        # Where each request's kept parts are decoded (`_fill`).
        self._dests: list[list[bytes | None] | bytes | None] = [None] * slots
        self._taken = ffi.new("int[]", slots)
        self._auth: tuple | None = None
        self.run_buffers = RunBuffers()

    @property
    def free(self) -> int:
        """Requests that may start now."""
        return len(self._free)

    @property
    def idle(self) -> bool:
        """No request is under way."""
        return len(self._free) == len(self._requests)

    def set_auth(self, headers: list[str], sigv4: tuple[str, str, str] | None,
                 connect_timeout: float, idle_timeout: float) -> None:
        """What the GETs started from now on are sent with (nothing when it
        is what they are sent with already): ``headers``, and SigV4 as
        ``(provider:region:service spec, access key, secret)``."""
        auth = (tuple(headers), sigv4, connect_timeout, idle_timeout)
        if auth == self._auth:
            return
        spec = user = ffi.NULL
        if sigv4 is not None:
            spec = sigv4[0].encode()
            user = ("%s:%s" % (sigv4[1], sigv4[2])).encode()
        err = lib.vn_ce_set_auth(self._engine, "\n".join(headers).encode(), spec, user,
                                 int(connect_timeout * 1000), max(1, int(idle_timeout)))
        if err:
            raise OSError(err, "cannot set the chunk engine's requests up")
        self._auth = auth

    def start(self, gets: Iterable[tuple[Any, str, Fprint, tuple[int, int, int] | None, float]]) -> None:
        """Start GETs of chunk objects, each ``(token, url, fingerprint,
        target, timeout)``: ``target`` the disk cache's ``(data fd, index
        fd, offset)`` or None; the chunk's bytes come back. There must be a
        free request for each (`free`)."""
        self.submit(Read(url, (Part(token, fp, 0, None, target),), timeout=timeout)
                    for token, url, fp, target, timeout in gets)

    def submit(self, reads: Iterable[Read]) -> None:
        """Start requests, one per `Read`: there must be a free request for
        each (`free`). ValueError for one the engine cannot take (nothing
        is started then)."""
        indices: list[int] = []
        try:
            for read in reads:
                i = self._free.pop()
                indices.append(i)
                self._dests[i] = self._fill(self._requests[i], read)
                self._tokens[i] = [part.token for part in read.parts]
            err = lib.vn_ce_submit(self._engine, indices, len(indices)) if indices else 0
        except BaseException:
            self._give_back(indices)
            raise
        if err:
            self._give_back(indices)
            if err == errno.EINVAL:
                raise ValueError("the chunk engine takes no such request (parts, range or path)")
            raise OSError(err, "the chunk engine takes no request: %s" % os.strerror(err))

    def _fill(self, r: Any, read: Read) -> list[bytes | None] | bytes:
        """Request ``r`` set up for ``read``; returns where its kept parts
        are decoded (held until the request ends): a bytes object per part,
        or one run buffer for them all (`RUN_BUFFER_PARTS`)."""
        raw = read.where.encode()
        if len(raw) >= lib.VN_CE_URL_MAX:
            raise ValueError("URL longer than %d bytes: %s..." % (lib.VN_CE_URL_MAX - 1, read.where[:80]))
        n = len(read.parts)
        if not 0 < n <= self.max_parts:
            raise ValueError("%d parts for a request of at most %d" % (n, self.max_parts))
        r.kind = lib.VN_CE_READ if read.file else lib.VN_CE_GET
        r.url = raw
        r.start = read.start
        r.end = -1 if read.end is None else read.end
        r.nparts = n
        r.timeout_ms = max(1, int(read.timeout * 1000))
        parts = r.parts
        # The whole part in one assignment (fp, lo, hi, data_fd, idx_fd,
        # offset, keep, dest; what the engine sets is zeroed).
        if n >= RUN_BUFFER_PARTS and all(part.keep for part in read.parts):
            run = self.run_buffers.take(n)
            at = ffi.from_buffer("unsigned char[]", run)
            for k, part in enumerate(read.parts):
                data_fd, idx_fd, offset = part.target if part.target is not None else _NO_TARGET
                parts[k] = (part.fp, part.lo, part.hi or 0, data_fd, idx_fd, offset, 1, at + k * CHUNK_SIZE)
            return run
        dests: list[bytes | None] = []
        for k, part in enumerate(read.parts):
            data_fd, idx_fd, offset = part.target if part.target is not None else _NO_TARGET
            if part.keep:
                dest = _new_bytes(None, CHUNK_SIZE)
                parts[k] = (part.fp, part.lo, part.hi or 0, data_fd, idx_fd, offset, 1,
                            ffi.from_buffer("unsigned char[]", dest))
            else:
                dest = None
                parts[k] = (part.fp, part.lo, part.hi or 0, data_fd, idx_fd, offset, 0, ffi.NULL)
            dests.append(dest)
        return dests

    def _give_back(self, indices: list[int]) -> None:
        for i in indices:
            self._tokens[i] = self._dests[i] = None
        self._free.extend(indices)

    async def answers(self) -> list[tuple[Any, Outcome]]:
        """The outcomes of the next batch of ended requests, one per part,
        waiting for one in trio."""
        while True:
            n = lib.vn_ce_take(self._engine, self._taken, len(self._requests))
            if n:
                out: list[tuple[Any, Outcome]] = []
                for k in range(n):
                    self._ended(self._taken[k], out)
                return out
            await trio.lowlevel.wait_readable(self._fd)
            try:
                os.eventfd_read(self._fd)
            except BlockingIOError:
                pass

    def _ended(self, i: int, out: list[tuple[Any, Outcome]]) -> None:
        r = self._requests[i]
        tokens, self._tokens[i] = self._tokens[i], None
        dests, self._dests[i] = self._dests[i], None
        self._free.append(i)
        assert tokens is not None and dests is not None
        failure = None if r.result in (lib.VN_CE_CHUNK, lib.VN_CE_MISMATCH, lib.VN_CE_SHORT) else self._failure(r)
        parts = r.parts
        if type(dests) is bytes:  # one run buffer, a chunk's size per part
            for k, token in enumerate(tokens):
                out.append((token, self._part_outcome(r, parts[k], dests, failure, k * CHUNK_SIZE)))
        else:
            for k, token in enumerate(tokens):
                out.append((token, self._part_outcome(r, parts[k], dests[k], failure)))

    @staticmethod
    def _kept(p: Any, dest: bytes | None, at: int | None) -> bytes | memoryview | None:
        """A verified part's bytes, if kept: its bytes object (a copy of its
        start for a chunk shorter than a chunk's size, the last of a file),
        or, in a run buffer (``at``: the part's place in it), a view of its
        place there (a view of its own, so that the buffer's reference count
        counts the chunks that hold it)."""
        if dest is None:
            return None
        if at is not None:
            return memoryview(dest)[at:at + p.length]
        return dest if p.length == CHUNK_SIZE else dest[:p.length]

    def _part_outcome(self, r: Any, p: Any, dest: bytes | None, failure: Any, at: int | None = None) -> Outcome:
        """One part's `Outcome` (``dest``: the bytes object its kept bytes
        were decoded into, at ``at`` in a run buffer); ``failure``: the
        whole request's."""
        result = p.result
        size = (p.hi - p.lo) if p.hi else r.body_len
        if result == lib.VN_CE_CHUNK:
            return Outcome(data=self._kept(p, dest, at), size=size, verified=True,
                           written=p.data_fd >= 0 and not p.write_errno, write_errno=p.write_errno)
        if result == lib.VN_CE_MISMATCH:
            return Outcome(size=size, mismatch=True)
        if result == lib.VN_CE_SHORT:
            where = ffi.string(r.url).decode("utf-8", "replace")
            return Outcome(failure=ChunkError(
                "%s holds %d bytes from %d, not the %d to %d of chunk %s: the pack was cut or replaced"
                % (where, r.body_len, r.start, p.lo, p.hi, Fprint(p.fp[0], p.fp[1]).name)))
        return Outcome(failure=failure)

    def _failure(self, r: Any) -> Response | OSError | ChunkError:
        """What a request that ended without its bytes failed with."""
        result = r.result
        message = ffi.string(r.error).decode("utf-8", "replace")
        if result == lib.VN_CE_HTTP:
            return Response(r.status, ffi.buffer(r.body, r.body_len)[:])
        if result == lib.VN_CE_TOO_LARGE:
            bound = MAX_CHUNK_BLOB_BYTES if r.end < 0 else r.end - r.start
            return BodyTooLarge(bound, r.declared if r.declared >= 0 else None)
        if result == lib.VN_CE_SHUTDOWN:
            return OSError(errno.ESHUTDOWN, "the chunk engine is closed")
        if result == lib.VN_CE_FILE:
            return OSError(r.sys_errno, message or os.strerror(r.sys_errno), ffi.string(r.url).decode())
        if result == lib.VN_CE_RANGE:
            return ChunkError("%s answered other bytes than asked: %s"
                              % (ffi.string(r.url).decode("utf-8", "replace"), message))
        return transport_error(r.curl_code, message)

    def in_flight(self) -> list[Any]:
        """The tokens of the parts of requests started and not yet handed
        back."""
        return [t for tokens in self._tokens if tokens is not None for t in tokens]

    def close(self) -> None:
        """Stop the engine's threads (GETs under way end unanswered, their
        tokens are `in_flight` still; a file read under way ends first)
        and free it; idempotent."""
        if self._engine is None:
            return
        engine, self._engine = self._engine, None
        lib.vn_ce_close(engine)
        lib.vn_ce_free(engine)
        os.close(self._fd)
