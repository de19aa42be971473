"""The Spark data source on plain files (the mount variant is in
test_end_to_end.py): results equal the same query run directly."""
import io
import json
import os
import socket
import sqlite3

import pytest

pyspark = pytest.importorskip("pyspark")

from verneuil_fuse import spark as vspark  # noqa: E402

QUERY = "SELECT kind, count(*) AS n, sum(v) AS total FROM events GROUP BY kind"


def make_dbs(root, count):
    paths = []
    for i in range(count):
        p = os.path.join(root, "tenant%02d.db" % i)
        con = sqlite3.connect(p)
        con.execute("CREATE TABLE events(id INTEGER PRIMARY KEY, kind TEXT, v REAL)")
        con.executemany("INSERT INTO events(kind, v) VALUES (?, ?)",
                        [("k%d" % (j % 3), j * 0.5 + i) for j in range(10 + 37 * i)])
        con.commit()
        con.close()
        paths.append(p)
    return paths


def direct(paths, query):
    rows = set()
    for p in paths:
        con = sqlite3.connect("file:%s?mode=ro" % p, uri=True)
        rows.update(tuple(r) + (p,) for r in con.execute(query))
        con.close()
    return rows


@pytest.fixture(scope="module")
def spark():
    session = vspark.spark_session("local[2]", app="verneuil-tests")
    yield session
    session.stop()


def test_balance_spreads_by_size(tmp_path):
    sizes = [900, 100, 500, 500, 300, 700]
    paths = []
    for i, s in enumerate(sizes):
        p = tmp_path / ("%d.db" % i)
        p.write_bytes(b"x" * s)
        paths.append(str(p))
    groups = vspark.balance(paths, 3)
    assert sorted(p for g in groups for p in g) == sorted(paths)
    totals = [sum(os.path.getsize(p) for p in g) for g in groups]
    assert max(totals) - min(totals) <= 200, totals


def test_find_databases(tmp_path):
    paths = make_dbs(str(tmp_path), 3)
    (tmp_path / "notes.txt").write_text("not a db")
    assert vspark.find_databases(str(tmp_path)) == paths
    assert vspark.find_databases(str(tmp_path / "tenant0*.db")) == paths
    assert vspark.find_databases([paths[1]]) == [paths[1]]
    with pytest.raises(vspark.VerneuilSourceError):
        vspark.find_databases(str(tmp_path / "missing"))


def test_query_over_many_files_equals_direct(spark, tmp_path):
    paths = make_dbs(str(tmp_path), 20)
    df = spark.read.format("verneuil").option("query", QUERY).load(str(tmp_path))
    assert [f.name for f in df.schema.fields] == ["kind", "n", "total", "_source"]
    got = {tuple(r) for r in df.collect()}
    assert got == direct(paths, QUERY)
    assert len(got) == 60


def test_paths_option_given_schema_and_errors(spark, tmp_path):
    paths = make_dbs(str(tmp_path), 4)
    bad = tmp_path / "broken.db"
    bad.write_bytes(b"this is not a database" * 100)
    all_paths = json.dumps(paths + [str(bad)])
    reader = spark.read.format("verneuil").option("query", QUERY).option("paths", all_paths)

    with pytest.raises(Exception) as e:
        reader.option("on_error", "fail").load().collect()
    # One line from the Python worker (spark_session hides its traceback):
    # the database, why, and the executor host.
    assert "DatabaseError: query failed on %s: file is not a database (executor host %s)" % (
        bad, socket.gethostname()) in str(e.value), str(e.value)
    assert "Traceback" not in str(e.value)

    skipped = {tuple(r) for r in reader.option("on_error", "skip").load().collect()}
    assert skipped == direct(paths, QUERY)

    reported = reader.option("on_error", "report").load().collect()
    errors = [r for r in reported if r["_error"] is not None]
    assert [r["_source"] for r in errors] == [str(bad)]
    assert len(reported) == len(skipped) + 1
    told = io.StringIO()
    kept = vspark.without_errors(reader.option("on_error", "report").load(), told)
    assert {tuple(r) for r in kept.collect()} == skipped and "_error" not in kept.columns
    assert told.getvalue() == ("warning: skipped 1 databases (on_error=skip):\n  %s: file is not a database "
                               "(executor host %s)\n" % (bad, socket.gethostname()))

    typed = (spark.read.format("verneuil").schema("kind STRING, n LONG, total DOUBLE, _source STRING")
             .option("query", QUERY).option("paths", json.dumps(paths)).load())
    assert {tuple(r) for r in typed.collect()} == direct(paths, QUERY)


def test_bad_options_are_clear(spark, tmp_path):
    make_dbs(str(tmp_path), 1)
    with pytest.raises(Exception, match="query"):
        spark.read.format("verneuil").load(str(tmp_path)).collect()
    with pytest.raises(Exception, match="on_error"):
        spark.read.format("verneuil").option("query", QUERY).option("on_error", "x").load(str(tmp_path)).collect()
    # A misspelt option is an error naming the valid ones, never ignored.
    with pytest.raises(Exception, match="unknown option on_eror; the verneuil source takes query, "):
        spark.read.format("verneuil").option("query", QUERY).option("on_eror", "skip").load(str(tmp_path)).collect()
    # A query that writes says so (not "cannot infer the schema").
    with pytest.raises(Exception, match="queries cannot write"):
        spark.read.format("verneuil").option("query", "DELETE FROM events").load(str(tmp_path)).collect()


def make_table(path, ddl, rows):
    con = sqlite3.connect(path)
    con.execute(ddl)
    if rows:
        con.executemany("INSERT INTO t VALUES (%s)" % ",".join("?" * len(rows[0])), rows)
    con.commit()
    con.close()
    return str(path)


def test_values_are_never_cast_silently(spark, tmp_path):
    """Types are inferred from the first databases that have rows (a column
    empty or NULL in the first file gets its type from the next). A value
    the schema's type cannot hold exactly (a REAL in a bigint column) is an
    error of that database (on_error) saying how to fix it, never a cast."""
    a = make_table(tmp_path / "a.db", "CREATE TABLE t(x INTEGER, y TEXT)", [(1, "p"), (2, "q")])
    b = make_table(tmp_path / "b.db", "CREATE TABLE t(x INTEGER, y TEXT)", [(3.75, "r"), (4.5, None)])
    reader = spark.read.format("verneuil").option("query", "SELECT x, y FROM t").option("paths", json.dumps([a, b]))
    df = reader.load()
    assert df.schema["x"].dataType.simpleString() == "bigint"
    with pytest.raises(Exception) as e:
        df.collect()
    why = vspark.explain(e.value)
    assert "b.db" in why and "column x: 3.75 is not an integer" in why and ".schema" in why, why
    assert sorted(r["x"] for r in reader.option("on_error", "skip").load().collect()) == [1, 2]
    reported = reader.option("on_error", "report").load().collect()
    (err,) = [r for r in reported if r["_error"]]
    assert err["_source"] == b and "3.75 is not an integer" in err["_error"]
    exact = (spark.read.format("verneuil").schema("x DOUBLE, y STRING, _source STRING")
             .option("query", "SELECT x, y FROM t").option("paths", json.dumps([a, b])).load())
    assert sorted((r["x"], r["y"]) for r in exact.collect()) == [(1.0, "p"), (2.0, "q"), (3.75, "r"), (4.5, None)]
    # An empty first database: the types come from the next one.
    empty = make_table(tmp_path / "0empty.db", "CREATE TABLE t(x INTEGER, y TEXT)", [])
    df = (spark.read.format("verneuil").option("query", "SELECT x, y FROM t")
          .option("paths", json.dumps([empty, b])).load())
    assert [f.dataType.simpleString() for f in df.schema.fields[:2]] == ["double", "string"]
    assert sorted(r["x"] for r in df.collect()) == [3.75, 4.5]


def test_given_schema_types_text_attach_and_names(spark, tmp_path):
    p = make_table(tmp_path / "c.db", "CREATE TABLE t(amount, at, ok, name)",
                   [("12.50", "2026-11-24T01:02:03", 1, b"f\xffo".decode("latin-1").encode("latin-1"))])
    con = sqlite3.connect(p)  # text that is not UTF-8
    con.execute("UPDATE t SET name = CAST(X'66FF6F' AS TEXT)")
    con.commit()
    con.close()
    before = open(p, "rb").read()
    df = (spark.read.format("verneuil").schema("amount DECIMAL(10,2), at TIMESTAMP, ok BOOLEAN, name STRING")
          .option("query", "SELECT amount, at, ok, name FROM t").load(p))
    (row,) = df.collect()
    import datetime
    import decimal
    assert row["amount"] == decimal.Decimal("12.50") and row["ok"] is True
    assert row["at"] == datetime.datetime(2026, 11, 24, 1, 2, 3)
    assert row["name"] == "f\ufffdo"
    with pytest.raises(Exception, match="unsupported type"):
        (spark.read.format("verneuil").schema("m MAP<STRING,INT>").option("query", "SELECT 1")
         .load(p).collect())
    # ATTACH is refused, and creates nothing.
    with pytest.raises(Exception) as e:
        spark.read.format("verneuil").option("query", "ATTACH '%s' AS x" % (tmp_path / "new.db")).load(p).collect()
    assert "not authorized" in vspark.explain(e.value)
    assert not os.path.exists(tmp_path / "new.db") and open(p, "rb").read() == before
    with pytest.raises(Exception, match="AS"):
        spark.read.format("verneuil").option("query", "SELECT 1 AS a, 2 AS a").load(p).collect()
    with pytest.raises(Exception, match="partitions"):
        spark.read.format("verneuil").option("query", "SELECT 1").option("partitions", "0").load(p).collect()
    odd = tmp_path / "br[1].db"
    os.link(p, odd)
    assert vspark.find_databases(str(odd)) == [str(odd)]


def test_ctrl_c_during_a_query_says_so_once(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) while
    Spark runs a long query: exit 130, one line, no traceback."""
    import signal
    import subprocess
    import sys
    import time

    db = make_table(tmp_path / "a.db", "CREATE TABLE t(x)", [(1,)])
    slow = ("WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < 3000000000) "
            "SELECT count(*) FROM c")
    ctl = os.path.join(os.path.dirname(sys.executable), "verneuilctl")
    p = subprocess.Popen([ctl, "query", db, slow, "--master", "local[1]"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the query runs (after Spark's start-up)
            time.sleep(1)
            # Its own Python workers (in its session), not another test's.
            children = subprocess.run(["pgrep", "-s", str(p.pid), "-f", "pyspark.daemon|pyspark.worker"],
                                      capture_output=True, text=True).stdout.split()
            if children or p.poll() is not None:
                break
        time.sleep(2)
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    assert p.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "verneuilctl: error: interrupted", err[-2000:]
    assert "Traceback" not in err, err[-3000:]


def test_partitions_planned_by_bytes(tmp_path):
    """Many small databases share a partition, a large one is alone; the
    size and the least number of partitions are options."""
    mib = 1 << 20
    big = tmp_path / "big.db"
    big.write_bytes(b"")
    os.truncate(big, 300 * mib)
    small = []
    for i in range(50):
        p = tmp_path / ("s%02d.db" % i)
        p.write_bytes(b"")
        os.truncate(p, mib)
        small.append(str(p))
    paths = [str(big)] + small
    groups = vspark.plan_by_bytes(paths, 100 * mib, 2)
    assert sorted(p for g in groups for p in g) == sorted(paths)
    assert [str(big)] in groups
    rest = [g for g in groups if g != [str(big)]]
    assert len(rest) >= 2 and all(8 <= len(g) <= 13 for g in rest), [len(g) for g in rest]
    from pyspark.sql.types import LongType, StructField, StructType
    schema = StructType([StructField("x", LongType())])
    opts = vspark.options.Options({"query": "SELECT 1", "paths": json.dumps(paths),
                                   "partition_bytes": "20m", "min_partitions": "3"})
    parts = vspark.VerneuilReader(opts, schema).partitions()
    # 401 MiB counted (300 + 50 x 1, and 1 MiB to open each) in 20 MiB
    # parts, a multiple of 3 of them.
    assert [str(big)] in [p.paths for p in parts] and len(parts) == 21, [len(p.paths) for p in parts]
    # Tiny databases: a few partitions of many, at least one per core.
    tiny = small[:40]
    for p in tiny:
        os.truncate(p, 8192)
    assert [len(g) for g in vspark.plan_by_bytes(tiny, 128 * mib, 2)] == [20, 20]
    assert len(vspark.plan_by_bytes(tiny, 128 * mib, 8)) == 8

    with pytest.raises(vspark.VerneuilSourceError, match="partition_bytes must be a size"):
        vspark.options.Options({"query": "SELECT 1", "path": str(big), "partition_bytes": "lots"})


def test_class_archive_is_kept_only_when_the_jvm_ends_cleanly(tmp_path, monkeypatch):
    """`verneuilctl query`'s JVM class archive: written under a temporary
    name, renamed once the JVM exited with 0, discarded otherwise; later
    starts map it."""
    from verneuil_fuse.spark import classcache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    class FakeJvm:
        def __init__(self, archive, code):
            self.stdin, self.returncode, self.archive, self.code = None, None, archive, code

        def wait(self, timeout):
            with open(self.archive.temp, "wb") as f:  # what the JVM writes as it exits
                f.write(b"archive")
            self.returncode = self.code

    first = classcache.ClassArchive()
    assert first.temp and any(o.startswith("-XX:ArchiveClassesAtExit=") for o in first.options)
    first.finish(FakeJvm(first, 1), succeeded=True)
    assert not os.path.exists(first.final) and not os.path.exists(first.temp)
    again = classcache.ClassArchive()
    again.finish(FakeJvm(again, 0), succeeded=True)
    assert os.path.exists(again.final) and not os.path.exists(again.temp)
    later = classcache.ClassArchive()
    assert later.temp is None and "-XX:SharedArchiveFile=" + later.final in later.options
    monkeypatch.setenv("VERNEUIL_SPARK_CDS", "0")
    assert classcache.ClassArchive().options == []
