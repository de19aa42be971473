"""reader/chunk_engine.py (csrc/chunk_engine.c): chunk GETs in C, decoded,
verified and written to the disk cache on the engine's thread, against real
servers: moto's S3 (with its signature checks on, too), and small HTTP
servers of the test's own for answers moto never gives (bodies over the
bound, no answer at all)."""
from __future__ import annotations

import errno
import http.server
import os
import socket
import threading

import pytest
import trio

from verneuil_fuse.format import CHUNK_SIZE, MAX_CHUNK_BLOB_BYTES, compress_chunk, fingerprint
from verneuil_fuse.reader.cache import ChunkCache
from verneuil_fuse.reader.chunk_engine import ChunkEngine
from verneuil_fuse.store import AccessDenied, NotFound, open_store
from verneuil_fuse.store.curl import BodyTooLarge, Response


def gather(engine: ChunkEngine, n: int, limit: float = 30.0) -> dict:
    """The outcomes of ``n`` GETs, by token."""
    async def go():
        got = {}
        with trio.fail_after(limit):
            while len(got) < n:
                got.update(await engine.answers())
        return got

    return trio.run(go)


def start(engine: ChunkEngine, backend, gets) -> None:
    """Start ``gets`` (token, key, fingerprint, target) on the backend's
    URLs and signing."""
    d = backend.direct_gets()
    engine.set_auth(d.headers, d.sigv4, d.connect_timeout, d.idle_timeout)
    engine.start([(token, d.url(key), fp, target, 10.0) for token, key, fp, target in gets])


def test_chunks_are_verified_and_written_into_their_cache_slots(s3_store, tmp_path):
    """zstd and raw chunks, a short last chunk: verified bytes, written by
    the engine into their slots with their index records (the cache reads
    them back, verified); a body that is not its chunk, a missing chunk:
    errors, nothing written."""
    backend = s3_store.chunks
    full, other, short = os.urandom(CHUNK_SIZE), os.urandom(CHUNK_SIZE), os.urandom(1000)
    fps = {name: fingerprint(data) for name, data in (("full", full), ("other", other), ("short", short))}
    backend.put(fps["full"].name, compress_chunk(full))
    backend.put(fps["short"].name, short)  # raw, as a writer may store it
    lie = fingerprint(b"x" * 10)
    backend.put(lie.name, compress_chunk(other))  # bytes that are not the chunk named
    cache = ChunkCache(str(tmp_path / "cache"), 1 << 26)
    cache.put(fps["other"], other)  # the segment's files exist from now on
    slots = {name: cache.reserve() for name in ("full", "short", "lie")}
    targets = {"full": slots["full"].target(fps["full"]), "short": slots["short"].target(fps["short"]),
               "lie": slots["lie"].target(lie)}
    assert all(t is not None for t in targets.values())
    assert cache.reserve().target(fps["other"]) is None  # cached already: nothing to write
    engine = ChunkEngine(8, MAX_CHUNK_BLOB_BYTES)
    try:
        start(engine, backend, [("full", fps["full"].name, fps["full"], targets["full"]),
                                ("short", fps["short"].name, fps["short"], targets["short"]),
                                ("lie", lie.name, lie, targets["lie"]),
                                ("missing", fps["other"].name, fps["other"], None)])
        got = gather(engine, 4)
        assert engine.free == 8
    finally:
        engine.close()
    assert got["full"].data == full and got["full"].written and got["full"].size == len(compress_chunk(full))
    assert got["short"].data == short and got["short"].written and got["short"].size == 1000
    assert got["lie"].mismatch and got["lie"].data is None and not got["lie"].written
    missing = got["missing"].failure
    assert isinstance(missing, Response) and missing.status == 404
    assert isinstance(backend.direct_get_error(fps["other"].name, missing, MAX_CHUNK_BLOB_BYTES), NotFound)
    for name in ("full", "short"):
        assert slots[name].written(fps[name], len(got[name].data), True, 0)
    slots["lie"].abandon()
    assert cache.get(fps["full"]) == full and cache.get(fps["short"]) == short
    # A new process's cache finds them from the records the engine wrote.
    again = ChunkCache(str(tmp_path / "cache"), 1 << 26)
    assert again.get(fps["full"]) == full and again.get(fps["short"]) == short and again.get(lie) is None


def test_a_failed_cache_write_is_reported_and_pauses_the_cache(s3_store, tmp_path):
    """A target the engine cannot write (here a read-only descriptor): the
    chunk is still served, its errno reported; the cache pauses its
    writes, as for its own failed writes."""
    backend = s3_store.chunks
    data = os.urandom(CHUNK_SIZE)
    fp = fingerprint(data)
    backend.put(fp.name, compress_chunk(data))
    cache = ChunkCache(str(tmp_path / "cache"), 1 << 26)
    cache.put(fingerprint(b"first"), b"first")
    slot = cache.reserve()
    fd, idx_fd, off = slot.target(fp)
    readonly = os.open(os.path.join(cache._dir, os.listdir(cache._dir)[0]), os.O_RDONLY)
    engine = ChunkEngine(2, MAX_CHUNK_BLOB_BYTES)
    try:
        start(engine, backend, [("t", fp.name, fp, (readonly, idx_fd, off))])
        outcome = gather(engine, 1)["t"]
    finally:
        engine.close()
        os.close(readonly)
    assert outcome.data == data and not outcome.written and outcome.write_errno == errno.EBADF
    assert slot.written(fp, len(data), False, outcome.write_errno)
    assert cache.describe()["writes_paused"] and cache.get(fp) is None


def test_signed_gets_are_accepted_by_moto_checking_signatures(tmp_path):
    """libcurl's SigV4 (the system's libcurl, not pycurl's) with the keys
    botocore's chain gives: moto with its signature checks on serves the
    chunk; a wrong secret is refused as access denied."""
    import boto3

    from support.s3server import S3Server, patched_environ
    data = os.urandom(CHUNK_SIZE)
    fp = fingerprint(data)
    with S3Server(auth=True, free_actions=3, log_dir=str(tmp_path)) as server:
        good = server.user_credentials("reader")
        s3 = boto3.session.Session().client(
            "s3", endpoint_url=server.moto_endpoint, region_name="us-east-1",
            aws_access_key_id=good["AWS_ACCESS_KEY_ID"], aws_secret_access_key=good["AWS_SECRET_ACCESS_KEY"])
        s3.create_bucket(Bucket="signed-chunks")
        with patched_environ(good):
            store = open_store(server.url("signed-chunks"))
            store.chunks.put(fp.name, compress_chunk(data))
            store.close()
        for env, expect in ((good, "chunk"), (dict(good, AWS_SECRET_ACCESS_KEY="not-the-secret"), "denied")):
            with patched_environ(env):
                store = open_store(server.url("signed-chunks"))
                engine = ChunkEngine(2, MAX_CHUNK_BLOB_BYTES)
                try:
                    start(engine, store.chunks, [("t", fp.name, fp, None)])
                    outcome = gather(engine, 1)["t"]
                    if expect == "chunk":
                        assert outcome.data == data
                    else:
                        assert isinstance(outcome.failure, Response) and outcome.failure.status == 403
                        error = store.chunks.direct_get_error(fp.name, outcome.failure, MAX_CHUNK_BLOB_BYTES)
                        assert isinstance(error, AccessDenied)
                finally:
                    engine.close()
                    store.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 - http.server's name
        size = 200_000
        if self.path.endswith("/declared"):  # a 2xx body over the bound, its length declared
            self.send_response(200)
            self.send_header("Content-Length", str(size))
        elif self.path.endswith("/chunked"):  # ... and without Content-Length
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
        else:  # an error answer with a body over the bound: kept up to it
            self.send_response(404)
            self.send_header("Content-Length", str(size))
        self.end_headers()
        try:
            if self.path.endswith("/chunked"):
                for _ in range(size // 1000):
                    self.wfile.write(b"3e8\r\n" + b"y" * 1000 + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.wfile.write(b"z" * size)
        except OSError:
            pass  # the client hung up: what a bound does

    def log_message(self, *args):
        pass


def test_bounds_silence_refusal_and_close():
    """A 2xx body over the engine's bound ends as BodyTooLarge (its declared
    length when there is one); an error's body is kept up to the bound; a
    refused connection and a silent server end as OSErrors within the
    request's time limit; `close` ends what is in flight, whose tokens stay
    `in_flight`."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    silent = socket.create_server(("127.0.0.1", 0), backlog=16)  # takes connections, never answers
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    base = "http://127.0.0.1:%d" % server.server_address[1]
    fp = fingerprint(b"any")
    engine = ChunkEngine(8, MAX_CHUNK_BLOB_BYTES)
    try:
        engine.set_auth([], None, 2.0, 15.0)
        engine.start([("declared", base + "/b/declared", fp, None, 10.0), ("chunked", base + "/b/chunked", fp, None, 10.0),
                      ("error", base + "/b/error", fp, None, 10.0),
                      ("refused", "http://127.0.0.1:%d/b/k" % closed_port, fp, None, 10.0),
                      ("silent", "http://127.0.0.1:%d/b/k" % silent.getsockname()[1], fp, None, 0.3)])
        got = gather(engine, 5)
        assert isinstance(got["declared"].failure, BodyTooLarge) and got["declared"].failure.size == 200_000
        assert isinstance(got["chunked"].failure, BodyTooLarge) and got["chunked"].failure.size is None
        error = got["error"].failure
        assert isinstance(error, Response) and error.status == 404 and error.body == b"z" * MAX_CHUNK_BLOB_BYTES
        assert isinstance(got["refused"].failure, ConnectionRefusedError)
        assert isinstance(got["silent"].failure, TimeoutError)
        assert engine.free == 8
        with pytest.raises(ValueError, match="URL longer"):
            engine.start([("long", base + "/" + "k" * 3000, fp, None, 1.0)])
        assert engine.free == 8 and not engine.in_flight()
        engine.start([(n, "http://127.0.0.1:%d/b/%d" % (silent.getsockname()[1], n), fp, None, 30.0) for n in range(3)])
        assert sorted(engine.in_flight()) == [0, 1, 2]
    finally:
        engine.close()
        engine.close()
        server.shutdown()
        server.server_close()
        silent.close()
    assert sorted(engine.in_flight()) == [0, 1, 2]
