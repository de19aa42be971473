"""Many HTTP requests in flight on one thread: libcurl's multi interface.

`CurlEngine` is the store's cheap path for object GETs and PUTs (the
copier's chunk uploads, manifests) and listing pages: a request costs about
0.05 ms of CPU here against about 1.8 ms for one boto3 call, and a hundred
of them in flight cost no thread each.  It knows nothing of S3:
`s3.S3Backend` builds each request (URL, headers, libcurl's SigV4 with
the credentials botocore's chain gives) and turns the answer into its
result or `StoreError`.  (The reader's chunk GETs have an engine in C of
their own, reader/chunk_engine.py.)

One daemon thread, started at the first request, runs the multi loop:
requests queued by `submit` (any thread) join it; a pipe wakes it at once;
each request's `done` is called on that thread with a `Response` or an
`OSError` (the transport failed: refused, reset, timed out; `BodyTooLarge`
for a body over the request's bound), so `done` must be quick or hand off.  Connections are kept
and reused (libcurl's connection cache).  `close` aborts what is in flight
(their `done` gets an OSError) and ends the thread.
"""
from __future__ import annotations

import errno
import logging
import os
import select
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import pycurl

log = logging.getLogger(__name__)

# Requests in flight at once, the rest wait in the queue: a hundred chunk
# GETs hide 20-30 ms of latency at several thousand GETs a second, and stay
# well under S3's per-prefix request rates.
DEFAULT_MAX_IN_FLIGHT = 128
# Idle connections kept for reuse: as many as can be in flight, so a burst
# never opens new connections twice.
CONNECTION_CACHE_SLACK = 8
# libcurl's receive buffer: a 64 KiB chunk (its zstd frame) in one write
# callback, not four of its default 16 KiB.
RECEIVE_BUFFER = 128 << 10
# What is kept of an error answer's body (S3 error documents are well under
# 1 KiB): enough for its code and message, never a large body in memory.
ERROR_BODY_MAX = 64 << 10
# What epoll watches a socket for, by what libcurl asks.
_EPOLL_MASKS = {pycurl.POLL_IN: select.EPOLLIN, pycurl.POLL_OUT: select.EPOLLOUT,
                pycurl.POLL_INOUT: select.EPOLLIN | select.EPOLLOUT}
# How often transfers are checked for silence (`Request.idle_timeout`), and
# so the longest wait of the loop with requests in flight (a socket or the
# pipe wakes it sooner): a tenth of a second is well under any idle bound.
IDLE_CHECK_SECONDS = 0.1


class BodyTooLarge(OSError):
    """The answer's body is larger than the request's `max_bytes`; `size`:
    its Content-Length, None when learnt while reading."""

    def __init__(self, bound: int, size: int | None):
        super().__init__(errno.EFBIG, "body larger than %d bytes" % bound)
        self.size = size


def transport_error(code: int, message: str) -> OSError:
    """The OSError of a transfer libcurl ended with CURLcode ``code``."""
    if code == pycurl.E_OPERATION_TIMEDOUT:
        return OSError(errno.ETIMEDOUT, message)
    if code == pycurl.E_COULDNT_CONNECT:
        return OSError(errno.ECONNREFUSED, message)
    return OSError(errno.EIO, "%s (curl error %d)" % (message, code))


@dataclass
class Request:
    method: str
    url: str
    headers: list[str]
    body: bytes | None = None
    max_bytes: int | None = None  # larger bodies abort the transfer (BodyTooLarge)
    # AWS SigV4 by libcurl: (provider:region:service spec, access key, secret)
    sigv4: tuple[str, str, str] | None = None
    connect_timeout: float = 3.0
    idle_timeout: float = 15.0  # no byte either way for this long ends it
    timeout: float = 30.0  # the whole transfer


@dataclass
class Response:
    status: int
    body: bytes
    etag: str | None = None  # the answer's ETag header, as sent (quotes kept)


@dataclass
class _Transfer:
    request: Request
    done: Callable[[Response | OSError], None]
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    too_large: bool = False
    declared: int | None = None  # Content-Length, when it is over max_bytes
    status: int = 0  # learnt at the body's first bytes, else at the end
    etag: str | None = None
    last_activity: float = 0.0  # time.monotonic() of the last byte either way


class _Handle:
    """What one easy handle was last set up for (`CurlEngine._prepare` sets
    only what changed) and the transfer it serves now (its write and header
    callbacks, made once per handle, read it)."""

    __slots__ = ("transfer", "settings", "method")

    def __init__(self) -> None:
        self.transfer: _Transfer | None = None
        self.settings: tuple | None = None
        self.method = ""


class CurlEngine:
    def __init__(self, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        self.max_in_flight = max_in_flight
        self._queue: deque[_Transfer] = deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._multi = pycurl.CurlMulti()
        self._multi.setopt(pycurl.M_MAXCONNECTS, max_in_flight + CONNECTION_CACHE_SLACK)
        self._free: list[pycurl.Curl] = []
        self._handles: dict[pycurl.Curl, _Handle] = {}
        self._active: dict[pycurl.Curl, _Transfer] = {}
        self._next_idle_check = 0.0
        self._sleeping = False  # in `_wait`'s poll: a submit must wake it
        # libcurl's socket interface: it says which sockets to watch for
        # what (`_on_socket`) and when its next timeout is (`_on_timer`);
        # each turn acts on the sockets epoll found ready, so a turn costs
        # the transfers that moved, not every transfer in flight.
        self._epoll = select.epoll()
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._watched: dict[int, int] = {}  # socket -> epoll mask
        self._timer: float | None = None  # time.monotonic() of libcurl's next timeout
        self._multi.setopt(pycurl.M_SOCKETFUNCTION, self._on_socket)
        self._multi.setopt(pycurl.M_TIMERFUNCTION, self._on_timer)

    # ------------------------------------------------------------- callers
    def submit(self, request: Request, done: Callable[[Response | OSError], None]) -> None:
        """Queue `request`; `done` gets its answer on the engine's thread."""
        self.submit_many([(request, done)])

    def submit_many(self, batch: list[tuple[Request, Callable[[Response | OSError], None]]]) -> None:
        """Queue several requests at once (one lock round and at most one
        wake-up for all); each `done` gets its answer on the engine's thread."""
        transfers = [_Transfer(request, done) for request, done in batch]
        with self._lock:
            if self._closed:
                raise OSError(errno.ESHUTDOWN, "the HTTP engine is closed")
            self._queue.extend(transfers)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="curl-engine", daemon=True)
                self._thread.start()
            # Only a loop about to sleep needs the pipe, once: a busy one
            # takes the queue at its next turn (see `_wait`).
            wake, self._sleeping = self._sleeping, False
        if wake:
            self._wake()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._wake()
        if thread is not None:
            thread.join(timeout=10)
        if thread is None or not thread.is_alive():
            self._epoll.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the loop wakes anyway
        except OSError:
            pass  # closed

    # ---------------------------------------------------------------- loop
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    closed = self._closed
                if closed:
                    break
                self._start_queued()
                self._act(self._wait())
                self._finish_done()
                self._expire_idle()
        except Exception:  # noqa: BLE001 - a bug here must not hang every caller
            log.exception("HTTP engine failed")
        finally:
            self._abort_all()

    def _expire_idle(self) -> None:
        """End the transfers silent for their `idle_timeout` (checked every
        `IDLE_CHECK_SECONDS`): a server that took the request and never
        answers, as libcurl's own speed check is not reliable for that."""
        now = time.monotonic()
        if now < self._next_idle_check:
            return
        self._next_idle_check = now + IDLE_CHECK_SECONDS
        for curl, t in list(self._active.items()):
            if now - t.last_activity > t.request.idle_timeout:
                self._release(curl)
                self._call(t, OSError(errno.ETIMEDOUT, "no answer for %.1fs" % t.request.idle_timeout))

    def _on_socket(self, what: int, sock: int, _multi, _data) -> None:
        """libcurl's SOCKETFUNCTION: watch `sock` for what it says."""
        if what == pycurl.POLL_REMOVE:
            if self._watched.pop(sock, None) is not None:
                try:
                    self._epoll.unregister(sock)
                except OSError:
                    pass  # closed already: epoll forgot it then
            return
        mask = _EPOLL_MASKS.get(what, 0)
        try:
            if sock in self._watched:
                self._epoll.modify(sock, mask)
            else:
                self._epoll.register(sock, mask)
        except FileNotFoundError:  # a new socket with a closed one's number
            self._epoll.register(sock, mask)
        self._watched[sock] = mask

    def _on_timer(self, timeout_ms: int) -> None:
        """libcurl's TIMERFUNCTION: its next timeout (-1: none)."""
        self._timer = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000.0

    def _act(self, events: list[tuple[int, int]]) -> None:
        """Hand libcurl the sockets epoll found ready, and its timeout when
        due."""
        multi = self._multi
        for sock, ev in events:
            if sock == self._wake_r:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                continue
            flags = 0
            if ev & select.EPOLLIN:
                flags |= pycurl.CSELECT_IN
            if ev & select.EPOLLOUT:
                flags |= pycurl.CSELECT_OUT
            if ev & (select.EPOLLERR | select.EPOLLHUP):
                flags |= pycurl.CSELECT_ERR
            multi.socket_action(sock, flags)
        if self._timer is not None and time.monotonic() >= self._timer:
            self._timer = None
            multi.socket_action(pycurl.SOCKET_TIMEOUT, 0)

    def _wait(self) -> list[tuple[int, int]]:
        """The ready sockets, waiting until one is ready, libcurl's next
        timeout, or a wake-up."""
        if self._timer is not None:
            timeout = max(0.0, self._timer - time.monotonic())
            if self._active:
                timeout = min(timeout, IDLE_CHECK_SECONDS)
        else:
            timeout = IDLE_CHECK_SECONDS if self._active else -1
        if timeout == 0:
            return []
        with self._lock:
            if (self._queue and len(self._active) < self.max_in_flight) or self._closed:
                return []  # queued before `_sleeping` was seen: no wake-up coming
            self._sleeping = True
        try:
            return self._epoll.poll(timeout)
        except InterruptedError:
            return []
        finally:
            with self._lock:
                self._sleeping = False

    def _start_queued(self) -> None:
        while len(self._active) < self.max_in_flight:
            with self._lock:
                if not self._queue:
                    return
                transfer = self._queue.popleft()
            curl = self._free.pop() if self._free else self._new_handle()
            try:
                self._prepare(curl, transfer)
            except pycurl.error as e:
                self._handles[curl].settings = None  # set up in part: all again next time
                self._free.append(curl)
                self._call(transfer, OSError(errno.EINVAL, "bad request: %s" % (e,)))
                continue
            self._active[curl] = transfer
            self._multi.add_handle(curl)

    def _new_handle(self) -> pycurl.Curl:
        curl = pycurl.Curl()
        curl.setopt(pycurl.NOSIGNAL, 1)
        curl.setopt(pycurl.TCP_NODELAY, 1)
        curl.setopt(pycurl.ACCEPT_ENCODING, None)  # the bytes as stored, never re-encoded
        curl.setopt(pycurl.BUFFERSIZE, RECEIVE_BUFFER)
        handle = self._handles[curl] = _Handle()

        def write(data: bytes):
            t = handle.transfer
            t.last_activity = time.monotonic()
            t.size += len(data)
            if t.status // 100 != 2:  # an error's body: kept up to a bound
                if t.size <= ERROR_BODY_MAX:
                    t.chunks.append(data)
                return None
            max_bytes = t.request.max_bytes
            if max_bytes is not None and t.size > max_bytes:
                t.too_large = True
                return 0  # aborts the transfer
            t.chunks.append(data)
            return None

        def header(line: bytes):
            # Only the status line, Content-Length and ETag matter, and
            # bytes tests keep this call per header line cheap.
            t = handle.transfer
            if line[:5] == b"HTTP/":
                parts = line.split()
                t.status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
                t.etag = None  # a redirect's or a 100's headers came first
                t.last_activity = time.monotonic()
            elif line[:5].lower() == b"etag:":
                t.etag = line[5:].strip().decode("latin-1")
            elif line[:15].lower() == b"content-length:" and t.request.max_bytes is not None \
                    and t.status // 100 == 2:
                value = line[15:].strip()
                if value.isdigit() and int(value) > t.request.max_bytes:
                    t.too_large, t.declared = True, int(value)
                    return 0  # aborts before the body
            return None

        curl.setopt(pycurl.WRITEFUNCTION, write)
        curl.setopt(pycurl.HEADERFUNCTION, header)
        return curl

    def _prepare(self, curl: pycurl.Curl, t: _Transfer) -> None:
        """Set the handle up for `t`: its URL, and what differs from the
        handle's last request (a backend's requests share their signing,
        headers and time limits, so usually nothing else)."""
        r = t.request
        handle = self._handles[curl]
        handle.transfer = t
        curl.setopt(pycurl.URL, r.url)
        settings = (r.sigv4, r.headers, r.connect_timeout, r.timeout)
        if settings != handle.settings:
            handle.settings = None
            if r.sigv4 is not None:
                spec, access_key, secret = r.sigv4
                curl.setopt(pycurl.AWS_SIGV4, spec)
                curl.setopt(pycurl.USERNAME, access_key)
                curl.setopt(pycurl.PASSWORD, secret)
            # (A backend signs all its requests or none: a handle never needs
            # its signing options unset.)
            curl.setopt(pycurl.HTTPHEADER, r.headers + ["Expect:"])
            curl.setopt(pycurl.CONNECTTIMEOUT_MS, int(r.connect_timeout * 1000))
            curl.setopt(pycurl.TIMEOUT_MS, int(r.timeout * 1000))
            handle.settings = settings
        t.last_activity = time.monotonic()
        if r.method == "GET":
            if handle.method != "GET":
                curl.setopt(pycurl.HTTPGET, 1)
        elif r.method == "HEAD":
            curl.setopt(pycurl.NOBODY, 1)
        elif r.method == "PUT":
            curl.setopt(pycurl.UPLOAD, 1)
            body = r.body or b""
            curl.setopt(pycurl.INFILESIZE_LARGE, len(body))
            view = memoryview(body)
            pos = [0]

            def read(size: int) -> bytes:
                t.last_activity = time.monotonic()
                start = pos[0]
                pos[0] = start + size
                return bytes(view[start:start + size])

            curl.setopt(pycurl.READFUNCTION, read)
        else:
            raise pycurl.error("unsupported method %s" % r.method)
        handle.method = r.method

    def _finish_done(self) -> None:
        multi = self._multi
        while True:
            queued, ok, failed = multi.info_read()
            for curl in ok:
                t = self._release(curl)
                status = curl.getinfo(pycurl.RESPONSE_CODE)
                self._call(t, Response(status, b"".join(t.chunks), t.etag))
            for curl, code, message in failed:
                t = self._release(curl)
                if t.too_large:
                    self._call(t, BodyTooLarge(t.request.max_bytes or 0, t.declared))
                else:
                    self._call(t, transport_error(code, message))
            if not queued:
                return

    def _release(self, curl: pycurl.Curl) -> _Transfer:
        self._multi.remove_handle(curl)
        t = self._active.pop(curl)
        if t.request.method == "HEAD":
            curl.setopt(pycurl.NOBODY, 0)
        elif t.request.method == "PUT":
            curl.setopt(pycurl.UPLOAD, 0)
        self._handles[curl].transfer = None
        self._free.append(curl)
        return t

    def _call(self, t: _Transfer, result: Response | OSError) -> None:
        try:
            t.done(result)
        except Exception:  # noqa: BLE001 - one caller's bug stays its own
            log.exception("HTTP engine: completion callback failed for %s", t.request.url)

    def _abort_all(self) -> None:
        for curl, t in list(self._active.items()):
            self._multi.remove_handle(curl)
            self._call(t, OSError(errno.ESHUTDOWN, "the HTTP engine is closed"))
        self._active.clear()
        with self._lock:
            queued, self._queue = list(self._queue), deque()
            self._closed = True
        for t in queued:
            self._call(t, OSError(errno.ESHUTDOWN, "the HTTP engine is closed"))
        for curl in self._free:
            curl.close()
        self._free.clear()
        self._handles.clear()
        self._multi.close()
