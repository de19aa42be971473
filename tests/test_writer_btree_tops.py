"""The writer bundles the chunks of the b-trees' upper levels in each manifest
(csrc/btree_tops.c): which chunks, within the budget, and never bytes that
differ from the file, even when the file is damaged or changed behind the
VFS's back.

The expected chunks come from an independent walk of the source file with
Python (verneuil_fuse.reader.btree and sqlite_schema read by SQLite itself).
"""
from __future__ import annotations

import os
import random
import shutil
import sqlite3

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import writer_vfs
from support.replicas import make_db
from verneuil_fuse.reader import btree
from verneuil_fuse.format import CHUNK_SIZE

from support import spoolutil

# A table t(id, k, v) and an index t_k whose trees are 3 levels deep, each
# level below the roots (which sit in chunk 0) spread over a few chunks: t's
# over 4, t_k's over 2 (asserted below, from the file itself).
ROWS = 60000


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tops") / "src.db")
    make_db(path, ROWS, seed=14, payload=100)
    return path


@pytest.fixture
def spool(tmp_path):
    path = str(tmp_path / "spool")
    writer_vfs.register(path)
    old = writer_vfs.set_bundle_chunks(4)
    yield path
    writer_vfs.set_bundle_chunks(old)


def tree_levels(data: bytes) -> dict[str, list[set[int]]]:
    """For each b-tree, the chunks of each interior level, root first."""
    page_size = int.from_bytes(data[16:18], "big")
    max_page = len(data) // page_size
    with sqlite3.connect(":memory:") as mem:
        mem.deserialize(data)
        roots = [("sqlite_schema", 1)] + mem.execute(
            "SELECT name, rootpage FROM sqlite_schema WHERE rootpage > 0").fetchall()
    out = {}
    for name, root in roots:
        levels, level = [], [root]
        while level:
            kids = []
            for p in level:
                page = data[(p - 1) * page_size : p * page_size]
                got = btree.interior_children(page, p, max_page)
                if got is None:
                    break
                kids += got
            else:
                levels.append({(p - 1) * page_size // CHUNK_SIZE for p in level})
                level = kids
                continue
            break
        out[name] = levels
    return out


def snapshot(db: str, spool: str):
    """One commit through the VFS; the staged manifest, checked against the
    file (bundled chunks included: spoolutil.rebuild compares them with the
    chunk files, which must exist too)."""
    conn = writer_vfs.connect(db)
    conn.execute("PRAGMA user_version = %d" % random.randrange(1, 1 << 30))
    conn.commit()
    stats = writer_vfs.stats(conn)
    conn.close()
    db_dir = spoolutil.db_spool_dir(spool, db)
    with open(db, "rb") as f:
        data = f.read()
    assert spoolutil.rebuild_from_staging(db_dir, db_path=db) == data
    _, m = spoolutil.read_manifest_dir(os.path.join(db_dir, "staging", "meta"))
    for i, chunk in m.bundled.items():
        assert chunk == data[i * CHUNK_SIZE : (i + 1) * CHUNK_SIZE]
    return m, stats, data


@pytest.mark.parametrize("budget", [0, 1, 4, 16])
def test_bundles_the_levels_below_the_roots(source, spool, tmp_path, budget):
    db = str(tmp_path / "db.db")
    shutil.copy(source, db)
    writer_vfs.set_bundle_chunks(budget)
    m, stats, data = snapshot(db, spool)
    levels = tree_levels(data)
    table, index = levels["t"], levels["t_k"]
    # The shape the expectations rely on: roots in chunk 0, one level below
    # them that is cheap to bundle, a next level far too wide.
    assert len(table) == len(index) == 2 and table[0] == index[0] == {0}
    assert (len(table[1]), len(index[1])) == (4, 2), (table, index)
    assert levels["sqlite_schema"] == [] or levels["sqlite_schema"] == [{0}]
    expected = {
        0: set(),
        1: set(),  # no tree's level fits in one chunk
        4: index[1],  # cheapest first: t_k's 2 chunks, then t's 4 do not fit
        16: table[1] | index[1],  # both; the next levels are hundreds of chunks
    }[budget]
    assert set(m.bundled) - {0} == expected
    assert stats["bundled"] == len(expected)
    # Later commits keep bundling the same chunks, at their new bytes.
    conn = writer_vfs.connect(db)
    for i in range(5):
        conn.execute("UPDATE t SET v = randomblob(100) WHERE id = ?", (i * 9973,))
        conn.commit()
    conn.close()
    m2, _, _ = snapshot(db, spool)
    assert set(m2.bundled) == set(m.bundled)


def test_an_index_built_late_bundles_its_root_and_the_level_below(spool, tmp_path):
    """CREATE INDEX after the rows are in puts the index's root at the end of
    the file, outside chunk 0: the walk takes the root's chunk (level 0),
    then the level below, cheapest trees first at each level."""
    db = str(tmp_path / "late.db")
    make_db(db, ROWS, seed=3, payload=100, index=False)
    with sqlite3.connect(db) as con:
        con.execute("CREATE INDEX t_k ON t(k)")
    con.close()
    writer_vfs.set_bundle_chunks(4)
    m, _, data = snapshot(db, spool)
    levels = tree_levels(data)
    table, index = levels["t"], levels["t_k"]
    assert table[0] == {0} and index[0] != {0} and len(index) == len(table) == 2
    tops = index[0] | index[1]
    assert len(tops) <= 4 < len(tops | table[1]), (table, index)
    assert set(m.bundled) - {0} == tops
    writer_vfs.set_bundle_chunks(16)
    m, _, _ = snapshot(db, spool)
    assert set(m.bundled) - {0} == tops | table[1]


def test_damaged_interior_pages_never_break_a_snapshot(source, spool, tmp_path):
    """Garbage in the pages the walk reads (the roots and the level below;
    SQLite itself does not read them for this commit) gives fewer or other
    bundled chunks, never a wrong manifest and never a failed commit."""
    clean = open(source, "rb").read()
    page_size = int.from_bytes(clean[16:18], "big")
    levels = tree_levels(clean)
    max_page = len(clean) // page_size
    # Pages of the levels below the roots, and the roots themselves.
    victims = []
    with sqlite3.connect(":memory:") as mem:
        mem.deserialize(clean)
        roots = [r for (r,) in mem.execute("SELECT rootpage FROM sqlite_schema WHERE rootpage > 0")]
    for root in roots:
        page = clean[(root - 1) * page_size : root * page_size]
        victims.append(root)
        victims += btree.interior_children(page, root, max_page) or []
    assert levels["t"][1] and len(victims) > 4
    rng = random.Random(8)
    for trial in range(12):
        db = str(tmp_path / ("damaged%d.db" % trial))
        data = bytearray(clean)
        for p in rng.sample(victims, 3):
            n = rng.choice([2, 16, 64, page_size])
            start = (p - 1) * page_size + rng.randrange(0, page_size - n + 1)
            data[start : start + n] = rng.randbytes(n)
        with open(db, "wb") as f:
            f.write(data)
        writer_vfs.set_bundle_chunks(16)
        m, stats, got = snapshot(db, spool)  # the commit itself must work
        assert got[100:] == bytes(data[100:])  # only the header changed
        assert len(m.bundled) - 1 == stats["bundled"] <= 16


def test_a_bundled_chunk_changed_behind_our_back_forces_a_rebuild(source, spool, tmp_path):
    """A bundled chunk is read and fingerprinted at every commit: bytes that
    changed without a version change (so no dirty chunk says so) are caught
    there, and the snapshot is rebuilt from a full scan (which would also
    catch other chunks changed the same way)."""
    db = str(tmp_path / "sneaky.db")
    shutil.copy(source, db)
    m, _, data = snapshot(db, spool)
    chunk = min(set(m.bundled) - {0})
    page_size = int.from_bytes(data[16:18], "big")
    # A leaf page of that chunk: the walk still takes the chunk.
    for p in range(chunk * CHUNK_SIZE // page_size + 1, (chunk + 1) * CHUNK_SIZE // page_size + 1):
        if data[(p - 1) * page_size] in (btree.LEAF_INDEX, btree.LEAF_TABLE):
            break
    else:
        pytest.fail("no leaf page in chunk %d" % chunk)
    with open(db, "r+b") as f:
        f.seek((p - 1) * page_size + page_size - 40)
        f.write(b"behind the VFS's back")
    m2, stats, _ = snapshot(db, spool)
    assert stats["verify_mismatch"] >= 1 and stats["full"] == 1 and stats["incremental"] == 0
    assert chunk in m2.bundled and m2.chunks[chunk] != m.chunks[chunk]


def test_budget_out_of_range_is_refused(spool):
    before = writer_vfs.set_bundle_chunks(3)
    assert before == 4
    for bad in (-1, 17):
        with pytest.raises(ValueError):
            writer_vfs.set_bundle_chunks(bad)
    assert writer_vfs.set_bundle_chunks(4) == 3


# ---------------------------------------------------------------- the walk alone
# csrc/btree_tops.c over bytes in memory (a cffi test hook, writer_vfs._vfs
# only), so that it can be fed files SQLite itself would refuse to open.

def tops_of(data: bytes, budget: int) -> list[int]:
    from writer_vfs._vfs import ffi, lib

    out = ffi.new("unsigned long long[]", 16)
    n = lib.vn_test_btree_tops(data, len(data), budget, out, 16)
    assert n >= 0, "the walk returned %d (-2: bundled bytes that are not the file's)" % n
    return list(out[0:n])


def test_the_walk_in_memory_matches_the_writer(source):
    data = open(source, "rb").read()
    levels = tree_levels(data)
    assert tops_of(data, 4) == sorted(levels["t_k"][1])
    assert tops_of(data, 16) == sorted(levels["t"][1] | levels["t_k"][1])
    assert tops_of(data, 0) == [] and tops_of(data[:99], 16) == []


@pytest.fixture(scope="module")
def small_deep(tmp_path_factory):
    """512-byte pages: a 3-level table and index in a 1.3 MiB file, so that
    every mutation below lands on pages the walk reads."""
    path = str(tmp_path_factory.mktemp("fuzz") / "small.db")
    make_db(path, 3000, seed=5, page_size=512, payload=150)
    data = open(path, "rb").read()
    page_size = 512
    levels = tree_levels(data)
    assert max(len(v) for v in levels.values()) >= 2
    interesting = {1}
    with sqlite3.connect(":memory:") as mem:
        mem.deserialize(data)
        for (root,) in mem.execute("SELECT rootpage FROM sqlite_schema WHERE rootpage > 0"):
            interesting.add(root)
            page = data[(root - 1) * page_size : root * page_size]
            interesting.update(btree.interior_children(page, root, len(data) // page_size) or [])
    return data, sorted(interesting)


_mutation = st.tuples(
    st.integers(0, 10**6),  # which page: an interesting one (mod their count) or any
    st.booleans(),  # interesting page?
    st.integers(0, 511),  # offset in the page
    st.binary(min_size=1, max_size=64),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(muts=st.lists(_mutation, max_size=6), cut=st.integers(0, 2**21), budget=st.integers(0, 16))
def test_the_walk_survives_any_bytes(small_deep, muts, cut, budget):
    """Random bytes over the schema, the roots and the levels below them, and
    files cut anywhere: the walk returns chunks of the file, ascending, within
    the budget, each with the file's bytes (checked in C), and never crashes."""
    base, interesting = small_deep
    data = bytearray(base)
    npages = len(data) // 512
    for which, pick, off, blob in muts:
        page = interesting[which % len(interesting)] if pick else 1 + which % npages
        start = (page - 1) * 512 + off
        data[start : start + len(blob)] = blob[: len(data) - start]
    if cut < len(data):
        del data[max(cut, 100):]
    got = tops_of(bytes(data), budget)
    nchunks = -(-len(data) // CHUNK_SIZE)
    assert got == sorted(set(got)) and len(got) <= budget
    assert all(0 < i < nchunks for i in got)
