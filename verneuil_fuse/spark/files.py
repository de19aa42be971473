"""The databases a Spark read covers: finding them, grouping them into
partitions by size, and opening each one read-only."""
from __future__ import annotations

import glob
import os
import re
import socket
import sqlite3
import urllib.parse
from typing import Sequence

# File names taken as SQLite databases when a directory is given.
DB_SUFFIXES = (".db", ".sqlite", ".sqlite3", ".db3")
# Bytes a partition should read. A task of a Python data source costs 40 to
# 100 ms on 2 cores whatever it reads (the Python worker round trip, the
# Arrow stream, the reader unpickled), measured with 16 tasks of tiny
# databases; at 512 MiB a task reads for 1-2 s from the page cache, so that
# cost stays under 5 %, while `min_partitions` keeps every core busy and a
# larger database still gets a task of its own. (Spark's 128 MiB, for JVM
# file sources whose tasks cost a few ms, made 16 tasks of 1.7 GiB.)
DEFAULT_PARTITION_BYTES = 512 << 20
# What opening a database costs, counted as bytes read, so thousands of tiny
# databases still spread over the cores instead of landing in one
# partition. Measured on the mount, warm: opening, reading the schema and
# closing costs about what reading 0.3 MiB does; 1 MiB leaves room for
# cold opens (Spark's own 4 MiB, for HDFS, made four tasks of 100 tiny
# databases on 2 cores, each task costing about 40 ms).
OPEN_COST_BYTES = 1 << 20


class VerneuilSourceError(ValueError):
    """Bad options or paths given to the data source."""


class DatabaseError(RuntimeError):
    """A database a task could not read (on_error=fail): its message names
    the database, the executor host and why."""


# The file system type of a verneuil mount in /proc/self/mountinfo.
MOUNT_FSTYPE = "fuse.verneuil"


def _mount_of(path: str) -> tuple[str, str] | None:
    """(mount point, file system type) of the mount that holds `path` on
    this host, from /proc/self/mountinfo (never touching the mount)."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.readlines()
    except OSError:
        return None
    path = os.path.abspath(path)
    best = None
    for line in lines:
        fields = line.split()
        if len(fields) < 10 or "-" not in fields:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        fstype = fields[fields.index("-") + 1]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fstype)
    return best


def explain_failure(path: str, error: Exception) -> str:
    """Why a task could not read `path`, for the driver: SQLite's words,
    or what is missing on this host (a file absent because no verneuil
    mount holds it here, a mount that could not reach its store), and the
    executor host's name."""
    why = str(error)
    mount = _mount_of(path)
    verneuil = mount is not None and mount[1] == MOUNT_FSTYPE
    if not os.path.exists(path):
        if verneuil:
            why = ("no such file in the verneuil mount at %s (gone from the store since the driver listed it, "
                   "or that mount is of another store)" % mount[0])
        else:
            near = os.path.dirname(os.path.abspath(path))
            while not os.path.isdir(near):
                near = os.path.dirname(near)
            why = ("no such file, and no verneuil mount holds it on this host (its nearest directory here is %s): "
                   "mount the store at the same path on every executor host" % near)
    elif verneuil and "disk I/O error" in why:
        why += " (the verneuil mount at %s could not get it from its store: see that mount's log)" % mount[0]
    return "%s (executor host %s)" % (why, socket.gethostname())


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


def sizes(paths: Sequence[str]) -> list[tuple[int, str]]:
    """(size, path) for each path, from stat; an unreadable file counts as 0
    (its error comes when the task opens it)."""
    out = []
    for p in paths:
        try:
            out.append((os.stat(p).st_size, p))
        except OSError:
            out.append((0, p))
    return out


def balance(paths: Sequence[str], n_parts: int) -> list[list[str]]:
    """Greedy largest-first assignment of files to `n_parts` groups of
    similar total size."""
    return balance_sized(sorted(sizes(paths), reverse=True), n_parts)


def plan_by_bytes(paths: Sequence[str], max_bytes: int, parallelism: int) -> list[list[str]]:
    """Groups of databases of about `max_bytes` each (a file's size plus
    OPEN_COST_BYTES), as Spark splits files: the target is lowered to an
    even share per core when the whole is small, so every core gets work;
    the number of groups is a multiple of `parallelism` (no last wave with
    one task and idle cores); a database larger than the target is a group
    alone. Groups are filled largest first, each file going to the
    emptiest group."""
    sized = sorted(((s + OPEN_COST_BYTES, p) for s, p in sizes(paths)), reverse=True)
    if not sized:
        return []
    cores = max(1, parallelism)
    total = sum(s for s, _ in sized)
    target = min(max_bytes, max(OPEN_COST_BYTES, -(-total // cores)))
    n = -(-max(cores, -(-total // target)) // cores) * cores
    groups = balance_sized(sized, min(n, len(sized)))
    return [g for g in groups if g]


def balance_sized(sized: list[tuple[int, str]], n: int) -> list[list[str]]:
    """`balance` on (size, path) pairs already sorted largest first."""
    groups: list[list[str]] = [[] for _ in range(max(1, min(n, len(sized))))]
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


def connect_readonly(path: str, immutable: bool = True,
                     lenient_text: bool = True) -> sqlite3.Connection:
    """A read-only connection: `immutable=1` for a pinned snapshot file,
    else `mode=ro`. ATTACH is refused (it could create files). With
    `lenient_text`, text that is not UTF-8 is read with replacement
    characters, as the sqlite3 shell shows it, instead of failing the whole
    database; without, text is decoded by sqlite3 in C (no Python call per
    value) and invalid UTF-8 raises `sqlite3.OperationalError` (see
    `is_decode_error`), after which the caller reads again leniently."""
    uri = "file:%s?%s" % (urllib.parse.quote(os.path.abspath(path)),
                          "immutable=1" if immutable else "mode=ro")
    con = sqlite3.connect(uri, uri=True, check_same_thread=False, factory=_ReadOnlyConnection)
    con.set_authorizer(_authorizer(con))
    con.text_factory = _replace_invalid if lenient_text else str
    return con


def _replace_invalid(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def is_decode_error(e: sqlite3.Error) -> bool:
    """Whether `e` is sqlite3 failing to decode text that is not UTF-8."""
    return isinstance(e, sqlite3.OperationalError) and "decode" in str(e)
