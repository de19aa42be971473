"""A PySpark data source that runs one SQL query over many SQLite files.

    spark.dataSource.register(VerneuilDataSource)
    df = (spark.read.format("verneuil")
          .option("query", "SELECT count(*) AS n FROM events")
          .load("/mnt/replicas/web1/data/tenants"))     # a directory, a glob,
                                                         # or option("paths", json list)

Each row carries the database it came from (column `_source`).  Databases
are spread over partitions by size so executors share the work evenly.  The
schema is given (`.schema(...)`; add `_source STRING` and, with
on_error=report, `_error STRING` as its last columns to get them) or inferred from the first
rows of the query on one database.  Files are opened read-only, as DESIGN.md
says for replicas on the mount: `immutable=1` by default (an open handle on
the mount pins one snapshot, so nothing changes under the connection), or
`mode=ro` with option `immutable=false` for files that may change.

Options: query (required), paths (JSON list, alternative to load's path),
partitions (default: one per database, at most 4x spark's default
parallelism), on_error = fail (default) | skip (log and drop that database) |
report (one row with `_error` set and the query's columns null),
immutable (true/false), infer_rows (rows used to infer types, default 100).
"""
from __future__ import annotations

import glob
import json
import logging
import os
import sqlite3
import urllib.parse
from typing import Iterator, Sequence

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import (BinaryType, DataType, DoubleType, LongType,
                               StringType, StructField, StructType)

log = logging.getLogger("verneuil_fuse.spark")

SOURCE_COLUMN = "_source"
ERROR_COLUMN = "_error"
# Enough rows to see a non-NULL value in most columns, few enough to be cheap.
DEFAULT_INFER_ROWS = 100
# More partitions than cores lets fast executors take more of the work; the
# cap keeps scheduling overhead small when there are thousands of files.
PARTITIONS_PER_CORE = 4
# File names taken as SQLite databases when a directory is given.
DB_SUFFIXES = (".db", ".sqlite", ".sqlite3", ".db3")
ON_ERROR = ("fail", "skip", "report")


class VerneuilSourceError(ValueError):
    """Bad options or paths given to the data source."""


def find_databases(spec: str | Sequence[str]) -> list[str]:
    """Expand a directory (recursively, by suffix), a glob, a file, or a list
    of those into a sorted list of database files."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    found: set[str] = set()
    for s in specs:
        if os.path.isdir(s):
            for root, _dirs, files in os.walk(s):
                found.update(os.path.join(root, f) for f in files if f.endswith(DB_SUFFIXES))
        elif any(c in s for c in "*?["):
            found.update(p for p in glob.glob(s, recursive=True) if os.path.isfile(p))
        elif os.path.isfile(s):
            found.add(s)
        else:
            raise VerneuilSourceError("no such database, directory or glob match: %s" % s)
    if not found:
        raise VerneuilSourceError("no SQLite databases found in %s" % ", ".join(specs))
    return sorted(found)


def balance(paths: Sequence[str], n_parts: int) -> list[list[str]]:
    """Greedy largest-first assignment of files to `n_parts` groups of
    similar total size (sizes from stat; unreadable files count as 0)."""
    sized = []
    for p in paths:
        try:
            sized.append((os.stat(p).st_size, p))
        except OSError:
            sized.append((0, p))
    sized.sort(reverse=True)
    groups: list[list[str]] = [[] for _ in range(max(1, min(n_parts, len(sized))))]
    totals = [0] * len(groups)
    for size, p in sized:
        i = totals.index(min(totals))
        groups[i].append(p)
        totals[i] += size
    return [sorted(g) for g in groups]


def connect_readonly(path: str, immutable: bool = True) -> sqlite3.Connection:
    """A read-only connection: `immutable=1` for a pinned snapshot file,
    else `mode=ro`."""
    uri = "file:%s?%s" % (urllib.parse.quote(os.path.abspath(path)),
                          "immutable=1" if immutable else "mode=ro")
    return sqlite3.connect(uri, uri=True, check_same_thread=False)


def _spark_type(values) -> DataType:
    kinds = {type(v) for v in values if v is not None}
    if not kinds:
        return StringType()
    if kinds <= {int}:
        return LongType()
    if kinds <= {int, float}:
        return DoubleType()
    if kinds <= {bytes}:
        return BinaryType()
    return StringType()


def infer_schema(path: str, query: str, immutable: bool, rows: int,
                 with_error: bool) -> StructType:
    """Column names from the cursor; types from the first `rows` rows."""
    con = connect_readonly(path, immutable)
    try:
        cur = con.execute(query)
        names = [d[0] for d in cur.description or ()]
        sample = cur.fetchmany(rows)
    finally:
        con.close()
    if not names:
        raise VerneuilSourceError("the query returns no columns: %s" % query)
    fields = [StructField(n, _spark_type([r[i] for r in sample]), True) for i, n in enumerate(names)]
    fields.append(StructField(SOURCE_COLUMN, StringType(), False))
    if with_error:
        fields.append(StructField(ERROR_COLUMN, StringType(), True))
    return StructType(fields)


def _convert(value, dtype: DataType):
    if value is None:
        return None
    if isinstance(dtype, LongType):
        return int(value)
    if isinstance(dtype, DoubleType):
        return float(value)
    if isinstance(dtype, BinaryType):
        return bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else str(value).encode()
    if isinstance(dtype, StringType):
        return value if isinstance(value, str) else (
            value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value))
    return value


class _Options:
    """The data source's options, parsed and checked once."""

    def __init__(self, options: dict):
        self.query = options.get("query")
        if not self.query:
            raise VerneuilSourceError('option "query" is required')
        if "paths" in options:
            try:
                spec = json.loads(options["paths"])
            except ValueError:
                spec = [p for p in options["paths"].split(",") if p]
        elif "path" in options:
            spec = options["path"]
        else:
            raise VerneuilSourceError("give a path to load() or option \"paths\"")
        self.paths = find_databases(spec)
        self.on_error = options.get("on_error", "fail")
        if self.on_error not in ON_ERROR:
            raise VerneuilSourceError("on_error must be one of %s" % ", ".join(ON_ERROR))
        self.immutable = options.get("immutable", "true").lower() not in ("false", "0", "no")
        self.infer_rows = int(options.get("infer_rows", DEFAULT_INFER_ROWS))
        self.partitions = int(options["partitions"]) if "partitions" in options else None


class VerneuilDataSource(DataSource):
    """`format("verneuil")`: one SQL query over many SQLite databases."""

    @classmethod
    def name(cls) -> str:
        return "verneuil"

    def schema(self) -> StructType:
        opts = _Options(self.options)
        last: Exception | None = None
        for path in opts.paths[:8]:  # a failing first database need not sink inference
            try:
                return infer_schema(path, opts.query, opts.immutable, opts.infer_rows,
                                    opts.on_error == "report")
            except sqlite3.Error as e:
                last = e
        raise VerneuilSourceError("cannot infer the schema of %r: %s" % (opts.query, last))

    def reader(self, schema: StructType) -> "VerneuilReader":
        return VerneuilReader(_Options(self.options), schema)


class DatabaseGroup(InputPartition):
    """One partition: the databases one task queries, in order."""

    def __init__(self, paths: list[str]):
        super().__init__(paths)
        self.paths = paths


class VerneuilReader(DataSourceReader):
    def __init__(self, opts: _Options, schema: StructType):
        self.opts = opts
        # A schema given by the user carries `_source` / `_error` only if it
        # names them; Spark expects rows of exactly the schema's width.
        names = [f.name for f in schema.fields]
        self.with_source = SOURCE_COLUMN in names
        self.with_error = ERROR_COLUMN in names
        if names[len(self.query_names(names)):] != [n for n in (SOURCE_COLUMN, ERROR_COLUMN) if n in names]:
            raise VerneuilSourceError("%s and %s must be the last columns of the schema"
                                      % (SOURCE_COLUMN, ERROR_COLUMN))
        self.query_fields = [f for f in schema.fields if f.name not in (SOURCE_COLUMN, ERROR_COLUMN)]

    @staticmethod
    def query_names(names):
        return [n for n in names if n not in (SOURCE_COLUMN, ERROR_COLUMN)]

    def _tail(self, path, error=None) -> list:
        return ([path] if self.with_source else []) + ([error] if self.with_error else [])

    def partitions(self) -> list[DatabaseGroup]:
        n = self.opts.partitions
        if n is None:
            n = len(self.opts.paths)
            try:
                from pyspark import SparkContext
                sc = SparkContext._active_spark_context
                if sc is not None:
                    n = min(n, PARTITIONS_PER_CORE * sc.defaultParallelism)
            except Exception:  # on a worker, or no context: one per database
                pass
        return [DatabaseGroup(g) for g in balance(self.opts.paths, n)]

    def read(self, partition: DatabaseGroup) -> Iterator[tuple]:
        for path in partition.paths:
            try:
                rows = list(self._query(path))
            except sqlite3.Error as e:
                if self.opts.on_error == "fail":
                    raise RuntimeError("query failed on %s: %s" % (path, e)) from None
                log.warning("skipping %s: %s", path, e)
                if self.opts.on_error == "report" and self.with_error:
                    yield tuple([None] * len(self.query_fields) + self._tail(path, str(e)))
                continue
            for row in rows:
                yield tuple(row + self._tail(path))

    def _query(self, path: str) -> Iterator[list]:
        con = connect_readonly(path, self.opts.immutable)
        try:
            cur = con.execute(self.opts.query)
            width = len(cur.description or ())
            if width != len(self.query_fields):
                raise sqlite3.OperationalError(
                    "query returns %d columns, schema has %d" % (width, len(self.query_fields)))
            for row in cur:
                yield [_convert(v, f.dataType) for v, f in zip(row, self.query_fields)]
        finally:
            con.close()


def spark_session(master: str = "local[*]", app: str = "verneuil"):
    """A SparkSession set up for this machine (loopback only, this Python on
    the workers) with the data source registered."""
    import sys

    from pyspark.sql import SparkSession
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    spark = (SparkSession.builder.master(master).appName(app)
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.sql.shuffle.partitions", "4")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(VerneuilDataSource)
    return spark


# Seconds between progress lines of run_query on a terminal.
PROGRESS_INTERVAL = 0.5


def _progress(sc, stop, stream) -> None:
    """Print 'tasks done/total' of the running stages until `stop` is set."""
    tracker = sc.statusTracker()
    last = ""
    while not stop.wait(PROGRESS_INTERVAL):
        done = total = 0
        for sid in tracker.getActiveStageIds():
            info = tracker.getStageInfo(sid)
            if info is not None:
                done += info.numCompletedTasks
                total += info.numTasks
        line = "  running: %d/%d tasks" % (done, total) if total else ""
        if line and line != last:
            stream.write("\r" + line)
            stream.flush()
            last = line
    if last:
        stream.write("\r" + " " * len(last) + "\r")
        stream.flush()


def run_query(spec, query: str, master: str = "local[*]", output: str | None = None,
              show: int = 20, on_error: str = "fail", stream=None) -> int:
    """`verneuilctl query`: run `query` over the databases of `spec` (a
    directory such as a mount, a glob, a file or a list), show the first
    `show` rows and write all of them to `output` (.parquet or .csv, a Spark
    output directory) if given.  Returns the number of rows."""
    import sys
    import threading

    stream = stream or sys.stderr
    paths = find_databases(spec)
    total = sum(os.path.getsize(p) for p in paths)
    stream.write("%d databases, %.1f MB\n" % (len(paths), total / 1e6))
    if output and not output.endswith((".parquet", ".csv")):
        raise VerneuilSourceError("--output must end in .parquet or .csv: %s" % output)
    spark = spark_session(master, app="verneuilctl-query")
    stop = threading.Event()
    ticker = None
    try:
        df = (spark.read.format("verneuil").option("query", query)
              .option("paths", json.dumps(paths)).option("on_error", on_error).load().cache())
        if stream.isatty():
            ticker = threading.Thread(target=_progress, args=(spark.sparkContext, stop, stream),
                                      daemon=True)
            ticker.start()
        n = df.count()
        stop.set()
        if ticker:
            ticker.join()
        if show:
            print(df._jdf.showString(show, 0, False))
        if output:
            writer = df.coalesce(1).write.mode("overwrite")
            if output.endswith(".parquet"):
                writer.parquet(output)
            else:
                writer.option("header", True).csv(output)
            stream.write("wrote %d rows to %s\n" % (n, output))
        return n
    finally:
        stop.set()
        spark.stop()
