"""The packed layout (docs/FORMAT.md, "Packed layout"): where the chunks of a
manifest live when many chunk blobs share one object, read by byte range.

A pack object is the concatenation of chunk blobs, each exactly what a chunk
object would hold (one zstd frame, or the raw bytes), so any range of a pack
that starts and ends at blob boundaries is a run of chunks each decodable and
verifiable on its own.  A manifest of the packed layout carries a
`PackedLayout`: the packs' name space, the packs' fingerprints, and for every
chunk (pack, offset, length); pack 0 means "the chunk's own object", as in
Verneuil's layout.

This module owns:

- `PackedLayout`, `pack_key` / `parse_pack_key` (the packs' object names),
  and the layout's bounds (`MAX_PACK_BYTES`, `check_layout`);
- `ChunkSource` and `chunk_source(m, index)` (`chunk_sources` for many):
  the one answer, for either layout, to "which object, and which bytes of
  it, hold chunk `index`"; every reader asks it (through
  `store.Reads.where`), and `store.Reads.chunk` reads what it says;
- `chunk_runs`: the sources of several chunks coalesced into runs of
  adjacent blobs of one pack (one range read each), up to `MAX_RUN_BYTES`;
- `stored_objects`: the objects a manifest needs, each with the chunks it
  holds (touch patrol, `versions`, `repair`, GC);
- `with_layout` / `strip_layout`: a raw manifest with its layout set or
  removed (the copier adds the layout to what the writer staged).

Pure computation, no I/O.
"""
from __future__ import annotations

import dataclasses
from array import array
from typing import Iterable, NamedTuple, Optional

from verneuil_fuse.format import manifest_pb2
from verneuil_fuse.format.manifest import MAX_CHUNK_BLOB_BYTES, ChunkList, Manifest, ManifestError
from verneuil_fuse.format.names import ZERO_CHUNK_FPRINT
from verneuil_fuse.format.umash import Fprint

# Prefix of every pack key; then the name space and the pack's fingerprint,
# 32 lowercase hex digits each (70 characters in all: a valid flat key).
PACK_KEY_PREFIX = "pack-"
_PACK_KEY_LEN = len(PACK_KEY_PREFIX) + 32 + 1 + 32

# The largest pack a reader accepts: every chunk's range ends at or before
# this offset.  Writers make packs of a few MiB to a few tens of MiB
# (copier.packing.PACK_TARGET_BYTES); 64 MiB bounds what a server that
# ignores a Range header could make a reader download.
MAX_PACK_BYTES = 64 << 20

# The longest run `chunk_runs` coalesces into one range read: 1 MiB holds
# 16 incompressible chunks, and at ~1 request per MiB a cold scan's request
# count stops mattering next to its bytes (docs/BENCHMARKS.md).
MAX_RUN_BYTES = 1 << 20

# Words per chunk in `PackedLayout.locations`: pack, offset, length.
_WORDS = 3


def pack_key(space: Fprint, fp: Fprint) -> str:
    """The object key of pack `fp` in name space `space`."""
    return "%s%s-%s" % (PACK_KEY_PREFIX, space.hex(), fp.hex())


def parse_pack_key(key: str) -> Optional[tuple[Fprint, Fprint]]:
    """(space, pack fingerprint) of a pack key, or None if `key` is not one."""
    if len(key) != _PACK_KEY_LEN or not key.startswith(PACK_KEY_PREFIX) or key[37] != "-":
        return None
    a, b = key[5:37], key[38:]
    if not all(c in "0123456789abcdef" for c in a + b):
        return None
    return (Fprint(int(a[:16], 16), int(a[16:], 16)), Fprint(int(b[:16], 16), int(b[16:], 16)))


def space_prefix(space: Fprint) -> str:
    """The key prefix every pack of name space `space` starts with."""
    return "%s%s-" % (PACK_KEY_PREFIX, space.hex())


@dataclasses.dataclass
class PackedLayout:
    """Where every chunk of one manifest lives: ``locations`` holds three
    words per chunk, in file order: the pack (1-based index into ``packs``;
    0: the chunk's own object, or no object at all for chunk 0 and the zero
    chunk), the blob's offset in it and its length."""

    space: Fprint
    packs: ChunkList
    locations: array
    _keys: Optional[list[str]] = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def build(cls, space: Fprint, places: list[Optional[tuple[Fprint, int, int]]]) -> "PackedLayout":
        """The layout of chunks placed at ``places[i]`` = (pack fingerprint,
        offset, length), or None for a chunk with no place in a pack."""
        numbers: dict[Fprint, int] = {}
        locations = array("Q", bytes(8 * _WORDS * len(places)))
        for i, place in enumerate(places):
            if place is None:
                continue
            pack, offset, length = place
            number = numbers.setdefault(pack, len(numbers) + 1)
            locations[_WORDS * i:_WORDS * i + _WORDS] = array("Q", (number, offset, length))
        return cls(space, ChunkList(numbers), locations)

    def key(self, number: int) -> str:
        """The key of pack ``number`` (1-based)."""
        if self._keys is None:
            self._keys = [pack_key(self.space, fp) for fp in self.packs]
        return self._keys[number - 1]

    def keys(self) -> list[str]:
        return [self.key(n) for n in range(1, len(self.packs) + 1)]

    def place(self, index: int) -> Optional[tuple[Fprint, int, int]]:
        """(pack fingerprint, offset, length) of chunk ``index``, or None."""
        at = _WORDS * index
        number = self.locations[at]
        if not number:
            return None
        return self.packs[number - 1], self.locations[at + 1], self.locations[at + 2]

    def __len__(self) -> int:
        return len(self.locations) // _WORDS


class ChunkSource(NamedTuple):
    """Where a chunk's blob is: bytes [start, end) of object ``key`` in the
    chunk namespace, or the whole object when ``end`` is None (a chunk
    object of its own, Verneuil's layout)."""

    key: str
    start: int = 0
    end: Optional[int] = None

    @property
    def ranged(self) -> bool:
        return self.end is not None

    @property
    def max_bytes(self) -> int:
        """The most bytes reading this source may return."""
        return MAX_CHUNK_BLOB_BYTES if self.end is None else self.end - self.start


def chunk_source(m: Manifest, index: int) -> ChunkSource:
    """Which object, and which bytes of it, hold the blob of chunk ``index``
    of ``m``, in either layout.  (Bundled chunks and the zero chunk need no
    object at all: readers serve them before asking.)"""
    layout = m.layout
    if layout is not None:
        at = _WORDS * index
        number = layout.locations[at]
        if number:
            offset = layout.locations[at + 1]
            return ChunkSource(layout.key(number), offset, offset + layout.locations[at + 2])
    return ChunkSource(m.chunks[index].name)


def chunk_sources(m: Manifest, indices: Iterable[int]) -> list[ChunkSource]:
    """`chunk_source` of each of ``indices``, in one pass (a readahead's
    hint of hundreds of chunks)."""
    layout = m.layout
    if layout is None:
        return [chunk_source(m, i) for i in indices]
    locations, key, out = layout.locations, layout.key, []
    for index in indices:
        at = _WORDS * index
        number = locations[at]
        if number:
            offset = locations[at + 1]
            out.append(ChunkSource(key(number), offset, offset + locations[at + 2]))
        else:
            out.append(ChunkSource(m.chunks[index].name))
    return out


class Run(NamedTuple):
    """One read that serves several chunks: bytes [start, end) of ``key``
    (``end`` None: the whole object, one chunk object), and for each chunk
    its index and its blob's place in the bytes read, [lo, hi) (hi None:
    all of them)."""

    key: str
    start: int
    end: Optional[int]
    parts: list[tuple[int, int, Optional[int]]]


def chunk_runs(m: Manifest, indices, limit: int = MAX_RUN_BYTES) -> list[Run]:
    """The chunks ``indices`` (in the order given) as reads: a chunk whose
    blob starts in the same pack where the previous one's ends joins its run
    while the run stays within ``limit`` bytes; a chunk object is a run of
    its own."""
    runs: list[Run] = []
    current: Optional[Run] = None
    for index in indices:
        source = chunk_source(m, index)
        if source.end is None:
            current = None
            runs.append(Run(source.key, 0, None, [(index, 0, None)]))
            continue
        if (current is not None and current.key == source.key and current.end == source.start
                and source.end - current.start <= limit):
            current.parts.append((index, source.start - current.start, source.end - current.start))
            current = runs[-1] = current._replace(end=source.end)
            continue
        current = Run(source.key, source.start, source.end, [(index, 0, source.end - source.start)])
        runs.append(current)
    return runs


def stored_objects(m: Manifest) -> dict[str, list[int]]:
    """The objects the store must hold for ``m``, each with the chunks it
    serves (none for a base chunk), in file order: every chunk but chunk 0
    (always bundled) and the zero chunk (never stored)."""
    objects: dict[str, list[int]] = {}
    if m.base_chunks_fprint is not None and m.base_chunks_fprint != ZERO_CHUNK_FPRINT:
        objects[m.base_chunks_fprint.name] = []
    for index, fp in enumerate(m.chunks):
        if index == 0 or fp == ZERO_CHUNK_FPRINT:
            continue
        objects.setdefault(chunk_source(m, index).key, []).append(index)
    return objects


# -- the protobuf field ------------------------------------------------------


def layout_from_pb(v1, nchunks: int) -> Optional[PackedLayout]:
    """The `PackedLayout` of a parsed ManifestV1 of ``nchunks`` chunks, or
    None when it has none; ManifestError (rule "packed-layout") for one
    that breaks docs/FORMAT.md's rules."""
    if not v1.HasField("packed"):
        return None
    packed = v1.packed

    def bad(detail: str) -> ManifestError:
        return ManifestError("packed-layout", detail)

    words = len(packed.packs)
    if words % 2:
        raise bad("the pack list has an odd number (%d) of words" % words)
    npacks = words // 2
    if npacks > max(1, nchunks):
        raise bad("%d packs for %d chunks" % (npacks, nchunks))
    if len(packed.locations) != _WORDS * nchunks:
        raise bad("%d location words for %d chunks" % (len(packed.locations), nchunks))
    if npacks and not packed.HasField("space"):
        raise bad("packs without a name space")
    locations = array("Q", packed.locations)
    _check_locations(locations, npacks, bad)
    return PackedLayout(Fprint(packed.space.major, packed.space.minor),
                        ChunkList.from_words(array("Q", packed.packs)), locations)


def _check_locations(locations: array, npacks: int, bad) -> None:
    """Every chunk's place: no object (all three words 0), or a pack of the
    list, a blob of 1 to MAX_CHUNK_BLOB_BYTES bytes, ending within
    MAX_PACK_BYTES."""
    it = iter(locations)
    for index, (number, offset, length) in enumerate(zip(it, it, it)):
        if number == 0:
            if offset or length:
                raise bad("chunk %d has a range but no pack" % index)
        elif number > npacks:
            raise bad("chunk %d names pack %d of %d" % (index, number, npacks))
        elif not 0 < length <= MAX_CHUNK_BLOB_BYTES:
            raise bad("chunk %d has a blob of %d bytes" % (index, length))
        elif offset + length > MAX_PACK_BYTES:
            raise bad("chunk %d ends at byte %d of its pack, past %d" % (index, offset + length, MAX_PACK_BYTES))


def layout_to_pb(v1, layout: Optional[PackedLayout]) -> None:
    """Set (or, for None, clear) the layout field of a ManifestV1."""
    v1.ClearField("packed")
    if layout is None:
        return
    packed = v1.packed
    packed.SetInParent()
    if len(layout.packs):
        packed.space.major, packed.space.minor = layout.space
    packed.packs.extend(layout.packs.words)
    packed.locations.extend(layout.locations)


def with_layout(raw: bytes, layout: Optional[PackedLayout]) -> bytes:
    """The raw (uncompressed) manifest ``raw`` with its layout set to
    ``layout`` (None: removed); every other field as it was."""
    top = manifest_pb2.Manifest()
    top.ParseFromString(raw)
    layout_to_pb(top.v1, layout)
    return top.SerializeToString()


def strip_layout(raw: bytes) -> bytes:
    """``raw`` without its packed layout: the bytes the writer staged."""
    return with_layout(raw, None)
