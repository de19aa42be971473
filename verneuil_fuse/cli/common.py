"""What every `verneuilctl` command shares: the store and spool its flags
name (--store, else VERNEUIL_CONFIG; --spool, else the configuration's
spool), the one manifest it is about (-m, --hostname/-s, --manifest-file,
bounded by --max-db-size), reading an input file or stdin, and its output:
sizes and times for people, aligned tables, JSON, the terminal progress bar
and the one-line error on stderr."""
from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
from typing import Any, Optional

from verneuil_fuse.errors import EXIT_USAGE, UserError

log = logging.getLogger("verneuilctl")


def store_from_args(args, required: bool = True, read_only: bool = False):
    """The store of --store (else VERNEUIL_CONFIG); None if not required and
    nothing is configured.  `read_only`: a missing directory store is an
    error instead of being created."""
    from verneuil_fuse.store import StoreError, open_store, parse_config, store_target
    from verneuil_fuse.store.config import env_config_present
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


def spool_from_args(args) -> str:
    from verneuil_fuse import config
    return config.spool_dir(args.spool, args.store)


def read_input(path: str, max_bytes: Optional[int] = None) -> bytes:
    """The bytes of `path` ('-': stdin); with `max_bytes`, at most that many
    + 1 are read (the caller tells a longer input by its length)."""
    try:
        if path == "-":
            return sys.stdin.buffer.read(-1 if max_bytes is None else max_bytes + 1)
        with open(path, "rb") as f:
            return f.read(-1 if max_bytes is None else max_bytes + 1)
    except OSError as e:
        raise UserError("cannot read %s: %s" % (path, e.strerror or e)) from None


def manifest_key(args) -> str:
    """The manifest name from -m, or from --hostname/-s."""
    from verneuil_fuse import format as fmt
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


def store_reads(args, store):
    """The reads of `store` bounded by --max-db-size (default
    `format.DEFAULT_MAX_DB_SIZE`), their refusals saying how to raise it."""
    from verneuil_fuse import format as fmt
    from verneuil_fuse.readback.restore import RAISE_LIMIT_HINT
    from verneuil_fuse.store import Reads
    return Reads(store, max_db_size=getattr(args, "max_db_size", None) or fmt.DEFAULT_MAX_DB_SIZE,
                 hint=RAISE_LIMIT_HINT)


def load_manifest(args, store):
    """(name, Manifest) from --manifest-file, -m, or --hostname + -s; no
    manifest larger than --max-db-size allows is read past that bound."""
    if getattr(args, "manifest_file", None):
        reads = store_reads(args, store)
        what = "manifest file %s" % args.manifest_file
        blob = read_input(args.manifest_file, max_bytes=reads.manifest_limit)
        if len(blob) > reads.manifest_limit:
            raise UserError(str(reads.manifest_too_large(what, None)))
        return os.path.basename(args.manifest_file), reads.load_blob(blob, what)
    if store is None:
        store = store_from_args(args, read_only=True)
    name = manifest_key(args)
    return name, store_reads(args, store).load(name, getattr(args, "version_id", None))


def fmt_time(seconds: float) -> str:
    if not seconds:
        return "-"
    return datetime.datetime.fromtimestamp(seconds).isoformat(sep=" ", timespec="seconds")


def fmt_size(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return ("%d %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit))
        n /= 1024
    return str(n)


def print_table(rows: list) -> None:
    """Rows of strings as left-aligned columns two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


class Progress:
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
                                                     fmt_size(done), fmt_size(total)))
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def print_error(message: str) -> None:
    sys.stderr.write("verneuilctl: error: %s\n" % " ".join(str(message).split("\n")))


# Seconds between `PhaseProgress` lines when stderr is not a terminal (shown
# with -v): a line a few seconds apart tells a large database is moving along.
PHASE_PROGRESS_INTERVAL = 5.0


class PhaseProgress:
    """progress(phase, done, total) of one database (`repair`, `convert`): a
    refreshed line on a terminal, else an INFO line every
    PHASE_PROGRESS_INTERVAL seconds."""

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
        elif now - self._last >= PHASE_PROGRESS_INTERVAL:
            log.info("%s: %s chunks %d/%d", self.label, phase, done, total)
        else:
            return
        self._last = now

    def finish(self) -> None:
        if self._shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._shown = False
