"""btree.py against SQLite's own view of its pages (the dbstat table)."""
from __future__ import annotations

import sqlite3

import pytest

from support.replicas import make_db
from verneuil_fuse.reader import btree


def _dbstat(path):
    con = sqlite3.connect(path)
    try:
        rows = con.execute("SELECT name, path, pageno, pagetype FROM dbstat").fetchall()
    except sqlite3.OperationalError:
        pytest.skip("this SQLite has no dbstat table")
    finally:
        con.close()
    by_path = {(name, p): (pageno, kind) for name, p, pageno, kind in rows}
    expected = {}
    for (name, p), (pageno, kind) in by_path.items():
        if kind != "internal":
            continue
        kids = sorted(
            q for (n, q) in by_path
            if n == name and q.startswith(p) and q != p and q.count("/") == p.count("/") + 1 and "+" not in q
        )
        expected[pageno] = [by_path[(name, q)][0] for q in kids]
    return expected


@pytest.mark.parametrize("page_size", [512, 4096, 65536])
def test_interior_pages_match_dbstat(tmp_path, page_size):
    path = str(tmp_path / "t.db")
    make_db(path, 3000 if page_size > 512 else 1500, page_size=page_size, payload=120)
    data = open(path, "rb").read()
    header = btree.parse_header(data[:100])
    assert header is not None and header.page_size == page_size
    assert header.page_count * page_size == len(data)
    expected = _dbstat(path)
    assert expected, "the test database should have interior pages"
    max_page = len(data) // page_size
    # Parse chunk by chunk, as the reader does.
    found = {}
    for start in range(0, len(data), 65536):
        for page_no, children in btree.interior_pages(data[start:start + 65536], start, page_size, max_page):
            found[page_no] = children
    assert found == expected


def test_rejects_garbage():
    assert btree.parse_header(b"not a database" * 10) is None
    assert btree.parse_header(b"SQLite format 3\x00" + b"\x00" * 84) is None  # page size 0
    assert btree.interior_children(b"\x05" + b"\xff" * 4095, 2, 10) is None  # child out of range
    assert btree.interior_children(b"\x0d" + b"\x00" * 4095, 2, 10) is None  # a leaf
    assert btree.interior_children(b"\x05\x00", 2, 10) is None  # too short
    assert list(btree.interior_pages(bytes(65536), 0, 4096, 16)) == []


def test_page_size_one_means_64k():
    header = bytearray(b"SQLite format 3\x00" + bytes(84))
    header[16:18] = (1).to_bytes(2, "big")
    assert btree.parse_header(bytes(header)).page_size == 65536
