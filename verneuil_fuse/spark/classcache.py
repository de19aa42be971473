"""A class-data archive (Java's AppCDS) for the driver JVM of command-line
runs: the classes Spark loads, parsed and verified once, then mapped at
every later start, which cuts `verneuilctl query`'s JVM start and first job
by about 3 s of 12 on 2 cores.

The first run writes the archive as its JVM exits (to a temporary name,
renamed only once the JVM has exited cleanly: a truncated archive would
crash the next JVM); later runs map it. The name carries the Java binary,
its modification time and the PySpark version, so an upgrade of either
starts a new archive. Set VERNEUIL_SPARK_CDS=0 to start without it."""
from __future__ import annotations

import glob
import hashlib
import logging
import os
import shutil
import time

log = logging.getLogger("verneuil_fuse.spark")

# Seconds the JVM may take to exit and write the archive (about 2 s for
# Spark's 12 000 classes on 2 cores); past that it is killed, no archive kept.
DUMP_TIMEOUT = 60
# A temporary archive older than this is left over from a run that was
# killed while writing it.
STALE_SECONDS = 600
# JVM options that keep the archive's own notices off the command's output
# (a stale archive is then silently not used).
_QUIET = ["-Xshare:auto", "-Xlog:cds=off", "-Xlog:cds+dynamic=off"]


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "verneuil")


def _archive_path() -> str | None:
    """Where the archive of this Java and this PySpark lives; None when
    either cannot be found or archives are turned off."""
    if os.environ.get("VERNEUIL_SPARK_CDS", "1") == "0":
        return None
    import pyspark
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if not java or not os.path.exists(java):
        return None
    java = os.path.realpath(java)
    key = "%s|%d|%s" % (java, os.stat(java).st_mtime_ns, pyspark.__version__)
    return os.path.join(_cache_dir(), "spark-driver-%s.jsa" % hashlib.sha256(key.encode()).hexdigest()[:16])


class ClassArchive:
    """The JVM options for one driver start, and what to do when it ends."""

    def __init__(self, enabled: bool = True):
        self.final = _archive_path() if enabled else None
        self.temp = None
        if self.final is None:
            self.options: list[str] = []
        elif os.path.exists(self.final):
            self.options = _QUIET + ["-XX:SharedArchiveFile=" + self.final]
        else:
            try:
                os.makedirs(os.path.dirname(self.final), exist_ok=True)
            except OSError:
                self.final, self.options = None, []
                return
            self._remove_stale()
            self.temp = "%s.%d.tmp" % (self.final, os.getpid())
            self.options = _QUIET + ["-XX:ArchiveClassesAtExit=" + self.temp]

    def _remove_stale(self) -> None:
        for path in glob.glob(self.final + ".*.tmp"):
            try:
                if time.time() - os.stat(path).st_mtime > STALE_SECONDS:
                    os.unlink(path)
            except OSError:
                pass

    def finish(self, proc, succeeded: bool) -> None:
        """After the session stopped: if this start writes the archive, end
        the JVM (`proc`, by closing its stdin as PySpark's gateway expects,
        bounded) and keep the archive if the JVM exited cleanly."""
        if self.temp is None or proc is None:
            return
        if not succeeded:
            self._discard()
            return
        try:
            if proc.stdin:
                proc.stdin.close()
            proc.wait(timeout=DUMP_TIMEOUT)
        except Exception:  # noqa: BLE001 - a JVM that does not end: no archive
            proc.kill()
            proc.wait(timeout=DUMP_TIMEOUT)
            self._discard()
            return
        if proc.returncode == 0 and os.path.exists(self.temp) and os.path.getsize(self.temp) > 0:
            os.replace(self.temp, self.final)
            log.debug("class archive written: %s", self.final)
        else:
            self._discard()

    def _discard(self) -> None:
        try:
            os.unlink(self.temp)
        except OSError:
            pass
