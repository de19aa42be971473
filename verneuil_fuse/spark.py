"""A PySpark data source that runs one SQL query over many SQLite files.

    spark.dataSource.register(VerneuilDataSource)
    df = (spark.read.format("verneuil")
          .option("query", "SELECT count(*) AS n FROM events")
          .load("/mnt/replicas/web1/data/tenants"))     # a directory, a glob,
                                                         # or option("paths", json list)

Each row carries the database it came from (column `_source`).  Databases
are spread over partitions by size so executors share the work evenly.  The
schema is given (`.schema(...)`; add `_source STRING` and, with
on_error=report, `_error STRING` as its last columns to get them; types: the
integer ones, boolean, float, double, decimal, string, binary, timestamp and
date) or inferred from the first rows of the query on a few databases, types
widened over them. A value its column's type cannot hold exactly (a REAL in a
long column) is an error of that database, never a silent cast.  Files are opened read-only, as DESIGN.md
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

import datetime
import decimal
import glob
import json
import logging
import os
import re
import sqlite3
import urllib.parse
from typing import Iterator, Sequence

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import (BinaryType, BooleanType, ByteType, DataType, DateType,
                               DecimalType, DoubleType, FloatType, IntegerType, LongType,
                               ShortType, StringType, StructField, StructType, TimestampType)

log = logging.getLogger("verneuil_fuse.spark")

SOURCE_COLUMN = "_source"
ERROR_COLUMN = "_error"
# Enough rows to see a non-NULL value in most columns, few enough to be cheap.
DEFAULT_INFER_ROWS = 100
# Databases sampled to infer the schema: types are widened over all of them
# (an INTEGER column holding a REAL in the second file is a double), and a
# column NULL or empty in the first gets its type from the next. A handful
# keeps the driver's work small with thousands of files; a value of another
# type further on is a per-database error (`on_error`), never a silent cast.
INFER_DATABASES = 8
# More partitions than cores lets fast executors take more of the work; the
# cap keeps scheduling overhead small when there are thousands of files.
PARTITIONS_PER_CORE = 4
# File names taken as SQLite databases when a directory is given.
DB_SUFFIXES = (".db", ".sqlite", ".sqlite3", ".db3")
ON_ERROR = ("fail", "skip", "report")


class VerneuilSourceError(ValueError):
    """Bad options or paths given to the data source."""


class ConversionError(ValueError):
    """A value that the schema's type cannot hold exactly (a REAL in a LONG
    column, text in a DOUBLE one): an error of that database, like a failing
    query, handled by `on_error`."""


def find_databases(spec: str | Sequence[str]) -> list[str]:
    """Expand a directory (recursively, by suffix), a glob, a file, or a list
    of those into a sorted list of database files. A name that exists is
    taken as it is, even if it holds glob characters."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    found: set[str] = set()
    for s in specs:
        if os.path.isdir(s):
            for root, _dirs, files in os.walk(s):
                found.update(os.path.join(root, f) for f in files if f.endswith(DB_SUFFIXES))
        elif os.path.isfile(s):
            found.add(s)
        elif any(c in s for c in "*?["):
            found.update(p for p in glob.glob(s, recursive=True) if os.path.isfile(p))
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


# Authorizer actions of statements that change a database: a query over
# replicas is refused them with a message of its own ("queries cannot write").
_WRITE_ACTIONS = frozenset(getattr(sqlite3, name) for name in dir(sqlite3) if name.startswith((
    "SQLITE_INSERT", "SQLITE_UPDATE", "SQLITE_DELETE", "SQLITE_CREATE_", "SQLITE_DROP_",
    "SQLITE_ALTER_TABLE", "SQLITE_REINDEX", "SQLITE_ANALYZE")))


class _ReadOnlyConnection(sqlite3.Connection):
    """A connection that remembers whether its authorizer refused a write."""

    refused_write = False


def _authorizer(con: _ReadOnlyConnection):
    def authorize(action, *_args):
        # ATTACH would open (and create) another file with the connection's
        # default read-write flags; a query over replicas has no use for it.
        if action in (sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH):
            return sqlite3.SQLITE_DENY
        if action in _WRITE_ACTIONS:
            con.refused_write = True
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK
    return authorize


def connect_readonly(path: str, immutable: bool = True) -> sqlite3.Connection:
    """A read-only connection: `immutable=1` for a pinned snapshot file,
    else `mode=ro`. ATTACH is refused (it could create files); text that is
    not UTF-8 is read with replacement characters, as the sqlite3 shell
    shows it, instead of failing the whole database."""
    uri = "file:%s?%s" % (urllib.parse.quote(os.path.abspath(path)),
                          "immutable=1" if immutable else "mode=ro")
    con = sqlite3.connect(uri, uri=True, check_same_thread=False, factory=_ReadOnlyConnection)
    con.set_authorizer(_authorizer(con))
    con.text_factory = lambda raw: raw.decode("utf-8", "replace")
    return con


def _spark_type(kinds: set) -> DataType:
    """The narrowest Spark type for values of these Python types (NULLs
    left out): long, double, binary, else string."""
    if not kinds:
        return StringType()
    if kinds <= {int}:
        return LongType()
    if kinds <= {int, float}:
        return DoubleType()
    if kinds <= {bytes}:
        return BinaryType()
    return StringType()


def infer_schema(paths: Sequence[str], query: str, immutable: bool, rows: int,
                 with_error: bool) -> StructType:
    """Column names from the cursor; types from the first `rows` rows of the
    query on up to INFER_DATABASES databases (fewer once every column has a
    value), widened over all of them. Databases where the query fails are
    passed over; if it fails on all of them, the last error is raised."""
    names: list[str] | None = None
    kinds: list[set] = []
    last: str | None = None
    for path in paths[:INFER_DATABASES]:
        con = None
        try:
            con = connect_readonly(path, immutable)
            try:
                cur = con.execute(query)
                these = [d[0] for d in cur.description or ()]
                sample = cur.fetchmany(rows)
            finally:
                con.close()
        except sqlite3.Error as e:
            if con is not None and con.refused_write:
                raise VerneuilSourceError("queries cannot write (replicas are read-only): %s" % query) from None
            last = "%s: %s" % (path, e)
            continue
        if names is None:
            names = these
            kinds = [set() for _ in names]
            if not names:
                raise VerneuilSourceError("the query returns no columns: %s" % query)
            clash = sorted({n for n in names if names.count(n) > 1 or n in (SOURCE_COLUMN, ERROR_COLUMN)})
            if clash:
                raise VerneuilSourceError("the query returns columns named %s more than once or "
                                          "reserved (%s, %s): give them other names with AS"
                                          % (", ".join(clash), SOURCE_COLUMN, ERROR_COLUMN))
        elif these != names:
            continue  # another shape: that database's error, at read time
        for row in sample:
            for i, v in enumerate(row):
                if v is not None:
                    kinds[i].add(type(v))
        if all(kinds):
            break  # every column has a type: no need to run the query on more databases
    if names is None:
        raise VerneuilSourceError("cannot infer the schema of %r: %s" % (query, last))
    fields = [StructField(n, _spark_type(k), True) for n, k in zip(names, kinds)]
    fields.append(StructField(SOURCE_COLUMN, StringType(), False))
    if with_error:
        fields.append(StructField(ERROR_COLUMN, StringType(), True))
    return StructType(fields)


def _integer(value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConversionError("%r is not an integer" % (value,))
    if isinstance(value, float):
        if not value.is_integer():
            raise ConversionError("%r is not an integer" % (value,))
        value = int(value)
    if not lo <= value <= hi:
        raise ConversionError("%d is out of range" % value)
    return value


def _timestamp(value) -> datetime.datetime:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return datetime.datetime.fromtimestamp(value, datetime.timezone.utc)
    if isinstance(value, str):
        try:
            return datetime.datetime.fromisoformat(value)
        except ValueError:
            pass
    raise ConversionError("%r is not a time (unix seconds or ISO 8601)" % (value,))


# Spark type -> exact conversion of a SQLite value (None never reaches them).
_CONVERTERS = {
    LongType: lambda v: _integer(v, -(1 << 63), (1 << 63) - 1),
    IntegerType: lambda v: _integer(v, -(1 << 31), (1 << 31) - 1),
    ShortType: lambda v: _integer(v, -(1 << 15), (1 << 15) - 1),
    ByteType: lambda v: _integer(v, -128, 127),
    BooleanType: lambda v: bool(_integer(v, 0, 1)),
}


def _convert(value, dtype: DataType):
    """`value` (from SQLite) as `dtype` holds it, exactly; ConversionError
    when it cannot (never a silent cast such as a REAL truncated)."""
    if value is None:
        return None
    conv = _CONVERTERS.get(type(dtype))
    if conv is not None:
        return conv(value)
    if isinstance(dtype, (DoubleType, FloatType)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConversionError("%r is not a number" % (value,))
        return float(value)
    if isinstance(dtype, DecimalType):
        if isinstance(value, (bytes, bool)):
            raise ConversionError("%r is not a number" % (value,))
        try:
            return decimal.Decimal(str(value))
        except decimal.InvalidOperation:
            raise ConversionError("%r is not a number" % (value,)) from None
    if isinstance(dtype, StringType):
        return value if isinstance(value, str) else (
            value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value))
    if isinstance(dtype, BinaryType):
        return value if isinstance(value, bytes) else str(value).encode()
    if isinstance(dtype, TimestampType):
        return _timestamp(value)
    if isinstance(dtype, DateType):
        if isinstance(value, str):
            try:
                return datetime.date.fromisoformat(value)
            except ValueError:
                pass
        return _timestamp(value).date()
    raise ConversionError("type %s is not supported" % dtype.simpleString())


SUPPORTED_TYPES = (LongType, IntegerType, ShortType, ByteType, BooleanType, DoubleType, FloatType,
                   DecimalType, StringType, BinaryType, TimestampType, DateType)


# Every option the data source reads; any other (a typo such as "on_eror")
# is an error, not silently ignored.
OPTIONS = ("query", "path", "paths", "on_error", "immutable", "infer_rows", "partitions")


class _Options:
    """The data source's options, parsed and checked once."""

    def __init__(self, options: dict):
        unknown = sorted(k for k in options if k.lower() not in OPTIONS)
        if unknown:
            raise VerneuilSourceError("unknown option%s %s; the verneuil source takes %s"
                                      % ("s" if len(unknown) > 1 else "", ", ".join(unknown), ", ".join(OPTIONS)))
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
        self.infer_rows = self._positive(options, "infer_rows", DEFAULT_INFER_ROWS)
        self.partitions = self._positive(options, "partitions", None)

    @staticmethod
    def _positive(options: dict, name: str, default):
        if name not in options:
            return default
        try:
            value = int(options[name])
        except ValueError:
            value = 0
        if value < 1:
            raise VerneuilSourceError("option %s must be a positive integer, not %r" % (name, options[name]))
        return value


class VerneuilDataSource(DataSource):
    """`format("verneuil")`: one SQL query over many SQLite databases."""

    @classmethod
    def name(cls) -> str:
        return "verneuil"

    def schema(self) -> StructType:
        opts = _Options(self.options)
        return infer_schema(opts.paths, opts.query, opts.immutable, opts.infer_rows,
                            opts.on_error == "report")

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
        odd = [f for f in self.query_fields if not isinstance(f.dataType, SUPPORTED_TYPES)]
        if odd:
            raise VerneuilSourceError("unsupported type in the schema: %s (use %s)" % (
                ", ".join("%s %s" % (f.name, f.dataType.simpleString()) for f in odd),
                ", ".join(t.typeName() for t in SUPPORTED_TYPES)))

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
            except (sqlite3.Error, ConversionError) as e:
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
            names = [f.name for f in self.query_fields]
            for row in cur:
                out = []
                for v, f, name in zip(row, self.query_fields, names):
                    try:
                        out.append(_convert(v, f.dataType))
                    except ConversionError as e:
                        raise ConversionError(
                            "column %s: %s for type %s (types were inferred from the first "
                            "databases: give the schema with .schema(...) if they differ)"
                            % (name, e, f.dataType.simpleString())) from None
                yield out
        finally:
            con.close()


# The driver JVM's logging for command-line runs (`quiet`): nothing below
# FATAL, so neither Spark's start-up notices nor its task errors (Java stack
# traces) reach the terminal; the command reports a failure once, in one line.
_QUIET_LOG4J = """\
rootLogger.level = fatal
rootLogger.appenderRef.stderr.ref = stderr
# PySpark's driver counts as a shell: its level, if it differs from the
# root's, replaces it with a notice ("Setting default log level").
logger.repl.name = org.apache.spark.repl.Main
logger.repl.level = fatal
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n
"""


# What the driver JVM prints on stderr before any logging is set up, in
# every run: notices for a Spark shell user, noise for a command-line tool.
# `quiet` sessions drop exactly these lines and pass everything else on.
_JVM_NOTICES = (
    b"WARNING: Using incubator modules:",
    b'Setting default log level to "',
    b"To adjust logging level use sc.setLogLevel(",
)


def _forward_stderr(pipe, notices: tuple[bytes, ...] = _JVM_NOTICES) -> None:
    """Copy the JVM's stderr, line by line, to ours, without its notices
    (runs in a daemon thread until the JVM closes its end)."""
    import sys
    with pipe:
        for line in pipe:
            if line.startswith(notices):
                continue
            try:
                sys.stderr.write(line.decode("utf-8", "replace"))
                sys.stderr.flush()
            except (OSError, ValueError):  # our stderr is gone: keep draining
                pass


def spark_session(master: str = "local[*]", app: str = "verneuil", quiet: bool = False):
    """A SparkSession set up for this machine (loopback only, this Python on
    the workers) with the data source registered. `quiet` (for command-line
    tools): the JVM logs only fatal errors, from its start on, and its
    start-up notices are dropped from its stderr."""
    import subprocess
    import sys
    import tempfile
    import threading

    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway
    from pyspark.sql import SparkSession
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    conf = (SparkConf().setMaster(master).setAppName(app)
            .set("spark.ui.enabled", "false")
            .set("spark.ui.showConsoleProgress", "false")
            .set("spark.driver.bindAddress", "127.0.0.1")
            .set("spark.sql.shuffle.partitions", "4"))
    if not quiet or SparkContext._active_spark_context is not None:
        spark = SparkSession.builder.config(conf=conf).getOrCreate()
    else:
        # Read by the driver JVM as it starts (spark-submit gets the
        # options), so the file must exist only until then.
        fd, log_config = tempfile.mkstemp(prefix="verneuil-log4j2-", suffix=".properties")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(_QUIET_LOG4J)
            conf.set("spark.driver.extraJavaOptions", "-Dlog4j2.configurationFile=file:" + log_config)
            gateway = launch_gateway(conf, popen_kwargs={"stderr": subprocess.PIPE})
        finally:
            os.unlink(log_config)
        threading.Thread(target=_forward_stderr, args=(gateway.proc.stderr,),
                         name="spark-stderr", daemon=True).start()
        SparkContext(conf=conf, gateway=gateway)
        spark = SparkSession.builder.getOrCreate()
    spark.sparkContext.setLogLevel("FATAL" if quiet else "ERROR")
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


# The lines of a wrapped Python worker or data source error that say what
# went wrong (Spark puts the whole Python traceback, and Java's, in its
# exception's message).
_CAUSE = re.compile(r"^(?:\w+\.)*(VerneuilSourceError|ConversionError|RuntimeError|"
                    r"(?:sqlite3\.)?\w*Error)\: (.+)$")


def explain(error: BaseException) -> str:
    """One line saying why a Spark job of this data source failed: the last
    error line of the Python traceback inside Spark's message, else the
    message's first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    causes = [m.group(2) for m in map(_CAUSE.match, lines) if m and "Traceback" not in m.group(2)]
    if causes:
        return causes[-1]
    return lines[0] if lines else type(error).__name__


def check_output(output: str, force: bool) -> None:
    """Refuse an --output that cannot or must not be written, before Spark
    starts: a Spark output is a directory, replaced only with force."""
    if not output.endswith((".parquet", ".csv")):
        raise VerneuilSourceError("--output must end in .parquet or .csv: %s" % output)
    if os.path.lexists(output) and not force:
        raise VerneuilSourceError("%s exists: use --force to replace it" % output)
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise VerneuilSourceError("cannot write %s: no directory %s" % (output, parent))


def run_query(spec, query: str, master: str = "local[*]", output: str | None = None,
              show: int = 20, on_error: str = "fail", stream=None, force: bool = False) -> int:
    """`verneuilctl query`: run `query` over the databases of `spec` (a
    directory such as a mount, a glob, a file or a list), show the first
    `show` rows and write all of them to `output` (.parquet or .csv, a Spark
    output directory; an existing one only with `force`) if given.  Returns
    the number of rows."""
    import sys
    import threading

    stream = stream or sys.stderr
    paths = find_databases(spec)
    total = sum(os.path.getsize(p) for p in paths)
    stream.write("%d databases, %.1f MB\n" % (len(paths), total / 1e6))
    if output:
        check_output(output, force)
    spark = spark_session(master, app="verneuilctl-query", quiet=True)
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
            writer = df.coalesce(1).write.mode("overwrite" if force else "errorifexists")
            if output.endswith(".parquet"):
                writer.parquet(output)
            else:
                writer.option("header", True).csv(output)
            stream.write("wrote %d rows to %s\n" % (n, output))
        return n
    finally:
        stop.set()
        spark.stop()
