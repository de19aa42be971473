"""`verneuilctl query`: one SQL query over many databases through Spark,
with progress on a terminal and errors explained in one line.

Per database (the default): SQLite runs the SQL on each database, each row
carrying its database in `_source`. With `union`: each table the SQL names
(a table of the first database) becomes a Spark SQL view, the union of that
table over every database with `_source` added, and Spark SQL runs the SQL
once over the views, so it can aggregate across databases. With
on_error=skip the driver prints how many databases were left out and why
(`without_errors`)."""
from __future__ import annotations

import json
import os
import re
import sqlite3

from verneuil_fuse.spark.files import VerneuilSourceError, connect_readonly, find_databases
from verneuil_fuse.spark.schema import ERROR_COLUMN, SOURCE_COLUMN
from verneuil_fuse.spark.session import finish_session, spark_session

# Databases named one by one in the driver's warning about skipped ones.
SKIPPED_SHOWN = 10
# Table names that can be Spark SQL views as they are (others are left out).
_VIEW_NAME = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")

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


def compile_on_the_driver(path: str, query: str) -> None:
    """Raise the error a job with on_error=fail would end with when SQLite
    cannot compile `query` on `path`, the first database, before Spark's
    JVM starts (some 20 s saved on a typo). Only an error of the SQL itself
    (SQLITE_ERROR: syntax, no such table or column) and only where the driver
    can open that database; anything else is left to the executors."""
    if query.lstrip()[:7].upper() == "EXPLAIN":
        return
    try:
        con = connect_readonly(path)
    except sqlite3.Error:
        return
    try:
        con.execute("EXPLAIN " + query)  # compiles the statement, runs nothing
    except sqlite3.Error as e:
        if getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_ERROR:
            raise RuntimeError("query failed on %s: %s" % (path, e)) from None
    finally:
        con.close()


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


def without_errors(df, stream, what: str = "databases"):
    """`df`, read with on_error=report, without its error rows and its
    `_error` column, after writing to `stream` (on the driver) how many
    databases failed and why. `df` is cached: its rows are computed once."""
    from pyspark.sql import functions as F
    df = df.cache()
    failed = df.where(F.col(ERROR_COLUMN).isNotNull()).select(SOURCE_COLUMN, ERROR_COLUMN).collect()
    if failed:
        stream.write("warning: skipped %d %s (on_error=skip):\n" % (len(failed), what))
        for row in failed[:SKIPPED_SHOWN]:
            stream.write("  %s: %s\n" % (row[0], row[1]))
        if len(failed) > SKIPPED_SHOWN:
            stream.write("  ... and %d more\n" % (len(failed) - SKIPPED_SHOWN))
    return df.where(F.col(ERROR_COLUMN).isNull()).drop(ERROR_COLUMN)


def tables_named(paths: list[str], query: str) -> list[str]:
    """The tables of the first database that has any whose names the SQL
    holds as a word (a cheap over-estimate: a table named and not used only
    costs reading its schema)."""
    for path in paths:
        try:
            con = connect_readonly(path)
            try:
                names = [r[0] for r in con.execute(
                    "SELECT name FROM sqlite_master WHERE type IN ('table', 'view') AND name NOT LIKE 'sqlite%'")]
            finally:
                con.close()
        except sqlite3.Error:
            continue
        if not names:
            continue
        words = {w.lower() for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", query)}
        used = [n for n in names if n.lower() in words and _VIEW_NAME.match(n)]
        if not used:
            raise VerneuilSourceError("the SQL names none of the tables of %s (%s)" % (path, ", ".join(sorted(names))))
        return used
    raise VerneuilSourceError("none of the databases could be read to find its tables (first: %s)" % paths[0])


def _union_frame(spark, read, paths: list[str], query: str, on_error: str, stream):
    """`query` run by Spark SQL over one view per table it names: that
    table's union over every database."""
    for table in tables_named(paths, query):
        view = read().option("table", table).load()
        if on_error == "skip":
            view = without_errors(view, stream, "databases' %s" % table)
        view.createOrReplaceTempView(table)
    return spark.sql(query)


def run_query(spec, query: str, master: str = "local[*]", output: str | None = None,
              show: int = 20, on_error: str = "fail", stream=None, force: bool = False,
              union: bool = False) -> int:
    """`verneuilctl query`: run `query` over the databases of `spec` (a
    directory such as a mount, a glob, a file or a list), show the first
    `show` rows and write all of them to `output` (.parquet or .csv, a Spark
    output directory; an existing one only with `force`) if given; `union`:
    once, in Spark SQL, over the union of the tables it names (see the
    module docstring).  Returns the number of rows."""
    import sys
    import threading

    stream = stream or sys.stderr
    paths = find_databases(spec)
    total = sum(os.path.getsize(p) for p in paths)
    stream.write("%d databases, %.1f MB\n" % (len(paths), total / 1e6))
    if output:
        check_output(output, force)
    if on_error == "fail" and not union:
        compile_on_the_driver(paths[0], query)
    spark = spark_session(master, app="verneuilctl-query", quiet=True, class_archive=True)
    stop = threading.Event()
    ticker = None
    succeeded = False
    try:
        def read():
            # skip is report here, so that the driver can say what it left out.
            return (spark.read.format("verneuil").option("paths", json.dumps(paths))
                    .option("on_error", "report" if on_error == "skip" else on_error)
                    .option("min_partitions", spark.sparkContext.defaultParallelism))
        if union:
            df = _union_frame(spark, read, paths, query, on_error, stream)
        else:
            df = read().option("query", query).load()
            if on_error == "skip":
                df = without_errors(df, stream)
        df = df.cache()
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
        succeeded = True
        return n
    finally:
        stop.set()
        finish_session(spark, succeeded)
