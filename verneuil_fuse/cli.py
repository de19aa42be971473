"""`verneuilctl`: replicate, inspect and restore SQLite databases.

Subcommands (each has --help):

  fingerprint    UMASH fingerprint / 64-bit hash / chunk names of a file
  manifest-name  the manifest blob name of a database path
  copier         run a copier daemon: spool -> store, until SIGTERM/SIGINT
  flush          upload everything pending in a spool, once; exit 0 when done
  sync           force a snapshot of databases through the VFS, then flush
  restore        rebuild a database file from the store, every chunk verified
  versions       every stored version of a database, with times; restore --at
  ls             replicated databases in a store
  manifest       decode one manifest
  lag            how far each database in a spool is behind
  repair         upload again, from the source files, chunks a store has lost
  query          one SQL query over many databases (a mount, a glob) with Spark

Common flags mean the same everywhere: --store (URL, path, @config.json or
JSON; default VERNEUIL_CONFIG), --spool (default: the configuration's
replication_spooling_dir), --hostname, -s/--source-path, -m/--manifest,
-o/--out.  Errors print one line on stderr and exit non-zero.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from typing import Any, NamedTuple, Optional

from . import __version__
from .errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UserError

log = logging.getLogger("verneuilctl")


# -- shared helpers -------------------------------------------------------------

def _open_store(args, required: bool = True, read_only: bool = False):
    """The store of --store (else VERNEUIL_CONFIG); None if not required and
    nothing is configured.  `read_only`: a missing directory store is an
    error instead of being created."""
    from .store import StoreError, open_store, parse_config, store_target
    from .store.config import env_config_present
    if not required and args.store is None and not env_config_present():
        return None
    try:
        spec = args.store
        if read_only:
            config = parse_config(spec)
            target = store_target(config)
            if target["kind"] == "directory":
                spec = {"directory": {"path": target["path"], "create": False}}
        return open_store(spec)
    except StoreError as e:
        raise UserError(str(e), EXIT_USAGE) from None


def _spool(args) -> str:
    from . import config
    return config.spool_dir(args.spool, args.store)


def _key_bytes(key: str) -> bytes:
    from . import format as fmt
    if key in fmt.KEYS:
        return fmt.KEYS[key]
    raw = key.encode("utf-8")
    if len(raw) > 32:
        raise UserError("a UMASH key is at most 32 bytes; %r has %d (or use one of: %s)"
                        % (key, len(raw), ", ".join(fmt.KEYS)), EXIT_USAGE)
    return raw


def _read_input(path: str, max_bytes: Optional[int] = None) -> bytes:
    """The bytes of `path` ('-': stdin); with `max_bytes`, at most that many
    + 1 are read (the caller tells a longer input by its length)."""
    try:
        if path == "-":
            return sys.stdin.buffer.read(-1 if max_bytes is None else max_bytes + 1)
        with open(path, "rb") as f:
            return f.read(-1 if max_bytes is None else max_bytes + 1)
    except OSError as e:
        raise UserError("cannot read %s: %s" % (path, e.strerror or e)) from None


def _manifest_key(args) -> str:
    """The manifest name from -m, or from --hostname/-s."""
    from . import format as fmt
    if getattr(args, "manifest", None):
        if fmt.parse_manifest_name(args.manifest) is None:
            raise UserError("%r is not a manifest name" % args.manifest, EXIT_USAGE)
        return args.manifest
    if getattr(args, "source_path", None):
        try:
            return fmt.manifest_name(args.source_path, args.hostname)
        except fmt.BadName as e:
            raise UserError(str(e), EXIT_USAGE) from None
    raise UserError("name the database: -s/--source-path PATH [--hostname HOST], "
                    "-m/--manifest NAME or --manifest-file FILE", EXIT_USAGE)


def _load_manifest(args, store):
    """(name, Manifest) from --manifest-file, -m, or --hostname + -s; no
    manifest larger than --max-db-size allows is read past that bound."""
    from . import format as fmt
    from .copier.restore import RAISE_LIMIT_HINT, decode_manifest, fetch_manifest
    max_db_size = getattr(args, "max_db_size", None) or fmt.DEFAULT_MAX_DB_SIZE
    if getattr(args, "manifest_file", None):
        limit = fmt.manifest_blob_limit(max_db_size)
        blob = _read_input(args.manifest_file, max_bytes=limit)
        if len(blob) > limit:
            raise UserError("manifest file %s is larger than %d bytes, the limit for databases "
                            "of up to %s (max_db_size); %s"
                            % (args.manifest_file, limit, fmt.format_size(max_db_size),
                               RAISE_LIMIT_HINT))
        return os.path.basename(args.manifest_file), decode_manifest(
            blob, store, "manifest file %s" % args.manifest_file, max_db_size=max_db_size)
    if store is None:
        store = _open_store(args, read_only=True)
    name = _manifest_key(args)
    return name, fetch_manifest(store, name, getattr(args, "version_id", None),
                                max_db_size=max_db_size)


def _fmt_time(seconds: float) -> str:
    if not seconds:
        return "-"
    return datetime.datetime.fromtimestamp(seconds).isoformat(sep=" ", timespec="seconds")


def _fmt_size(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return ("%d %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit))
        n /= 1024
    return str(n)


def _print_table(rows: list) -> None:
    """Rows of strings as left-aligned columns two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


# A one-off `flush` or `sync` ships at the store's speed: no pacing (that is
# for the daemon's steady state, beside the writers), and enough uploads in
# flight to hide 20 ms of latency per 64 KiB PUT at ~3,000 PUTs/s (each
# worker waits for one PUT at a time; the HTTP engine carries them all).
FLUSH_RATE = 0.0
FLUSH_WORKERS = 64
# `flush`/`sync` give up when nothing was uploaded for this long: a store
# that stopped answering, not a large database (which keeps going as long as
# uploads succeed). Two minutes outlast the copier's retries of an outage.
FLUSH_STALL_SECONDS = 120.0
# Progress lines when stderr is not a terminal (a log, a CI job): this often.
FLUSH_PROGRESS_LOG_SECONDS = 10.0


def _copier_kwargs(args, cfg: dict, one_off: bool = False) -> dict:
    """Copier options: the command line, else the config's `copier` object
    (the daemon's); `one_off` (flush, sync) ships unpaced with more workers
    unless the command line says otherwise."""
    from . import config
    kw = config.copier_options(cfg)
    if one_off:
        kw["rate"], kw["workers"] = FLUSH_RATE, FLUSH_WORKERS
    for name in ("rate", "burst", "workers", "db_workers", "poll_interval", "lock_timeout"):
        value = getattr(args, name, None)
        if value is not None:
            kw[name] = value
    return kw


def _make_copier(args, one_off: bool = False, **extra):
    from . import config
    from .copier import Copier
    spool = _spool(args)
    store = _open_store(args)
    cfg = config.load_optional(args.store)
    kw = _copier_kwargs(args, cfg, one_off)
    kw.update(extra)
    return Copier(spool, store, **kw)


# -- subcommands ----------------------------------------------------------------

def cmd_fingerprint(args) -> int:
    from . import format as fmt
    key = _key_bytes(args.key)
    data = _read_input(args.file)
    if args.chunks:
        view = memoryview(data)
        for start in range(0, len(view), fmt.CHUNK_SIZE):
            piece = view[start:start + fmt.CHUNK_SIZE]
            if args.hash64:
                print("%016x" % fmt.hash64(piece, key))
            else:
                print(fmt.fingerprint(piece, key).name)
        return EXIT_OK
    if args.hash64:
        print("%016x" % fmt.hash64(data, key))
    else:
        print(fmt.fingerprint(data, key).name)
    return EXIT_OK


def cmd_manifest_name(args) -> int:
    from . import format as fmt
    if not args.path:
        raise UserError("PATH is empty", EXIT_USAGE)
    try:
        print(fmt.manifest_name(args.path, args.hostname))
    except fmt.BadName as e:
        raise UserError(str(e), EXIT_USAGE) from None
    return EXIT_OK


def cmd_sqlite_extension(args) -> int:
    try:
        import writer_vfs
        print(writer_vfs.loadable_extension_path())
    except (ImportError, FileNotFoundError) as e:
        raise UserError("the SQLite extension is not built (reinstall the package): %s" % e) from None
    return EXIT_OK


def cmd_copier(args) -> int:
    # The handlers go in first: making the copier imports boto3 (a few
    # hundred ms), and a SIGTERM in that time must still end it cleanly.
    stop_event = threading.Event()  # Copier.run() ends once it is set
    copier = None

    def on_signal(signum, _frame):
        log.info("got signal %d, stopping", signum)
        stop_event.set()
        if copier is not None:
            copier.wake()  # out of its idle wait at once

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    copier = _make_copier(args, create_spool=True, stop_event=stop_event)
    exporter = None
    try:
        if args.metrics_port is not None:
            from .copier.exporter import MetricsServer
            try:
                exporter = MetricsServer(copier, args.metrics_port, args.metrics_address)
            except OSError as e:
                raise UserError("cannot serve metrics on %s:%d: %s"
                                % (args.metrics_address, args.metrics_port, e.strerror or e)) from None
        copier.run()
    finally:
        if exporter is not None:
            exporter.close()
        copier.close()
        copier.store.close()
    return EXIT_OK


def _uploaded(copier) -> tuple:
    """What `copier` has shipped so far (any change is progress)."""
    st = copier.stats_snapshot()
    return (st["chunks_uploaded"], st["chunks_skipped"], st["chunk_bytes_raw"],
            st["manifests_uploaded"], st["manifests_skipped"])


def _flush_with_progress(args, copier, names: Optional[set] = None) -> None:
    """copier.flush of every database of the spool (or those whose spool
    directory is in `names`), watched by a thread: a progress bar of the
    chunk bytes sent against those pending at the start (a line every
    `FLUSH_PROGRESS_LOG_SECONDS` when stderr is not a terminal), and the end
    of the flush once nothing was uploaded for `--stall-timeout` seconds.
    Errors name the option that ended it."""
    import threading

    from .copier import Stopped
    from .copier.status import spool_status
    progress = _Progress(not args.quiet)
    total = sum(db["pending_bytes"] for db in spool_status(copier.spool_dir)
                if names is None or db["dbdir"] in names)
    log.info("flush: %s pending in %s -> %s (%s, %d workers)", _fmt_size(total), copier.spool_dir,
             copier.store.describe(),
             "%g requests/s" % copier.bucket.rate if copier.bucket.rate else "unpaced", copier.workers)
    done = threading.Event()
    stalled = threading.Event()

    def watch() -> None:
        last, last_change, last_line = _uploaded(copier), time.monotonic(), time.monotonic()
        while not done.wait(0.2):
            now, sent = time.monotonic(), _uploaded(copier)
            if sent != last:
                last, last_change = sent, now
            elif args.stall_timeout and now - last_change >= args.stall_timeout:
                stalled.set()
                copier.stop_event.set()
                return
            shipped = min(sent[2], total)
            progress(shipped, total)
            if not progress.enabled and now - last_line >= FLUSH_PROGRESS_LOG_SECONDS and total:
                last_line = now
                log.info("flush: %s of %s sent (%.0f%%)", _fmt_size(shipped), _fmt_size(total),
                         100.0 * shipped / total)

    watcher = threading.Thread(target=watch, name="flush-watch", daemon=True)
    watcher.start()
    try:
        copier.flush(timeout=args.timeout, only=None if names is None else (lambda db: db.name in names))
    except Stopped:
        if not stalled.is_set():
            raise
        error = copier.stats_snapshot()["last_error"] or "no error reported"
        raise UserError("nothing was uploaded for %gs (--stall-timeout); the store's last error: %s"
                        % (args.stall_timeout, error)) from None
    except TimeoutError as e:
        paced = ("; uploads were paced at %g requests/s (--rate; 0 sends as fast as the store takes)"
                 % copier.bucket.rate if copier.bucket.rate else "")
        raise UserError("%s (--timeout %gs%s)" % (e, args.timeout, paced)) from None
    finally:
        done.set()
        watcher.join()
        progress.finish()


def cmd_flush(args) -> int:
    copier = _make_copier(args, one_off=True)
    try:
        _flush_with_progress(args, copier)
    finally:
        copier.close()
        copier.store.close()
    s = copier.stats
    log.info("flushed: %d chunks (%d bytes sent), %d manifests",
             s.chunks_uploaded, s.chunk_bytes_sent, s.manifests_uploaded)
    return EXIT_OK


def _force_snapshot(path: str, spool: str, verbose: bool = False) -> dict:
    """Commit an empty write transaction on `path` through the verneuil VFS,
    which makes it publish a fresh snapshot into the spool. Returns the
    connection's VFS counters (writer_vfs.stats); `verbose` also prints the
    VFS's own log on stderr."""
    import sqlite3
    import urllib.parse
    try:
        import writer_vfs
    except ImportError as e:
        raise UserError("the writer VFS (writer_vfs) is not available: %s" % e) from None
    if not os.path.isfile(path):
        raise UserError("%s: no such database file" % path)
    writer_vfs.register(spool_dir=spool)
    writer_vfs.set_log_stderr(verbose)
    # sync explains a database it could not snapshot in its own error line.
    writer_vfs.set_warn_stderr(verbose)
    uri = "file:%s?vfs=verneuil" % urllib.parse.quote(os.path.abspath(path))
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=30)
        try:
            # Rewriting user_version with its own value dirties the header
            # page, so SQLite really commits (an empty BEGIN IMMEDIATE/COMMIT
            # writes nothing) and the VFS snapshots on unlock.
            conn.execute("BEGIN IMMEDIATE")
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            conn.execute("PRAGMA user_version = %d" % int(version))
            conn.execute("COMMIT")
            return writer_vfs.stats(conn)
        finally:
            conn.close()
    except sqlite3.Error as e:
        raise UserError("%s: %s" % (path, e)) from None


def _staged_matches(db, path: str) -> bool:
    """Whether the staged manifest of `db` describes the file at `path` now."""
    from . import format as fmt
    from .copier import spool as sp
    from .format import manifest_pb2
    meta = db.sub(sp.STAGING, sp.META)
    with open(path, "rb") as f:
        header = fmt.header_fprint_of(f.read(100))
    for name in sp.listdir_or_empty(meta):
        # Only the header fingerprint is needed: no full validation (which a
        # manifest XOR-ed with a base chunk could not pass without the store).
        top = manifest_pb2.Manifest()
        try:
            with open(os.path.join(meta, name), "rb") as f:
                top.ParseFromString(f.read())
        except Exception:
            continue
        fp = top.v1.header_fprint
        if (fp.major, fp.minor) == tuple(header):
            return True
    return False


def cmd_sync(args) -> int:
    from .copier import spool as sp
    spool = _spool(args)
    sp.check_spool(spool, create=True)
    wanted = set()
    for path in args.db:
        counters = _force_snapshot(path, spool, verbose=args.verbose > 0)
        db = sp.DbDir(os.path.join(spool, sp.current_boot_root_name()), sp.dbdir_name(path))
        if not _staged_matches(db, path):
            why = ("it is a WAL database, which the VFS does not replicate" if counters.get("wal") else
                   "the VFS could not write its snapshot to the spool %s" % spool
                   if counters.get("failed") else "the reason is in the VFS's log")
            raise UserError("%s: the VFS spooled no snapshot of the current file: %s%s" % (
                path, why, "" if args.verbose else " (run with -v to see the VFS's log)"))
        wanted.add(db.name)
    copier = _make_copier(args, one_off=True, create_spool=True)
    try:
        _flush_with_progress(args, copier, wanted)
    finally:
        copier.close()
        copier.store.close()
    return EXIT_OK


class _Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and done < total:
            return
        self._last = now
        frac = done / total if total else 1.0
        width = 30
        bar = "#" * int(frac * width)
        sys.stderr.write("\r[%-*s] %3d%% %s / %s" % (width, bar, frac * 100,
                                                     _fmt_size(done), _fmt_size(total)))
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _check_restore_target(path: str, force: bool) -> None:
    """Refuse an output that cannot be written, before any download."""
    if os.path.isdir(path):
        raise UserError("%s is a directory: give the path of the database file to write" % path,
                        EXIT_USAGE)
    if os.path.lexists(path) and not force:
        raise UserError("%s exists: use --force to replace it" % path, EXIT_USAGE)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UserError("cannot write %s: no directory %s" % (path, parent), EXIT_USAGE)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError("cannot write %s: directory %s is not writable" % (path, parent), EXIT_USAGE)


def _relative_at(argv: list[str]) -> list[str]:
    """`--at -2h` as `--at=-2h`: argparse takes a value starting with '-'
    that is not a number for an option."""
    from .history import RELATIVE_RE
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--at" and RELATIVE_RE.match(arg):
            out[-1] = "--at=" + arg
        else:
            out.append(arg)
    return out


def _parse_at(text: str) -> int:
    """--at TIME in nanoseconds since the epoch (history.parse_time)."""
    from .history import BadTime, parse_time
    try:
        return parse_time(text)
    except BadTime as e:
        raise UserError("--at: %s" % e, EXIT_USAGE) from None


def _pick_version_at(args, store) -> None:
    """Set args.version_id to the version of the database current at
    --at (the newest whose time is at or before it)."""
    from . import format as fmt
    from .copier.versions import version_at
    from .history import format_time
    at_ns = _parse_at(args.at)
    name = _manifest_key(args)
    version, infos = version_at(store, name, at_ns,
                                max_db_size=args.max_db_size or fmt.DEFAULT_MAX_DB_SIZE)
    if not infos:
        raise UserError("no such replicated database in %s: manifest %s"
                        % (store.manifests.describe(), name))
    if version is None:
        raise UserError("no version of %s is as old as %s (%d versions; see verneuilctl versions)"
                        % (name, format_time(at_ns), len(infos)))
    log.info("--at %s: version %s from %s", format_time(at_ns), version.info.version_id,
             format_time(version.time_ns))
    args.version_id = version.info.version_id


def cmd_restore(args) -> int:
    import tempfile
    from .copier.restore import restore_to_path, write_snapshot
    if args.at is not None:  # refused before anything else: a bad time, two ways to pick
        _parse_at(args.at)
        if args.version_id:
            raise UserError("give --at or --version-id, not both", EXIT_USAGE)
        if args.manifest_file:
            raise UserError("--at picks a version in the store: not with --manifest-file", EXIT_USAGE)
    if args.out != "-":
        _check_restore_target(args.out, args.force)
    store = _open_store(args, read_only=True)
    try:
        if args.at is not None:
            _pick_version_at(args, store)
        name, m = _load_manifest(args, store)
        progress = _Progress(not args.quiet)
        try:
            if args.out == "-":
                # Never a partial or wrong stream: verify everything first.
                with tempfile.TemporaryFile() as tmp:
                    write_snapshot(store, m, tmp, progress=progress)
                    progress.finish()
                    tmp.seek(0)
                    out = sys.stdout.buffer
                    while True:
                        block = tmp.read(1 << 20)
                        if not block:
                            break
                        out.write(block)
                    out.flush()
            else:
                try:
                    restore_to_path(store, m, args.out, progress=progress)
                except OSError as e:
                    raise UserError("cannot write %s: %s" % (args.out, e.strerror or e)) from None
                progress.finish()
                log.info("restored %s (%d bytes) to %s", name, m.len, args.out)
        except BaseException:
            progress.finish()
            raise
    finally:
        store.close()
    return EXIT_OK


def cmd_versions(args) -> int:
    """Every stored version of one database, oldest first."""
    from . import format as fmt
    from .copier.versions import check_chunks, list_history, load_all
    store = _open_store(args, read_only=True)
    try:
        name = _manifest_key(args)
        infos = list_history(store, name)
        if not infos:
            raise UserError("no such replicated database in %s: manifest %s"
                            % (store.manifests.describe(), name))
        versions = load_all(store, name, infos, workers=args.workers,
                            max_db_size=args.max_db_size or fmt.DEFAULT_MAX_DB_SIZE)
        if not args.no_check:
            check_chunks(store, versions, workers=args.workers)
    finally:
        store.close()
    rows = [v.describe() for v in versions]
    if args.json:
        _print_json(rows)
        return EXIT_OK
    table = [("TIME", "SIZE", "CHUNKS", "VERSION ID", "")]
    for r in rows:
        if "error" in r:
            chunks = "ERROR"
        elif r["missing_chunks"] is None:
            chunks = "%d" % r["chunks"]
        else:
            chunks = "%d, %s" % (r["chunks"], "all present" if r["complete"]
                                 else "%d MISSING" % r["missing_chunks"])
        table.append((r["time"] + ("" if r["time_source"] == "manifest" else " (store)"),
                      _fmt_size(r["size"]), chunks, r["version_id"],
                      "latest" if r["is_latest"] else ""))
    _print_table(table)
    for r in rows:
        if "error" in r:
            print("warning: version %s: %s" % (r["version_id"], r["error"]), file=sys.stderr)
    return EXIT_OK


def _ls_entry(store, info, versions: bool, max_db_size: Optional[int] = None) -> dict:
    from . import format as fmt
    from .copier.restore import RAISE_LIMIT_HINT, RestoreError, decode_manifest
    from .store import NotFound, TooLarge
    max_db_size = max_db_size or fmt.DEFAULT_MAX_DB_SIZE
    parsed = fmt.parse_manifest_name(info.key)
    entry: dict = {"name": info.key, "hostname": parsed.hostname if parsed else None,
                   "path": parsed.path if parsed else None,
                   "blob_size": info.size, "mtime": info.mtime}
    if parsed is not None and parsed.mangled:
        entry["path"] = "%s...%s" % (parsed.prefix, parsed.suffix)
    limit = fmt.manifest_blob_limit(max_db_size)
    try:
        # Bounded by max_db_size: an over-large object is an error for its
        # entry, never read whole.
        blob = store.manifests.get(info.key, max_bytes=limit)
        m = decode_manifest(blob, store, "manifest %s" % info.key, max_db_size=max_db_size)
        entry.update(size=m.len, ctime=m.ctime + m.ctime_ns / 1e9, chunks=len(m.chunks))
    except NotFound:
        entry.update(error="deleted while listing")
    except TooLarge as e:
        size = "%d bytes" % e.size if e.size is not None else "larger"
        entry.update(error="manifest is %s, more than the %d-byte limit for databases of up "
                           "to %s (max_db_size); %s"
                           % (size, limit, fmt.format_size(max_db_size), RAISE_LIMIT_HINT))
    except RestoreError as e:
        entry.update(error=str(e))
    if versions:
        entry["versions"] = len(store.manifests.list_versions(info.key))
    return entry


def cmd_ls(args) -> int:
    store = _open_store(args, read_only=True)
    try:
        prefix = ""
        entries = []
        for info in sorted(store.manifests.list(prefix), key=lambda i: i.key):
            entry = _ls_entry(store, info, not args.no_versions, args.max_db_size)
            if args.hostname is not None and entry["hostname"] != args.hostname:
                continue
            entries.append(entry)
        if not entries:
            _say_why_empty(store, args.hostname)
    finally:
        store.close()
    if args.json:
        _print_json(entries)
        return EXIT_OK
    rows = [("HOST", "PATH", "SIZE", "CTIME", "VERSIONS")]
    for e in entries:
        rows.append((e["hostname"] or "?", e["path"] or e["name"],
                     "ERROR" if "error" in e else _fmt_size(e.get("size")),
                     _fmt_time(e.get("ctime", 0)), str(e.get("versions", "-"))))
    _print_table(rows)
    for e in entries:
        if "error" in e:
            print("warning: %s: %s" % (e["name"], e["error"]), file=sys.stderr)
    return EXIT_OK


def _say_why_empty(store, hostname: Optional[str]) -> None:
    """One line on stderr for a listing that found nothing: where it looked,
    and the likely mistake of an S3 URL without manifest_bucket (one bucket
    with both prefixes, where Verneuil's layout has two buckets)."""
    where = store.manifests.describe()
    text = "no replicated databases%s in %s" % (" of host %s" % hostname if hostname else "", where)
    bucket = getattr(store.chunks, "bucket", None)
    if bucket is not None and bucket == getattr(store.manifests, "bucket", None):
        text += ("; this URL names one bucket for chunks and manifests (no manifest_bucket=): "
                 "if the manifests are in a bucket of their own, add manifest_bucket=NAME")
    print("verneuilctl: %s" % text, file=sys.stderr)


def _manifest_dict(name: str, m) -> dict:
    from . import format as fmt
    parsed = fmt.parse_manifest_name(name)
    distinct = set(m.chunks)
    return {
        "name": name,
        "hostname": parsed.hostname if parsed else None,
        "path": parsed.path if parsed else None,
        "len": m.len,
        "ctime": m.ctime,
        "ctime_ns": m.ctime_ns,
        "version_id": m.version_id.hex(),
        "generated_by": m.generated_by.decode("utf-8", "replace"),
        "header_fprint": m.header_fprint.name,
        "contents_fprint": m.contents_fprint.name,
        "base_chunks_fprint": m.base_chunks_fprint.name if m.base_chunks_fprint else None,
        "bundled_chunks": sorted(m.bundled),
        "num_chunks": len(m.chunks),
        "distinct_chunks": len(distinct),
        "zero_chunks": sum(1 for fp in m.chunks if fp == fmt.ZERO_CHUNK_FPRINT),
        "chunks": [fp.name for fp in m.chunks],
    }


def cmd_manifest(args) -> int:
    store = None
    store = _open_store(args, required=not args.manifest_file, read_only=True)
    try:
        name, m = _load_manifest(args, store)
    finally:
        if store is not None:
            store.close()
    d = _manifest_dict(name, m)
    if args.json:
        _print_json(d)
        return EXIT_OK
    print("name:            %s" % d["name"])
    if d["hostname"] is not None:
        print("hostname:        %s" % d["hostname"])
    if d["path"] is not None:
        print("path:            %s" % d["path"])
    print("length:          %d bytes (%s)" % (d["len"], _fmt_size(d["len"])))
    print("ctime:           %s (%d.%09d)" % (_fmt_time(m.ctime), m.ctime, m.ctime_ns))
    print("chunks:          %d (%d distinct, %d zero)" % (d["num_chunks"], d["distinct_chunks"],
                                                          d["zero_chunks"]))
    print("header_fprint:   %s" % d["header_fprint"])
    print("contents_fprint: %s" % d["contents_fprint"])
    if d["base_chunks_fprint"]:
        print("base chunk:      %s" % d["base_chunks_fprint"])
    print("version_id:      %s" % (d["version_id"] or "-"))
    print("generated_by:    %s" % (d["generated_by"] or "-"))
    print("bundled chunks:  %s" % (", ".join(map(str, d["bundled_chunks"])) or "-"))
    if args.chunks:
        for i, c in enumerate(d["chunks"]):
            print("  %6d %s" % (i, c))
    return EXIT_OK


def cmd_lag(args) -> int:
    from .copier.status import spool_status
    spool = _spool(args)
    store = None
    if not args.no_store:
        try:
            store = _open_store(args, required=False)
        except UserError:
            if args.store is not None:
                raise
            # VERNEUIL_CONFIG may name a spool but no store: report the spool only.
    try:
        report = spool_status(spool, store)
    finally:
        if store is not None:
            store.close()
    if args.json:
        _print_json(report)
        return EXIT_OK
    if not report:
        print("no databases in spool %s" % spool)
        return EXIT_OK
    for db in report:
        lag = db["lag"]
        if db["in_sync"] is None:  # no store to compare with
            state = ("nothing pending" if lag == 0 and not db["pending_bytes"] else
                     "pending for %.1fs" % lag if lag is not None else "pending")
        else:
            state = ("in sync" if db["in_sync"] else
                     "behind %.1fs" % lag if lag is not None else "pending")
        if db.get("wal"):
            state = ("WAL: NOT replicated (the database is in journal_mode=WAL; replication resumes "
                     "after PRAGMA journal_mode=DELETE); last snapshot: " + state)
        elif db["source_changed"]:
            state += " (the source changed since its last snapshot)"
        print("%s: %s" % (db["source"] or db["dbdir"], state))
        for m in db["manifests"]:
            extra = ""
            if m.get("source_changed"):
                extra = (", source changed since: writes the VFS could not snapshot (spool full or "
                         "unwritable? see the writer's log) or a writer not using the VFS")
            if "error" in m:
                extra += ", INVALID: %s" % m["error"]
            print("  staged manifest: %s old, %s%s%s" % (
                "%.1fs" % m["age"], _fmt_size(m.get("len")),
                ", store: %s" % m["in_store"] if "in_store" in m else "", extra))
        for which in ("ready", "consuming"):
            for s in db[which]:
                print("  %s %s: %.1fs old, %d chunks (%s)" % (
                    which, s["uuid"], s["age"], s["chunks"], _fmt_size(s["chunk_bytes"])))
        print("  staged chunks: %d (%s); pending: %s" % (
            db["staged_chunks"], _fmt_size(db["staged_chunk_bytes"]),
            _fmt_size(db["pending_bytes"])))
    return EXIT_OK


# -- repair -------------------------------------------------------------------------

# `repair` exit codes besides EXIT_OK, EXIT_ERROR and EXIT_USAGE (docs/COPIER.md).
EXIT_UNREPAIRABLE = 3  # chunks are still missing: the source changed since the store's snapshot
EXIT_REPAIRABLE = 4    # --dry-run only: chunks are missing, and a real run would upload them all
# Unrepairable chunk names listed per database in the text report: enough to
# look a few up by hand without flooding a terminal (--json lists them all).
REPAIR_LISTED = 10
# Seconds between progress lines when stderr is not a terminal (shown with
# -v): a line a few seconds apart tells a large database is moving along.
REPAIR_PROGRESS_INTERVAL = 5.0


class _RepairProgress:
    """progress(phase, done, total) of one database: a refreshed line on a
    terminal, else an INFO line every REPAIR_PROGRESS_INTERVAL seconds."""

    def __init__(self, label: str, enabled: bool):
        self.label = label
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self._last = time.monotonic()
        self._shown = False

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if now - self._last < 0.1 and done < total:
                return
            sys.stderr.write("\r%s: %s chunks %d/%d\033[K" % (self.label, phase, done, total))
            sys.stderr.flush()
            self._shown = True
        elif now - self._last >= REPAIR_PROGRESS_INTERVAL:
            log.info("%s: %s chunks %d/%d", self.label, phase, done, total)
        else:
            return
        self._last = now

    def finish(self) -> None:
        if self._shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._shown = False


def _repair_targets(args) -> list[tuple[str, str]]:
    """(source path, manifest name) of each database to repair."""
    from . import format as fmt
    from .copier.repair import spool_databases
    paths = list(args.db) + list(args.source_path or [])
    if args.all:
        if paths:
            raise UserError("give database files or --all, not both", EXIT_USAGE)
        targets = []
        for source, name in spool_databases(_spool(args), args.hostname):
            if os.path.isfile(source):
                targets.append((source, name))
            else:
                log.warning("%s: the database file is gone, skipped", source)
        return targets
    if not paths:
        raise UserError("name the databases to repair (their files on this host), or --all "
                        "with --spool", EXIT_USAGE)
    targets = []
    for path in paths:
        if not os.path.isfile(path):
            raise UserError("%s: no such database file" % path, EXIT_USAGE)
        try:
            name = fmt.manifest_name(path if args.hostname is None else os.path.abspath(path),
                                     args.hostname)
        except fmt.BadName as e:
            raise UserError(str(e), EXIT_USAGE) from None
        targets.append((path, name))
    return targets


def _repair_advice(report) -> str:
    what = ("the base chunk of its manifest is missing (the manifest's chunk list cannot be "
            "read without it) and cannot be rebuilt" if report.base_chunk_unrepairable else
            "%d missing chunks cannot be repaired" % len(report.unrepairable))
    return ("%s: %s: the file changed since the store's snapshot of it. Publish a snapshot of "
            "the file as it is now (`verneuilctl sync %s`, or a commit through the verneuil VFS "
            "after `PRAGMA verneuil_full_snapshot`), then run `verneuilctl repair` again"
            % (report.source, what, report.source))


def cmd_repair(args) -> int:
    from .copier.repair import DEFAULT_WORKERS, NoManifest, repair_database
    from .copier.restore import RestoreError
    workers = DEFAULT_WORKERS if args.workers is None else args.workers
    if workers < 1:
        raise UserError("--workers must be at least 1", EXIT_USAGE)
    targets = _repair_targets(args)
    if not targets:
        print("no databases in spool %s" % _spool(args))
        return EXIT_OK
    # Read-only: never creates a directory store that is not there.
    store = _open_store(args, read_only=True)
    reports, failed = [], []
    try:
        for source, name in targets:
            progress = _RepairProgress(source, not args.quiet)
            try:
                reports.append(repair_database(store, source, name, dry_run=args.dry_run,
                                               workers=workers, progress=progress))
            except NoManifest as e:
                failed.append((source, name, "nothing to repair: %s (was it replicated to this "
                               "store, from this host? `verneuilctl ls` lists what the store "
                               "holds)" % e))
            except RestoreError as e:
                failed.append((source, name, str(e)))
            except OSError as e:
                failed.append((source, name, "cannot read it: %s" % (e.strerror or e)))
            finally:
                progress.finish()
    finally:
        store.close()
    if args.json:
        _print_json([r.as_dict() for r in reports] +
                    [{"source": s, "manifest": n, "error": why} for s, n, why in failed])
    else:
        for r in reports:
            done = ("%d repairable (dry run: nothing uploaded)" % len(r.repairable)
                    if r.dry_run else "%d repaired" % len(r.repaired))
            print("%s: %d chunks checked, %d missing, %s, %d unrepairable%s" % (
                r.source, r.checked, len(r.missing), done, len(r.unrepairable),
                "" if r.dry_run or not r.complete else " (complete)"))
            for chunk in r.unrepairable[:REPAIR_LISTED]:
                print("  unrepairable: %s" % chunk)
            if len(r.unrepairable) > REPAIR_LISTED:
                print("  ... and %d more" % (len(r.unrepairable) - REPAIR_LISTED))
    for source, _name, why in failed:
        _error("%s: %s" % (source, why))
    unrepairable = [r for r in reports if r.unrepairable]
    for r in unrepairable:
        _error(_repair_advice(r))
    if failed:
        return EXIT_ERROR
    if unrepairable:
        return EXIT_UNREPAIRABLE
    if args.dry_run and any(r.missing for r in reports):
        return EXIT_REPAIRABLE
    return EXIT_OK


# -- query --------------------------------------------------------------------------

def cmd_query(args) -> int:
    try:
        from . import spark
    except ImportError as e:
        raise UserError("query needs PySpark (pip install 'verneuil_fuse[spark]'): %s" % e)
    if args.verbose < 2:
        # py4j logs tracebacks through the root logger when Ctrl-C cuts a
        # call to the JVM; the interruption is reported once, by main().
        for handler in logging.getLogger().handlers:
            handler.addFilter(lambda record: "%spy4j%s" % (os.sep, os.sep) not in record.pathname)
    if args.sql is not None:
        where, sql = args.items, args.sql
    elif len(args.items) >= 2:
        where, sql = args.items[:-1], args.items[-1]
    else:
        raise UserError("query needs databases and SQL: verneuilctl query MOUNT_OR_GLOB... 'SQL' "
                        "(or --sql 'SQL')", EXIT_USAGE)
    try:
        spark.run_query(where, sql, master=args.master, output=args.output,
                        show=args.show, on_error=args.on_error, force=args.force)
    except spark.VerneuilSourceError as e:
        raise UserError(str(e), EXIT_USAGE) from None
    except Exception as e:  # Spark wraps worker errors in long Java traces
        why = spark.explain(e)
        raise UserError(why if why.startswith("query failed") else "query failed: %s" % why) from None
    return EXIT_OK


# -- argument parsing ---------------------------------------------------------------

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
                                   "the store still holds every chunk it needs.")
    p.add_argument("--hostname", help="host the database lives on (default: this one)")
    p.add_argument("-s", "--source-path", metavar="PATH",
                   help="path of the database on its host (made canonical without --hostname)")
    p.add_argument("-m", "--manifest", metavar="NAME", help="manifest blob name")
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
                                   "whether the store holds the latest snapshot.")
    p.add_argument("--json", action="store_true", help="JSON output")
    p.add_argument("--no-store", action="store_true", help="do not compare with the store")
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


def _add_query(sub, parents: _Parents) -> None:
    p = sub.add_parser("query", parents=[parents.common],
                       help="one SQL query over many databases, with Spark",
                       description="Run SQL on every SQLite database under MOUNT_OR_GLOB (a "
                                   "directory such as a verneuil mount, a glob, or files) with "
                                   "Spark; each row carries its database in _source. Shows the "
                                   "first rows; --output writes them all. Queries cannot write.")
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
                   help="a database that fails: fail the job, skip it, or report it in _error")
    p.set_defaults(func=cmd_query)


# The subcommands, in the order `verneuilctl --help` lists them: each adds
# its parser to the subparsers action, taking the shared option groups.
_SUBCOMMANDS = (
    _add_fingerprint, _add_manifest_name, _add_sqlite_extension, _add_copier, _add_flush,
    _add_sync, _add_restore, _add_versions, _add_ls, _add_manifest, _add_lag, _add_repair,
    _add_query,
)


def build_parser() -> argparse.ArgumentParser:
    """verneuilctl's parser: the global flags, then one subparser per command."""
    parents = _parent_parsers()
    parser = _main_parser()
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub, parents)
    return parser


def _setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.ERROR if quiet else (
        logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG)
    logging.basicConfig(level=level, format="verneuilctl: %(levelname)s: %(message)s",
                        stream=sys.stderr)
    # botocore's debug output holds request headers (the access key id, a
    # session token): never below INFO, however verbose.
    for name in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(name).setLevel(max(level, logging.INFO))


def _error(message: str) -> None:
    sys.stderr.write("verneuilctl: error: %s\n" % " ".join(str(message).split("\n")))


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_relative_at(sys.argv[1:] if argv is None else argv))
    if args.command is None:  # `verneuilctl` alone: the commands, as --help lists them
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    args.verbose += args.verbose0
    args.quiet = args.quiet or args.quiet0
    if args.command == "copier":
        # A daemon: its start, the databases it replicates and its stop are
        # what an operator reads in its log, so INFO is its default.
        args.verbose = max(args.verbose, 1)
    _setup_logging(args.verbose, args.quiet)
    from .copier import NotASpool, RestoreError, Stopped
    from .format import BadName, ChunkError, ManifestError
    from .store import ConfigError, StoreError
    try:
        return args.func(args)
    except UserError as e:
        _error(str(e))
        return e.exit_code
    except ConfigError as e:
        _error(str(e))
        return EXIT_USAGE
    except NotASpool as e:
        _error(str(e))
        return EXIT_USAGE
    except (StoreError, RestoreError, ManifestError, ChunkError, BadName, TimeoutError) as e:
        _error(str(e))
        return EXIT_ERROR
    except Stopped:
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        try:
            sys.stdout.close()
        except OSError:
            pass
        return EXIT_ERROR
    except OSError as e:
        _error("%s%s" % (e.strerror or e, ": %s" % e.filename if e.filename else ""))
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
