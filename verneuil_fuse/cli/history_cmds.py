"""A database's past in the store: `versions` (every stored version of one
database, oldest first, with its time and whether its chunks are all
there), and the `--at TIME` of `restore` (parsed by history.parse_time,
then the version current at that time)."""
from __future__ import annotations

import sys

from verneuil_fuse.errors import EXIT_OK, EXIT_USAGE, UserError
from verneuil_fuse.cli.common import (fmt_size, log, manifest_key, print_json, print_table, store_from_args,
                                      store_reads)

# `versions` exits with this when the latest version misses chunks or
# cannot be read: the database as it is now cannot be restored or read.
EXIT_INCOMPLETE = 3


def parse_at(text: str) -> int:
    """--at TIME in nanoseconds since the epoch (history.parse_time)."""
    from verneuil_fuse.history import BadTime, parse_time
    try:
        return parse_time(text)
    except BadTime as e:
        raise UserError("--at: %s" % e, EXIT_USAGE) from None


def pick_version_at(args, store) -> None:
    """Set args.version_id to the version of the database current at
    --at (the newest whose time is at or before it)."""
    from verneuil_fuse.readback.versions import version_at
    from verneuil_fuse.history import format_time
    at_ns = parse_at(args.at)
    name = manifest_key(args)
    reads = store_reads(args, store)
    version, infos = version_at(reads, name, at_ns)
    if not infos:
        raise UserError("no such replicated database in %s: manifest %s" % (reads.where_manifests(), name))
    if version is None:
        raise UserError("no version of %s is as old as %s (%d versions; see verneuilctl versions)"
                        % (name, format_time(at_ns), len(infos)))
    log.info("--at %s: version %s from %s", format_time(at_ns), version.info.version_id,
             format_time(version.time_ns))
    args.version_id = version.info.version_id


def cmd_versions(args) -> int:
    """Every stored version of one database, oldest first."""
    from verneuil_fuse.readback.versions import check_chunks, load_all
    store = store_from_args(args, read_only=True)
    try:
        name = manifest_key(args)
        reads = store_reads(args, store)
        infos = reads.versions(name)
        if not infos:
            raise UserError("no such replicated database in %s: manifest %s" % (reads.where_manifests(), name))
        versions = load_all(reads, name, infos, workers=args.workers)
        if not args.no_check:
            check_chunks(store, versions, workers=args.workers)
    finally:
        store.close()
    rows = [v.describe() for v in versions]
    code = _exit_code(rows)
    if args.json:
        print_json(rows)
        return code
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
                      fmt_size(r["size"]), chunks, r["version_id"],
                      "latest" if r["is_latest"] else ""))
    print_table(table)
    _warn(rows, name)
    return code


def _exit_code(rows: list[dict]) -> int:
    """EXIT_INCOMPLETE when the latest version cannot be read or misses
    chunks, else EXIT_OK (older incomplete versions are warned about)."""
    latest = [r for r in rows if r["is_latest"]] or rows[-1:]
    return EXIT_INCOMPLETE if any("error" in r or r["complete"] is False for r in latest) else EXIT_OK


def _warn(rows: list[dict], name: str) -> None:
    """stderr: versions that cannot be read, and what missing chunks mean."""
    for r in rows:
        if "error" in r:
            print("warning: version %s: %s" % (r["version_id"], r["error"]), file=sys.stderr)
    incomplete = [r for r in rows if r.get("complete") is False and "error" not in r]
    if any(r["is_latest"] for r in incomplete):
        r = next(r for r in incomplete if r["is_latest"])
        print("warning: the latest version misses %d chunk%s: restoring or reading the database as it is "
              "now fails; verneuilctl repair puts back what its source file still holds (manifest %s)"
              % (r["missing_chunks"], "" if r["missing_chunks"] == 1 else "s", name), file=sys.stderr)
    older = [r for r in incomplete if not r["is_latest"]]
    if older:
        print("warning: %d older version%s miss%s chunks and cannot be restored (the store expired or lost "
              "them)" % (len(older), "" if len(older) == 1 else "s", "es" if len(older) == 1 else ""),
              file=sys.stderr)
