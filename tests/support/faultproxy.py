"""A fault-injecting HTTP proxy for tests: 127.0.0.1 in front of moto's S3 server.

Unlike the byte pump of `s3server.Proxy`, this proxy understands HTTP/1.1
framing (Content-Length and chunked bodies, `Expect: 100-continue`,
keep-alive towards the client), so it can count requests and break each one
in a chosen way:

    proxy = FaultProxy(s3_server.moto_endpoint)     # starts listening
    proxy.endpoint                                  # http://127.0.0.1:PORT
    proxy.set_faults(0.3, ["500", "cut_body"], seed=1, match=lambda r: r.method == "GET")
    proxy.fail_next(2, "slowdown")                  # the next 2 matching requests
    proxy.clear()                                   # everything passes again
    proxy.requests                                  # [Request(method, path, query, fault, status)]
    proxy.count(method="GET", path_contains=KEY)
    proxy.close()

Fault kinds (`KINDS`):

- ``500`` / ``503`` / ``slowdown``: an S3 XML error (InternalError,
  ServiceUnavailable, SlowDown) answered by the proxy; moto never sees it.
- ``reset``: the connection is closed as soon as the request is read (no
  response; the request never reaches moto).
- ``cut_request``: only half of the request body reaches moto, then both
  connections are closed (an upload dropped mid-body).
- ``lost_response``: the request reaches moto (so a PUT lands), the client
  gets its connection closed instead of the answer.
- ``cut_body``: the response headers and half the body, then the connection
  is closed (a download dropped mid-body).
- ``short_body``: a truncated body with a Content-Length that matches it (a
  complete-looking answer with the wrong bytes: only verification notices).
- ``corrupt``: the body with a few bytes of its second half flipped, same
  length (a zstd frame keeps its header).
- ``stall``: wait `stall` seconds (default 3) before answering normally.
- ``hang``: never answer; the connection stays open until the client gives
  up or the proxy closes.

Every request is recorded, faulted or not.  Only loopback is bound; the
proxy sets TCP_NODELAY on every socket (see docs/DESIGN.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
import socket
import threading
import time
import urllib.parse
from typing import Callable, Iterable, Optional

HOST = "127.0.0.1"

KINDS = ("500", "503", "slowdown", "reset", "cut_request", "lost_response", "cut_body",
         "short_body", "corrupt", "stall", "hang")
# Faults that answer without involving moto at all.
ERROR_STATUS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "ServiceUnavailable", "Service is unable to handle request."),
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
}
# Longest head (request line + headers) accepted, and socket timeouts.
MAX_HEAD = 64 * 1024
UPSTREAM_TIMEOUT = 60.0
CLIENT_IDLE_TIMEOUT = 120.0


@dataclasses.dataclass
class Request:
    method: str
    path: str
    query: str
    fault: Optional[str]
    status: Optional[int] = None
    time: float = 0.0

    @property
    def key(self) -> str:
        """The object key of a path-style request (after the bucket), decoded."""
        parts = self.path.lstrip("/").split("/", 1)
        return urllib.parse.unquote(parts[1]) if len(parts) == 2 else ""

    @property
    def bucket(self) -> str:
        return self.path.lstrip("/").split("/", 1)[0]


@dataclasses.dataclass
class _Rule:
    kinds: list[str]
    rate: float                     # probability per matching request
    match: Optional[Callable[[Request], bool]]
    remaining: Optional[int] = None  # fail_next: how many more


class _Closed(Exception):
    pass


def _recv_until(sock: socket.socket, buf: bytearray, marker: bytes, limit: int) -> int:
    """Read until `marker` is in buf; index just past it.  _Closed on EOF."""
    while True:
        i = buf.find(marker)
        if i >= 0:
            return i + len(marker)
        if len(buf) > limit:
            raise _Closed("head too long")
        data = sock.recv(65536)
        if not data:
            raise _Closed("eof")
        buf += data


def _recv_exact(sock: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        data = sock.recv(max(65536, n - len(buf)))
        if not data:
            raise _Closed("eof in body")
        buf += data
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _parse_head(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if not line:
            continue
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    return lines[0], headers


def _header(headers: list[tuple[str, str]], name: str) -> Optional[str]:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def _read_body(sock: socket.socket, buf: bytearray, headers, *, until_close: bool) -> bytes:
    te = (_header(headers, "transfer-encoding") or "").lower()
    if "chunked" in te:
        out = bytearray()
        while True:
            end = _recv_until(sock, buf, b"\r\n", MAX_HEAD)
            size = int(bytes(buf[:end - 2]).split(b";")[0].strip() or b"0", 16)
            del buf[:end]
            if size == 0:
                end = _recv_until(sock, buf, b"\r\n\r\n", MAX_HEAD) if not buf.startswith(b"\r\n") else 2
                del buf[:end]
                return bytes(out)
            out += _recv_exact(sock, buf, size)
            _recv_exact(sock, buf, 2)
    length = _header(headers, "content-length")
    if length is not None:
        return _recv_exact(sock, buf, int(length))
    if not until_close:
        return b""
    while True:
        data = sock.recv(65536)
        if not data:
            out = bytes(buf)
            buf.clear()
            return out
        buf += data


def _error_xml(code: str, message: str) -> bytes:
    return ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>%s</Code>"
            "<Message>%s</Message><RequestId>faultproxy</RequestId></Error>"
            % (code, message)).encode()


class FaultProxy:
    """HTTP proxy on 127.0.0.1 that forwards to `target` (an http:// URL)
    and injects faults on request (see the module docstring)."""

    def __init__(self, target: str, *, seed: int = 0, stall: float = 3.0) -> None:
        parts = urllib.parse.urlsplit(target)
        self.target = (parts.hostname or HOST, parts.port or 80)
        self.stall = stall
        self.requests: list[Request] = []
        self._rules: list[_Rule] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._closed = threading.Event()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((HOST, 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="faultproxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return "http://%s:%d" % (HOST, self.port)

    # -- configuration ------------------------------------------------------

    def set_faults(self, rate: float, kinds: Iterable[str], *, seed: Optional[int] = None,
                   match: Optional[Callable[[Request], bool]] = None) -> None:
        """From now on each matching request fails with probability `rate`,
        with a kind drawn from `kinds` (replaces earlier rules)."""
        kinds = list(kinds)
        assert kinds and all(k in KINDS for k in kinds), kinds
        with self._lock:
            if seed is not None:
                self._rng.seed(seed)
            self._rules = [_Rule(kinds, rate, match)]

    def fail_next(self, n: int, kind: str, *,
                  match: Optional[Callable[[Request], bool]] = None) -> None:
        """The next `n` matching requests fail with `kind` (before other rules)."""
        assert kind in KINDS, kind
        with self._lock:
            self._rules.insert(0, _Rule([kind], 1.0, match, remaining=n))

    def clear(self) -> None:
        with self._lock:
            self._rules = []

    def reset_counts(self) -> None:
        with self._lock:
            self.requests = []

    def count(self, *, method: Optional[str] = None, path_contains: Optional[str] = None,
              faulted: Optional[bool] = None) -> int:
        with self._lock:
            reqs = list(self.requests)
        n = 0
        for r in reqs:
            if method is not None and r.method != method:
                continue
            if path_contains is not None and path_contains not in urllib.parse.unquote(r.path):
                continue
            if faulted is not None and (r.fault is not None) != faulted:
                continue
            n += 1
        return n

    def _decide(self, req: Request) -> Optional[str]:
        with self._lock:
            for rule in list(self._rules):
                if rule.match is not None and not rule.match(req):
                    continue
                if rule.remaining is not None:
                    rule.remaining -= 1
                    if rule.remaining <= 0:
                        self._rules.remove(rule)
                    return rule.kinds[0]
                if self._rng.random() < rule.rate:
                    return self._rng.choice(rule.kinds)
                return None
        return None

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5)
        with self._lock:
            socks, self._sockets = self._sockets, set()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _track(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._sockets.add(sock)

    def _untrack(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        with contextlib.suppress(OSError):
            sock.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._track(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    # -- one client connection -------------------------------------------------

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(CLIENT_IDLE_TIMEOUT)
        buf = bytearray()
        try:
            while not self._closed.is_set():
                end = _recv_until(client, buf, b"\r\n\r\n", MAX_HEAD)
                head = bytes(buf[:end])
                del buf[:end]
                request_line, headers = _parse_head(head)
                method, target, _version = (request_line.split(" ", 2) + ["", ""])[:3]
                if (_header(headers, "expect") or "").lower() == "100-continue":
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    headers = [(k, v) for k, v in headers if k.lower() != "expect"]
                body = _read_body(client, buf, headers, until_close=False)
                parts = urllib.parse.urlsplit(target)
                req = Request(method, parts.path, parts.query, None, time=time.monotonic())
                req.fault = self._decide(req)
                with self._lock:
                    self.requests.append(req)
                keep = self._handle(client, req, method, target, headers, body)
                if not keep or (_header(headers, "connection") or "").lower() == "close":
                    return
        except (_Closed, OSError, ValueError):
            return
        finally:
            self._untrack(client)

    def _handle(self, client, req: Request, method, target, headers, body) -> bool:
        """Answer one request; False if the client connection must close."""
        fault = req.fault
        if fault in ERROR_STATUS:
            status, code, message = ERROR_STATUS[fault]
            payload = _error_xml(code, message)
            req.status = status
            client.sendall(("HTTP/1.1 %d Error\r\nContent-Type: application/xml\r\n"
                            "Content-Length: %d\r\n\r\n" % (status, len(payload))).encode() + payload)
            return True
        if fault == "reset":
            return False
        if fault == "hang":
            self._closed.wait(UPSTREAM_TIMEOUT)
            return False
        if fault == "cut_request":
            self._forward(method, target, headers, body, cut=True)
            return False
        status, rheaders, rbody = self._forward(method, target, headers, body)
        req.status = status
        if fault == "lost_response":
            return False
        if fault == "stall":
            if self._closed.wait(self.stall):
                return False
        length = len(rbody)
        if method == "HEAD":
            length = int(_header(rheaders, "content-length") or 0)
        out_body = rbody
        if fault == "short_body" and rbody:
            out_body = rbody[: len(rbody) // 2]
            length = len(out_body)
        elif fault == "corrupt" and rbody:
            # Past any header (a zstd frame still starts with its magic), so
            # that only a check of the content itself can notice.
            b = bytearray(rbody)
            for i in range(len(b) // 2, len(b), max(1, len(b) // 8)):
                b[i] ^= 0x5A
            out_body = bytes(b)
        drop = {"connection", "transfer-encoding", "content-length", "keep-alive"}
        lines = ["HTTP/1.1 %d %s" % (status, "OK" if status < 400 else "Error")]
        lines += ["%s: %s" % (k, v) for k, v in rheaders if k.lower() not in drop]
        lines.append("Content-Length: %d" % length)
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if fault == "cut_body" and out_body:
            client.sendall(head + out_body[: len(out_body) // 2])
            return False
        client.sendall(head + (b"" if method == "HEAD" else out_body))
        return True

    def _forward(self, method, target, headers, body, cut: bool = False):
        up = socket.create_connection(self.target, timeout=UPSTREAM_TIMEOUT)
        self._track(up)
        try:
            drop = {"connection", "transfer-encoding", "content-length", "keep-alive", "expect"}
            lines = ["%s %s HTTP/1.1" % (method, target)]
            lines += ["%s: %s" % (k, v) for k, v in headers if k.lower() not in drop]
            if body or method in ("PUT", "POST"):
                lines.append("Content-Length: %d" % len(body))
            lines.append("Connection: close")
            head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
            if cut:
                up.sendall(head + body[: len(body) // 2])
                time.sleep(0.05)
                return None
            up.sendall(head + body)
            buf = bytearray()
            end = _recv_until(up, buf, b"\r\n\r\n", MAX_HEAD)
            status_line, rheaders = _parse_head(bytes(buf[:end]))
            del buf[:end]
            status = int(status_line.split(" ", 2)[1])
            if method == "HEAD" or status in (204, 304) or status < 200:
                rbody = b""
            else:
                rbody = _read_body(up, buf, rheaders, until_close=True)
            return status, rheaders, rbody
        finally:
            self._untrack(up)
