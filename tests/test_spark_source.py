"""The Spark data source on plain files (the mount variant is in
test_end_to_end.py): results equal the same query run directly."""
import json
import os
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
    assert "broken.db" in str(e.value)

    skipped = {tuple(r) for r in reader.option("on_error", "skip").load().collect()}
    assert skipped == direct(paths, QUERY)

    reported = reader.option("on_error", "report").load().collect()
    errors = [r for r in reported if r["_error"] is not None]
    assert [r["_source"] for r in errors] == [str(bad)]
    assert len(reported) == len(skipped) + 1

    typed = (spark.read.format("verneuil").schema("kind STRING, n LONG, total DOUBLE, _source STRING")
             .option("query", QUERY).option("paths", json.dumps(paths)).load())
    assert {tuple(r) for r in typed.collect()} == direct(paths, QUERY)


def test_bad_options_are_clear(spark, tmp_path):
    make_dbs(str(tmp_path), 1)
    with pytest.raises(Exception, match="query"):
        spark.read.format("verneuil").load(str(tmp_path)).collect()
    with pytest.raises(Exception, match="on_error"):
        spark.read.format("verneuil").option("query", QUERY).option("on_error", "x").load(str(tmp_path)).collect()
