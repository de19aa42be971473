"""Manifests: encode, decode and validate; chunk blobs: compress and verify.

`decode_and_validate` is the gate every manifest from outside passes through:
it applies each rule of docs/FORMAT.md ("Validation rules") and raises one
exception type, `ManifestError`, whose `rule` names the rule that failed.
"""
from __future__ import annotations

import dataclasses
import itertools
import struct
import sys
import threading
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, NamedTuple, Optional, Union

import zstandard

from verneuil_fuse.format import manifest_pb2
from verneuil_fuse.format.names import CHUNK_SIZE, ZERO_CHUNK_FPRINT
from verneuil_fuse.format.umash import CHUNK_KEY, DIRECTORY_KEY, HEADER_KEY, Fprint, fingerprint

if TYPE_CHECKING:
    from verneuil_fuse.format.packs import PackedLayout

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# Verneuil's cap on a decompressed manifest (384 MiB: 16 bytes per 64 KiB
# chunk describes databases of about 1.5 TiB).  No limit derived from
# `max_db_size` ever exceeds it.
MAX_MANIFEST_BYTES = 3 << 27

# The largest database a mount or a restore serves by default: 64 GiB, whose
# manifest's chunk list is 16 MiB (1 Mi chunks of 16 bytes).  It bounds what a
# manifest may make a reader allocate; callers take it as a `max_db_size`
# setting, so larger databases only need that setting raised.
DEFAULT_MAX_DB_SIZE = 64 << 30

# Bytes a manifest spends per chunk of its chunk list (two fixed64 words).
MANIFEST_BYTES_PER_CHUNK = 16

# Bytes a packed layout (docs/FORMAT.md, "Packed layout") may spend per
# chunk at most: three varints (a pack number below 2^28, an offset below
# 64 MiB, a length below 2^21: 4 + 4 + 3 bytes) and a pack fingerprint
# (16 bytes; a layout names at most one pack per chunk).
PACKED_LAYOUT_BYTES_PER_CHUNK = 27

# Room in a manifest for bundled chunks: writers bundle at most 17 chunks of
# 64 KiB (chunk 0 and up to 16 b-tree tops, VN_MANIFEST_MAX_EXTRA in the C
# writer), i.e. 1.06 MiB plus a few bytes of keys each; 2 MiB leaves headroom.
MANIFEST_BUNDLED_ALLOWANCE = 2 << 20

# Room for the other fields (fingerprints, len, ctime, version_id,
# generated_by, protobuf tags): under a KiB in practice; 64 KiB tolerates long
# free-form tags without mattering next to the chunk list.
MANIFEST_OTHER_ALLOWANCE = 64 << 10

# The largest database replicated: the writer snapshots no larger file
# (csrc/tracker.h, VN_MAX_DB_SIZE, the same formula), copiers refuse a
# larger manifest and `verneuilctl lag` calls such a database stopped. It is
# the largest whose manifest fits MAX_MANIFEST_BYTES with room for the
# bundled chunks and the other fields, at 16 bytes per chunk: about 1.5 TiB.
# VERNEUIL_CONFIG's `max_db_size` lowers it for all three (never raises it).
# A mount serves up to its own `max_db_size=` (DEFAULT_MAX_DB_SIZE), a bound
# on what a store can make it allocate.
MAX_REPLICATED_DB_SIZE = ((MAX_MANIFEST_BYTES - MANIFEST_BUNDLED_ALLOWANCE - MANIFEST_OTHER_ALLOWANCE)
                          // MANIFEST_BYTES_PER_CHUNK * CHUNK_SIZE)

# A zstd frame may be a little longer than its content (incompressible
# data): ZSTD_COMPRESSBOUND(n) = n + n/256 + at most 64 bytes below 128 KiB;
# this covers the constant part and the frame header.
ZSTD_FRAME_SLACK = 1 << 10

# The largest chunk object accepted from a store: a zstd frame of 64 KiB
# (ZSTD_COMPRESSBOUND(65536) = 65536 + 256 + 32 = 65824 bytes at worst) plus
# room for frame options (the largest frame header, a content checksum, a
# dictionary id), rounded up to 64 KiB + 1 KiB.  A raw chunk is at most
# 64 KiB anyway.
MAX_CHUNK_BLOB_BYTES = CHUNK_SIZE + 1024
MANIFEST_ZSTD_LEVEL = 1   # docs/FORMAT.md: manifests change on every commit; be cheap.
CHUNK_ZSTD_LEVEL = 3      # docs/FORMAT.md: zstd's default level for chunks.
HEADER_BYTES = 100        # SQLite's file header, covered by header_fprint.
GENERATED_BY = b"verneuil_fuse-v0.1.0"


class ManifestError(ValueError):
    """A manifest that breaks a rule of docs/FORMAT.md; `rule` names the rule."""

    def __init__(self, rule: str, detail: str):
        super().__init__("invalid manifest (%s): %s" % (rule, detail))
        self.rule = rule
        self.detail = detail


class ChunkError(ValueError):
    """A chunk blob whose bytes do not match the fingerprint that names it."""


class ChunkList(Sequence):
    """A manifest's chunk list: the fingerprints as u64 words major0, minor0,
    major1, ... in one `array('Q')`, 16 bytes per chunk and no Python object
    per chunk (a 64 GiB database has a million chunks).

    Reads like the `list[Fprint]` it stands for: `len`, indexing (negative
    too) and iteration give `Fprint`s, a slice gives a list, `in` and
    `index` search the words, and it equals another ChunkList or any list or
    tuple of the same fingerprints.  It is never modified in place.
    """

    __slots__ = ("_words",)

    def __init__(self, chunks: Iterable[Fprint] = ()) -> None:
        if isinstance(chunks, ChunkList):
            self._words = chunks._words
            return
        words = array("Q")
        for major, minor in chunks:
            words.append(major)
            words.append(minor)
        self._words = words

    @classmethod
    def from_words(cls, words) -> "ChunkList":
        """The list whose words are `words` (an even number of u64 values:
        an `array('Q')`, taken as is, or any iterable of ints)."""
        if not (isinstance(words, array) and words.typecode == "Q"):
            words = array("Q", words)
        if len(words) % 2:
            raise ValueError("a chunk list has an even number of words, not %d" % len(words))
        self = cls.__new__(cls)
        self._words = words
        return self

    @property
    def words(self) -> array:
        """The words, in host byte order (do not modify)."""
        return self._words

    def words_le(self):
        """The words as little-endian bytes (a bytes-like object)."""
        if sys.byteorder == "little":
            return memoryview(self._words).cast("B")
        swapped = array("Q", self._words)
        swapped.byteswap()
        return swapped.tobytes()

    def __len__(self) -> int:
        return len(self._words) >> 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:  # a run of chunks (a read request's): no lookup per chunk
                it = iter(self._words[2 * start:2 * max(start, stop)])
                return list(itertools.starmap(Fprint, zip(it, it)))
            return [self[i] for i in range(start, stop, step)]
        n = len(self._words) >> 1
        index = index.__index__()
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("chunk index out of range")
        w = self._words
        return Fprint(w[2 * index], w[2 * index + 1])

    def __iter__(self) -> Iterator[Fprint]:
        it = iter(self._words)
        return itertools.starmap(Fprint, zip(it, it))

    def _find(self, fp) -> int:
        """Index of the first chunk equal to `fp`, or -1."""
        try:
            major, minor = fp
        except (TypeError, ValueError):
            return -1
        w = self._words
        start = 0
        while True:
            try:
                at = w.index(major, start)
            except (ValueError, TypeError, OverflowError):
                return -1
            if at % 2 == 0 and w[at + 1] == minor:
                return at >> 1
            start = at + 1

    def __contains__(self, fp) -> bool:
        return self._find(fp) >= 0

    def index(self, fp, start: int = 0, stop: Optional[int] = None) -> int:
        if start == 0 and stop is None:
            at = self._find(fp)
            if at >= 0:
                return at
            raise ValueError("%r is not in the chunk list" % (fp,))
        return super().index(fp, start, len(self) if stop is None else stop)

    def __eq__(self, other) -> bool:
        if isinstance(other, ChunkList):
            return self._words == other._words
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares equal to lists

    def __reduce__(self):
        return (ChunkList.from_words, (self._words,))

    def __repr__(self) -> str:
        n = len(self)
        shown = ", ".join(fp.name for fp in itertools.islice(self, 3))
        return "ChunkList(%d chunks: %s%s)" % (n, shown, ", ..." if n > 3 else "")


@dataclasses.dataclass
class Manifest:
    """One snapshot: the file's length, its chunk list and metadata.

    `chunks` may be given as any sequence of `Fprint`s; it is stored as a
    `ChunkList`."""

    len: int
    chunks: ChunkList
    header_fprint: Fprint
    contents_fprint: Fprint
    version_id: bytes = b""
    ctime: int = 0
    ctime_ns: int = 0
    bundled: dict[int, bytes] = dataclasses.field(default_factory=dict)
    base_chunks_fprint: Optional[Fprint] = None
    generated_by: bytes = GENERATED_BY
    # Where the chunks live in a packed store (`packs.PackedLayout`); None
    # in Verneuil's layout, where each chunk is an object named by it.
    layout: Optional["PackedLayout"] = None

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, ChunkList):
            self.chunks = ChunkList(self.chunks)

    def chunk_length(self, index: int) -> int:
        """Byte length of chunk `index` (the last one may be short)."""
        return min(CHUNK_SIZE, self.len - index * CHUNK_SIZE)


def chunk_count(length: int) -> int:
    """Number of 64 KiB chunks that cover a file of `length` bytes."""
    return (length + CHUNK_SIZE - 1) // CHUNK_SIZE


ChunksLike = Union[ChunkList, Iterable[Fprint]]


def _as_chunk_list(chunks: ChunksLike) -> ChunkList:
    return chunks if isinstance(chunks, ChunkList) else ChunkList(chunks)


def words_of(chunks: ChunksLike) -> bytes:
    """The little-endian u64 words major0, minor0, major1, ... of a chunk
    list (a ChunkList or any iterable of Fprints)."""
    return bytes(_as_chunk_list(chunks).words_le())


def contents_fprint_of(chunks: ChunksLike) -> Fprint:
    """`contents_fprint`: the directory-key fingerprint of the chunk words."""
    return fingerprint(_as_chunk_list(chunks).words_le(), DIRECTORY_KEY)


def zstd_frame_bound(n: int) -> int:
    """The longest a zstd frame of `n` bytes of content may be (zstd's
    worst-case growth, and room for the frame's header and options)."""
    return n + (n >> 8) + ZSTD_FRAME_SLACK


def manifest_blob_limit(max_db_size: int) -> int:
    """The largest manifest blob accepted for a database of at most
    `max_db_size` bytes: the bound on the stored object (raw protobuf or a
    zstd frame of it) and on its decompressed size.  16 bytes per chunk
    and at most 27 more for a packed layout, room for bundled chunks and
    the other fields, and zstd's worst-case expansion; never more than
    MAX_MANIFEST_BYTES."""
    if max_db_size < 0:
        raise ValueError("max_db_size must not be negative, got %d" % max_db_size)
    raw = ((MANIFEST_BYTES_PER_CHUNK + PACKED_LAYOUT_BYTES_PER_CHUNK) * chunk_count(max_db_size)
           + MANIFEST_BUNDLED_ALLOWANCE + MANIFEST_OTHER_ALLOWANCE)
    return min(MAX_MANIFEST_BYTES, zstd_frame_bound(raw))


def format_size(n: int) -> str:
    """`n` bytes for messages: "64 GiB", "512 MiB", "1.5 TiB" or "1234 bytes"."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return ("%d %s" % (value, unit)) if value == int(value) else ("%.1f %s" % (value, unit))
    return "%d bytes" % n


def header_fprint_of(data) -> Fprint:
    """`header_fprint`: the header-key fingerprint of bytes [0, 100)."""
    return fingerprint(bytes(data[:HEADER_BYTES]), HEADER_KEY)


def _set_fp(msg, fp: Fprint) -> None:
    msg.major, msg.minor = fp


def _xor_array(words: array, base: bytes) -> None:
    """XOR `words` (an array('Q'), in place) with the u64 words of `base`
    (at most 64 KiB, so at most 8192 words are touched)."""
    n = min(len(base) // 8, len(words))
    for i, b in enumerate(struct.unpack("<%dQ" % n, base[:8 * n])):
        words[i] ^= b


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
    chunks = _as_chunk_list(m.chunks)
    words = chunks.words
    if m.base_chunks_fprint is not None:
        if base is None or fingerprint(base, CHUNK_KEY) != m.base_chunks_fprint or len(base) % 16:
            raise ValueError("encode_manifest needs the base chunk's bytes (a multiple of 16)")
        words = array("Q", words)
        _xor_array(words, base)
    v1.chunks.extend(words)
    for index in sorted(m.bundled):
        b = v1.bundled_chunks.add()
        b.chunk_index = index
        b.chunk_offset = index * CHUNK_SIZE
        _set_fp(b.chunk_fprint, chunks[index])
        b.chunk_data = m.bundled[index]
    if m.layout is not None:
        from verneuil_fuse.format.packs import layout_to_pb  # packs builds on this module
        layout_to_pb(v1, m.layout)
    return top.SerializeToString()


def compress_manifest(raw: bytes) -> bytes:
    """A zstd frame of a manifest, as uploaded (level 1)."""
    return zstandard.ZstdCompressor(level=MANIFEST_ZSTD_LEVEL).compress(raw)


# Each thread's zstd contexts (`compress_chunk`, `_thread_decompressor`):
# neither kind is for two threads at once.
_per_thread = threading.local()


def compress_chunk(raw: bytes) -> bytes:
    """A zstd frame of a chunk, as uploaded (zstd's default level), made by
    this thread's compressor: making one per chunk cost a tenth of the
    chunk's compression (its context allocated and cleared each time)."""
    cctx = getattr(_per_thread, "cctx", None)
    if cctx is None:
        cctx = _per_thread.cctx = zstandard.ZstdCompressor(level=CHUNK_ZSTD_LEVEL)
    return cctx.compress(raw)


class _PastLimit(zstandard.ZstdError):
    """A zstd frame whose content is longer than the caller's limit."""


# Output read at a time when measuring a frame that failed to decompress:
# bounds the memory spent telling "too long" from "broken".
_PROBE_PIECE = 1 << 20


def _longer_than(blob: bytes, limit: int) -> bool:
    """Whether the frame's content runs past `limit` bytes (reading at most
    limit + 1 bytes of output, a piece at a time, keeping none)."""
    total = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(blob) as reader:
            while total <= limit:
                piece = reader.read(min(_PROBE_PIECE, limit + 1 - total))
                if not piece:
                    break
                total += len(piece)
    except zstandard.ZstdError:
        pass
    return total > limit


# Frames whose output bound is at most this (chunks, 64 KiB) are decompressed
# with their thread's own decompressor, made once (`_thread_decompressor`):
# making one costs ~15 us (zstd probes the CPU, a trapped instruction in a
# VM), ten times the decompression of a chunk; a larger bound (a manifest,
# up to hundreds of MiB) gets a new one, so that no thread keeps the buffers
# of a large frame.
_REUSED_DECOMPRESSOR_LIMIT = 1 << 20


def _thread_decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor (a ZstdDecompressor is not for two threads
    at once; each call resets its state, a failed frame's included)."""
    dctx = getattr(_per_thread, "dctx", None)
    if dctx is None:
        dctx = _per_thread.dctx = zstandard.ZstdDecompressor()
    return dctx


def _decompress_bounded(blob: bytes, limit: int) -> bytes:
    """zstd-decompress one whole frame of at most `limit` bytes (any bytes
    after it are ignored).  `_PastLimit` (a ZstdError) when the frame declares
    or produces more, never holding more than `limit` + 1 bytes of output (a
    decompression bomb stops early); ZstdError on a broken or cut frame."""
    declared = zstandard.get_frame_parameters(blob).content_size
    unknown = declared in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR)
    if not unknown and declared > limit:
        raise _PastLimit("declares %d bytes, more than %d" % (declared, limit))
    dctx = _thread_decompressor() if limit <= _REUSED_DECOMPRESSOR_LIMIT else zstandard.ZstdDecompressor()
    try:
        # One pass: the output buffer is the declared size, or `limit` bytes
        # when the frame does not declare one (then a longer frame fails).
        return dctx.decompress(blob, max_output_size=max(limit, 1))
    except zstandard.ZstdError:
        if unknown and _longer_than(blob, limit):
            raise _PastLimit("decompresses past %d bytes" % limit) from None
        raise


def _size_limit_detail(max_db_size: int) -> str:
    return "the limit for databases of up to %s (max_db_size, configurable)" % format_size(max_db_size)


def _decompress_manifest(blob: bytes, limit: int, max_db_size: int) -> bytes:
    if not blob.startswith(ZSTD_MAGIC):
        return blob
    try:
        return _decompress_bounded(blob, limit)
    except _PastLimit:
        raise ManifestError("size-limit", "zstd frame decompresses past %d bytes, %s"
                            % (limit, _size_limit_detail(max_db_size))) from None
    except zstandard.ZstdError:
        return blob  # docs/FORMAT.md: a manifest that fails to decompress is tried raw


def _parse(raw: bytes):
    top = manifest_pb2.Manifest()
    try:
        top.ParseFromString(raw)
    except Exception as e:  # the protobuf runtime raises DecodeError and friends
        raise ManifestError("protobuf", "not a Manifest message: %s" % e) from None
    return top


def _fp(msg) -> Fprint:
    return Fprint(msg.major, msg.minor)


def decode_chunk(blob: bytes, expected: Fprint, max_size: int = CHUNK_SIZE) -> bytes:
    """The bytes of a chunk blob (zstd or raw) of at most `max_size` bytes,
    verified against `expected`'s full 128 bits; ChunkError otherwise (never
    wrong bytes)."""
    if blob.startswith(ZSTD_MAGIC):
        try:
            data = _decompress_bounded(blob, max_size)
        except zstandard.ZstdError:
            data = None
        if data is not None and fingerprint(data, CHUNK_KEY) == expected:
            return data
    if len(blob) <= max_size and fingerprint(blob, CHUNK_KEY) == expected:
        return bytes(blob)
    raise chunk_mismatch(expected)


def chunk_mismatch(expected: Fprint) -> ChunkError:
    """The error of a blob that is not the chunk `expected` names."""
    return ChunkError("chunk %s: bytes do not match its fingerprint" % expected.name)


def base_chunk_limit(max_db_size: int = DEFAULT_MAX_DB_SIZE) -> int:
    """The largest base chunk accepted for databases of up to `max_db_size`
    bytes: a chunk list of that many chunks, 16 bytes each (Verneuil's writer
    makes its base chunks as long as the list they encode; docs/FORMAT.md)."""
    return 16 * max(1, -(-max_db_size // CHUNK_SIZE))


def base_chunk_blob_limit(max_db_size: int = DEFAULT_MAX_DB_SIZE) -> int:
    """The largest base chunk object read from a store: `base_chunk_limit`
    bytes, raw or as a zstd frame of them (zstd's worst-case growth)."""
    return zstd_frame_bound(base_chunk_limit(max_db_size))


def decode_base_chunk(blob: bytes, expected: Fprint, max_db_size: int = DEFAULT_MAX_DB_SIZE) -> bytes:
    """`decode_chunk` for a base chunk, bounded by `base_chunk_limit`."""
    return decode_chunk(blob, expected, base_chunk_limit(max_db_size))


def raw_manifest(blob: bytes, max_db_size: int = DEFAULT_MAX_DB_SIZE) -> bytes:
    """The protobuf bytes of a manifest blob (zstd or raw), bounded as
    `decode_and_validate` bounds them (rules 1 to 3), not parsed."""
    limit = manifest_blob_limit(max_db_size)
    if len(blob) > limit:
        raise ManifestError("size-limit", "blob of %d bytes is larger than %d bytes, %s"
                            % (len(blob), limit, _size_limit_detail(max_db_size)))
    raw = _decompress_manifest(bytes(blob), limit, max_db_size)
    if raw.startswith(ZSTD_MAGIC):
        # Tried as raw protobuf, the magic reads as top-level field 5 with
        # varint type, which a Manifest never has: this is a broken frame.
        raise ManifestError("zstd", "zstd frame that does not decompress")
    return raw


def same_manifest(blob: bytes, raw: bytes) -> bool:
    """Whether the manifest object `blob` (raw protobuf, or a zstd frame of
    it) holds exactly the raw manifest `raw`, decompressing at most
    len(raw) + 1 bytes of it."""
    if blob == raw:
        return True
    if not blob.startswith(ZSTD_MAGIC):
        return False
    try:
        with zstandard.ZstdDecompressor().stream_reader(blob) as reader:
            return reader.read(len(raw) + 1) == raw
    except zstandard.ZstdError:
        return False


class StoredFields(NamedTuple):
    """A manifest's fields as stored (`stored_fields`): its chunk list
    still XOR-ed with its base chunk when it has one."""

    len: int
    header_fprint: Fprint
    contents_fprint: Fprint
    words: array


def stored_fields(blob: bytes, max_db_size: int = MAX_REPLICATED_DB_SIZE) -> StoredFields:
    """The fields of a manifest object, bounded as `decode_and_validate`
    bounds it and parsed, not validated: what a caller needs of a manifest
    it cannot validate (its base chunk lost or not at hand). ManifestError
    for an object that is no manifest."""
    v1 = _parse(raw_manifest(blob, max_db_size)).v1
    return StoredFields(v1.len, _fp(v1.header_fprint), _fp(v1.contents_fprint), array("Q", v1.chunks))


def decode_and_validate(blob: bytes,
                        fetch_chunk: Optional[Callable[[Fprint], bytes]] = None, *,
                        max_db_size: int = DEFAULT_MAX_DB_SIZE) -> Manifest:
    """Decode a manifest blob (zstd or raw) and apply every rule of docs/FORMAT.md.

    `fetch_chunk(fprint)` returns a chunk's (verified) bytes; it is needed only
    for manifests whose chunk list is XOR-ed with a base chunk.

    `max_db_size` bounds the work a manifest can cause: a blob longer than
    `manifest_blob_limit(max_db_size)`, a frame that decompresses past it, or
    a `len` above `max_db_size` is refused with rule "size-limit", and the
    chunk count is checked against `len` before any per-chunk work.
    """
    top = _parse(raw_manifest(blob, max_db_size))
    if not top.HasField("v1"):
        raise ManifestError("v1-missing", "no ManifestV1 in the message")
    v1 = top.v1
    for field in ("header_fprint", "contents_fprint"):
        if not v1.HasField(field):
            raise ManifestError(field.replace("_", "-") + "-missing", "%s is absent" % field)
    length = v1.len
    if length > max_db_size:
        raise ManifestError("size-limit", "a database of %s (%d bytes) is larger than the %s "
                            "limit (max_db_size, configurable)"
                            % (format_size(length), length, format_size(max_db_size)))
    nwords = len(v1.chunks)
    if nwords % 2:
        raise ManifestError("chunks-odd", "chunk list has an odd number (%d) of words" % nwords)
    if chunk_count(length) != nwords // 2:
        raise ManifestError("length", "%d chunks cannot hold %d bytes" % (nwords // 2, length))
    words = array("Q", v1.chunks)
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
        _xor_array(words, base)
    chunks = ChunkList.from_words(words)
    contents = _fp(v1.contents_fprint)
    if contents_fprint_of(chunks) != contents:
        raise ManifestError("contents-fprint", "chunk list does not match contents_fprint")
    m = Manifest(len=length, chunks=chunks, header_fprint=_fp(v1.header_fprint),
                 contents_fprint=contents, version_id=bytes(v1.version_id),
                 ctime=v1.ctime, ctime_ns=v1.ctime_ns, base_chunks_fprint=base_fp,
                 generated_by=bytes(v1.generated_by))
    _take_bundled(v1, m)
    if 0 in m.bundled and header_fprint_of(m.bundled[0]) != m.header_fprint:
        raise ManifestError("header-fprint", "header_fprint does not match bytes [0, 100)")
    from verneuil_fuse.format.packs import layout_from_pb  # packs builds on this module
    m.layout = layout_from_pb(v1, len(chunks))
    return m


def _take_bundled(v1, m: Manifest) -> None:
    """Check every bundled chunk of `v1` (docs/FORMAT.md, "Bundled chunks")
    and put its bytes in `m.bundled`."""
    chunks = m.chunks
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
