"""Manifests: round trips, Verneuil's byte layout, one test per rule."""
import os
import struct

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from verneuil_fuse import format as fmt
from verneuil_fuse.format import manifest_pb2

CS = fmt.CHUNK_SIZE


def db_bytes(n_chunks: int, tail: int = 0, seed: int = 1) -> bytes:
    rnd = __import__("random").Random(seed)
    data = bytearray(rnd.randbytes(n_chunks * CS + tail))
    data[CS:2 * CS] = bytes(CS) if n_chunks > 2 else data[CS:2 * CS]  # a zero chunk
    return bytes(data)


def rebuild(m: fmt.Manifest, blobs: dict) -> bytes:
    out = bytearray()
    for i, fp in enumerate(m.chunks):
        if i in m.bundled:
            out += m.bundled[i]
        elif fp == fmt.ZERO_CHUNK_FPRINT:
            out += bytes(CS)
        else:
            out += blobs[fp]
    return bytes(out)


@pytest.mark.parametrize("n_chunks,tail", [(1, 0), (0, 100), (3, 0), (3, 1234)])
def test_round_trip_raw_and_zstd(n_chunks, tail):
    data = db_bytes(n_chunks, tail)
    m, blobs = fmt.snapshot_of(data, version_id=b"v" * 16, ctime=1700000000, ctime_ns=123)
    assert fmt.ZERO_CHUNK_FPRINT not in blobs
    raw = fmt.encode_manifest(m)
    for blob in (raw, fmt.compress_manifest(raw)):
        got = fmt.decode_and_validate(blob)
        assert got == m
        assert rebuild(got, blobs) == data


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=1, max_size=3 * CS + 7))
def test_round_trip_property(data):
    m, blobs = fmt.snapshot_of(data)
    got = fmt.decode_and_validate(fmt.compress_manifest(fmt.encode_manifest(m)))
    assert rebuild(got, blobs) == data


def test_verneuil_byte_layout_of_hand_built_manifest():
    """Field numbers, wire types and packing as Verneuil's prost schema."""
    chunk0 = b"SQLite format 3\x00" + bytes(200 - 16)
    fp0 = fmt.fingerprint(chunk0)
    hdr = fmt.header_fprint_of(chunk0)
    contents = fmt.contents_fprint_of([fp0])
    m = fmt.Manifest(len=200, chunks=[fp0], header_fprint=hdr, contents_fprint=contents,
                     version_id=b"\x01\x02", ctime=5, ctime_ns=-1, bundled={0: chunk0},
                     generated_by=b"g")

    def fprint_msg(fp):  # fixed64 major = 1, fixed64 minor = 2
        return b"\x09" + struct.pack("<Q", fp.major) + b"\x11" + struct.pack("<Q", fp.minor)

    def ld(tag, payload):
        return bytes([tag]) + _varint(len(payload)) + payload

    # proto3 (and prost) omit zero scalars: chunk_index 0 and chunk_offset 0 vanish.
    bundled = ld(0x1A, fprint_msg(fp0)) + b"\x7a" + _varint(len(chunk0)) + chunk0
    v1 = (ld(0x0A, fprint_msg(hdr)) + ld(0x12, b"\x01\x02") + ld(0x1A, fprint_msg(contents))
          + b"\x28" + _varint(200) + b"\x30\x05"
          + b"\x3d" + struct.pack("<i", -1)
          + ld(0x4A, b"g")
          + b"\x7a" + _varint(16) + struct.pack("<QQ", *fp0)
          + b"\x82\x01" + _varint(len(bundled)) + bundled)
    want = ld(0x0A, v1)
    assert fmt.encode_manifest(m) == want
    assert fmt.decode_and_validate(want) == m


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


# --- one test per validation rule ------------------------------------------------

def _good():
    data = db_bytes(2, 500)
    m, blobs = fmt.snapshot_of(data)
    return m, blobs, data


def _pb(m):
    top = manifest_pb2.Manifest()
    top.ParseFromString(fmt.encode_manifest(m))
    return top


def _refused(blob, rule, **kw):
    with pytest.raises(fmt.ManifestError) as e:
        fmt.decode_and_validate(blob, **kw)
    assert e.value.rule == rule, str(e.value)
    assert rule in str(e.value)


def test_rule_protobuf():
    _refused(b"\xff\xff\xff garbage", "protobuf")


def test_rule_corrupt_zstd_tried_as_raw():
    m, _, _ = _good()
    blob = fmt.compress_manifest(fmt.encode_manifest(m))
    broken = blob[:4] + bytes(len(blob) - 4)  # keeps the magic, not a valid frame
    _refused(broken, "zstd")


def test_rule_v1_missing():
    _refused(b"", "v1-missing")


def test_rule_header_and_contents_fprint_missing():
    m, _, _ = _good()
    top = _pb(m)
    top.v1.ClearField("header_fprint")
    _refused(top.SerializeToString(), "header-fprint-missing")
    top = _pb(m)
    top.v1.ClearField("contents_fprint")
    _refused(top.SerializeToString(), "contents-fprint-missing")


def test_rule_chunks_odd():
    m, _, _ = _good()
    top = _pb(m)
    top.v1.chunks.append(7)
    _refused(top.SerializeToString(), "chunks-odd")


def test_rule_contents_fprint():
    m, _, _ = _good()
    top = _pb(m)
    top.v1.chunks[2] ^= 1
    _refused(top.SerializeToString(), "contents-fprint")


def test_rule_length():
    m, _, _ = _good()
    top = _pb(m)
    top.v1.len = 10 * CS
    _refused(top.SerializeToString(), "length")
    top.v1.len = 2 * CS  # one chunk too many for this length
    _refused(top.SerializeToString(), "length")


def test_rule_bundled_chunk():
    m, _, _ = _good()
    top = _pb(m)
    top.v1.bundled_chunks[0].chunk_data = b"x" + top.v1.bundled_chunks[0].chunk_data[1:]
    _refused(top.SerializeToString(), "bundled-chunk")
    top = _pb(m)
    top.v1.bundled_chunks[0].chunk_offset = 1
    _refused(top.SerializeToString(), "bundled-chunk")
    top = _pb(m)
    top.v1.bundled_chunks[0].chunk_index = 9
    _refused(top.SerializeToString(), "bundled-chunk")


def test_rule_header_fprint():
    m, _, _ = _good()
    top = _pb(m)
    top.v1.header_fprint.major ^= 1
    _refused(top.SerializeToString(), "header-fprint")


def test_rule_size_limit():
    # A zstd bomb: tiny frame, decompresses past the 384 MiB cap.
    cctx = zstandard.ZstdCompressor(level=1)
    w = cctx.compressobj()
    chunk = bytes(1 << 20)
    bomb = b"".join(w.compress(chunk) for _ in range((fmt.MAX_MANIFEST_BYTES >> 20) + 1)) + w.flush()
    assert len(bomb) < 1 << 20
    _refused(bomb, "size-limit")


def _xor_manifest(base_words):
    data = db_bytes(4, 10, seed=3)
    m, blobs = fmt.snapshot_of(data)
    base = struct.pack("<%dQ" % len(base_words), *base_words)
    base_fp = fmt.fingerprint(base)
    words = [w for fp in m.chunks for w in fp]
    xored = [w ^ (base_words[i] if i < len(base_words) else 0) for i, w in enumerate(words)]
    top = _pb(m)
    del top.v1.chunks[:]
    top.v1.chunks.extend(xored)
    top.v1.base_chunks_fprint.major, top.v1.base_chunks_fprint.minor = base_fp
    return m, data, blobs, top.SerializeToString(), {base_fp: base}


@pytest.mark.parametrize("n_base", [2, 6, 10, 14])  # shorter, equal-ish and longer than the list
def test_base_chunk_xor(n_base):
    base_words = [(i + 1) * 0x9E3779B97F4A7C15 % (1 << 64) for i in range(n_base)]
    m, data, blobs, blob, store = _xor_manifest(base_words)
    got = fmt.decode_and_validate(blob, fetch_chunk=store.__getitem__)
    assert got.chunks == m.chunks
    assert rebuild(got, blobs) == data


def test_encode_with_base_chunk():
    data = db_bytes(4, 10, seed=5)
    m, blobs = fmt.snapshot_of(data)
    base = bytes(range(48))
    based = fmt.Manifest(**{**m.__dict__, "base_chunks_fprint": fmt.fingerprint(base)})
    blob = fmt.encode_manifest(based, base=base)
    top = manifest_pb2.Manifest.FromString(blob)
    assert list(top.v1.chunks)[6:] == [w for fp in m.chunks for w in fp][6:]
    assert list(top.v1.chunks)[:6] != [w for fp in m.chunks for w in fp][:6]
    got = fmt.decode_and_validate(blob, fetch_chunk=lambda fp: base)
    assert got.chunks == m.chunks and rebuild(got, blobs) == data
    with pytest.raises(ValueError):
        fmt.encode_manifest(based)


def test_rule_base_chunk():
    m, data, blobs, blob, store = _xor_manifest([1, 2, 3, 4])
    _refused(blob, "base-chunk")  # nothing to fetch it with
    (fp, base), = store.items()
    _refused(blob, "base-chunk", fetch_chunk=lambda f: base + b"x" * 16)  # other bytes
    odd = base[:24]
    odd_fp = fmt.fingerprint(odd)
    top = manifest_pb2.Manifest()
    top.ParseFromString(blob)
    top.v1.base_chunks_fprint.major, top.v1.base_chunks_fprint.minor = odd_fp
    _refused(top.SerializeToString(), "base-chunk", fetch_chunk=lambda f: odd)  # not 16-aligned


def test_decode_chunk_verifies_full_fingerprint():
    data = os.urandom(CS)
    fp = fmt.fingerprint(data)
    assert fmt.decode_chunk(data, fp) == data
    assert fmt.decode_chunk(fmt.compress_chunk(data), fp) == data
    # zstd-looking raw chunk: decompression fails, raw bytes pass
    tricky = fmt.ZSTD_MAGIC + data[4:]
    assert fmt.decode_chunk(tricky, fmt.fingerprint(tricky)) == tricky
    with pytest.raises(fmt.ChunkError):
        fmt.decode_chunk(data[:-1] + bytes([data[-1] ^ 1]), fp)
    # same major, other minor: refused (stricter than Verneuil's 64-bit check)
    with pytest.raises(fmt.ChunkError):
        fmt.decode_chunk(data, fmt.Fprint(fp.major, fp.minor ^ 1))


def test_chunk_names():
    fp = fmt.Fprint(0x712dc93b96d4ca86, 0x25dce0c3a3ad05b2)
    assert fp.name == "712dc93b96d4ca86%2F25dce0c3a3ad05b2"
    assert fmt.parse_chunk_name(fp.name) == fp
    for bad in ["", "712dc93b96d4ca86/25dce0c3a3ad05b2", "712DC93B96D4CA86%2F25dce0c3a3ad05b2",
                "712dc93b96d4ca86%2F25dce0c3a3ad05b", "../etc/passwd"]:
        with pytest.raises(fmt.BadName):
            fmt.parse_chunk_name(bad)


def test_manifest_name_rules():
    assert fmt.manifest_name("/tmp/test.db", "test.com") == "7cb1-verneuil%3Atest.com%3A80ad%2F%2Ftmp%2Ftest.db"
    assert "%7E" in fmt.manifest_name("/a~b", "h")
    with pytest.raises(fmt.BadName):
        fmt.manifest_name("relative.db", "h")
    long = fmt.manifest_name("/" + "d" * 300 + "/x.db", "h")
    assert len(long) == 240
    parsed = fmt.parse_manifest_name(long)
    assert parsed.mangled and parsed.hostname == "h" and parsed.suffix.endswith("/x.db")
    assert fmt.parse_manifest_name("not-a-manifest") is None


def test_manifest_name_canonicalises_local_paths(tmp_path):
    real = tmp_path / "real.db"
    real.write_bytes(b"")
    link = tmp_path / "link.db"
    link.symlink_to(real)
    assert fmt.manifest_name(str(link)) == fmt.manifest_name(str(real)) == \
        fmt.manifest_name(os.path.realpath(real), fmt.local_hostname())


# --- the chunk list as a compact sequence ------------------------------------------

def test_chunk_list_behaves_like_a_list_of_fprints():
    fps = [fmt.Fprint(i * 0x9E3779B97F4A7C15 % (1 << 64), (i + 7) ** 5 % (1 << 64)) for i in range(6)]
    chunks = fmt.ChunkList(fps)
    assert len(chunks) == 6 and isinstance(chunks[0], fmt.Fprint)
    assert chunks[0] == fps[0] and chunks[5] == fps[5]
    assert chunks[-1] == fps[-1] and chunks[-6] == fps[0]
    assert chunks[3].name == fps[3].name
    for bad in (6, -7):
        with pytest.raises(IndexError):
            chunks[bad]
    assert list(chunks) == fps and [fp for fp in chunks] == fps
    assert chunks[1:4] == fps[1:4] and chunks[::-1] == fps[::-1]
    assert chunks == fps and fps == chunks and chunks == tuple(fps)
    assert chunks == fmt.ChunkList(fps) and chunks != fmt.ChunkList(fps[:-1])
    assert chunks != fps[:-1] and chunks != fps[::-1]
    assert fps[4] in chunks and tuple(fps[4]) in chunks
    assert fmt.Fprint(fps[0].minor, fps[1].major) not in chunks  # words across two chunks
    assert fmt.Fprint(fps[0].major, 12345) not in chunks and "x" not in chunks
    assert chunks.index(fps[2]) == 2 and chunks.count(fps[2]) == 1
    assert set(chunks) == set(fps) and dict(enumerate(chunks)) == dict(enumerate(fps))
    assert len(chunks.words) == 12 and chunks.words.itemsize == 8
    assert fmt.words_of(chunks) == fmt.words_of(fps) == struct.pack("<12Q", *[w for fp in fps for w in fp])
    assert fmt.contents_fprint_of(chunks) == fmt.contents_fprint_of(fps)
    assert fmt.ChunkList.from_words(chunks.words) == chunks
    with pytest.raises(ValueError):
        fmt.ChunkList.from_words([1, 2, 3])
    import pickle
    assert pickle.loads(pickle.dumps(chunks)) == chunks
    empty = fmt.ChunkList()
    assert len(empty) == 0 and list(empty) == [] and empty == []


def test_manifest_chunks_is_a_chunk_list():
    m, blobs, data = _good()
    assert isinstance(m.chunks, fmt.ChunkList)  # converted from the writer's list
    got = fmt.decode_and_validate(fmt.encode_manifest(m))
    assert isinstance(got.chunks, fmt.ChunkList) and got.chunks == m.chunks and got == m
    # A manifest may still be built with, or given, a plain list.
    listed = fmt.Manifest(**{**m.__dict__, "chunks": list(m.chunks)})
    assert listed == m and fmt.encode_manifest(listed) == fmt.encode_manifest(m)
    listed.chunks = list(m.chunks)
    assert fmt.encode_manifest(listed) == fmt.encode_manifest(m)


def test_million_chunk_manifest_is_compact():
    """64 GiB of zero chunks (the default size limit): decodes fast (timing
    printed, not asserted) and holds 16 bytes per chunk."""
    import time
    n = fmt.DEFAULT_MAX_DB_SIZE // CS
    chunks = fmt.ChunkList.from_words(list(fmt.ZERO_CHUNK_FPRINT) * n)
    m = fmt.Manifest(len=n * CS, chunks=chunks, header_fprint=fmt.Fprint(1, 2),
                     contents_fprint=fmt.contents_fprint_of(chunks))
    blob = fmt.compress_manifest(fmt.encode_manifest(m))
    start = time.perf_counter()
    got = fmt.decode_and_validate(blob)
    print("decoded %d chunks in %.3f s" % (n, time.perf_counter() - start))
    assert len(got.chunks) == n and got.chunks[-1] == fmt.ZERO_CHUNK_FPRINT
    assert got.chunks.words.itemsize * len(got.chunks.words) == 16 * n
    assert len(fmt.encode_manifest(got)) <= fmt.manifest_blob_limit(fmt.DEFAULT_MAX_DB_SIZE)
    # One byte more than the limit allows is one chunk too many.
    with pytest.raises(fmt.ManifestError) as e:
        fmt.decode_and_validate(blob, max_db_size=n * CS - 1)
    assert e.value.rule == "size-limit"


# --- size limits -------------------------------------------------------------------

def test_size_limit_constants():
    assert fmt.DEFAULT_MAX_DB_SIZE == 64 << 30
    assert fmt.MAX_CHUNK_BLOB_BYTES >= 65536 + 256 + 32  # ZSTD_COMPRESSBOUND(64 KiB)
    assert fmt.MAX_CHUNK_BLOB_BYTES <= 2 * CS
    limit = fmt.manifest_blob_limit(fmt.DEFAULT_MAX_DB_SIZE)
    # 16 MiB of chunk list, 27 MiB at most of packed layout, room for bundled chunks
    assert 43 << 20 < limit < 48 << 20
    assert fmt.manifest_blob_limit(1 << 39) < fmt.MAX_MANIFEST_BYTES
    assert fmt.manifest_blob_limit(1 << 50) == fmt.MAX_MANIFEST_BYTES
    assert fmt.manifest_blob_limit(0) < fmt.manifest_blob_limit(CS) < limit
    with pytest.raises(ValueError):
        fmt.manifest_blob_limit(-1)


def zstd_bomb(n_chunks: int, *, declare_size: bool = False) -> bytes:
    """A manifest that declares `n_chunks` chunks of zeros (len and
    contents_fprint consistent, so only a size rule can stop it), as a small
    zstd frame.  Built from a chunk-less message plus the chunks field: the
    parser merges the two ManifestV1 pieces."""
    zeros = bytes(16 * n_chunks)  # calloc'd zero pages: nothing resident
    top = manifest_pb2.Manifest()
    top.v1.header_fprint.major, top.v1.header_fprint.minor = 1, 2
    top.v1.contents_fprint.major, top.v1.contents_fprint.minor = fmt.fingerprint(
        zeros, fmt.DIRECTORY_KEY)
    top.v1.len = n_chunks * CS
    field = b"\x7a" + _varint(len(zeros))
    head = top.SerializeToString() + b"\x0a" + _varint(len(field) + len(zeros)) + field
    cctx = zstandard.ZstdCompressor(level=3)
    w = cctx.compressobj(size=len(head) + len(zeros) if declare_size else -1)
    parts = [w.compress(head)]
    view = memoryview(zeros)
    for off in range(0, len(zeros), 1 << 24):
        parts.append(w.compress(view[off:off + (1 << 24)]))
    parts.append(w.flush())
    return b"".join(parts)


def test_zstd_bomb_is_still_a_valid_manifest_below_any_limit():
    """The bomb builder makes real manifests: a small one decodes."""
    m = fmt.decode_and_validate(zstd_bomb(100))
    assert len(m.chunks) == 100 and m.len == 100 * CS and m.chunks[7] == fmt.Fprint(0, 0)


@pytest.mark.parametrize("declare_size", [False, True], ids=["streamed", "declared"])
def test_zstd_bomb_refused_fast_and_small(declare_size):
    """25 million zero chunks (a 1.5 TiB database, 400 MB of chunk list) in a
    small frame: refused with size-limit without decompressing it all."""
    import time
    import tracemalloc
    bomb = zstd_bomb(25_000_000, declare_size=declare_size)
    assert len(bomb) < 200_000
    assert (zstandard.get_frame_parameters(bomb).content_size
            != zstandard.CONTENTSIZE_UNKNOWN) == declare_size
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(fmt.ManifestError) as e:
            fmt.decode_and_validate(bomb)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print("bomb of %d bytes refused in %.3f s, traced peak %.1f MiB"
          % (len(bomb), elapsed, peak / 2**20))
    assert e.value.rule == "size-limit", str(e.value)
    assert "max_db_size" in str(e.value) and "64 GiB" in str(e.value)
    assert peak < 64 << 20  # the 45 MiB limit, never the 400 MB
    assert elapsed < 10  # generous: milliseconds on an idle machine


def test_manifest_just_under_a_small_max_db_size_decodes():
    data = db_bytes(3, 500)
    m, blobs = fmt.snapshot_of(data)
    for blob in (fmt.encode_manifest(m), fmt.compress_manifest(fmt.encode_manifest(m))):
        got = fmt.decode_and_validate(blob, max_db_size=len(data))
        assert got == m and rebuild(got, blobs) == data
        _refused(blob, "size-limit", max_db_size=len(data) - 1)


def test_len_over_max_db_size_refused():
    """A consistent chunk list of 10 zero chunks, for a limit of 5 chunks."""
    chunks = [fmt.ZERO_CHUNK_FPRINT] * 10
    m = fmt.Manifest(len=10 * CS, chunks=chunks, header_fprint=fmt.Fprint(1, 2),
                     contents_fprint=fmt.contents_fprint_of(chunks))
    blob = fmt.encode_manifest(m)
    assert fmt.decode_and_validate(blob, max_db_size=10 * CS) == m
    with pytest.raises(fmt.ManifestError) as e:
        fmt.decode_and_validate(blob, max_db_size=5 * CS)
    assert e.value.rule == "size-limit"
    text = str(e.value)
    assert "640 KiB" in text and "320 KiB" in text and "max_db_size" in text and "configurable" in text


def test_huge_len_refused_before_any_chunk_work():
    """A len of 2^60 with one chunk: size-limit, not a length or fingerprint
    complaint; and a chunk count that contradicts len is refused as such
    before the chunk list is fingerprinted."""
    m, _, _ = _good()
    top = _pb(m)
    top.v1.len = 1 << 60
    _refused(top.SerializeToString(), "size-limit")
    top = _pb(m)
    top.v1.len = 1 * CS
    top.v1.contents_fprint.major ^= 1  # wrong too, but the count is checked first
    _refused(top.SerializeToString(), "length")


def test_over_long_raw_blob_refused_before_parsing():
    limit = fmt.manifest_blob_limit(4 * CS)
    junk = b"\xff" * (limit + 1)  # not protobuf at all: the size rule comes first
    _refused(junk, "size-limit", max_db_size=4 * CS)
    _refused(junk[:limit], "protobuf", max_db_size=4 * CS)
    frame = zstandard.ZstdCompressor(level=1).compress(bytes(limit + 1))
    _refused(frame, "size-limit", max_db_size=4 * CS)  # declared size, then output size


def test_decode_chunk_bounds():
    data = os.urandom(CS)
    fp = fmt.fingerprint(data)
    frame = fmt.compress_chunk(data)
    assert len(frame) <= fmt.MAX_CHUNK_BLOB_BYTES
    assert fmt.decode_chunk(frame + b"trailing", fp) == data  # bytes after the frame: ignored
    big = zstandard.ZstdCompressor().compress(data + b"x")  # declares 64 KiB + 1
    with pytest.raises(fmt.ChunkError):
        fmt.decode_chunk(big, fmt.fingerprint(data + b"x"))
    w = zstandard.ZstdCompressor().compressobj()  # no declared size: stops at the bound
    streamed = w.compress(bytes(10 * CS)) + w.flush()
    with pytest.raises(fmt.ChunkError):
        fmt.decode_chunk(streamed, fmt.fingerprint(bytes(10 * CS)))
    w = zstandard.ZstdCompressor().compressobj()
    ok = w.compress(data) + w.flush()
    assert fmt.decode_chunk(ok, fp) == data
    with pytest.raises(fmt.ChunkError):
        fmt.decode_chunk(ok[:-3], fp)  # a cut frame


def test_decode_chunk_reuses_one_decompressor_per_thread_safely():
    """Chunks share their thread's decompressor: a broken, cut, oversized or
    streamed frame before a good one changes nothing of the good one's
    bytes, and threads decoding at once each get their own."""
    import threading

    from verneuil_fuse.format import manifest as mf

    datas = [os.urandom(CS // 2) * 2 for _ in range(4)]
    frames = [fmt.compress_chunk(d) for d in datas]
    fps = [fmt.fingerprint(d) for d in datas]
    w = zstandard.ZstdCompressor().compressobj()
    bomb = w.compress(bytes(10 * CS)) + w.flush()
    bad = [frames[0][: len(frames[0]) // 2], frames[1][:-3], bomb,
           zstandard.ZstdCompressor().compress(datas[2] + b"x")]
    assert mf._thread_decompressor() is mf._thread_decompressor()
    for k in range(20):
        with pytest.raises(fmt.ChunkError):
            fmt.decode_chunk(bad[k % len(bad)], fps[k % 4])
        assert fmt.decode_chunk(frames[k % 4], fps[k % 4]) == datas[k % 4]
    errors: list = []
    mine: list = []

    def decode(n: int) -> None:
        mine.append(mf._thread_decompressor())
        try:
            for k in range(300):
                j = (k + n) % 4
                if k % 7 == 0:
                    try:
                        fmt.decode_chunk(bad[j], fps[j])
                        errors.append("a bad frame decoded")
                    except fmt.ChunkError:
                        pass
                if fmt.decode_chunk(frames[j], fps[j]) != datas[j]:
                    errors.append("wrong bytes")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=decode, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len({id(d) for d in mine}) == 4
