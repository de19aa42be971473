"""Table mode of the Spark data source: the schema from the table's
declared columns, each pushed filter kind giving exactly the rows SQLite
gives on the source files (and Spark gives without pushdown), `explain`
listing the filters pushed, and column selection."""
import contextlib
import io
import json
import sqlite3

import pytest

pytest.importorskip("pyspark")

from verneuil_fuse import spark as vspark  # noqa: E402

DDL = ("CREATE TABLE t(id INTEGER PRIMARY KEY, k TEXT COLLATE NOCASE, v REAL, n INTEGER, "
       "flag BOOLEAN, note TEXT)")
KS = ["a", "A", "b", "B", "é", "ab", "ba", "", None]
COLUMNS = "id, k, v, n, flag, note"

# (Spark condition, the same condition in SQLite, pushed entirely?)
# Text compares byte by byte in Spark: in SQLite that is COLLATE BINARY,
# whatever the column's declared collation (k's is NOCASE).
FILTERS = [
    ("n = 3", "n = 3", True),
    ("n <> 3", "n <> 3", True),
    ("n > 2", "n > 2", True),
    ("n >= 2", "n >= 2", True),
    ("n < 2", "n < 2", True),
    ("n <= -1", "n <= -1", True),
    ("v > 1.5", "v > 1.5", True),
    ("v <= 0.0", "v <= 0.0", True),
    ("v = 2.25", "v = 2.25", True),
    ("k = 'a'", "k = 'a' COLLATE BINARY", True),
    ("k > 'B'", "k > 'B' COLLATE BINARY", True),
    ("k <= 'b'", "k <= 'b' COLLATE BINARY", True),
    ("k IN ('a', 'B', 'é')", "k COLLATE BINARY IN ('a', 'B', 'é')", True),
    ("n IN (1, 2, 7)", "n IN (1, 2, 7)", True),
    ("k IS NULL", "k IS NULL", True),
    ("v IS NOT NULL", "v IS NOT NULL", True),
    ("NOT (n IN (1, 2))", "NOT (n IN (1, 2))", True),
    ("flag", "flag = 1", True),
    ("NOT flag", "flag = 0", True),
    ("flag IS NULL", "flag IS NULL", True),
    ("n <=> 3", "n IS 3", True),
    ("k LIKE 'a%'", "substr(k, 1, 1) = 'a' COLLATE BINARY", True),
    ("k LIKE '%a'", "substr(k, -1) = 'a' COLLATE BINARY", True),
    ("k LIKE '%b%'", "instr(k, 'b') > 0", True),
    ("n > 1 AND k = 'b'", "n > 1 AND k = 'b' COLLATE BINARY", True),
    ("n = 1 OR k = 'b'", "n = 1 OR k = 'b' COLLATE BINARY", False),
    ("n + 1 = 3", "n + 1 = 3", False),
    ("note = 'x'", "note = 'x' COLLATE BINARY", True),
]


def _make(root, count):
    paths = []
    for i in range(count):
        path = str(root / ("db%d.db" % i))
        con = sqlite3.connect(path)
        con.execute(DDL)
        rows = []
        for j in range(30):
            k = KS[(i + j) % len(KS)]
            v = None if j % 7 == 3 else (j - 10) * 0.75
            n = None if j % 5 == 4 else (j % 9) - 2
            flag = None if j % 6 == 5 else j % 2
            rows.append((k, v, n, flag, "x" if j % 4 == 0 else "note %d" % j))
        con.executemany("INSERT INTO t(k, v, n, flag, note) VALUES (?, ?, ?, ?, ?)", rows)
        con.commit()
        con.close()
        paths.append(path)
    return paths


def _direct(paths, where):
    rows = set()
    for p in paths:
        con = sqlite3.connect("file:%s?mode=ro" % p, uri=True)
        for r in con.execute("SELECT %s FROM t WHERE %s" % (COLUMNS, where)):
            rows.add(r[:4] + (None if r[4] is None else bool(r[4]),) + r[5:] + (p,))
        con.close()
    return rows


@pytest.fixture(scope="module")
def spark():
    session = vspark.spark_session("local[2]", app="verneuil-tests-table")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def dbs(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("tables"), 3)


def _table(spark, paths, **options):
    reader = spark.read.format("verneuil").option("table", "t").option("paths", json.dumps(paths))
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load()


def _plan(df, mode=None) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        df.explain(mode) if mode else df.explain()
    return out.getvalue()


def test_schema_from_declared_columns(spark, dbs):
    df = _table(spark, dbs)
    assert df.schema.simpleString() == ("struct<id:bigint,k:string,v:double,n:bigint,flag:boolean,"
                                        "note:string,_source:string>")
    assert len(df.collect()) == 90


@pytest.mark.parametrize("spark_cond,sqlite_cond,pushed", FILTERS, ids=[f[0] for f in FILTERS])
def test_pushed_filter_equals_sqlite(spark, dbs, spark_cond, sqlite_cond, pushed):
    df = _table(spark, dbs).where(spark_cond)
    got = {tuple(r) for r in df.collect()}
    expected = _direct(dbs, sqlite_cond)
    assert got == expected
    unpushed = {tuple(r) for r in _table(spark, dbs, pushdown="false").where(spark_cond).collect()}
    assert unpushed == expected
    if pushed:
        plan = _plan(df, "formatted")
        assert "PushedFilters: [" in plan and "PushedFilters: []" not in plan, plan
    # What Spark still filters after the scan: nothing when all was pushed.
    assert ("Filter" not in _plan(df).split("BatchScan")[0]) == pushed, _plan(df)


def test_explain_names_the_pushed_filters(spark, dbs):
    df = _table(spark, dbs).where("n > 1 AND k IN ('a', 'b') AND flag IS NOT NULL").select("id")
    plan = _plan(df, "formatted")
    line = [x for x in plan.splitlines() if x.startswith("PushedFilters")][0]
    for f in ("GreaterThan(n,1)", "In(k, [a,b])", "IsNotNull(flag)"):
        assert f in line, line


def test_columns_option_and_given_schema(spark, dbs):
    df = _table(spark, dbs, columns="n, k").where("n = 3")
    assert [f.name for f in df.schema.fields] == ["n", "k", "_source"]
    assert {tuple(r) for r in df.collect()} == {(r[3], r[1], r[6]) for r in _direct(dbs, "n = 3")}
    typed = (spark.read.format("verneuil").schema("id INT, v DOUBLE").option("table", "t")
             .option("paths", json.dumps(dbs)).load().where("id <= 2"))
    assert sorted(tuple(r) for r in typed.collect()) == sorted(
        (r[0], r[2]) for r in _direct(dbs, "id <= 2"))
    only_source = (spark.read.format("verneuil").schema("_source STRING").option("table", "t")
                   .option("paths", json.dumps(dbs)).load())
    assert sorted(r[0] for r in only_source.collect()) == sorted(dbs * 30)


def test_each_database_is_checked_against_the_schema(spark, dbs, tmp_path):
    other = str(tmp_path / "other.db")
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE t(id INTEGER, k BLOB, v REAL, n INTEGER, flag BOOLEAN, note TEXT)")
    con.execute("INSERT INTO t VALUES (1, x'00', 1.0, 1, 1, 'x')")
    con.commit()
    con.close()
    missing = str(tmp_path / "none.db")
    sqlite3.connect(missing).execute("CREATE TABLE u(x)").connection.close()
    rows = (spark.read.format("verneuil").option("table", "t").option("on_error", "report")
            .option("paths", json.dumps(dbs + [other, missing])).load().where("n = 1").collect())
    errors = {r["_source"]: r["_error"] for r in rows if r["_error"]}
    assert set(errors) == {other, missing}, errors
    assert "k BLOB" in errors[other] and "no such table" in errors[missing]
    assert len(rows) - 2 == len(_direct(dbs, "n = 1"))


def test_table_mode_mistakes_are_clear(spark, dbs):
    reader = spark.read.format("verneuil").option("paths", json.dumps(dbs))
    with pytest.raises(Exception, match='option "query" .* or option "table"'):
        reader.option("table", "t").option("query", "SELECT 1").load().collect()
    with pytest.raises(Exception, match="cannot read table nope"):
        spark.read.format("verneuil").option("table", "nope").option("paths", json.dumps(dbs)).load()
    with pytest.raises(Exception, match="has no column zz"):
        spark.read.format("verneuil").option("table", "t").option("columns", "id,zz").load(dbs[0])
    with pytest.raises(Exception, match="goes with"):
        spark.read.format("verneuil").option("query", "SELECT 1").option("columns", "id").load(dbs[0]).collect()


def test_to_sql_refuses_what_sqlite_would_answer_otherwise():
    from pyspark.sql import datasource as ds

    from verneuil_fuse.spark.tables import to_sql
    kinds = {"n": "integer", "v": "real", "k": "text", "b": "boolean", "d": ""}
    assert to_sql(ds.EqualTo(("n",), 3), kinds) == ('"n" = ?', [3])
    assert to_sql(ds.EqualTo(("n",), 3.5), kinds) is None  # Spark casts the column
    assert to_sql(ds.EqualTo(("v",), float("nan")), kinds) is None  # SQLite has no NaN
    assert to_sql(ds.EqualTo(("d",), "2026-01-01"), kinds) is None  # dates: Spark's order
    assert to_sql(ds.GreaterThan(("b",), False), kinds) is None
    assert to_sql(ds.EqualTo(("a", "b"), 1), kinds) is None  # a nested field
    assert to_sql(ds.In(("n",), list(range(10_000))), kinds) is None
    assert to_sql(ds.Not(ds.IsNull(("k",))), kinds) == ('NOT ("k" IS NULL)', [])
    assert to_sql(ds.EqualTo(("k",), "x"), kinds) == ('"k" = ? COLLATE BINARY', ["x"])
