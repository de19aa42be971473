"""`verneuilctl query`: one SQL query over many databases through Spark,
with progress on a terminal and errors explained in one line."""
from __future__ import annotations

import json
import os
import re

from .files import VerneuilSourceError, find_databases
from .session import finish_session, spark_session

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
    spark = spark_session(master, app="verneuilctl-query", quiet=True, class_archive=True)
    stop = threading.Event()
    ticker = None
    succeeded = False
    try:
        df = (spark.read.format("verneuil").option("query", query)
              .option("paths", json.dumps(paths)).option("on_error", on_error)
              .option("min_partitions", spark.sparkContext.defaultParallelism).load().cache())
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
