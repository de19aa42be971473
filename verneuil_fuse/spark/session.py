"""The SparkSession for this project's tools and tests: loopback only,
this Python on the workers, filter pushdown on, the data source registered,
and (for command-line tools) a quiet JVM."""
from __future__ import annotations

import os

from verneuil_fuse.spark.classcache import ClassArchive
from verneuil_fuse.spark.source import VerneuilDataSource

# What a `quiet` session launched itself, for `finish_session`.
_launched: dict = {}

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


def spark_session(master: str = "local[*]", app: str = "verneuil", quiet: bool = False,
                  conf: dict | None = None, class_archive: bool = False):
    """A SparkSession set up for this machine (loopback only, this Python on
    the workers, filter pushdown on, Python workers' errors as one line
    without their traceback) with the data source registered; `conf`
    adds or overrides Spark settings (a cluster's executor sizes, say).
    `quiet` (for command-line tools): the JVM logs only fatal errors, from
    its start on, and its start-up notices are dropped from its stderr;
    with `class_archive` too, its JVM maps (or writes, for the next start)
    a class-data archive (classcache.py); end such a session with
    `finish_session`."""
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
    settings = conf or {}
    conf = (SparkConf().setMaster(master).setAppName(app)
            .set("spark.ui.enabled", "false")
            .set("spark.ui.showConsoleProgress", "false")
            .set("spark.driver.bindAddress", "127.0.0.1")
            .set("spark.sql.shuffle.partitions", "4")
            # Off by default in PySpark; table mode's filters go to SQLite.
            .set("spark.sql.python.filterPushdown.enabled", "true")
            # A database a task cannot read is the user's to fix (a host
            # without the mount, a damaged file): the driver gets the
            # error's one line (DatabaseError: the database, the executor
            # host, why), not a Python traceback of the data source.
            .set("spark.sql.execution.pyspark.udf.hideTraceback.enabled", "true"))
    for key, value in settings.items():
        conf.set(key, str(value))
    if not quiet or SparkContext._active_spark_context is not None:
        spark = SparkSession.builder.config(conf=conf).getOrCreate()
    else:
        # Read by the driver JVM as it starts (spark-submit gets the
        # options), so the file must exist only until then.
        fd, log_config = tempfile.mkstemp(prefix="verneuil-log4j2-", suffix=".properties")
        archive = ClassArchive(enabled=class_archive)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(_QUIET_LOG4J)
            conf.set("spark.driver.extraJavaOptions", " ".join(
                ["-Dlog4j2.configurationFile=file:" + log_config] + archive.options))
            gateway = launch_gateway(conf, popen_kwargs={"stderr": subprocess.PIPE})
        finally:
            os.unlink(log_config)
        _launched.update(proc=gateway.proc, archive=archive)
        threading.Thread(target=_forward_stderr, args=(gateway.proc.stderr,),
                         name="spark-stderr", daemon=True).start()
        SparkContext(conf=conf, gateway=gateway)
        spark = SparkSession.builder.getOrCreate()
    spark.sparkContext.setLogLevel("FATAL" if quiet else "ERROR")
    spark.dataSource.register(VerneuilDataSource)
    return spark


def finish_session(spark, succeeded: bool) -> None:
    """Stop `spark`; for a `quiet` session's JVM that writes its class
    archive, end the JVM and keep the archive if all went well."""
    spark.stop()
    if _launched:
        _launched["archive"].finish(_launched["proc"], succeeded)
        _launched.clear()
