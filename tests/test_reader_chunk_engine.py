"""reader/chunk_engine.py (csrc/chunk_engine.c): requests of chunks in C,
decoded, verified and written to the disk cache on the engine's threads:
GETs of chunk objects and range GETs of packs against real servers (moto's
S3, with its signature checks on too, and small HTTP servers of the test's
own for answers moto never gives: bodies over the bound, no answer at all,
ranges ignored or not the asked ones), and reads of a directory store's
chunk files and packs (damaged, cut, missing, not regular files)."""
from __future__ import annotations

import errno
import http.server
import os
import socket
import threading

import pytest
import trio

from verneuil_fuse.format import (CHUNK_SIZE, MAX_CHUNK_BLOB_BYTES, MAX_PACK_BYTES, ChunkError, compress_chunk,
                                  fingerprint)
from verneuil_fuse.reader.cache import ChunkCache
from verneuil_fuse.reader.chunk_engine import ChunkEngine, Part, Read
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
    # Decoded straight into bytes objects of their own, each of the chunk's length.
    assert type(got["full"].data) is bytes and type(got["short"].data) is bytes
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


# -- several chunks per request, and a directory store's files -----------------

def _chunks(n: int) -> list[bytes]:
    """``n`` chunks, compressible and not, the last one short."""
    out = []
    for k in range(n):
        if k % 3 == 0:
            out.append(os.urandom(CHUNK_SIZE))
        else:
            out.append((b"row %06d " % k) * (CHUNK_SIZE // 11) + os.urandom(CHUNK_SIZE % 11))
    out[-1] = out[-1][:5000]
    return out


def _pack(chunks: list[bytes]) -> tuple[bytes, list[tuple[int, int]]]:
    """A pack of ``chunks`` (zstd frames, every fourth raw, as a writer may
    store an incompressible chunk) and each blob's place in it."""
    blobs = [c if k % 4 == 3 else compress_chunk(c) for k, c in enumerate(chunks)]
    places, at = [], 0
    for blob in blobs:
        places.append((at, at + len(blob)))
        at += len(blob)
    return b"".join(blobs), places


def _run_read(where: str, places, fps, start: int, end: int, targets=None, keep=True, file=False) -> Read:
    """The `Read` of the blobs at ``places`` (object offsets) between
    ``start`` and ``end``, tokens their indices."""
    parts = [Part(k, fps[k], lo - start, hi - start, targets[k] if targets else None, keep)
             for k, (lo, hi) in enumerate(places) if start <= lo and hi <= end]
    return Read(where, parts, start, end, 10.0, file)


def _submit_all(engine: ChunkEngine, reads: list[Read], limit: float = 60.0) -> dict:
    """Every read submitted as requests free up; the outcomes by token."""
    async def go():
        got, pending = {}, list(reads)
        expected = sum(len(r.parts) for r in reads)
        with trio.fail_after(limit):
            while len(got) < expected:
                n = min(engine.free, len(pending))
                engine.submit(pending[:n])
                del pending[:n]
                got.update(await engine.answers())
        return got

    return trio.run(go)


def test_file_reads_of_chunk_objects_verify_write_and_refuse(local_store, tmp_path):
    """A directory store's chunk files read by the engine's workers: zstd
    and raw chunks verified, written into their cache slots (one not kept
    in memory); a damaged or truncated file is a mismatch, a file over a
    chunk object's bound too large, and a missing file, a symlink, a
    directory or a FIFO an OSError of its own, never bytes."""
    chunks = {"zstd": os.urandom(CHUNK_SIZE // 2) * 2, "raw": os.urandom(3000), "unkept": os.urandom(CHUNK_SIZE)}
    fps = {name: fingerprint(data) for name, data in chunks.items()}
    backend = local_store.chunks
    backend.put(fps["zstd"].name, compress_chunk(chunks["zstd"]))
    backend.put(fps["raw"].name, chunks["raw"])
    backend.put(fps["unkept"].name, compress_chunk(chunks["unkept"]))
    damaged = bytearray(compress_chunk(chunks["zstd"]))
    damaged[len(damaged) // 2] ^= 0xFF
    bad = {"damaged": bytes(damaged), "truncated": compress_chunk(chunks["unkept"])[:-10],
           "huge": os.urandom(MAX_CHUNK_BLOB_BYTES + 1)}
    for name, blob in bad.items():
        backend.put(name, blob)
    path = {name: os.path.join(backend.root, name) for name in ("damaged", "truncated", "huge", "missing")}
    path.update({name: os.path.join(backend.root, fps[name].name) for name in chunks})
    for name in ("link", "dir", "fifo"):
        path[name] = os.path.join(backend.root, name)
    os.symlink(path["zstd"], path["link"])
    os.mkdir(path["dir"])
    os.mkfifo(path["fifo"])
    cache = ChunkCache(str(tmp_path / "cache"), 1 << 26)
    cache.put(fingerprint(b"first"), b"first")  # the segment's files exist from now on
    slots = {name: cache.reserve() for name in chunks}
    reads = [Read(path[name], [Part(name, fps[name], target=slots[name].target(fps[name]), keep=name != "unkept")],
                  file=True) for name in chunks]
    reads += [Read(path[name], [Part(name, fps["zstd"])], file=True) for name in path if name not in chunks]
    engine = ChunkEngine(4, MAX_CHUNK_BLOB_BYTES, workers=2)
    try:
        got = _submit_all(engine, reads)
        assert engine.free == 4 and not engine.in_flight()
    finally:
        engine.close()
    for name in ("zstd", "raw"):
        assert got[name].data == chunks[name] and got[name].verified and got[name].written
        assert slots[name].written(fps[name], len(chunks[name]), True, 0)
    assert got["raw"].size == 3000
    unkept = got["unkept"]
    assert unkept.verified and unkept.data is None and unkept.written
    assert slots["unkept"].written(fps["unkept"], CHUNK_SIZE, True, 0)
    assert all(cache.get(fps[name]) == data for name, data in chunks.items())
    assert got["damaged"].mismatch and got["truncated"].mismatch and not got["damaged"].verified
    huge = got["huge"].failure
    assert isinstance(huge, BodyTooLarge) and huge.size == MAX_CHUNK_BLOB_BYTES + 1
    errnos = {name: got[name].failure.errno for name in ("missing", "link", "dir", "fifo")}
    assert errnos == {"missing": errno.ENOENT, "link": errno.ELOOP, "dir": errno.EISDIR, "fifo": errno.EINVAL}
    assert got["missing"].failure.filename == path["missing"]
    assert isinstance(backend._error(got["missing"].failure, "read", "missing"), NotFound)


def test_file_range_reads_of_a_pack_split_verify_and_write_each_chunk(local_store, tmp_path):
    """Runs of a pack file, one request each: every chunk verified on its
    own, written into its own cache slot, the same bytes as the store's
    Python read (`Reads.run`); a pack cut short serves the chunks it still
    holds and fails the others (ChunkError), a damaged blob fails only its
    chunk, a range past the end fails every chunk."""
    from verneuil_fuse.format import Run
    from verneuil_fuse.store.reads import Reads

    chunks = _chunks(12)
    fps = [fingerprint(c) for c in chunks]
    pack, places = _pack(chunks)
    backend = local_store.chunks
    backend.put("pack-whole", pack)
    cut = places[7][0] + 100  # inside chunk 7's blob
    backend.put("pack-cut", pack[:cut])
    damaged = bytearray(pack)
    damaged[(places[4][0] + places[4][1]) // 2] ^= 0x55
    backend.put("pack-damaged", bytes(damaged))
    cache = ChunkCache(str(tmp_path / "cache"), 1 << 26)
    cache.put(fingerprint(b"first"), b"first")
    slots = [cache.reserve() for _ in chunks]
    targets = [slot.target(fp) for slot, fp in zip(slots, fps)]
    where = {key: os.path.join(backend.root, key) for key in ("pack-whole", "pack-cut", "pack-damaged")}
    # Two runs of the whole pack: chunks 0-5 (kept) and 6-11 (only cached).
    middle = places[6][0]
    engine = ChunkEngine(4, 1 << 20, max_parts=16, workers=2)
    try:
        whole = _submit_all(engine, [_run_read(where["pack-whole"], places, fps, 0, middle, targets, True, True),
                                     _run_read(where["pack-whole"], places, fps, middle, len(pack), targets, False,
                                               True)])
        cut_short = _submit_all(engine, [_run_read(where["pack-cut"], places, fps, 0, len(pack), file=True)])
        bad = _submit_all(engine, [_run_read(where["pack-damaged"], places, fps, 0, len(pack), file=True)])
        past = _submit_all(engine, [Read(where["pack-cut"], [Part("past", fps[9], 0, places[9][1] - places[9][0])],
                                         places[9][0], places[9][1], file=True)])
    finally:
        engine.close()
    run = Run("pack-whole", 0, len(pack), [(k, lo, hi) for k, (lo, hi) in enumerate(places)])
    python = dict(Reads(local_store).run(run, dict(enumerate(fps))))
    for k, data in enumerate(chunks):
        assert whole[k].verified and whole[k].written and whole[k].size == places[k][1] - places[k][0]
        assert whole[k].data == (data if k < 6 else None)
        assert python[k] == data
        assert slots[k].written(fps[k], len(data), True, 0) and cache.get(fps[k]) == data
    assert [cut_short[k].data == chunks[k] for k in range(12)] == [k < 7 for k in range(12)]
    assert all(isinstance(cut_short[k].failure, ChunkError) for k in range(7, 12))
    assert "cut or replaced" in str(cut_short[8].failure)
    assert [bad[k].mismatch for k in range(12)] == [k == 4 for k in range(12)]
    assert all(bad[k].data == chunks[k] for k in range(12) if k != 4)
    assert isinstance(past["past"].failure, ChunkError)


def test_many_file_reads_in_flight_on_few_workers(local_store):
    """Hundreds of chunk files through a pool of 16 requests on 2 workers:
    every chunk verified and handed back once; malformed requests are
    refused whole (ValueError, nothing started); `close` with reads queued
    ends them (their tokens stay `in_flight`), and nothing after."""
    root = local_store.chunks.root
    chunks = [os.urandom(2000) + bytes([k % 251]) * (CHUNK_SIZE - 2000) for k in range(300)]
    fps = [fingerprint(c) for c in chunks]
    for fp, data in zip(fps, chunks):  # the store's files, written as the store writes them but for fsync
        with open(os.path.join(root, fp.name), "wb") as f:
            f.write(compress_chunk(data))
    reads = [Read(os.path.join(root, fp.name), [Part(k, fp)], file=True) for k, fp in enumerate(fps)]
    engine = ChunkEngine(16, MAX_CHUNK_BLOB_BYTES, max_parts=2, workers=2)
    try:
        got = _submit_all(engine, reads)
        assert len(got) == 300 and all(got[k].data == chunks[k] for k in range(300))
        for bad in (Read("x", [Part(0, fps[0])] * 3, 0, 10, file=True),  # more parts than the engine takes
                    Read("x", [Part(0, fps[0], 0, 20)], 0, 10, file=True),  # a part past the range
                    Read("x", [Part(0, fps[0], 5, 5)], 0, 10, file=True),  # an empty part
                    Read("x", [Part(0, fps[0], 0, 1)], MAX_PACK_BYTES, MAX_PACK_BYTES + 1, file=True),
                    Read("x", [Part(0, fps[0], 0, 2 << 20)], 0, 2 << 20, file=True)):  # over max_body
            with pytest.raises(ValueError):
                engine.submit([reads[0], bad])
            assert engine.free == 16 and not engine.in_flight()
        engine.submit(reads[:16])
    finally:
        engine.close()
    left = engine.in_flight()
    assert set(left) <= set(range(16))
    without_workers = ChunkEngine(2, MAX_CHUNK_BLOB_BYTES)
    try:
        with pytest.raises(ValueError):
            without_workers.submit(reads[:1])
    finally:
        without_workers.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_range_gets_of_a_pack_on_s3(s3_store, tmp_path, workers):
    """Runs of a pack object on moto's S3, one range GET each, finished on
    the engine's HTTP thread or on its workers: every chunk verified on
    its own and written into its cache slot; a range that runs past the
    object's end serves the chunks the object holds and fails the others,
    one that starts past it fails every chunk (ChunkError, as `Reads.run`'s
    short read)."""
    chunks = _chunks(10)
    fps = [fingerprint(c) for c in chunks]
    pack, places = _pack(chunks)
    backend = s3_store.chunks
    backend.put("pack-whole", pack)
    backend.put("pack-cut", pack[:places[6][0] + 10])
    d = backend.direct_gets()
    cache = ChunkCache(str(tmp_path / "cache"), 1 << 26)
    cache.put(fingerprint(b"first"), b"first")
    slots = [cache.reserve() for _ in chunks]
    targets = [slot.target(fp) for slot, fp in zip(slots, fps)]
    engine = ChunkEngine(4, 1 << 20, max_parts=16, workers=workers)
    try:
        engine.set_auth(d.headers, d.sigv4, d.connect_timeout, d.idle_timeout)
        whole = _submit_all(engine, [_run_read(d.url("pack-whole"), places, fps, places[1][0], len(pack), targets)])
        cut = _submit_all(engine, [_run_read(d.url("pack-cut"), places, fps, 0, len(pack))])
        past = _submit_all(engine, [_run_read(d.url("pack-cut"), places, fps, places[8][0], len(pack))])
    finally:
        engine.close()
    assert sorted(whole) == list(range(1, 10)) and all(whole[k].data == chunks[k] and whole[k].written for k in whole)
    assert all(slots[k].written(fps[k], len(chunks[k]), True, 0) and cache.get(fps[k]) == chunks[k] for k in whole)
    slots[0].abandon()
    assert [cut[k].data == chunks[k] for k in range(10)] == [k < 6 for k in range(10)]
    assert all(isinstance(cut[k].failure, ChunkError) for k in range(6, 10))
    assert all(isinstance(past[k].failure, ChunkError) for k in (8, 9))


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    """A pack's bytes (``server.pack``) under answers that break the rules,
    one per path; ``server.sent`` counts the bytes each path's answer got
    out."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 - http.server's name
        pack = self.server.pack
        first, last = (int(x) for x in self.headers["Range"].split("=")[1].split("-"))
        asked = pack[first:last + 1]
        kind = self.path.rsplit("/", 1)[1]
        if kind == "ignores":  # a 200 with the whole object, and more
            status, body, extra = 200, pack + bytes(4 << 20), {}
        elif kind == "other":  # a 206 for other bytes than asked
            status, body, extra = 206, pack[first + 1:last + 2], {"Content-Range": "bytes %d-%d/%d"
                                                                 % (first + 1, last + 1, len(pack))}
        elif kind == "longer":  # the asked range's header, more bytes
            status, body, extra = 206, (pack + bytes(999))[first:last + 1000], {"Content-Range": "bytes %d-%d/%d"
                                                                % (first, last, len(pack))}
        else:  # a 206 without Content-Range
            status, body, extra = 206, asked, {}
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra.items():
            self.send_header(name, value)
        self.end_headers()
        sent = 0
        try:
            for at in range(0, len(body), 65536):
                self.wfile.write(body[at:at + 65536])
                sent += len(body[at:at + 65536])
        except OSError:
            self.close_connection = True
        self.server.sent[kind] = sent

    def log_message(self, *args):
        pass


def test_range_answers_that_break_the_rules():
    """A range GET answered with the whole object (a server that ignores
    Range): the asked bytes are taken from it, verified, and the transfer
    stops at the range's end; a 206 for other bytes, or without its
    Content-Range, is a ChunkError for every chunk; a 206 with more bytes
    than asked is too large, never read past the asked length."""
    chunks = _chunks(6)
    fps = [fingerprint(c) for c in chunks]
    pack, places = _pack(chunks)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RangeHandler)
    server.daemon_threads = True
    server.pack, server.sent = pack, {}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = "http://127.0.0.1:%d/b/" % server.server_address[1]
    start, end = places[1][0], places[4][1]
    engine = ChunkEngine(4, 1 << 20, max_parts=8)
    try:
        engine.set_auth([], None, 2.0, 15.0)
        got = {kind: _submit_all(engine, [_run_read(base + kind, places, fps, start, end)])
               for kind in ("ignores", "other", "longer", "none")}
    finally:
        engine.close()
        server.shutdown()
        server.server_close()
    assert sorted(got["ignores"]) == [1, 2, 3, 4] and all(got["ignores"][k].data == chunks[k] for k in (1, 2, 3, 4))
    assert server.sent["ignores"] < len(pack) + (4 << 20)  # the engine hung up, well before the end
    for kind in ("other", "none"):
        assert all(isinstance(o.failure, ChunkError) and "other bytes" in str(o.failure) for o in got[kind].values())
    assert all(isinstance(o.failure, BodyTooLarge) and o.failure.size == end - start + 999
               for o in got["longer"].values())


def test_runs_of_a_packed_manifest_become_requests(local_store):
    """`format.chunk_runs` of a packed manifest, through `run_reads`, on an
    engine that takes 5 chunks a request: the run of 12 chunks is 3 file
    reads of its pack, every chunk verified; a chunk object of its own is
    a read of its own."""
    from verneuil_fuse import format as fmt
    from verneuil_fuse.reader.chunk_engine import run_reads

    data = b"SQLite format 3\x00" + b"".join(_chunks(14))[16:]
    m, _ = fmt.snapshot_of(data)
    chunks = [data[k * CHUNK_SIZE:(k + 1) * CHUNK_SIZE] for k in range(len(m.chunks))]
    pack, places = _pack(chunks[1:13])  # chunk 0 is bundled, chunk 13 an object of its own
    space, name = fmt.Fprint(1, 2), fmt.Fprint(3, 4)
    m.layout = fmt.PackedLayout.build(space, [None] + [(name, lo, hi - lo) for lo, hi in places] + [None])
    root = local_store.chunks.root
    local_store.chunks.put(fmt.pack_key(space, name), pack)
    local_store.chunks.put(m.chunks[13].name, compress_chunk(chunks[13]))
    runs = fmt.chunk_runs(m, range(1, 14))
    reads = [read for run in runs
             for read in run_reads(run, os.path.join(root, run.key), lambda k: Part(k, m.chunks[k]), 5, file=True)]
    assert [len(r.parts) for r in reads] == [5, 5, 2, 1]
    engine = ChunkEngine(4, 1 << 20, max_parts=5, workers=2)
    try:
        got = _submit_all(engine, reads)
    finally:
        engine.close()
    assert sorted(got) == list(range(1, 14)) and all(got[k].data == chunks[k] for k in got)
