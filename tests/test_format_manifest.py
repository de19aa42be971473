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
    assert fmt.chunk_name(fp) == fp.name == "712dc93b96d4ca86%2F25dce0c3a3ad05b2"
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
