"""The data source on a real Spark standalone cluster on 127.0.0.1: a master
and two workers started from PySpark's own `bin/spark-class`, each worker
launching its own executor JVM and Python workers. The databases are read
through one verneuil mount for the host (every executor sees the same
path), or as plain files where FUSE is unavailable; the query's partitions
must run on both workers and the rows equal the sources'. A second cluster
has one worker on a "host" without the mount (its own mount and UTS
namespaces, where the mount is detached and the host name is another): the
driver must name that host and the path, without a traceback. Every process
started here is ended by its process group in teardown."""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time

import pytest

pyspark = pytest.importorskip("pyspark")

from support.replicas import Mount, fuse_unavailable  # noqa: E402
from verneuil_fuse import spark as vspark  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DATABASES = 8
QUERY = "SELECT kind, count(*) AS n, sum(v) AS total FROM events GROUP BY kind"
# Seconds for a daemon to log that it is up, or for the executors to
# register: a cold JVM on a busy 2-core machine takes 5-15 s.
START_TIMEOUT = 90
# Seconds a daemon has to exit after SIGTERM before it is killed.
STOP_TIMEOUT = 15
# The host name of the worker that has no mount.
NO_MOUNT_HOST = "worker-without-mount"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """One `spark-class` JVM (master or worker) in its own process group,
    logging to a file."""

    def __init__(self, name: str, args: list[str], log_dir: str, prefix: tuple[str, ...] = ()):
        home = os.path.dirname(pyspark.__file__)
        env = dict(os.environ, SPARK_HOME=home, SPARK_LOCAL_IP="127.0.0.1",
                   SPARK_DAEMON_MEMORY="256m", SPARK_NO_DAEMONIZE="1")
        self.name = name
        self.log = os.path.join(log_dir, name + ".log")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([*prefix, os.path.join(home, "bin", "spark-class"), *args], env=env,
                                         stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_for(self, text: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            with open(self.log, errors="replace") as f:
                if text in f.read():
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.3)
        with open(self.log, errors="replace") as f:
            tail = f.read()[-3000:]
        raise RuntimeError("%s did not log %r in time:\n%s" % (self.name, text, tail))

    def stop(self) -> None:
        """SIGTERM to the group (the JVM, its executors and their Python
        workers), then SIGKILL if it outlives STOP_TIMEOUT."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
                os.killpg(self.proc.pid, signal.SIGKILL)  # executors left in the group
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                pass
            return


def _start_cluster(root, workers: int, prefix: tuple[str, ...] = ()):
    """A master and `workers` workers of one core each (the workers run
    under `prefix`); returns (url, work dirs, daemons), the daemons to stop."""
    port = _free_port()
    url = "spark://127.0.0.1:%d" % port
    daemons = []
    try:
        master = Daemon("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                   "--port", str(port), "--webui-port", str(_free_port())], str(root))
        daemons.append(master)
        deadline = time.monotonic() + START_TIMEOUT
        master.wait_for("I have been elected leader", deadline)
        work_dirs = []
        for i in range(1, workers + 1):
            work = root / ("worker%d" % i)
            work.mkdir()
            w = Daemon("worker%d" % i, ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                                        "--cores", "1", "--memory", "1g", "--work-dir", str(work),
                                        "--webui-port", str(_free_port()), url], str(root), prefix)
            daemons.append(w)
            work_dirs.append(str(work))
        for w in daemons[1:]:
            w.wait_for("Successfully registered with master", deadline)
    except BaseException:
        for d in reversed(daemons):
            d.stop()
        raise
    return url, work_dirs, daemons


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    url, workers, daemons = _start_cluster(root, 2)
    try:
        yield url, workers, root
    finally:
        for d in reversed(daemons):
            d.stop()


@pytest.fixture
def cluster_without_mount(replicas, tmp_path_factory):
    """A master and one worker whose host has no verneuil mount: the worker
    runs in mount and UTS namespaces of its own, where the mount is detached
    (umount -l there only) and the host name is NO_MOUNT_HOST. For one test
    (which runs first), so that its JVMs are gone before `cluster` starts."""
    _paths, _replica_dir, mountpoint = replicas
    if mountpoint is None:
        pytest.skip("no FUSE mount to leave out: %s" % fuse_unavailable())
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    root = tmp_path_factory.mktemp("cluster-without-mount")
    # The host name must resolve there (the JVM looks itself up): a hosts
    # file of that namespace's own, bound over /etc/hosts there only.
    hosts = root / "hosts"
    with open("/etc/hosts") as f:
        hosts.write_text(f.read() + "\n127.0.0.1 %s\n" % NO_MOUNT_HOST)
    prefix = ("unshare", "--mount", "--uts", "--propagation", "private", "--", "sh", "-c",
              'hostname "$0" && mount --bind "$1" /etc/hosts && umount -l "$2" && shift 2 && exec "$@"',
              NO_MOUNT_HOST, str(hosts), mountpoint)
    url, _workers, daemons = _start_cluster(root, 1, prefix)
    try:
        yield url
    finally:
        for d in reversed(daemons):
            d.stop()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """The databases as the executors read them: through a verneuil mount
    of a store the copier filled, or the source files without FUSE."""
    root = tmp_path_factory.mktemp("cluster-data")
    src = root / "src"
    src.mkdir()
    if fuse_unavailable():
        paths = [_make(str(src / ("t%d.db" % i)), i, sqlite3.connect) for i in range(DATABASES)]
        yield paths, str(src), None
        return
    import writer_vfs
    from verneuil_fuse import copier
    from verneuil_fuse.format import local_hostname

    spool, store_url = str(root / "spool"), "file://%s" % (root / "store")
    writer_vfs.register(spool)
    with copier.start_background(spool, store_url, rate=0) as bg:
        paths = [_make(str(src / ("t%d.db" % i)), i, writer_vfs.connect) for i in range(DATABASES)]
        bg.flush(timeout=120)
    mount = Mount(store_url, str(root / "mnt"), "cache_dir=%s" % (root / "cache")).start()
    try:
        yield paths, mount.path(local_hostname(), str(src)), mount.mountpoint
    finally:
        mount.stop()


def _make(path: str, i: int, connect) -> str:
    con = connect(path)
    con.execute("CREATE TABLE events(id INTEGER PRIMARY KEY, kind TEXT, v REAL)")
    con.executemany("INSERT INTO events(kind, v) VALUES (?, ?)",
                    [("k%d" % (j % 3), j * 0.5 + i) for j in range(20 + 10 * i)])
    con.commit()
    con.close()
    return path


def _cluster_session(url: str, app: str, executors: int, conf: dict | None = None):
    """A session on the cluster at `url` with `executors` executors of one
    core, once they registered (any local session left by another module
    stopped first); `conf` adds settings."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    spark = vspark.spark_session(url, app=app, conf={
        "spark.driver.host": "127.0.0.1", "spark.executor.memory": "512m",
        "spark.executor.cores": "1", "spark.cores.max": str(executors), **(conf or {})})
    status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus
    deadline = time.monotonic() + START_TIMEOUT
    while status().size() < executors + 1 and time.monotonic() < deadline:
        time.sleep(0.5)  # the driver counts as one
    if status().size() != executors + 1:
        _stop_session(spark)
        raise AssertionError("executors did not register")
    return spark


def _stop_session(spark) -> None:
    """Stop the session and end the driver JVM by its PID."""
    from pyspark import SparkContext
    gateway = SparkContext._gateway
    spark.stop()
    proc = getattr(gateway, "proc", None)
    if proc is not None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT)
    SparkContext._gateway = None
    SparkContext._jvm = None


def test_a_worker_without_the_mount_is_named_on_the_driver(cluster_without_mount, replicas):
    """The only worker's host has no verneuil mount. on_error=fail: the
    driver's error names a database, that executor host and what is
    missing, in one line (no Python traceback); a report read, then
    `without_errors` on the driver (what `verneuilctl query --on-error skip`
    runs; the end to end tests run that command) says how many databases
    were skipped and why, in the same session."""
    url = cluster_without_mount
    _paths, replica_dir, _mountpoint = replicas
    # One attempt per task: the error is the same after Spark's 4 (the
    # default), which only cost time here.
    spark = _cluster_session(url, "verneuil-no-mount-test", 1, {"spark.task.maxFailures": "1"})
    try:
        with pytest.raises(Exception) as failed:
            spark.read.format("verneuil").option("query", QUERY).load(replica_dir).collect()
        text = str(failed.value)
        assert "query failed on %s/t" % replica_dir in text, text[-3000:]
        assert "no verneuil mount holds it on this host" in text and "(executor host %s)" % NO_MOUNT_HOST in text
        assert "Traceback" not in text, text[-3000:]
        said = io.StringIO()
        rows = vspark.without_errors(spark.read.format("verneuil").option("query", QUERY)
                                     .option("on_error", "report").load(replica_dir), said).collect()
    finally:
        _stop_session(spark)
    said = said.getvalue()
    assert rows == []
    assert "warning: skipped %d databases (on_error=skip):" % DATABASES in said, said[-3000:]
    assert "no verneuil mount holds it on this host" in said
    assert said.count("(executor host %s)" % NO_MOUNT_HOST) == DATABASES, said[-3000:]


def test_query_runs_on_both_workers(cluster, replicas):
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    url, workers, _root = cluster
    paths, replica_dir, _mountpoint = replicas
    spark = _cluster_session(url, "verneuil-cluster-test", 2)
    try:

        # The executor's working directory is <worker dir>/<app>/<executor id>:
        # a Python UDF in the same task as the scan tells which worker ran it.
        where = F.udf(lambda: os.getcwd(), StringType())
        df = (spark.read.format("verneuil").option("query", QUERY)
              .option("partitions", str(DATABASES)).load(replica_dir)
              .withColumn("cwd", where()))
        rows = df.collect()
        ran_on = {w for w in workers for r in rows if r["cwd"].startswith(w + os.sep)}
        assert ran_on == set(workers), sorted({r["cwd"] for r in rows})
        got = {(r["kind"], r["n"], r["total"], os.path.basename(r["_source"])) for r in rows}
        assert got == _direct(paths)

        # Table mode with a pushed filter, on the cluster too.
        table = (spark.read.format("verneuil").option("table", "events").load(replica_dir)
                 .where("kind = 'k1' AND v > 3").groupBy("_source").count().collect())
        assert {(os.path.basename(r[0]), r[1]) for r in table} == _direct(
            paths, "SELECT count(*) FROM events WHERE kind = 'k1' AND v > 3", per_db=True)
    finally:
        _stop_session(spark)


def _direct(paths, query=QUERY, per_db=False):
    rows = set()
    for p in paths:
        con = sqlite3.connect("file:%s?mode=ro" % p, uri=True)
        for r in con.execute(query):
            if per_db:
                if r[0]:
                    rows.add((os.path.basename(p), r[0]))
            else:
                rows.add(tuple(r) + (os.path.basename(p),))
        con.close()
    return rows


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
