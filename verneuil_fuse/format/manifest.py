"""Manifests: encode, decode and validate; chunk blobs: compress and verify.

`decode_and_validate` is the gate every manifest from outside passes through:
it applies each rule of FORMAT.md ("Manifest", "Compression") and raises one
exception type, `ManifestError`, whose `rule` names the rule that failed.
"""
from __future__ import annotations

import dataclasses
import struct
from typing import Callable, Iterable, Optional

import zstandard

from . import manifest_pb2
from .names import CHUNK_SIZE, ZERO_CHUNK_FPRINT
from .umash import CHUNK_KEY, DIRECTORY_KEY, HEADER_KEY, Fprint, fingerprint

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# Verneuil's cap on a decompressed manifest (384 MiB: 16 bytes per 64 KiB
# chunk describes databases of about 1.5 TiB).
MAX_MANIFEST_BYTES = 3 << 27
MANIFEST_ZSTD_LEVEL = 1   # FORMAT.md: manifests change on every commit; be cheap.
CHUNK_ZSTD_LEVEL = 3      # FORMAT.md: zstd's default level for chunks.
HEADER_BYTES = 100        # SQLite's file header, covered by header_fprint.
GENERATED_BY = b"verneuil_fuse-v0.1.0"


class ManifestError(ValueError):
    """A manifest that breaks a rule of FORMAT.md; `rule` names the rule."""

    def __init__(self, rule: str, detail: str):
        super().__init__("invalid manifest (%s): %s" % (rule, detail))
        self.rule = rule
        self.detail = detail


class ChunkError(ValueError):
    """A chunk blob whose bytes do not match the fingerprint that names it."""


@dataclasses.dataclass
class Manifest:
    """One snapshot: the file's length, its chunk list and metadata."""

    len: int
    chunks: list[Fprint]
    header_fprint: Fprint
    contents_fprint: Fprint
    version_id: bytes = b""
    ctime: int = 0
    ctime_ns: int = 0
    bundled: dict[int, bytes] = dataclasses.field(default_factory=dict)
    base_chunks_fprint: Optional[Fprint] = None
    generated_by: bytes = GENERATED_BY

    def chunk_length(self, index: int) -> int:
        """Byte length of chunk `index` (the last one may be short)."""
        return min(CHUNK_SIZE, self.len - index * CHUNK_SIZE)


def chunk_count(length: int) -> int:
    """Number of 64 KiB chunks that cover a file of `length` bytes."""
    return (length + CHUNK_SIZE - 1) // CHUNK_SIZE


def words_of(chunks: list[Fprint]) -> bytes:
    """The little-endian u64 words major0, minor0, major1, ... of a list."""
    flat = [w for fp in chunks for w in fp]
    return struct.pack("<%dQ" % len(flat), *flat)


def contents_fprint_of(chunks: list[Fprint]) -> Fprint:
    """`contents_fprint`: the directory-key fingerprint of the chunk words."""
    return fingerprint(words_of(chunks), DIRECTORY_KEY)


def header_fprint_of(data) -> Fprint:
    """`header_fprint`: the header-key fingerprint of bytes [0, 100)."""
    return fingerprint(bytes(data[:HEADER_BYTES]), HEADER_KEY)


def _set_fp(msg, fp: Fprint) -> None:
    msg.major, msg.minor = fp


def xor_words(words: list[int], base: bytes) -> list[int]:
    """`words` XOR-ed with the u64 words of `base`, zero-padded (FORMAT.md)."""
    n = min(len(base) // 8, len(words))
    base_words = struct.unpack("<%dQ" % n, base[:8 * n])
    return [w ^ base_words[i] for i, w in enumerate(words[:n])] + words[n:]


def encode_manifest(m: Manifest, base: Optional[bytes] = None) -> bytes:
    """Serialise to raw (uncompressed) protobuf bytes, Verneuil's layout.

    `m.chunks` is always the real chunk list; when `m.base_chunks_fprint` is
    set, `base` (that chunk's bytes) must be given and the stored list is
    XOR-ed with it.
    """
    top = manifest_pb2.Manifest()
    v1 = top.v1
    _set_fp(v1.header_fprint, m.header_fprint)
    v1.version_id = m.version_id
    _set_fp(v1.contents_fprint, m.contents_fprint)
    v1.len = m.len
    v1.ctime = m.ctime
    v1.ctime_ns = m.ctime_ns
    if m.base_chunks_fprint is not None:
        _set_fp(v1.base_chunks_fprint, m.base_chunks_fprint)
    v1.generated_by = m.generated_by
    words = [w for fp in m.chunks for w in fp]
    if m.base_chunks_fprint is not None:
        if base is None or fingerprint(base, CHUNK_KEY) != m.base_chunks_fprint or len(base) % 16:
            raise ValueError("encode_manifest needs the base chunk's bytes (a multiple of 16)")
        words = xor_words(words, base)
    v1.chunks.extend(words)
    for index in sorted(m.bundled):
        b = v1.bundled_chunks.add()
        b.chunk_index = index
        b.chunk_offset = index * CHUNK_SIZE
        _set_fp(b.chunk_fprint, m.chunks[index])
        b.chunk_data = m.bundled[index]
    return top.SerializeToString()


def compress_manifest(raw: bytes) -> bytes:
    """A zstd frame of a manifest, as uploaded (level 1)."""
    return zstandard.ZstdCompressor(level=MANIFEST_ZSTD_LEVEL).compress(raw)


def compress_chunk(raw: bytes) -> bytes:
    """A zstd frame of a chunk, as uploaded (zstd's default level)."""
    return zstandard.ZstdCompressor(level=CHUNK_ZSTD_LEVEL).compress(raw)


def _decompress_bounded(blob: bytes, limit: int) -> bytes:
    """zstd-decompress a whole frame of at most `limit` bytes; ZstdError past
    that (a decompression bomb stops early), or on a broken or cut frame."""
    with zstandard.ZstdDecompressor().stream_reader(blob) as reader:
        probe = reader.read(limit + 1)
    if len(probe) > limit:
        raise zstandard.ZstdError("decompresses past %d bytes" % limit)
    # The output is known to be small now; decode again to learn whether the
    # frame was complete (the stream reader stops quietly at a cut frame).
    dobj = zstandard.ZstdDecompressor().decompressobj()
    out = dobj.decompress(blob)
    if not dobj.eof:
        raise zstandard.ZstdError("truncated zstd frame")
    return out


def _decompress_manifest(blob: bytes) -> bytes:
    if not blob.startswith(ZSTD_MAGIC):
        if len(blob) > MAX_MANIFEST_BYTES:
            raise ManifestError("size-limit", "%d bytes exceeds %d" % (len(blob), MAX_MANIFEST_BYTES))
        return blob
    try:
        return _decompress_bounded(blob, MAX_MANIFEST_BYTES)
    except zstandard.ZstdError as e:
        if "past" in str(e):
            raise ManifestError("size-limit", "decompresses past %d bytes" % MAX_MANIFEST_BYTES) from None
        return blob  # FORMAT.md: a manifest that fails to decompress is tried raw


def _parse(raw: bytes):
    top = manifest_pb2.Manifest()
    try:
        top.ParseFromString(raw)
    except Exception as e:  # the protobuf runtime raises DecodeError and friends
        raise ManifestError("protobuf", "not a Manifest message: %s" % e) from None
    return top


def _fp(msg) -> Fprint:
    return Fprint(msg.major, msg.minor)


def decode_chunk(blob: bytes, expected: Fprint) -> bytes:
    """The bytes of a chunk blob (zstd or raw), verified against `expected`'s
    full 128 bits; ChunkError otherwise (never wrong bytes)."""
    if blob.startswith(ZSTD_MAGIC):
        try:
            data = _decompress_bounded(blob, CHUNK_SIZE)
        except zstandard.ZstdError:
            data = None
        if data is not None and fingerprint(data, CHUNK_KEY) == expected:
            return data
    if len(blob) <= CHUNK_SIZE and fingerprint(blob, CHUNK_KEY) == expected:
        return bytes(blob)
    raise ChunkError("chunk %s: bytes do not match its fingerprint" % expected.name)


def decode_and_validate(blob: bytes,
                        fetch_chunk: Optional[Callable[[Fprint], bytes]] = None) -> Manifest:
    """Decode a manifest blob (zstd or raw) and apply every rule of FORMAT.md.

    `fetch_chunk(fprint)` returns a chunk's (verified) bytes; it is needed only
    for manifests whose chunk list is XOR-ed with a base chunk.
    """
    raw = _decompress_manifest(bytes(blob))
    if raw.startswith(ZSTD_MAGIC):
        # Tried as raw protobuf, the magic reads as top-level field 5 with
        # varint type, which a Manifest never has: this is a broken frame.
        raise ManifestError("zstd", "zstd frame that does not decompress")
    top = _parse(raw)
    if not top.HasField("v1"):
        raise ManifestError("v1-missing", "no ManifestV1 in the message")
    v1 = top.v1
    for field in ("header_fprint", "contents_fprint"):
        if not v1.HasField(field):
            raise ManifestError(field.replace("_", "-") + "-missing", "%s is absent" % field)
    words = list(v1.chunks)
    if len(words) % 2:
        raise ManifestError("chunks-odd", "chunk list has an odd number (%d) of words" % len(words))
    base_fp = None
    if v1.HasField("base_chunks_fprint"):
        base_fp = _fp(v1.base_chunks_fprint)
        if fetch_chunk is None:
            raise ManifestError("base-chunk", "needs base chunk %s but no store to fetch it from" % base_fp.name)
        try:
            base = fetch_chunk(base_fp)
        except Exception as e:
            raise ManifestError("base-chunk", "cannot fetch base chunk %s: %s" % (base_fp.name, e)) from None
        if fingerprint(base, CHUNK_KEY) != base_fp:
            raise ManifestError("base-chunk", "base chunk %s has other bytes" % base_fp.name)
        if len(base) % 16:
            raise ManifestError("base-chunk", "base chunk length %d is not a multiple of 16" % len(base))
        words = xor_words(words, base)
    chunks = [Fprint(words[i], words[i + 1]) for i in range(0, len(words), 2)]
    contents = _fp(v1.contents_fprint)
    if contents_fprint_of(chunks) != contents:
        raise ManifestError("contents-fprint", "chunk list does not match contents_fprint")
    length = v1.len
    if chunk_count(length) != len(chunks):
        raise ManifestError("length", "%d chunks cannot hold %d bytes" % (len(chunks), length))
    m = Manifest(len=length, chunks=chunks, header_fprint=_fp(v1.header_fprint),
                 contents_fprint=contents, version_id=bytes(v1.version_id),
                 ctime=v1.ctime, ctime_ns=v1.ctime_ns, base_chunks_fprint=base_fp,
                 generated_by=bytes(v1.generated_by))
    for b in v1.bundled_chunks:
        i = b.chunk_index
        if i >= len(chunks):
            raise ManifestError("bundled-chunk", "bundled chunk index %d past the end" % i)
        if b.chunk_offset != i * CHUNK_SIZE:
            raise ManifestError("bundled-chunk", "bundled chunk %d at offset %d" % (i, b.chunk_offset))
        data = bytes(b.chunk_data)
        if len(data) != m.chunk_length(i):
            raise ManifestError("bundled-chunk", "bundled chunk %d has %d bytes, expected %d"
                                % (i, len(data), m.chunk_length(i)))
        fp = fingerprint(data, CHUNK_KEY)
        if fp != chunks[i] or (b.HasField("chunk_fprint") and _fp(b.chunk_fprint) != fp):
            raise ManifestError("bundled-chunk", "bundled chunk %d does not match its fingerprint" % i)
        m.bundled[i] = data
    if 0 in m.bundled and header_fprint_of(m.bundled[0]) != m.header_fprint:
        raise ManifestError("header-fprint", "header_fprint does not match bytes [0, 100)")
    return m


def snapshot_of(data, version_id: bytes = b"", ctime: int = 0, ctime_ns: int = 0,
                bundle: Iterable[int] = ()) -> tuple[Manifest, dict[Fprint, bytes]]:
    """A writer's snapshot of `data` (a whole file): the manifest with chunk 0
    bundled, and the chunks to upload (neither chunk 0 nor the zero chunk,
    unless another chunk shares chunk 0's bytes).  The chunks of `bundle` are
    bundled too (as the C writer bundles b-tree tops), and still uploaded."""
    view = memoryview(data)
    if len(view) == 0:
        raise ValueError("an empty file has no snapshot")
    chunks: list[Fprint] = []
    blobs: dict[Fprint, bytes] = {}
    for index in range(chunk_count(len(view))):
        piece = view[index * CHUNK_SIZE:(index + 1) * CHUNK_SIZE]
        fp = fingerprint(piece, CHUNK_KEY)
        chunks.append(fp)
        if index > 0 and fp != ZERO_CHUNK_FPRINT:
            blobs.setdefault(fp, bytes(piece))
    header = header_fprint_of(view)
    m = Manifest(len=len(view), chunks=chunks, header_fprint=header,
                 contents_fprint=contents_fprint_of(chunks),
                 version_id=version_id, ctime=ctime, ctime_ns=ctime_ns,
                 bundled={0: bytes(view[:CHUNK_SIZE])})
    for index in bundle:
        m.bundled[index] = bytes(view[index * CHUNK_SIZE:(index + 1) * CHUNK_SIZE])
    return m, blobs
