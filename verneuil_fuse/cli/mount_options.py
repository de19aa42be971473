"""The `verneuil` command line: one table of its mount options
(`MOUNT_OPTIONS`), and what comes from it: the `Options` a mount is made
with and their defaults, the parser of ``-o`` (`parse_args`), the options'
part of ``--help`` (`help_text`) and the table of docs/READER.md
(`docs_table`; tests/test_mount_cli.py fails when that table and this one
disagree, scripts/mount_options_doc.py writes it again).

Each option has its name, how its value is read (a function that raises
ValueError for a bad one), its default (the constant of the module that
uses it), a line of help and a longer description for the docs; an option
whose default is computed when the mount is made (``None`` here) says what
it will be (``shown``).

Beside the mount's own options: libfuse's (`LIBFUSE_FLAGS`,
`LIBFUSE_VALUES`), passed on, and those mount(8), mount.fuse3 or fstab may
add that mean nothing here (`IGNORED_FLAGS`), dropped; anything else is an
error (docs/DESIGN.md, "Facts about the platform").
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import textwrap
from typing import Any, Callable, Optional

from verneuil_fuse import __version__
from verneuil_fuse.errors import EXIT_USAGE, UserError
from verneuil_fuse.format import CHUNK_SIZE, DEFAULT_MAX_DB_SIZE
from verneuil_fuse.reader.cache import DEFAULT_CACHE_DIR, DEFAULT_CACHE_SIZE
from verneuil_fuse.reader.catalog import DEFAULT_REFRESH_INTERVAL
from verneuil_fuse.reader.fetcher import (DEFAULT_ATTEMPT_TIMEOUT, DEFAULT_CONCURRENCY, DEFAULT_DEADLINE,
                                          DEFAULT_MEM_CACHE_BYTES, DEFAULT_RETRIES, DEFAULT_THREAD_CONCURRENCY)
from verneuil_fuse.reader.prefetch import PrefetchConfig
from verneuil_fuse.reader.watch import DEFAULT_INTERVAL as DEFAULT_FOLLOW_INTERVAL

# Options libfuse accepts (docs/DESIGN.md); anything else makes fuse_session_new fail.
LIBFUSE_FLAGS = frozenset(
    {
        "ro", "allow_other", "allow_root", "default_permissions", "auto_unmount", "debug",
        "dev", "nodev", "suid", "nosuid", "exec", "noexec", "atime", "noatime",
    }
)
LIBFUSE_VALUES = frozenset({"fsname", "subtype"})
# Options mount(8), mount.fuse3 or fstab may hand us that mean nothing here.
IGNORED_FLAGS = frozenset(
    {
        "rw", "defaults", "_netdev", "nofail", "auto", "noauto", "user", "users", "nouser",
        "owner", "group", "relatime", "norelatime", "strictatime", "nostrictatime",
        "diratime", "nodiratime", "lazytime", "nolazytime", "sync", "async", "silent", "loud",
    }
)

# The kernel's readahead for the mount. libfuse answers the kernel's INIT with
# 128 KiB, so sequential reads arrive as 128 KiB requests, each a round trip
# through Python. A request is at most 1 MiB (libfuse 3 negotiates max_pages
# 256) whatever this is; a 4 MiB window keeps up to four of them in flight and
# ramps up faster after every jump of a scan (16, 64, 256 KiB, then 1 MiB
# requests instead of 16, 64, 128, 256, 512 KiB): a warm SQL scan served
# from the disk cache took 0.64-0.65 s instead of 0.77-0.80 s, medians of 5
# (docs/READER.md). Random reads are not read ahead.
DEFAULT_READ_AHEAD_KB = 4096
# The kernel keeps a name (and its attributes) this long: a burst of lookups
# of one file (an open's stat, the open, SQLite's journal check) is answered
# by the kernel, and a name that changed is seen again within a second.
DEFAULT_ENTRY_TIMEOUT = 1.0
# Largest `concurrency`: each GET in flight holds an HTTP connection and a
# request of the chunk engine (about 130 KiB), or a worker thread on a
# directory store; 1024 leaves room for a store far away while a typo
# (50000000) cannot exhaust memory at start-up.
MAX_CONCURRENCY = 1024
# Smallest non-zero `cache_size`: the disk cache keeps its bound by evicting
# whole segments, 16 of them, of at least 1 MiB each (cache.py), so a bound
# below 16 MiB could not be kept.
MIN_CACHE_SIZE = 16 << 20
# metrics_port listens on loopback unless told otherwise: the series name
# the databases of the host.
DEFAULT_METRICS_ADDRESS = "127.0.0.1"
# Largest uid= or gid=: the kernel's ids are 32 bits, and (uid_t)-1 means
# "no change" to the system calls that take one.
MAX_ID = (1 << 32) - 2
# Options that only mean something for an S3 store.
S3_ONLY_OPTIONS = ("profile", "credentials_file")
# The log levels log_level= takes.
LOG_LEVELS = ("debug", "info", "warning", "error")

# --help's columns: an option's name and value, then its text.
HELP_NAME_WIDTH = 24
HELP_WIDTH = 79


# ------------------------------------------------------------------ values
_SIZE = re.compile(r"\A(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\Z", re.I)


def parse_size(text: str) -> int:
    """A size such as 2G, 512M, 1.5T or 100 (bytes; K, M, G, T are powers of 1024)."""
    m = _SIZE.match(text.strip())
    if not m:
        raise ValueError("not a size: %r" % text)
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    value = float(m.group(1)) * scale
    if not math.isfinite(value) or value >= 1 << 62:
        raise ValueError("too large: %r" % text)
    return int(value)


def _bool(text: str) -> bool:
    t = text.lower()
    if t in ("1", "on", "yes", "true", ""):
        return True
    if t in ("0", "off", "no", "false"):
        return False
    raise ValueError("not on/off: %r" % text)


def _checked(parse: Callable[[str], Any], ok: Callable[[Any], bool], why: str) -> Callable[[str], Any]:
    """An option's parser: ``parse`` the text, then ValueError(``why``)
    unless ``ok`` accepts the value."""
    def check(text: str) -> Any:
        value = parse(text)
        if not ok(value):
            raise ValueError(why)
        return value
    return check


_positive_int = _checked(int, lambda v: v >= 1, "must be at least 1")
_concurrency = _checked(_positive_int, lambda v: v <= MAX_CONCURRENCY, "at most %d" % MAX_CONCURRENCY)
_cache_size = _checked(parse_size, lambda v: not 0 < v < MIN_CACHE_SIZE,
                       "0 (no disk cache) or at least %dM" % (MIN_CACHE_SIZE >> 20))
_db_size = _checked(parse_size, lambda v: v >= CHUNK_SIZE, "at least 64K")
_path = _checked(str, bool, "an empty path")
_nonneg_int = _checked(int, lambda v: v >= 0, "must not be negative")
_seconds = _checked(float, lambda v: 0 < v < math.inf, "must be a positive number of seconds")
_nonneg_seconds = _checked(float, lambda v: 0 <= v < math.inf, "must be a number of seconds, 0 or more")


def _level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise ValueError("one of %s" % ", ".join(LOG_LEVELS))
    return text.lower()


def _profile(text: str) -> str:
    if not text or any(c.isspace() or c in "[]" for c in text):
        raise ValueError("not a profile name: %r" % text)
    return text


def _port(text: str) -> int:
    v = int(text)
    if not 0 <= v <= 65535:
        raise ValueError("a TCP port, 0 to 65535")
    return v


def _address(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise ValueError("not an address: %r" % text)
    return text


def _named_id(text: str, lookup, what: str) -> int:
    """A user or group id: a number, or a name `lookup` finds on this host."""
    if re.fullmatch(r"[0-9]+", text):
        if int(text) > MAX_ID:
            raise ValueError("at most %d" % MAX_ID)
        return int(text)
    try:
        return lookup(text)
    except KeyError:
        raise ValueError("no %s %r on this host" % (what, text)) from None


def _uid(text: str) -> int:
    import pwd

    return _named_id(text, lambda name: pwd.getpwnam(name).pw_uid, "user")


def _gid(text: str) -> int:
    import grp

    return _named_id(text, lambda name: grp.getgrnam(name).gr_gid, "group")


def _umask(text: str) -> int:
    try:
        v = int(text, 8)
    except ValueError:
        raise ValueError("an octal mode such as 022 or 0077") from None
    if not 0 <= v <= 0o777:
        raise ValueError("an octal mode from 0 to 0777")
    return v


def _subdir(text: str) -> str:
    parts = [p for p in text.split("/") if p]
    if not text.startswith("/") or not parts or any(p in (".", "..") for p in parts):
        raise ValueError("a directory of the tree, /HOST or /HOST/PATH, such as /web1/srv/data")
    return "/" + "/".join(parts)


def shown_size(n: int) -> str:
    """A size as the options take it: 2G, 64M, 512K, or bytes."""
    for shift, unit in ((40, "T"), (30, "G"), (20, "M"), (10, "K")):
        if n and n % (1 << shift) == 0:
            return "%d%s" % (n >> shift, unit)
    return str(n)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return "%g" % value
    return str(value)


# ------------------------------------------------------------------ the table
@dataclasses.dataclass(frozen=True)
class MountOption:
    """One ``-o name=value`` option of the mount (see the module's docstring)."""

    name: str
    value: str  # what --help and the docs write after "name=": SIZE, SECONDS, on|off ...
    parse: Callable[[str], Any]
    default: Any
    help: str  # --help's words
    doc: str = ""  # docs/READER.md's, when longer than --help's
    shown: Optional[str] = None  # the default as said (one computed at mount time, or a size)
    flag: bool = False  # the name alone turns it on

    @property
    def default_text(self) -> str:
        return self.shown if self.shown is not None else _shown(self.default)

    @property
    def spelled(self) -> str:
        """The option as written: ``name=VALUE`` (``name[=on|off]`` for a flag)."""
        return "%s[=%s]" % (self.name, self.value) if self.flag else "%s=%s" % (self.name, self.value)


def _option(name: str, value: str, parse: Callable[[str], Any], default: Any, help: str, doc: str = "",
            shown: Optional[str] = None, flag: bool = False) -> MountOption:
    return MountOption(name, value, parse, default, " ".join(help.split()), " ".join(doc.split()), shown, flag)


MOUNT_OPTIONS: tuple[MountOption, ...] = (
    _option("cache_dir", "PATH", _path, None,
            "chunk cache directory, shared by all mounts and kept across remounts",
            "disk cache of verified chunks, keyed by fingerprint, shared by every database and by every mount "
            "naming it, kept across remounts (see [The disk cache](#the-disk-cache))",
            shown="%s as root, else ~/.cache/verneuil" % DEFAULT_CACHE_DIR),
    _option("cache_size", "SIZE", _cache_size, DEFAULT_CACHE_SIZE,
            "bound of the disk cache this mount keeps (mounts sharing a cache_dir each add theirs), e.g. 2G, "
            "512M; 0 = no disk cache, else at least 16M; it also leaves 5% of its file system free (at most 1G)",
            "bound kept by this mount, not by the directory (`0`: none; each mount evicts when it starts a "
            "segment, counting what it sees of the others' segments, but the segments the others are writing "
            "and what they wrote since its last rescan come on top: N mounts sharing one `cache_dir` with "
            "`16M` each may hold up to about N × 16 MiB there, 30-45 MiB measured for 2-3 mounts); else at "
            "least `16M`: the bound is kept by evicting whole segments, 16 of at least 1 MiB; 5 % of the file "
            "system, at most 1 GiB, is always left free: the disk bounds a larger `cache_size`)",
            shown=shown_size(DEFAULT_CACHE_SIZE)),
    _option("mem_cache", "SIZE", parse_size, DEFAULT_MEM_CACHE_BYTES,
            "in-process cache of hot chunks", "in-process LRU of hot chunks",
            shown=shown_size(DEFAULT_MEM_CACHE_BYTES)),
    _option("refresh", "SECONDS", _seconds, DEFAULT_REFRESH_INTERVAL,
            "how often the store is polled for new or removed databases and versions",
            "store polling interval (a listing)"),
    _option("follow", "on|off", _bool, True,
            "open handles of a live database follow it: a SQLite connection (mode=ro, not immutable=1) moves "
            "to the newest version at its next read transaction, each open handle with a page cache of its "
            "own; off: a handle reads the version it opened until it is closed, and concurrent handles share "
            "one page cache",
            "open handles of live databases follow them: a SQLite connection moves to the newest version at "
            "its next read transaction, each open handle with an inode and a page cache of its own "
            "([Following](#following-long-lived-connections-see-new-versions)); off: a handle reads the "
            "version it opened until it is closed, and concurrent handles of a version share its page cache"),
    _option("follow_interval", "SECONDS", _nonneg_seconds, DEFAULT_FOLLOW_INTERVAL,
            "how often the manifests of the databases open or opened in the last minute are checked (a "
            "conditional GET each, 304 while unchanged); 0: only the poll",
            "how often the manifests of the databases in use (open, or opened in the last minute) are checked "
            "with a conditional GET; `0`: only the poll"),
    _option("readahead", "on|off", _bool, True, "sequential readahead"),
    _option("readahead_max", "N", _nonneg_int, PrefetchConfig.readahead_max,
            "largest readahead window, in 64 KiB chunks (0: no readahead)"),
    _option("btree_prefetch", "on|off", _bool, True,
            "B-tree-aware prefetch of the sibling pages a scan reads next"),
    _option("btree_max", "N", _nonneg_int, PrefetchConfig.btree_max,
            "largest B-tree prefetch window, in chunks (0: no B-tree prefetch)"),
    _option("concurrency", "N", _concurrency, None,
            "parallel GETs to the store, 1-%d" % MAX_CONCURRENCY,
            "GETs in flight, 1 to %d (each holds a connection and a request of the chunk engine; on a "
            "directory store, a thread)" % MAX_CONCURRENCY,
            shown="%d on S3, %d on a directory store, whose reads take a thread each"
            % (DEFAULT_CONCURRENCY, DEFAULT_THREAD_CONCURRENCY)),
    _option("prefetch_concurrency", "N", _concurrency, None,
            "of which prefetches may use at most N", shown="3/4 of concurrency"),
    _option("retries", "N", _nonneg_int, DEFAULT_RETRIES, "retries of a failed or slow GET"),
    _option("timeout", "SECONDS", _seconds, DEFAULT_ATTEMPT_TIMEOUT, "time limit of one GET attempt"),
    _option("deadline", "SECONDS", _seconds, DEFAULT_DEADLINE,
            "longest wait for one chunk, retries included; then the read fails with EREMOTEIO, which SQLite "
            "reports as \"disk I/O error\"",
            "longest wait for one chunk, retries and queueing included; then the read fails with `EREMOTEIO`"),
    _option("max_db_size", "SIZE", _db_size, DEFAULT_MAX_DB_SIZE,
            "largest database served: a manifest describing a larger one is skipped with one log line, and "
            "no manifest object larger than such a database needs is read",
            shown=shown_size(DEFAULT_MAX_DB_SIZE)),
    _option("hydrate", "on|off", _bool, False,
            "fetch every chunk of every database into the disk cache in the background, again for each new "
            "version; progress per database in the stats; needs a disk cache",
            "fetch every chunk of every database (and of every new version) into the disk cache in the "
            "background", flag=True),
    _option("entry_timeout", "SECONDS", _nonneg_seconds, DEFAULT_ENTRY_TIMEOUT, "kernel cache of names"),
    _option("read_ahead_kb", "N", _nonneg_int, None,
            "the kernel's readahead for this mount, in KiB (/sys/class/bdi/MAJ:MIN/read_ahead_kb): "
            "sequential reads become 1 MiB requests, several in flight",
            "the kernel's readahead for this mount: written to `/sys/class/bdi/MAJ:MIN/read_ahead_kb` "
            "(found in `/proc/self/mountinfo`) once the kernel has processed FUSE INIT, whose reply would cap "
            "it at libfuse's 128 KiB; needs root (else an info line, or a warning if asked for explicitly)",
            shown=str(DEFAULT_READ_AHEAD_KB)),
    _option("log_file", "PATH", _path, None,
            "log here",
            "a daemon with no `/dev/log` logs to `/var/log/verneuil/MNT.log` (root) or "
            "`~/.cache/verneuil/log/MNT.log` (or under `$VERNEUIL_LOG_DIR`), MNT the mount point with `/` as "
            "`-`, and names that file on stderr once the mount is up",
            shown="stderr with -f, else syslog, else, when /dev/log is missing, /var/log/verneuil/MNT.log as "
            "root or ~/.cache/verneuil/log/MNT.log, named on stderr once the mount is up"),
    _option("log_level", "LEVEL", _level, "info", ", ".join(LOG_LEVELS)),
    _option("profile", "NAME", _profile, None,
            "S3 stores: the AWS profile of the shared credentials and config files that signs requests (as "
            "AWS_PROFILE; fstab mounts have no environment at boot)",
            "S3 stores: the profile of the shared credentials and config files whose credentials sign requests "
            "(an fstab mount has no environment at boot); an unknown profile fails the mount with one line, "
            "exit 3", shown="boto3's chain: AWS_PROFILE, else default"),
    _option("credentials_file", "PATH", _path, None,
            "S3 stores: the shared credentials file to read (as AWS_SHARED_CREDENTIALS_FILE)",
            "S3 stores: the shared credentials file boto3 reads, for this mount only; one that cannot be read "
            "is a usage error (exit 2). This option or `profile=` with a directory store is a usage error (they "
            "apply to S3 stores only)", shown="AWS_SHARED_CREDENTIALS_FILE, else ~/.aws/credentials"),
    _option("start_retry", "SECONDS", _nonneg_seconds, 0.0,
            "when the store cannot be reached at start (network not up yet at boot), keep trying for this "
            "long, waiting 1 s doubling to 10 s between attempts, before failing (0: fail at once)",
            "while the store cannot be reached at start (refused, timed out, 5xx: the network is not up yet at "
            "boot), list it again for up to this long, 1 s doubling to 10 s between attempts, each logged as a "
            "warning; then the usual one-line `cannot list` error (exit 3). Other errors (no bucket, access "
            "denied) fail at once. A background mount's parent waits this long on top of its usual 120 s; "
            "systemd gives an fstab mount 90 s by default, so a longer wait needs `x-systemd.mount-timeout=` "
            "as well"),
    _option("metrics_port", "PORT", _port, None,
            "also serve /.verneuil/metrics over HTTP at http://ADDRESS:PORT/metrics, for Prometheus (0: any "
            "free port, named in the log and the stats)",
            "also serve `/.verneuil/metrics` over HTTP at `http://ADDRESS:PORT/metrics` for Prometheus, from a "
            "thread of the mount (each scrape is rendered in trio's thread); port 0 takes a free one, named in "
            "the log and in the stats (`mount.metrics_url`); a port that cannot be had fails the mount before "
            "it is made (exit 2)", shown="none"),
    _option("metrics_address", "ADDRESS", _address, DEFAULT_METRICS_ADDRESS,
            "the address for metrics_port (0.0.0.0 for every interface)"),
    _option("uid", "USER", _uid, None,
            "owner of every file and directory, a number or a name",
            "owner of every file and directory, a number or a name of this host (what s3fs, rclone and "
            "mountpoint-s3 users type)", shown="the mounting user's"),
    _option("gid", "GROUP", _gid, None, "group of every file and directory, a number or a name",
            shown="the mounting user's"),
    _option("umask", "MODE", _umask, 0,
            "permission bits taken away, in octal: files are 0444 and directories 0555 less these (with "
            "allow_other, umask=027 keeps others out)",
            "permission bits taken away, in octal: files are `0444`, directories `0555`, less these; the "
            "kernel enforces them (`default_permissions`), so with `allow_other`, `uid=1000,umask=077` lets "
            "user 1000 alone read"),
    _option("subdir", "/HOST[/PATH]", _subdir, "",
            "mount one host's databases, or one directory of them: the directory /HOST/PATH of the whole tree "
            "becomes the mount's root",
            "mount one directory of the tree: `/web1` for one host's databases, `/web1/srv/data` for one "
            "directory of them; that directory is the mount's root, nothing outside it is kept (the store is "
            "still listed whole: manifest names start with a hash, not the host), and a database published "
            "there after the last poll opens at once by its name", shown="the whole tree"),
)
OPTIONS_BY_NAME = {o.name: o for o in MOUNT_OPTIONS}

Options = dataclasses.make_dataclass(
    "Options",
    [("source", str), ("mountpoint", str), ("foreground", bool, False),
     ("fuse", list, dataclasses.field(default_factory=list))]
    + [(o.name, Any, o.default) for o in MOUNT_OPTIONS],
    namespace={"__doc__": "What a mount is made with: the source, the mount point, -f, the options "
                          "passed on to libfuse (`fuse`) and every mount option of `MOUNT_OPTIONS`."},
)


# ------------------------------------------------------------------ help, docs
def help_text() -> str:
    """The options' part of ``verneuil --help``."""
    lines = ["verneuil options (-o name=value, comma-separated; libfuse's own options ro,",
             "allow_other, allow_root, default_permissions, auto_unmount, debug, dev/nodev,",
             "suid/nosuid, exec/noexec, atime/noatime, fsname=, subtype= are passed on;",
             "rw, defaults, _netdev, nofail, auto/noauto, user(s), x-* are ignored):"]
    indent = " " * (2 + HELP_NAME_WIDTH)
    for o in MOUNT_OPTIONS:
        text = "%s (default %s)" % (o.help, o.default_text)
        head = "  %-*s" % (HELP_NAME_WIDTH, o.spelled)
        if len(o.spelled) >= HELP_NAME_WIDTH:
            lines.append("  " + o.spelled)
            head = indent
        lines.extend(textwrap.wrap(text, HELP_WIDTH, initial_indent=head, subsequent_indent=indent))
    return "\n".join(lines) + "\n"


def docs_table() -> str:
    """The table of options in docs/READER.md, "Options"."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for o in MOUNT_OPTIONS:
        rows.append("| `%s` | %s | %s |" % (o.spelled.replace("|", "\\|"), o.default_text.replace("|", "\\|"),
                                            o.doc or o.help))
    return "\n".join(rows) + "\n"


# ------------------------------------------------------------------ the parser
def _fuse_value(text: str) -> str:
    """A value libfuse can take in one option: printable ASCII without the
    comma it splits on or the backslash it unescapes (pyfuse3 encodes options
    as ASCII); anything else becomes "_"."""
    return re.sub(r"[^\x21-\x7e]|[,\\]", "_", text)[:200]


def _split_options(text: str) -> list[str]:
    """Split on commas not escaped by a backslash (libfuse's convention)."""
    out, cur, i = [], [], 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            cur.append(text[i + 1])
            i += 2
            continue
        if ch == ",":
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
        i += 1
    out.append("".join(cur))
    return out


def _argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verneuil",
        description="Mount the SQLite replicas of a Verneuil store (read-only, FUSE). "
        "Files appear at /<hostname>/<path of the source database>; "
        "statistics at /.verneuil/stats.",
        epilog=help_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", help="store: file:///dir, /dir, s3://bucket?..., @config.json or JSON")
    parser.add_argument("mountpoint", help="an existing directory")
    parser.add_argument("-o", dest="options", action="append", default=[], metavar="OPTIONS",
                        help="comma-separated mount options (below)")
    parser.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground")
    parser.add_argument("--version", action="version", version="verneuil " + __version__)

    def error(message: str) -> None:
        raise UserError(message, EXIT_USAGE)

    parser.error = error  # type: ignore[method-assign]
    return parser


def _own_value(option: MountOption, eq: str, value: str) -> Any:
    """The value of one of the mount's own options, or a UserError."""
    if not eq and not option.flag:
        raise UserError("option %s needs a value (%s=...)" % (option.name, option.name), EXIT_USAGE)
    try:
        return option.parse(value)
    except ValueError as e:
        raise UserError("bad value for option %s: %s" % (option.name, e), EXIT_USAGE) from None


def _read_options(groups: list[str], fuse: set[str]) -> dict[str, Any]:
    """The mount's own options of ``-o`` groups, by name; libfuse's go into
    ``fuse``; those that mean nothing here are dropped; others are errors."""
    own: dict[str, Any] = {}
    for group in groups:
        for item in _split_options(group):
            if not item:
                continue
            name, eq, value = item.partition("=")
            if name in LIBFUSE_FLAGS and not eq:
                fuse.add(name)
            elif name in LIBFUSE_VALUES and eq:
                if not value:
                    raise UserError("option %s needs a value (%s=...)" % (name, name), EXIT_USAGE)
                fuse.add("%s=%s" % (name, _fuse_value(value)))
            elif name in OPTIONS_BY_NAME:
                own[name] = _own_value(OPTIONS_BY_NAME[name], eq, value)
            elif name in IGNORED_FLAGS or name.startswith("x-") or name == "comment":
                continue
            else:
                raise UserError("unknown mount option: %s (see verneuil --help)" % item, EXIT_USAGE)
    return own


def parse_args(argv: list[str] | None) -> Options:
    """The command line as `Options`; a UserError (exit 2) for a bad one."""
    ns = _argument_parser().parse_args(argv)
    fuse = {"ro", "default_permissions"}
    own = _read_options(ns.options, fuse)
    opts = Options(source=ns.source, mountpoint=ns.mountpoint, foreground=ns.foreground, **own)
    if opts.hydrate and opts.cache_size == 0:
        raise UserError("option hydrate needs a disk cache (cache_size=0 turns it off)", EXIT_USAGE)
    if not any(o.startswith("fsname=") for o in fuse):
        fuse.add("fsname=" + _fuse_value(opts.source))
    if not any(o.startswith("subtype=") for o in fuse):
        fuse.add("subtype=verneuil")
    opts.fuse = sorted(fuse)
    return opts
