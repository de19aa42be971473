"""The packed layout's bytes (docs/FORMAT.md, "Packed layout"): the layout
field of a manifest, its validation rules and bounds, where a chunk is
(`chunk_source`), runs of adjacent chunks (`chunk_runs`), pack keys, and
that Verneuil's decoder (which knows only its own fields) reads a packed
manifest as the same Verneuil manifest."""
from __future__ import annotations

import random

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from verneuil_fuse import format as fmt
from verneuil_fuse.format import manifest_pb2

CS = fmt.CHUNK_SIZE
SPACE = fmt.Fprint(0x1111, 0x2222)
P1, P2 = fmt.Fprint(1, 10), fmt.Fprint(2, 20)


def snapshot(nchunks: int = 5, seed: int = 1):
    data = b"SQLite format 3\x00" + random.Random(seed).randbytes(nchunks * CS - 16 - 100)
    return fmt.snapshot_of(data)


def packed(m, places):
    m.layout = fmt.PackedLayout.build(SPACE, places)
    return fmt.encode_manifest(m)


def test_layout_round_trip_and_sources():
    m, _ = snapshot()
    places = [None, (P1, 0, 100), (P1, 100, 200), (P2, 0, 300), None]
    got = fmt.decode_and_validate(fmt.compress_manifest(packed(m, places)))
    assert got.layout == m.layout and [got.layout.place(i) for i in range(5)] == places
    p1 = fmt.pack_key(SPACE, P1)
    assert fmt.chunk_source(got, 1) == fmt.ChunkSource(p1, 0, 100)
    assert fmt.chunk_source(got, 2) == fmt.ChunkSource(p1, 100, 300)
    assert fmt.chunk_source(got, 3) == fmt.ChunkSource(fmt.pack_key(SPACE, P2), 0, 300)
    # No place: the chunk's own object, as in Verneuil's layout.
    assert fmt.chunk_source(got, 4) == fmt.ChunkSource(m.chunks[4].name)
    assert not fmt.chunk_source(got, 4).ranged and fmt.chunk_source(got, 1).max_bytes == 100
    assert fmt.stored_objects(got) == {p1: [1, 2], fmt.pack_key(SPACE, P2): [3], m.chunks[4].name: [4]}


def test_without_layout_the_bytes_are_verneuils():
    """Removing the layout gives back the very bytes of the same manifest
    in Verneuil's layout; a manifest without one is unchanged by it."""
    m, _ = snapshot()
    plain = fmt.encode_manifest(m)
    with_layout = packed(m, [None, (P1, 0, 9), (P1, 9, 9), (P1, 18, 9), (P2, 0, 1)])
    assert len(with_layout) > len(plain)
    assert fmt.strip_layout(with_layout) == plain
    assert fmt.with_layout(plain, m.layout) == with_layout
    assert fmt.strip_layout(plain) == plain
    assert fmt.decode_and_validate(plain).layout is None


def _verneuil_message_class():
    """Manifest as Verneuil's schema has it: without this project's field
    1024 nor its PackedLayout message (proto3 decoders skip unknown fields,
    as Verneuil's prost does)."""
    proto = descriptor_pb2.FileDescriptorProto()
    manifest_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = "verneuil_only.proto"
    proto.package = "verneuil_only"
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = field.type_name.replace(".verneuil.", ".verneuil_only.")
        kept = [f for f in message.field if f.number < 1024]
        del message.field[:]
        message.field.extend(kept)
    kept_types = [t for t in proto.message_type if t.name != "PackedLayout"]
    del proto.message_type[:]
    proto.message_type.extend(kept_types)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("verneuil_only.Manifest"))


def test_verneuils_decoder_reads_a_packed_manifest_as_its_own():
    m, _ = snapshot()
    blob = packed(m, [None, (P1, 0, 9), (P1, 9, 9), (P1, 18, 9), (P2, 0, 1)])
    verneuil = _verneuil_message_class()()
    verneuil.ParseFromString(blob)
    ours = manifest_pb2.Manifest()
    ours.ParseFromString(fmt.encode_manifest(fmt.decode_and_validate(fmt.strip_layout(blob))))
    v, o = verneuil.v1, ours.v1
    assert list(v.chunks) == list(o.chunks) and v.len == o.len
    assert (v.contents_fprint.major, v.contents_fprint.minor) == tuple(m.contents_fprint)
    assert [b.chunk_data for b in v.bundled_chunks] == [b.chunk_data for b in o.bundled_chunks]


BAD = [
    ("odd pack words", lambda p: p.packs.append(7)),
    ("too many packs", lambda p: p.packs.extend([9] * 2 * 7)),
    ("locations short", lambda p: p.locations.pop()),
    ("no pack", lambda p: p.locations.__setitem__(3, 3)),
    ("zero length", lambda p: p.locations.__setitem__(5, 0)),
    ("blob too long", lambda p: p.locations.__setitem__(5, fmt.MAX_CHUNK_BLOB_BYTES + 1)),
    ("past the pack bound", lambda p: p.locations.__setitem__(4, fmt.MAX_PACK_BYTES - 8)),
    ("a range without a pack", lambda p: p.locations.__setitem__(13, 5)),
    ("packs without a space", lambda p: p.ClearField("space")),
]


@pytest.mark.parametrize("what, spoil", BAD, ids=[b[0] for b in BAD])
def test_broken_layouts_are_refused(what, spoil):
    m, _ = snapshot()
    top = manifest_pb2.Manifest()
    top.ParseFromString(packed(m, [None, (P1, 0, 100), (P1, 100, 200), (P2, 0, 300), None]))
    spoil(top.v1.packed)
    with pytest.raises(fmt.ManifestError) as err:
        fmt.decode_and_validate(top.SerializeToString())
    assert err.value.rule == "packed-layout", what


def test_the_largest_layout_fits_the_manifest_bound():
    """One pack per chunk, every place at the far end of its bounds: still
    within manifest_blob_limit (27 bytes a chunk for the layout)."""
    n = 300
    data = random.Random(3).randbytes(n * CS)
    m, _ = fmt.snapshot_of(data)
    places = [None] + [(fmt.Fprint(2**64 - 1 - i, 2**64 - 1), fmt.MAX_PACK_BYTES - fmt.MAX_CHUNK_BLOB_BYTES,
                        fmt.MAX_CHUNK_BLOB_BYTES) for i in range(1, n)]
    m.bundled = {0: m.bundled[0]}
    blob = packed(m, places)
    assert len(blob) <= fmt.manifest_blob_limit(n * CS)
    assert fmt.decode_and_validate(blob, max_db_size=n * CS).layout.place(n - 1) == places[-1]


def test_chunk_runs_join_adjacent_blobs_of_one_pack():
    m, _ = snapshot(8)
    half = fmt.MAX_RUN_BYTES // 2
    m.layout = fmt.PackedLayout.build(SPACE, [None, (P1, 0, 10), (P1, 10, 20), (P1, 40, 5), (P2, 0, 7),
                                              (P2, 7, half), (P2, 7 + half, half), None])
    runs = fmt.chunk_runs(m, [1, 2, 3, 4, 5, 6, 7])
    k1, k2 = fmt.pack_key(SPACE, P1), fmt.pack_key(SPACE, P2)
    assert runs == [
        fmt.Run(k1, 0, 30, [(1, 0, 10), (2, 10, 30)]),      # adjacent
        fmt.Run(k1, 40, 45, [(3, 0, 5)]),                   # a gap before it
        fmt.Run(k2, 0, 7 + half, [(4, 0, 7), (5, 7, 7 + half)]),
        fmt.Run(k2, 7 + half, 7 + 2 * half, [(6, 0, half)]),  # past MAX_RUN_BYTES with the others
        fmt.Run(m.chunks[7].name, 0, None, [(7, 0, None)]),  # its own object
    ]
    assert len(fmt.chunk_runs(m, [2, 1])) == 2  # in the order asked: not adjacent that way


def test_pack_keys():
    key = fmt.pack_key(SPACE, P1)
    assert key.startswith(fmt.space_prefix(SPACE)) and len(key) == 70
    assert fmt.parse_pack_key(key) == (SPACE, P1)
    for bad in (key[:-1], key.upper(), "x" + key[1:], key[:37] + "+" + key[38:], P1.name, ""):
        assert fmt.parse_pack_key(bad) is None, bad
