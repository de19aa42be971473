"""The commands that move a spool to a store, and watch it: `copier` (the
daemon, until SIGTERM/SIGINT, with its --metrics-port), `flush` (everything
pending, once, with a progress bar and the --timeout/--stall-timeout
limits), `sync` (a fresh snapshot of each database through the writer VFS,
then a flush of those) and `lag` (how far each database of a spool is
behind, against the store when there is one)."""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

from verneuil_fuse.errors import EXIT_OK, UserError
from verneuil_fuse.cli.common import Progress, fmt_size, log, print_json, spool_from_args, store_from_args


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
    from verneuil_fuse import config
    kw = config.copier_options(cfg)
    kw["max_db_size"] = config.max_db_size(cfg)
    if one_off:
        kw["rate"], kw["workers"] = FLUSH_RATE, FLUSH_WORKERS
    for name in ("rate", "burst", "workers", "db_workers", "poll_interval", "lock_timeout"):
        value = getattr(args, name, None)
        if value is not None:
            kw[name] = value
    return kw


def _make_copier(args, one_off: bool = False, **extra):
    from verneuil_fuse import config
    from verneuil_fuse.copier import Copier
    spool = spool_from_args(args)
    store = store_from_args(args)
    cfg = config.load_optional(args.store)
    kw = _copier_kwargs(args, cfg, one_off)
    kw.update(extra)
    return Copier(spool, store, **kw)


def cmd_copier(args) -> int:
    # The handlers go in first: making the copier imports boto3 (a few
    # hundred ms), and a SIGTERM in that time must still end it cleanly.
    stop_event = threading.Event()  # Copier.run() ends once it is set
    running: list = []  # the copier, once made

    def on_signal(signum, _frame):
        log.info("got signal %d (%s), stopping", signum, signal.Signals(signum).name)
        stop_event.set()
        for copier in running:
            copier.wake()  # out of its idle wait at once

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.pidfile:
        write_pidfile(args.pidfile)
    try:
        _run_copier(args, stop_event, running.append)
    finally:
        if args.pidfile:
            remove_pidfile(args.pidfile)
    return EXIT_OK


def _run_copier(args, stop_event: threading.Event, started) -> None:
    """The daemon's body: the copier, its metrics endpoint, until stopped."""
    copier = _make_copier(args, create_spool=True, stop_event=stop_event)
    started(copier)
    exporter = None
    try:
        if args.metrics_port is not None:
            from verneuil_fuse.copier.exporter import MetricsServer
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_pidfile(path: str) -> None:
    """Write this process's PID into `path` (atomically); refused while the
    PID already there is a live process other than this one."""
    try:
        with open(path) as f:
            other = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        other = None
    if other is not None and other != os.getpid() and _pid_alive(other):
        raise UserError("pidfile %s names process %d, which is running (another copier?); "
                        "stop it, or remove the file if that process is not a copier" % (path, other))
    tmp = "%s.%d.tmp" % (path, os.getpid())
    try:
        with open(tmp, "w") as f:
            f.write("%d\n" % os.getpid())
        os.replace(tmp, path)
    except OSError as e:
        raise UserError("cannot write pidfile %s: %s" % (path, e.strerror or e)) from None


def remove_pidfile(path: str) -> None:
    """Remove `path` if it still names this process."""
    try:
        with open(path) as f:
            if f.read().split()[:1] == [str(os.getpid())]:
                os.unlink(path)
    except OSError:
        pass


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
    from verneuil_fuse.copier import Stopped
    from verneuil_fuse.copier.status import spool_status
    progress = Progress(not args.quiet)
    total = sum(db["pending_bytes"] for db in spool_status(copier.spool_dir)
                if names is None or db["dbdir"] in names)
    log.info("flush: %s pending in %s -> %s (%s, %d workers)", fmt_size(total), copier.spool_dir,
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
                log.info("flush: %s of %s sent (%.0f%%)", fmt_size(shipped), fmt_size(total),
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
    from verneuil_fuse import format as fmt
    from verneuil_fuse.copier import spool as sp
    from verneuil_fuse.copier.source import committed_header
    meta = db.sub(sp.STAGING, sp.META)
    raw = committed_header(path)
    if raw is None:
        return False
    header = fmt.header_fprint_of(raw)
    for name in sp.listdir_or_empty(meta):
        # Only the header fingerprint is needed: no full validation (which a
        # manifest XOR-ed with a base chunk could not pass without the store).
        try:
            with open(os.path.join(meta, name), "rb") as f:
                staged = fmt.stored_fields(f.read())
        except (OSError, fmt.ManifestError):
            continue
        if staged.header_fprint == header:
            return True
    return False


def cmd_sync(args) -> int:
    from verneuil_fuse.copier import spool as sp
    spool = spool_from_args(args)
    sp.check_spool(spool, create=True)
    wanted = set()
    for path in args.db:
        counters = _force_snapshot(path, spool, verbose=args.verbose > 0)
        db = sp.DbDir(os.path.join(spool, sp.current_boot_root_name()), sp.dbdir_name(path))
        if not _staged_matches(db, path):
            why = ("the VFS could not write its snapshot to the spool %s" % spool
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


# `lag` exits with this when a database is not replicated, or is behind
# by more than --max-lag: a monitoring check's "not OK".
EXIT_LAGGING = 3
# `lag`'s default --max-lag: a database behind by up to a minute is a busy
# one, not a stuck one (the daemon's pacing lets a large commit take that).
DEFAULT_MAX_LAG = 60.0


def lag_state(db: dict, max_lag: float) -> tuple[str, bool]:
    """What `lag` says about one database of `spool_status`, and whether it
    is fine: replicated, and at most `max_lag` seconds behind."""
    lag = db["lag"]
    if not db.get("snapshotted", True):
        state, ok = "never snapshotted: nothing of it is in the store", False
    elif db["in_sync"] is None:  # no store to compare with
        state = ("nothing pending" if lag == 0 and not db["pending_bytes"] else
                 "pending for %.1fs" % lag if lag is not None else "pending")
        ok = lag is not None and lag <= max_lag
    else:
        state = ("in sync" if db["in_sync"] else
                 "behind %.1fs" % lag if lag is not None else "not in the store")
        ok = db["in_sync"] or (lag is not None and lag <= max_lag)
    stopped = db.get("stopped")
    if stopped is not None:
        state = "STOPPED replicating: %s%s; the store's copy is behind%s" % (
            stopped["reason"],
            " (for %.1fs)" % (time.time() - stopped["since"]) if stopped.get("since") else "",
            " by %.1fs at least" % lag if lag else "")
        ok = False
    elif db["source_changed"]:
        state += " (the source changed since its last snapshot)"
        ok = False
    if db.get("wal"):
        state += " [WAL mode]"
    return state, ok


def cmd_lag(args) -> int:
    from verneuil_fuse import config
    from verneuil_fuse.copier.status import spool_status
    spool = spool_from_args(args)
    bound = config.max_db_size(config.load_optional(args.store))
    store = None
    if not args.no_store:
        try:
            store = store_from_args(args, required=False)
        except UserError:
            if args.store is not None:
                raise
            # VERNEUIL_CONFIG may name a spool but no store: report the spool only.
    try:
        report = spool_status(spool, store, max_db_size=bound)
    finally:
        if store is not None:
            store.close()
    states = [lag_state(db, args.max_lag) for db in report]
    code = EXIT_OK if all(ok for _, ok in states) else EXIT_LAGGING
    if args.json:
        print_json(report)
        return code
    if not report:
        print("no databases in spool %s" % spool)
        return code
    for db, (state, _ok) in zip(report, states):
        print("%s: %s" % (db["source"] or db["dbdir"], state))
        _print_lag_details(db)
    letters = report[-1].get("dead_letters") or {}
    if letters.get("entries") or letters.get("dropped"):
        print("dead letters: %d (%s) kept, %d oldest dropped" % (
            letters["entries"], fmt_size(letters["bytes"]), letters["dropped"]))
    return code


def _print_lag_details(db: dict) -> None:
    """The lines of `lag` under a database: its staged manifests, its
    snapshots waiting, its staged chunks."""
    for m in db["manifests"]:
        extra = ""
        if m.get("source_changed"):
            extra = (", source changed since: writes the VFS could not snapshot (spool full or "
                     "unwritable? see the writer's log) or a writer not using the VFS")
        if "error" in m:
            extra += ", INVALID: %s" % m["error"]
        print("  staged manifest: %s old, %s%s%s" % (
            "%.1fs" % m["age"], fmt_size(m.get("len")),
            ", store: %s" % m["in_store"] if "in_store" in m else "", extra))
    for which in ("ready", "consuming"):
        for s in db[which]:
            print("  %s %s: %.1fs old, %d chunks (%s)" % (
                which, s["uuid"], s["age"], s["chunks"], fmt_size(s["chunk_bytes"])))
    print("  staged chunks: %d (%s); pending: %s" % (
        db["staged_chunks"], fmt_size(db["staged_chunk_bytes"]), fmt_size(db["pending_bytes"])))
