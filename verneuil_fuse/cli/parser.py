"""verneuilctl's command line: the argparse types of its values, the option
groups several subcommands share, the top-level parser, one function per
subcommand that adds its parser (and the cmd_* function it runs), and the
rewriting of `--at -2h` that argparse would otherwise refuse."""
from __future__ import annotations

import argparse
import re
from typing import NamedTuple

from verneuil_fuse import __version__
from verneuil_fuse.cli.convert_cmds import cmd_convert
from verneuil_fuse.cli.copier_cmds import (DEFAULT_MAX_LAG, EXIT_LAGGING, FLUSH_STALL_SECONDS, FLUSH_WORKERS,
                                           cmd_copier, cmd_flush, cmd_lag, cmd_sync)
from verneuil_fuse.cli.history_cmds import EXIT_INCOMPLETE, cmd_versions
from verneuil_fuse.cli.query import cmd_query
from verneuil_fuse.cli.repair_cmds import cmd_repair
from verneuil_fuse.cli.store_cmds import cmd_ls, cmd_manifest, cmd_restore
from verneuil_fuse.cli.tools import cmd_fingerprint, cmd_manifest_name, cmd_sqlite_extension


def relative_at(argv: list[str]) -> list[str]:
    """`--at -2h` as `--at=-2h`: argparse takes a value starting with '-'
    that is not a number for an option."""
    from verneuil_fuse.history import RELATIVE_RE
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--at" and RELATIVE_RE.match(arg):
            out[-1] = "--at=" + arg
        else:
            out.append(arg)
    return out


def _not_negative(convert, noun: str):
    """An argparse type: `convert` (int, float) of the text, 0 or more."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError("%r is not %s" % (text, noun)) from None
        if value < 0:
            raise argparse.ArgumentTypeError("%r must not be negative" % text)
        return value
    return parse


_nonneg_int = _not_negative(int, "an integer")
_positive_float = _not_negative(float, "a number")


def _port(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535."""
    value = _nonneg_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError("%r is not a TCP port (0 to 65535)" % text)
    return value

# A --max-db-size value: a number and an optional binary unit ("64G" is
# 64 GiB; "64GiB" and "64GB" read the same).
_SIZE_RE = re.compile(r"\A\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:I?B)?\s*\Z", re.I)
_SIZE_SHIFTS = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40, "P": 50}


def _byte_size(text: str) -> int:
    """An argparse type: a size in bytes above 0, such as "64G", "512M",
    "1.5T" or "1048576" (K, M, G, T, P are powers of 1024)."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError("%r is not a size (such as 64G, 512M or 1048576)" % text)
    number, unit = match.groups()
    size = int(float(number) * (1 << _SIZE_SHIFTS[unit.upper()])) if "." in number \
        else int(number) << _SIZE_SHIFTS[unit.upper()]
    if size <= 0:
        raise argparse.ArgumentTypeError("%r: the size must be more than 0" % text)
    return size


def _add_one_database(p: argparse.ArgumentParser) -> None:
    """The options that name one database in the store (`versions`,
    `convert`): by host and path, or by manifest name."""
    p.add_argument("--hostname", help="host the database lives on (default: this one)")
    p.add_argument("-s", "--source-path", metavar="PATH",
                   help="path of the database on its host (made canonical without --hostname)")
    p.add_argument("-m", "--manifest", metavar="NAME", help="manifest blob name")


def _add_max_db_size(p: argparse.ArgumentParser) -> None:
    # The default (None) is format.DEFAULT_MAX_DB_SIZE, resolved when used so
    # that building the parser does not load the format package.
    p.add_argument("--max-db-size", type=_byte_size, default=None, metavar="SIZE",
                   help="largest database accepted, e.g. 64G or 512M (default 64G): bounds "
                        "what a manifest may make this command read and allocate")


def _add_flush_limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=_positive_float, default=None,
                   help="give up after this many seconds in all (default: none, as long as "
                        "uploads make progress)")
    p.add_argument("--stall-timeout", type=_positive_float, default=FLUSH_STALL_SECONDS,
                   help="give up when nothing was uploaded for this many seconds (default %g; 0: never)"
                        % FLUSH_STALL_SECONDS)


class _Parents(NamedTuple):
    """Option groups shared by several subcommands (argparse parent
    parsers, without -h): each subcommand lists the ones it takes."""
    common: argparse.ArgumentParser  # -v, -q
    store: argparse.ArgumentParser   # --store
    spool: argparse.ArgumentParser   # --spool
    target: argparse.ArgumentParser  # which manifest: --hostname, -s, -m, --manifest-file, --version-id
    pacing: argparse.ArgumentParser  # the copier's --rate, --burst, --workers, ...


def _parent_parsers() -> _Parents:
    """The shared option groups, each built once for every subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-vv for debug)")
    common.add_argument("-q", "--quiet", action="store_true", help="errors only")

    store = argparse.ArgumentParser(add_help=False)
    store.add_argument("--store", metavar="URL",
                       help="store: file:///dir, /dir, s3://bucket?..., @config.json or JSON "
                            "(default: $VERNEUIL_CONFIG)")
    spool = argparse.ArgumentParser(add_help=False)
    spool.add_argument("--spool", metavar="DIR",
                       help="spool directory (default: replication_spooling_dir of the config)")
    target = argparse.ArgumentParser(add_help=False)
    target.add_argument("--hostname", help="host the database lives on (default: this one)")
    target.add_argument("-s", "--source-path", metavar="PATH",
                        help="path of the database on its host (made canonical without --hostname)")
    target.add_argument("-m", "--manifest", metavar="NAME", help="manifest blob name")
    target.add_argument("--manifest-file", metavar="FILE",
                        help="a manifest blob in a local file (zstd or raw)")
    target.add_argument("--version-id", metavar="ID",
                        help="an older version of the manifest (versioned buckets)")
    pacing = argparse.ArgumentParser(add_help=False)
    pacing.add_argument("--rate", type=_positive_float,
                        help="store requests per second (0 = unpaced; default 30 for the daemon, "
                             "unpaced for flush and sync)")
    pacing.add_argument("--burst", type=int, help="token bucket burst (default 100)")
    pacing.add_argument("--workers", type=int, help="parallel chunk uploads (default 4 for the daemon, %d for flush and sync)"
                        % FLUSH_WORKERS)
    pacing.add_argument("--db-workers", type=int, help="databases handled at once (default 4)")
    pacing.add_argument("--lock-timeout", type=_positive_float,
                        help="seconds to wait for a database's copier lock (default 5)")
    return _Parents(common, store, spool, target, pacing)


def _main_parser() -> argparse.ArgumentParser:
    """The top-level parser and the flags it takes before the subcommand."""
    parser = argparse.ArgumentParser(
        prog="verneuilctl",
        description="Replicate, inspect and restore SQLite databases (Verneuil-compatible).")
    # Also accepted before the subcommand (own dests: a subparser's defaults
    # would overwrite values parsed by the main parser).
    parser.add_argument("-v", "--verbose", dest="verbose0", action="count", default=0,
                        help="more logging (-vv for debug)")
    parser.add_argument("-q", "--quiet", dest="quiet0", action="store_true", help="errors only")
    parser.add_argument("--version", action="version", version="verneuilctl " + __version__)
    return parser


def _add_fingerprint(sub, parents: _Parents) -> None:
    p = sub.add_parser("fingerprint", parents=[parents.common],
                       help="UMASH fingerprint of a file's bytes",
                       description="Print the 128-bit UMASH fingerprint of FILE's bytes, spelled "
                                   "%016x%2F%016x (a chunk name).")
    p.add_argument("--key", default="chunk",
                   help="parameter key: chunk, directory, header, path, hostname, mangling, or a "
                        "literal key string of at most 32 bytes (default: chunk)")
    p.add_argument("--hash64", action="store_true", help="print the 64-bit hash (16 hex digits)")
    p.add_argument("--chunks", action="store_true",
                   help="one line per 64 KiB chunk of the file")
    p.add_argument("file", metavar="FILE", help="input file ('-' for stdin)")
    p.set_defaults(func=cmd_fingerprint)


def _add_manifest_name(sub, parents: _Parents) -> None:
    p = sub.add_parser("manifest-name", parents=[parents.common],
                       help="manifest blob name of a database path",
                       description="Print the manifest blob name of PATH on HOST (default: this "
                                   "host, and PATH made canonical).")
    p.add_argument("--hostname", help="host name (PATH is then used as written)")
    p.add_argument("path", metavar="PATH")
    p.set_defaults(func=cmd_manifest_name)


def _add_sqlite_extension(sub, parents: _Parents) -> None:
    p = sub.add_parser("sqlite-extension", parents=[parents.common],
                       help="path of the loadable SQLite extension (for .load)",
                       description="Print the path of the writer's loadable SQLite extension, "
                                   "for the sqlite3 shell: .load $(verneuilctl sqlite-extension)")
    p.set_defaults(func=cmd_sqlite_extension)


def _add_copier(sub, parents: _Parents) -> None:
    p = sub.add_parser("copier", parents=[parents.common, parents.store, parents.spool, parents.pacing],
                       help="copy a spool to a store until SIGTERM/SIGINT",
                       description="Run a copier daemon. Any number may run on one spool.")
    p.add_argument("--poll-interval", type=_positive_float,
                   help="seconds between idle passes (default 0.2)")
    p.add_argument("--metrics-port", type=_port, metavar="PORT",
                   help="serve Prometheus metrics at http://ADDRESS:PORT/metrics (0: any free port, logged)")
    p.add_argument("--metrics-address", default="127.0.0.1", metavar="ADDRESS",
                   help="address for --metrics-port (default 127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--pidfile", metavar="PATH",
                   help="write the copier's PID here while it runs (refused while the PID there is "
                        "alive; under systemd, not needed)")
    p.set_defaults(func=cmd_copier)


def _add_flush(sub, parents: _Parents) -> None:
    p = sub.add_parser("flush", parents=[parents.common, parents.store, parents.spool, parents.pacing],
                       help="upload everything pending in a spool, once",
                       description="Upload every pending snapshot; exit 0 only when the store "
                                   "holds them all.")
    _add_flush_limits(p)
    p.set_defaults(func=cmd_flush)


def _add_sync(sub, parents: _Parents) -> None:
    p = sub.add_parser("sync", parents=[parents.common, parents.store, parents.spool, parents.pacing],
                       help="force a snapshot of databases through the VFS, then flush them",
                       description="Open each DB with the verneuil VFS, commit a no-op write "
                                   "transaction (so the VFS publishes a snapshot), then upload.")
    _add_flush_limits(p)
    p.add_argument("db", nargs="+", metavar="DB", help="database file")
    p.set_defaults(func=cmd_sync)


def _add_restore(sub, parents: _Parents) -> None:
    p = sub.add_parser("restore", parents=[parents.common, parents.store, parents.target],
                       help="rebuild a database file from the store",
                       description="Fetch a manifest and its chunks, verify every chunk, and "
                                   "write the database atomically (temp file + rename).")
    p.add_argument("-o", "--out", required=True, metavar="FILE",
                   help="output file, or '-' for stdout; an existing file is refused "
                        "without --force")
    p.add_argument("-f", "--force", action="store_true",
                   help="replace FILE if it exists (atomically; a symlink is replaced, "
                        "not followed)")
    p.add_argument("--at", metavar="TIME",
                   help="the version current at TIME: the newest whose time (its manifest's "
                        "ctime) is at or before it; ISO 8601 (2026-11-26T19:00:00Z, no zone = "
                        "UTC, up to 9 decimals) or relative (-2h, -30m, -1d); not with "
                        "--version-id")
    _add_max_db_size(p)
    p.set_defaults(func=cmd_restore)


def _add_versions(sub, parents: _Parents) -> None:
    p = sub.add_parser("versions", parents=[parents.common, parents.store],
                       help="every stored version of a database, oldest first",
                       description="List every version of one database's manifest in the store "
                                   "(a versioned bucket, or a directory store's kept versions), "
                                   "oldest first: its time (the manifest's ctime, else the "
                                   "store's, marked '(store)'), size, version id, and whether "
                                   "the store still holds every chunk it needs. Exit %d when "
                                   "the latest version misses chunks or cannot be read (the "
                                   "database cannot be restored as it is now)." % EXIT_INCOMPLETE)
    _add_one_database(p)
    p.add_argument("--json", action="store_true", help="JSON output (a list, oldest first)")
    p.add_argument("--no-check", action="store_true",
                   help="do not check that the chunks are present (one request per distinct "
                        "chunk fewer)")
    p.add_argument("--workers", type=_nonneg_int, default=8,
                   help="store requests in flight at once (default 8)")
    _add_max_db_size(p)
    p.set_defaults(func=cmd_versions)


def _add_ls(sub, parents: _Parents) -> None:
    p = sub.add_parser("ls", parents=[parents.common, parents.store],
                       help="replicated databases in a store",
                       description="List replicated databases: host, path, size, ctime, versions.")
    p.add_argument("--hostname", help="only this host's databases")
    p.add_argument("--json", action="store_true", help="JSON output")
    p.add_argument("--no-versions", action="store_true",
                   help="do not count versions (one request less per database)")
    _add_max_db_size(p)
    p.set_defaults(func=cmd_ls)


def _add_manifest(sub, parents: _Parents) -> None:
    p = sub.add_parser("manifest", parents=[parents.common, parents.store, parents.target],
                       help="decode one manifest",
                       description="Decode and validate one manifest; human-readable or JSON.")
    p.add_argument("--json", action="store_true", help="JSON output (includes the chunk list)")
    p.add_argument("--chunks", action="store_true", help="list every chunk")
    _add_max_db_size(p)
    p.set_defaults(func=cmd_manifest)


def _add_lag(sub, parents: _Parents) -> None:
    p = sub.add_parser("lag", parents=[parents.common, parents.store, parents.spool],
                       help="how far each database in a spool is behind",
                       description="For each database in the spool: pending snapshots, staged "
                                   "chunks and bytes, staged manifest age, and (with a store) "
                                   "whether the store holds the latest snapshot. Exit 0 when "
                                   "every database is replicated and at most --max-lag behind, "
                                   "%d when one is not replicated (stopped, never snapshotted, "
                                   "changed since its last snapshot) or further behind."
                                   % EXIT_LAGGING)
    p.add_argument("--json", action="store_true", help="JSON output")
    p.add_argument("--no-store", action="store_true", help="do not compare with the store")
    p.add_argument("--max-lag", type=_positive_float, default=DEFAULT_MAX_LAG, metavar="SECONDS",
                   help="a database behind by more than this is an exit %d (default %g)"
                        % (EXIT_LAGGING, DEFAULT_MAX_LAG))
    p.set_defaults(func=cmd_lag)


def _add_repair(sub, parents: _Parents) -> None:
    p = sub.add_parser("repair", parents=[parents.common, parents.store, parents.spool],
                       help="upload again, from the source files, chunks a store has lost",
                       description="For each database: fetch its current manifest from the "
                                   "store, find the chunks the store lacks, and upload those "
                                   "whose bytes the source file (or the manifest) still holds, "
                                   "each checked against its fingerprint. Exit 0 when every "
                                   "manifest is complete, 3 when chunks stay missing because "
                                   "the file changed since that snapshot, 4 (--dry-run) when "
                                   "chunks are missing and a real run would upload them all, "
                                   "1 on errors (no manifest in the store, unreadable file).")
    p.add_argument("db", nargs="*", metavar="DB",
                   help="database file on this host (the source the writer replicated)")
    p.add_argument("-s", "--source-path", metavar="PATH", action="append",
                   help="a database file, as DB (repeatable)")
    p.add_argument("--all", action="store_true",
                   help="every database of the spool (--spool) whose file still exists")
    p.add_argument("--hostname",
                   help="host the databases were replicated from (default: this host, "
                        "and each path made canonical; with --hostname, only made absolute)")
    p.add_argument("--dry-run", action="store_true", help="report only, upload nothing")
    p.add_argument("--json", action="store_true", help="JSON report (one entry per database)")
    p.add_argument("--workers", type=_nonneg_int,
                   help="store requests in flight at once (default 8)")
    p.set_defaults(func=cmd_repair)


def _add_convert(sub, parents: _Parents) -> None:
    p = sub.add_parser("convert", parents=[parents.common, parents.store],
                       help="rewrite databases in the other store layout (packed, or Verneuil's chunks)",
                       description="Rewrite the current version of one database (-s PATH or -m NAME), "
                                   "or of every database of the store (--all), in the layout --to "
                                   "names: 'packed' (many chunks per object, read by range) or "
                                   "'chunks' (Verneuil's: one object per chunk, which Verneuil's "
                                   "readers need). Every chunk is verified on the way; the new "
                                   "manifest is uploaded last, as a new version. Resumable: run it "
                                   "again after an interruption. Stop the copiers of those databases "
                                   "first (or give them the new layout=), or their next upload "
                                   "is in their own layout again.")
    p.add_argument("--to", required=True, choices=("packed", "chunks"), help="the layout to convert to")
    _add_one_database(p)
    p.add_argument("--all", action="store_true", help="every database of the store")
    p.add_argument("--workers", type=_nonneg_int,
                   help="store requests in flight at once (default 8)")
    p.set_defaults(func=cmd_convert)


def _add_query(sub, parents: _Parents) -> None:
    p = sub.add_parser("query", parents=[parents.common],
                       help="one SQL query over many databases, with Spark",
                       description="Run SQL on every SQLite database under MOUNT_OR_GLOB (a "
                                   "directory such as a verneuil mount, a glob, or files) with "
                                   "Spark; each row carries its database in _source. With "
                                   "--union, the SQL runs once over the union of the tables it "
                                   "names (e.g. SELECT count(*) FROM t counts every database's "
                                   "rows). Shows the first rows; --output writes them all. "
                                   "Queries cannot write.")
    p.add_argument("items", nargs="+", metavar="MOUNT_OR_GLOB... SQL",
                   help="directories, globs or database files (a glob the shell expanded is "
                        "fine), then the SQL (unless --sql gives it)")
    p.add_argument("--sql", metavar="SQL", help="the SQL; then every positional is a path")
    p.add_argument("--output", metavar="OUT",
                   help="write the result to OUT.parquet or OUT.csv (a Spark output directory; "
                        "an existing one only with --force)")
    p.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
    p.add_argument("--show", type=_nonneg_int, default=20, help="rows to show (default 20; 0: none)")
    p.add_argument("-f", "--force", action="store_true",
                   help="replace OUT if it exists (otherwise refused before the query runs)")
    p.add_argument("--on-error", choices=("fail", "skip", "report"), default="fail",
                   help="a database that fails: fail the job, skip it (the count and the reasons "
                        "are printed), or report it in _error")
    p.add_argument("--union", action="store_true",
                   help="run the SQL once, in Spark SQL, over the union of each table it names across "
                        "the databases (each row with its database in _source), so that it can "
                        "aggregate across them; without it SQLite runs the SQL on each database")
    p.set_defaults(func=cmd_query)


# The subcommands, in the order `verneuilctl --help` lists them: each adds
# its parser to the subparsers action, taking the shared option groups.
_SUBCOMMANDS = (
    _add_fingerprint, _add_manifest_name, _add_sqlite_extension, _add_copier, _add_flush,
    _add_sync, _add_restore, _add_versions, _add_ls, _add_manifest, _add_lag, _add_repair,
    _add_convert, _add_query,
)


def build_parser() -> argparse.ArgumentParser:
    """verneuilctl's parser: the global flags, then one subparser per command."""
    parents = _parent_parsers()
    parser = _main_parser()
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub, parents)
    return parser
