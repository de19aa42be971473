"""The Arrow path (record batches, the default) and the tuple path
(arrow=false, value by value) of the Spark data source give the same rows
and the same errors for every supported type, NULLs and edge values."""
import json
import os
import sqlite3

import pytest

pytest.importorskip("pyspark")

from verneuil_fuse import spark as vspark  # noqa: E402
from verneuil_fuse.spark import source  # noqa: E402

# Spark type -> (values its column holds exactly, values it cannot hold).
# Stored in an untyped column, so SQLite keeps each value's own class.
CASES = {
    "BIGINT": ([0, -1, (1 << 63) - 1, -(1 << 63), 3.0, -2.0 ** 62, None], [3.5, "7", b"\x01", 1e19]),
    "INT": ([(1 << 31) - 1, -(1 << 31), 7.0, None], [1 << 31, 0.5]),
    "SMALLINT": ([32767, -32768, None], [32768]),
    "TINYINT": ([127, -128, 0, None], [-129]),
    "BOOLEAN": ([0, 1, 1.0, None], [2, -1, "true"]),
    "DOUBLE": ([1, 2.5, -0.0, (1 << 53) + 1, (1 << 63) - 1, 1e308, 9e999, -9e999, 5e-324, None],
               ["x", b"\x00"]),
    "FLOAT": ([0.1, 1e300, (1 << 31) + 1, 3, None], ["1.5"]),
    "DECIMAL(10,2)": (["12.50", 3, 1.25, "-0.01", None], [b"1", "abc"]),
    "STRING": (["a", "", "é☃𝄞", 5, 2.5, b"\xff\x00bin", b"ok", None], []),
    "BINARY": ([b"\x00\xff", "text é", 5, 1.5, b"", None], []),
    "TIMESTAMP": (["2026-11-24T01:02:03", "2026-11-24 01:02:03+02:00", 0, 1.5, 1700000000, None],
                  ["yesterday", b"\x01"]),
    "DATE": (["2026-11-24", 86400, "2026-02-28T10:00:00", None], ["2026-13-01"]),
}


def _db(path, values):
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t(v)")  # no affinity: each value keeps its class
    con.executemany("INSERT INTO t VALUES (?)", [(v,) for v in values])
    con.commit()
    con.close()
    return str(path)


@pytest.fixture(scope="module")
def spark():
    session = vspark.spark_session("local[2]", app="verneuil-tests-arrow")
    yield session
    session.stop()


def _read(spark, paths, dtype, arrow, on_error="report"):
    df = (spark.read.format("verneuil").schema("v %s, _source STRING, _error STRING" % dtype)
          .option("query", "SELECT v FROM t").option("paths", json.dumps(paths))
          .option("on_error", on_error).option("arrow", str(arrow).lower()).load())
    return sorted((repr(r["v"]), r["_source"], r["_error"]) for r in df.collect())


@pytest.mark.parametrize("dtype", sorted(CASES))
def test_arrow_and_tuples_agree(spark, tmp_path, dtype):
    good, bad = CASES[dtype]
    paths = [_db(tmp_path / "good.db", good)]
    paths += [_db(tmp_path / ("bad%d.db" % i), [1, v]) for i, v in enumerate(bad)]
    with_arrow = _read(spark, paths, dtype, True)
    with_tuples = _read(spark, paths, dtype, False)
    assert with_arrow == with_tuples
    rows = [r for r in with_arrow if r[2] is None]
    errors = [r for r in with_arrow if r[2] is not None]
    assert len(rows) == len(good), with_arrow
    assert sorted(r[1] for r in errors) == sorted(paths[1:]), errors
    assert all("column v:" in r[2] for r in errors), errors


def test_many_batches_and_invalid_text(spark, tmp_path):
    """More rows than one record batch holds; text that is not UTF-8 (read
    again with replacement characters) among them."""
    n = source.BATCH_ROWS * 2 + 7
    path = tmp_path / "big.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t(i INTEGER, x REAL, s TEXT)")
    con.execute("WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < ?) "
                "INSERT INTO t SELECT i, i * 0.25, 'row ' || i FROM c", (n,))
    con.execute("UPDATE t SET s = CAST(X'66FF6F' AS TEXT) WHERE i = ?", (n - 1,))
    con.commit()
    con.close()
    results = []
    for arrow in ("true", "false"):
        df = (spark.read.format("verneuil").option("query", "SELECT i, x, s FROM t")
              .option("arrow", arrow).load(str(path)))
        results.append(sorted(tuple(r) for r in df.collect()))
    assert results[0] == results[1]
    assert len(results[0]) == n
    assert results[0][n - 2][2] == "f\ufffdo"


def test_bad_flag_is_clear(spark, tmp_path):
    path = _db(tmp_path / "a.db", [1])
    with pytest.raises(Exception, match="option arrow must be true or false"):
        spark.read.format("verneuil").option("query", "SELECT v FROM t").option("arrow", "maybe").load(path).collect()
    assert os.path.exists(path)


def test_reader_yields_record_batches(tmp_path):
    """Without Spark: the reader's own output, batches or tuples."""
    import pyarrow as pa
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    path = _db(tmp_path / "a.db", [1, 2, None])
    schema = StructType([StructField("v", LongType()), StructField("_source", StringType(), False)])
    for arrow, kind in (("true", pa.RecordBatch), ("false", tuple)):
        opts = vspark.options.Options({"query": "SELECT v FROM t", "path": path, "arrow": arrow})
        reader = source.VerneuilReader(opts, schema)
        (group,) = reader.partitions()
        out = list(reader.read(group))
        assert out and all(isinstance(o, kind) for o in out)
        if arrow == "true":
            assert out[0].to_pydict() == {"v": [1, 2, None], "_source": [path] * 3}
