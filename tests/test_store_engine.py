"""store/curl.py and the S3 backend's engine path (object GETs and PUTs
through libcurl's multi interface), against real servers: moto's S3 (with
its signature checks on), and small HTTP servers of the test's own for
answers moto never gives (no Content-Length, no answer at all)."""
from __future__ import annotations

import errno
import http.server
import os
import socket
import threading
import time

import pytest

from verneuil_fuse.store import BucketNotFound, NotFound, StoreError, TooLarge, TransientError, open_store
from verneuil_fuse.store.base import AccessDenied
from verneuil_fuse.store.curl import BodyTooLarge, CurlEngine, Request, Response

pytestmark = pytest.mark.s3

KEY = "0123456789abcdef%2F0123456789abcdef"


def wait(engine: CurlEngine, request: Request, timeout: float = 30.0):
    box = []
    done = threading.Event()
    engine.submit(request, lambda r: (box.append(r), done.set()))
    assert done.wait(timeout)
    return box[0]


def test_engine_path_serves_gets_puts_and_errors(s3_store):
    backend = s3_store.chunks
    backend.put(KEY, b"x" * 70000)
    assert backend._engine is not None and backend.use_engine  # the engine served it
    assert backend.get(KEY) == b"x" * 70000
    assert backend.get(KEY, max_bytes=70000) == b"x" * 70000
    with pytest.raises(TooLarge) as e:
        backend.get(KEY, max_bytes=69999)
    assert e.value.size == 70000 and e.value.bound == 69999
    with pytest.raises(NotFound):
        backend.get(KEY + "0", max_bytes=10)  # an error body longer than the bound
    # What the reader's chunk engine gets: the URL and signing of the same
    # GETs, and the StoreError each failure means.
    gets = backend.direct_gets()
    assert gets.url(KEY) == backend._engine_build(backend._engine_auth(), "GET", KEY, None, None, None).url
    assert gets.url(KEY).endswith("/" + KEY.replace("%", "%25")) and gets.sigv4[0] == "aws:amz:us-east-1:s3"
    assert isinstance(backend.direct_get_error(KEY, Response(404, b"<Code>NoSuchKey</Code>"), 10), NotFound)
    assert isinstance(backend.direct_get_error(KEY, BodyTooLarge(10, 70000), 10), TooLarge)
    assert isinstance(backend.direct_get_error(KEY, OSError(errno.ECONNRESET, "reset"), 10), TransientError)
    backend.use_engine = False
    assert backend.direct_gets() is None


def test_put_async_answers_on_the_engine_thread(s3_server, s3_store):
    """put_async: None once stored, a StoreError otherwise, on the engine's
    thread; False, with nothing sent, where the engine is not available."""
    answers = []
    ready = threading.Event()

    def done(answer):
        answers.append((answer, threading.current_thread().name))
        ready.set()

    assert s3_store.chunks.put_async(KEY, b"y" * 70000, done)
    assert ready.wait(30)
    assert answers == [(None, "curl-engine")]
    assert s3_store.chunks.get(KEY) == b"y" * 70000
    missing = open_store(s3_server.url("no-such-bucket-%d" % os.getpid(), "no-such-manifests-%d" % os.getpid()))
    try:
        ready.clear()
        assert missing.chunks.put_async(KEY, b"data", done)
        assert ready.wait(30)
        assert isinstance(answers[-1][0], BucketNotFound) and answers[-1][1] == "curl-engine"
        missing.chunks.use_engine = False
        assert not missing.chunks.put_async(KEY, b"data", done)
    finally:
        missing.close()


def test_engine_missing_bucket_and_creation_on_demand(s3_server):
    # A name of this test's own: the bucket exists once created on demand.
    url = s3_server.url("engine-on-demand-%d" % os.getpid(), s3_server.new_bucket("m", versioned=True))
    store = open_store(url)
    try:
        with pytest.raises(BucketNotFound):
            store.chunks.get(KEY)
        with pytest.raises(BucketNotFound):
            store.chunks.put(KEY, b"data")
    finally:
        store.close()
    store = open_store(url + "&create_buckets_on_demand=true")
    try:
        store.chunks.put(KEY, b"data")  # boto3's path creates the bucket
        assert store.chunks.get(KEY) == b"data"
    finally:
        store.close()


def test_libcurl_signs_what_s3_checks(aws_env, tmp_path):
    """moto with its signature checks on: the engine's GETs and PUTs, signed
    by libcurl with the keys botocore's chain gives, are accepted; with a
    wrong secret they are refused as access denied, never retried as
    transient."""
    import boto3

    from support.s3server import S3Server
    with S3Server(auth=True, free_actions=3, log_dir=str(tmp_path)) as server:
        from support.s3server import patched_environ
        good = server.user_credentials("replicas")
        with patched_environ(good):
            s3 = boto3.session.Session().client(
                "s3", endpoint_url=server.moto_endpoint, region_name="us-east-1",
                aws_access_key_id=good["AWS_ACCESS_KEY_ID"], aws_secret_access_key=good["AWS_SECRET_ACCESS_KEY"])
            s3.create_bucket(Bucket="signed-chunks")
            s3.create_bucket(Bucket="signed-manifests")
            url = server.url("signed-chunks", "signed-manifests")
            store = open_store(url)
            try:
                store.chunks.put(KEY, b"signed bytes")
                assert store.chunks.get(KEY) == b"signed bytes"
                assert store.chunks._engine is not None and store.chunks.use_engine
            finally:
                store.close()
        with patched_environ(dict(good, AWS_SECRET_ACCESS_KEY="not-the-secret")):
            store = open_store(url)
            try:
                start = time.monotonic()
                with pytest.raises(AccessDenied):
                    store.chunks.get(KEY)
                with pytest.raises(AccessDenied):
                    store.chunks.put(KEY, b"forged")
                assert time.monotonic() - start < 10
                assert store.chunks._engine is not None
            finally:
                store.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    mode = "chunked"

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.mode == "hang":
            time.sleep(5)
            return
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for _ in range(100):  # 100 KB in 1 KB pieces, no Content-Length
            self.wfile.write(b"400\r\n" + b"y" * 1024 + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args):
        pass


@pytest.fixture(params=["chunked", "hang"])
def odd_server(request):
    handler = type("Handler", (_Handler,), {"mode": request.param})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield request.param, "http://127.0.0.1:%d/x" % server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_engine_bounds_bodies_without_length_and_silent_servers(odd_server):
    mode, url = odd_server
    engine = CurlEngine()
    try:
        if mode == "chunked":
            answer = wait(engine, Request("GET", url, [], max_bytes=10_000))
            assert isinstance(answer, BodyTooLarge) and answer.size is None
            answer = wait(engine, Request("GET", url, [], max_bytes=200_000))
            assert isinstance(answer, Response) and answer.status == 200 and answer.body == b"y" * 102400
        else:
            start = time.monotonic()
            answer = wait(engine, Request("GET", url, [], idle_timeout=0.5, timeout=30))
            assert isinstance(answer, OSError) and not isinstance(answer, BodyTooLarge)
            assert 0.4 < time.monotonic() - start < 3
    finally:
        engine.close()


def test_engine_refused_and_closed():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    engine = CurlEngine()
    answer = wait(engine, Request("GET", "http://127.0.0.1:%d/x" % port, [], connect_timeout=2))
    assert isinstance(answer, OSError)
    engine.close()
    with pytest.raises(OSError):
        engine.submit(Request("GET", "http://127.0.0.1:%d/x" % port, []), lambda r: None)


def test_transient_errors_come_back_as_transient(s3_server):
    """A stopped endpoint: the engine's GET is a TransientError (the
    fetcher's and the copier's retry loops then retry it)."""
    url = s3_server.url(s3_server.new_bucket("c"), s3_server.new_bucket("m", versioned=True))
    store = open_store(url, connect_timeout=1.0, max_attempts=1)
    try:
        store.chunks.put(KEY, b"z")
        s3_server.stop()
        try:
            with pytest.raises(TransientError):
                store.chunks.get(KEY)
        finally:
            s3_server.start()
        assert store.chunks.get(KEY) == b"z"
    finally:
        store.close()
    assert issubclass(TransientError, StoreError)
