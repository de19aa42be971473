"""A latency-adding TCP proxy that counts S3 requests and bytes.

Every system under test (the verneuil mount, s3fs, rclone, the copier,
`verneuilctl restore`, plain boto3) reaches moto through one of these, so
their GETs and bytes are counted by the same meter and all pay the same
added round trip.

- `latency` seconds are slept before forwarding each new request (the first
  client bytes after the server last spoke), as tests/s3server.py's proxy;
- both sockets get TCP_NODELAY (without it every request stalls ~40 ms on
  delayed ACKs, DESIGN.md);
- a request is counted when those first bytes start with an HTTP method; a
  GET whose path names an object (`/bucket/key`, path-style) counts as
  "GET", a GET of a bucket (listings) as "LIST";
- `bytes_down` counts every byte moto sent to clients (headers included),
  `bytes_up` every byte clients sent.

Binds 127.0.0.1 only.  `close()` stops the listener and every connection.
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time

HOST = "127.0.0.1"
BUFFER = 256 * 1024
METHODS = (b"GET", b"PUT", b"HEAD", b"POST", b"DELETE")


class _Conn:
    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.server_spoke = True
        self.pending = 2
        self.lock = threading.Lock()


def classify(first: bytes) -> str | None:
    """The counter name for a request starting with `first` (None: not a
    request start, e.g. a body sent after `100 Continue`)."""
    line = first.split(b"\r\n", 1)[0]
    parts = line.split(b" ")
    if len(parts) != 3 or parts[0] not in METHODS or not parts[2].startswith(b"HTTP/"):
        return None
    method = parts[0].decode()
    if method != "GET":
        return method
    path = parts[1].split(b"?", 1)[0]
    segments = [s for s in path.split(b"/") if s]
    return "GET" if len(segments) >= 2 else "LIST"


class CountingProxy:
    """Forwards HOST:port to HOST:target_port, adding latency and counting."""

    def __init__(self, target_port: int, latency: float = 0.0) -> None:
        self.target_port = target_port
        self.latency = latency
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._bytes = {"down": 0, "up": 0}
        self._sockets: set[socket.socket] = set()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((HOST, 0))
        self._listener.listen(256)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="bench-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return "http://%s:%d" % (HOST, self.port)

    # -- counters ---------------------------------------------------------
    def snapshot(self) -> dict:
        with self._lock:
            out = dict(self._counts)
            out["bytes_down"] = self._bytes["down"]
            out["bytes_up"] = self._bytes["up"]
            return out

    @staticmethod
    def delta(before: dict, after: dict) -> dict:
        """Counts between two snapshots: requests (all methods), GETs
        (object GETs), LISTs, HEADs, PUTs, bytes down/up."""
        keys = set(before) | set(after)
        d = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
        requests = sum(v for k, v in d.items() if not k.startswith("bytes_"))
        return {"requests": requests, "gets": d.get("GET", 0), "lists": d.get("LIST", 0),
                "heads": d.get("HEAD", 0), "puts": d.get("PUT", 0) + d.get("POST", 0),
                "bytes_down": d.get("bytes_down", 0), "bytes_up": d.get("bytes_up", 0)}

    # -- plumbing ---------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((HOST, self.target_port), timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._sockets.update((client, upstream))
            conn = _Conn(client, upstream)
            for request in (True, False):
                threading.Thread(target=self._pump, args=(conn, request), daemon=True).start()

    def _pump(self, conn: _Conn, request: bool) -> None:
        src, dst = (conn.client, conn.upstream) if request else (conn.upstream, conn.client)
        key = "up" if request else "down"
        try:
            while True:
                data = src.recv(BUFFER)
                if not data:
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    break
                if request:
                    if conn.server_spoke:
                        kind = classify(data[:4096])
                        if kind is not None:
                            with self._lock:
                                self._counts[kind] = self._counts.get(kind, 0) + 1
                        if self.latency > 0:
                            time.sleep(self.latency)
                    conn.server_spoke = False
                else:
                    conn.server_spoke = True
                with self._lock:
                    self._bytes[key] += len(data)
                dst.sendall(data)
        except OSError:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        with conn.lock:
            conn.pending -= 1
            last = conn.pending == 0
        if last:
            with self._lock:
                self._sockets.discard(conn.client)
                self._sockets.discard(conn.upstream)
            conn.client.close()
            conn.upstream.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets, self._sockets = self._sockets, set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
