"""The whole chain on the embedded default: writes through the C VFS, a
background copier, a real FUSE mount, then `verneuilctl query` (the Spark
data source) over 24 replicas; answers equal the sources'. (The data
source's API over the same chain: tests/test_spark_cluster.py.)"""
from __future__ import annotations

import csv
import glob
import os
import random
import socket
import sqlite3
import subprocess
import sys

import pytest

pytest.importorskip("pyspark")

from support.replicas import Mount, fuse_unavailable  # noqa: E402
from verneuil_fuse.format import local_hostname  # noqa: E402

pytestmark = [pytest.mark.fuse, pytest.mark.slow, pytest.mark.timeout(400)]
if fuse_unavailable():
    pytestmark.append(pytest.mark.skip(reason=fuse_unavailable()))

TENANTS = 24
QUERY = "SELECT region, count(*) AS n, sum(amount) AS total FROM orders GROUP BY region"


def direct(paths, query=QUERY):
    rows = set()
    for p in paths:
        con = sqlite3.connect("file:%s?mode=ro" % p, uri=True)
        rows.update(tuple(r) + (os.path.basename(p),) for r in con.execute(query))
        con.close()
    return rows


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    import writer_vfs
    from verneuil_fuse import copier

    root = tmp_path_factory.mktemp("e2e")
    spool, store_url = str(root / "spool"), "file://%s" % (root / "store")
    src = root / "src"
    src.mkdir()
    writer_vfs.register(str(spool))
    rnd = random.Random(5)
    paths = []
    with copier.start_background(str(spool), store_url, rate=0) as bg:
        for i in range(TENANTS):
            p = str(src / ("t%02d.db" % i))
            con = writer_vfs.connect(p)
            con.execute("CREATE TABLE orders(id INTEGER PRIMARY KEY, region TEXT, amount REAL)")
            for _ in range(3):  # several commits per database while the copier runs
                con.executemany("INSERT INTO orders(region, amount) VALUES (?, ?)",
                                [(rnd.choice("nsew"), rnd.randint(1, 1000) / 4) for _ in range(50 + 30 * i)])
                con.commit()
            con.close()
            paths.append(p)
        bg.flush(timeout=120)
    mount = Mount(store_url, str(root / "mnt"), "cache_dir=%s,refresh=1" % (root / "cache")).start()
    try:
        replica_dir = mount.path(local_hostname(), str(src))
        yield paths, replica_dir, root
    finally:
        mount.stop()


def test_replicas_equal_sources(chain):
    paths, replica_dir, _ = chain
    for p in paths:
        with open(p, "rb") as a, open(os.path.join(replica_dir, os.path.basename(p)), "rb") as b:
            assert a.read() == b.read(), p


def test_verneuilctl_query_writes_csv(chain):
    paths, replica_dir, root = chain
    out = str(root / "result.csv")
    # The glob as the shell expands it when left unquoted: many paths, then the SQL.
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "verneuilctl"), "query",
                           *sorted(glob.glob(os.path.join(replica_dir, "t0*.db"))), QUERY, "--master", "local[2]",
                           "--output", out, "--show", "5"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Only the command's own lines: none of the JVM's start-up notices.
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].startswith("10 databases, ") and lines[1] == "wrote 40 rows to " + out, lines
    assert "_source" in proc.stdout  # the first rows are shown
    rows = set()
    for part in glob.glob(os.path.join(out, "part-*.csv")):
        with open(part) as f:
            for r in csv.DictReader(f):
                rows.add((r["region"], int(r["n"]), float(r["total"]), os.path.basename(r["_source"])))
    assert rows == direct(sorted(paths)[:10])
    # The same output again: refused before Spark starts, the result kept;
    # a failing query says why in one line.
    ctl = os.path.join(os.path.dirname(sys.executable), "verneuilctl")
    before = sorted(os.listdir(out))
    proc = subprocess.run([ctl, "query", replica_dir, QUERY, "--output", out],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "exists: use --force" in proc.stderr, proc.stderr
    assert sorted(os.listdir(out)) == before
    proc = subprocess.run([ctl, "query", os.path.join(replica_dir, "t0*.db"), "SELECT nope FROM orders",
                           "--master", "local[2]"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].endswith("no such column: nope"), proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 2, proc.stderr[-2000:]  # the count, the error
    assert "Traceback" not in proc.stderr
    # Said by the driver, which compiled the SQL on the first database
    # before starting Spark (an executor's error names its host).
    assert "(executor host" not in proc.stderr and "query failed on %s/t00.db" % replica_dir in proc.stderr


def test_verneuilctl_query_union_aggregates_across_databases(chain):
    """`--union`: the SQL runs once, in Spark SQL, over the union of the
    table across every replica (with _source), so one count and one sum per
    region come back for all of them, equal to the sources' totals."""
    paths, replica_dir, root = chain
    out = str(root / "union.csv")
    sql = ("SELECT region, count(*) AS n, sum(amount) AS total, count(DISTINCT _source) AS dbs "
           "FROM orders GROUP BY region")
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "verneuilctl"), "query", replica_dir,
                           "--sql", sql, "--union", "--master", "local[2]", "--output", out, "--show", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = {}
    for part in glob.glob(os.path.join(out, "part-*.csv")):
        with open(part) as f:
            for r in csv.DictReader(f):
                got[r["region"]] = (int(r["n"]), round(float(r["total"]), 6), int(r["dbs"]))
    want: dict = {}
    for p in paths:
        con = sqlite3.connect("file:%s?mode=ro" % p, uri=True)
        for region, n, total in con.execute(QUERY):
            a, b, c = want.get(region, (0, 0.0, 0))
            want[region] = (a + n, b + total, c + 1)
        con.close()
    assert got == {k: (n, round(t, 6), d) for k, (n, t, d) in want.items()}
    assert len(got) == 4 and all(d == TENANTS for _, _, d in got.values())


def test_a_missing_database_is_explained_by_where_it_should_be(chain, tmp_path):
    """What a task says of a database it cannot open: absent from a
    verneuil mount, or absent because no verneuil mount holds its path."""
    from verneuil_fuse.spark import explain_failure

    _paths, replica_dir, root = chain
    error = sqlite3.OperationalError("unable to open database file")
    inside = explain_failure(os.path.join(replica_dir, "nope.db"), error)
    assert inside.startswith("no such file in the verneuil mount at %s " % (root / "mnt")), inside
    outside = explain_failure(str(tmp_path / "a" / "b" / "nope.db"), error)
    assert outside.startswith("no such file, and no verneuil mount holds it on this host (its nearest "
                              "directory here is %s)" % tmp_path), outside
    assert outside.endswith("(executor host %s)" % socket.gethostname())
