"""The reader's chunk path in C (csrc/chunk_engine.c): chunk GETs many in
flight on a thread of its own, each answer decoded, verified against its
fingerprint and written into its place in the disk cache there, none of it
holding Python's GIL; trio gets the answers in batches.

`ChunkEngine` owns a fixed pool of requests (as many as GETs may be in
flight). `start` sends GETs, each with a token of the caller's: the chunk's
URL, its fingerprint, where its bytes go in the disk cache
(`CacheSlot.target`) and its time limit; the URL's signing is set once for
all (`set_auth`: the headers, and libcurl's own SigV4 with the credentials
the store's boto3 client holds). `answers` waits in trio (the engine's
eventfd) for the next batch of `(token, Outcome)`. `close` stops the
engine's thread, then frees it: after it nothing writes to the cache.

Chunks only: every other request of the store (manifests, listings, PUTs)
goes through the store's own engine (store/curl.py) or boto3.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any, Iterable

import trio

from verneuil_fuse.format import CHUNK_KEY, CHUNK_SIZE, Fprint
from verneuil_fuse.reader._chunk_engine import ffi, lib
from verneuil_fuse.store.curl import BodyTooLarge, Response, transport_error

# The UMASH key's length (csrc/umash.h): the chunk key, zero-padded.
_KEY_BYTES = 32
assert lib.VN_CE_CHUNK_SIZE == CHUNK_SIZE


@dataclass(slots=True)
class Outcome:
    """How one GET ended: the chunk's verified bytes (``data``), or what
    went wrong (``failure``: the store's non-2xx answer as a `Response`, or
    an OSError for no answer; ``mismatch``: a body that is not the chunk)."""

    data: bytes | None = None
    size: int = 0  # the body's bytes
    written: bool = False  # the bytes and their index record are in the cache target
    write_errno: int = 0  # why not, when a target was given
    failure: Response | OSError | None = None
    mismatch: bool = False


class ChunkEngine:
    """A pool of ``slots`` chunk GETs in C (see the module's docstring);
    bodies over ``max_body`` bytes are refused (`BodyTooLarge`)."""

    def __init__(self, slots: int, max_body: int):
        self.max_body = max_body
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        box = ffi.new("struct vn_ce_engine **")
        err = lib.vn_ce_open(slots, max_body, CHUNK_KEY.ljust(_KEY_BYTES, b"\0"), self._fd, box)
        if err:
            os.close(self._fd)
            raise OSError(err, "cannot start the chunk engine: %s" % os.strerror(err))
        self._engine = box[0]
        self._requests = [lib.vn_ce_request(self._engine, i) for i in range(slots)]
        self._free = list(range(slots))
        self._tokens: list[Any] = [None] * slots
        self._taken = ffi.new("int[]", slots)
        self._auth: tuple | None = None

    @property
    def free(self) -> int:
        """Requests that may start now."""
        return len(self._free)

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
        """Start GETs, each ``(token, url, fingerprint, target, timeout)``:
        ``target`` the disk cache's ``(data fd, index fd, offset)`` or None.
        There must be a free request for each (`free`)."""
        indices = []
        requests, tokens = self._requests, self._tokens
        try:
            for token, url, fp, target, timeout in gets:
                raw = url.encode()
                if len(raw) >= lib.VN_CE_URL_MAX:
                    raise ValueError("URL longer than %d bytes: %s..." % (lib.VN_CE_URL_MAX - 1, url[:80]))
                i = self._free.pop()
                indices.append(i)
                r = requests[i]
                r.url = raw
                r.fp[0], r.fp[1] = fp
                if target is None:
                    r.data_fd = -1
                else:
                    r.data_fd, r.idx_fd, r.offset = target
                r.timeout_ms = max(1, int(timeout * 1000))
                tokens[i] = token
            err = lib.vn_ce_submit(self._engine, indices, len(indices)) if indices else 0
        except BaseException:
            self._give_back(indices)
            raise
        if err:
            self._give_back(indices)
            raise OSError(err, "the chunk engine takes no request: %s" % os.strerror(err))

    def _give_back(self, indices: list[int]) -> None:
        for i in indices:
            self._tokens[i] = None
        self._free.extend(indices)

    async def answers(self) -> list[tuple[Any, Outcome]]:
        """The next batch of ended GETs, waiting for one in trio."""
        while True:
            n = lib.vn_ce_take(self._engine, self._taken, len(self._requests))
            if n:
                return [self._ended(self._taken[k]) for k in range(n)]
            await trio.lowlevel.wait_readable(self._fd)
            try:
                os.eventfd_read(self._fd)
            except BlockingIOError:
                pass

    def _ended(self, i: int) -> tuple[Any, Outcome]:
        r = self._requests[i]
        token, self._tokens[i] = self._tokens[i], None
        self._free.append(i)
        result = r.result
        if result == lib.VN_CE_CHUNK:
            return token, Outcome(data=ffi.buffer(r.chunk, r.length)[:], size=r.body_len,
                                  written=r.data_fd >= 0 and not r.write_errno, write_errno=r.write_errno)
        if result == lib.VN_CE_HTTP:
            return token, Outcome(failure=Response(r.status, ffi.buffer(r.body, r.body_len)[:]))
        if result == lib.VN_CE_MISMATCH:
            return token, Outcome(size=r.body_len, mismatch=True)
        if result == lib.VN_CE_TOO_LARGE:
            return token, Outcome(failure=BodyTooLarge(self.max_body, r.declared if r.declared >= 0 else None))
        if result == lib.VN_CE_SHUTDOWN:
            return token, Outcome(failure=OSError(errno.ESHUTDOWN, "the chunk engine is closed"))
        return token, Outcome(failure=transport_error(r.curl_code, ffi.string(r.error).decode("utf-8", "replace")))

    def in_flight(self) -> list[Any]:
        """The tokens of the GETs started and not yet handed back."""
        return [t for t in self._tokens if t is not None]

    def close(self) -> None:
        """Stop the engine's thread (GETs under way end unanswered, their
        tokens are `in_flight` still) and free it; idempotent."""
        if self._engine is None:
            return
        engine, self._engine = self._engine, None
        lib.vn_ce_close(engine)
        lib.vn_ce_free(engine)
        os.close(self._fd)
