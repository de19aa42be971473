"""The commands that read a store: `ls` (the replicated databases, with
their sizes, times and version counts), `manifest` (one manifest decoded,
for people or as JSON) and `restore` (a database file rebuilt from its
chunks, every one verified, written atomically or to stdout; `--at` picks
the version through history_cmds)."""
from __future__ import annotations

import os
import sys
from typing import Optional

from verneuil_fuse.errors import EXIT_OK, EXIT_USAGE, UserError
from verneuil_fuse.cli.common import (Progress, fmt_size, fmt_time, load_manifest, log, print_json,
                                      print_table, store_from_args, store_reads)
from verneuil_fuse.cli.history_cmds import parse_at, pick_version_at


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


def cmd_restore(args) -> int:
    import tempfile
    from verneuil_fuse.readback.restore import restore_to_path, write_snapshot
    if args.at is not None:  # refused before anything else: a bad time, two ways to pick
        parse_at(args.at)
        if args.version_id:
            raise UserError("give --at or --version-id, not both", EXIT_USAGE)
        if args.manifest_file:
            raise UserError("--at picks a version in the store: not with --manifest-file", EXIT_USAGE)
    if args.out != "-":
        _check_restore_target(args.out, args.force)
    store = store_from_args(args, read_only=True)
    try:
        if args.at is not None:
            pick_version_at(args, store)
        name, m = load_manifest(args, store)
        progress = Progress(not args.quiet)
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


def _ls_entry(reads, info, versions: bool) -> dict:
    from verneuil_fuse import format as fmt
    from verneuil_fuse.store import ReadError
    parsed = fmt.parse_manifest_name(info.key)
    entry: dict = {"name": info.key, "hostname": parsed.hostname if parsed else None,
                   "path": parsed.path if parsed else None,
                   "blob_size": info.size, "mtime": info.mtime}
    if parsed is not None and parsed.mangled:
        entry["path"] = "%s...%s" % (parsed.prefix, parsed.suffix)
    try:
        # Bounded by max_db_size: an over-large object is an error for its
        # entry, never read whole.
        m = reads.load(info.key)
        entry.update(size=m.len, ctime=m.ctime + m.ctime_ns / 1e9, chunks=len(m.chunks))
    except ReadError as e:
        entry.update(error="deleted while listing" if e.missing else str(e))
    if versions:
        entry["versions"] = len(reads.versions(info.key))
    return entry


def cmd_ls(args) -> int:
    store = store_from_args(args, read_only=True)
    try:
        reads = store_reads(args, store)
        entries = []
        for info in sorted(reads.names(), key=lambda i: i.key):
            entry = _ls_entry(reads, info, not args.no_versions)
            if args.hostname is not None and entry["hostname"] != args.hostname:
                continue
            entries.append(entry)
        if not entries:
            _say_why_empty(store, args.hostname)
    finally:
        store.close()
    if args.json:
        print_json(entries)
        return EXIT_OK
    rows = [("HOST", "PATH", "SIZE", "CTIME", "VERSIONS")]
    for e in entries:
        rows.append((e["hostname"] or "?", e["path"] or e["name"],
                     "ERROR" if "error" in e else fmt_size(e.get("size")),
                     fmt_time(e.get("ctime", 0)), str(e.get("versions", "-"))))
    print_table(rows)
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
    if _s3_bucket(store.chunks) is not None and _s3_bucket(store.chunks) == _s3_bucket(store.manifests):
        text += ("; this URL names one bucket for chunks and manifests (no manifest_bucket=): "
                 "if the manifests are in a bucket of their own, add manifest_bucket=NAME")
    print("verneuilctl: %s" % text, file=sys.stderr)


def _s3_bucket(backend) -> Optional[str]:
    """The bucket of an S3 backend, from its `Backend.identity`
    (``s3://bucket/prefix``); None for any other backend."""
    where = backend.identity()
    return where[len("s3://"):].split("/", 1)[0] if where.startswith("s3://") else None


def _manifest_dict(name: str, m) -> dict:
    from verneuil_fuse import format as fmt
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
        "layout": "chunks" if m.layout is None else "packed",
        "packs": [] if m.layout is None else m.layout.keys(),
    }


def cmd_manifest(args) -> int:
    from verneuil_fuse import format as fmt
    store = None
    store = store_from_args(args, required=not args.manifest_file, read_only=True)
    try:
        name, m = load_manifest(args, store)
    finally:
        if store is not None:
            store.close()
    d = _manifest_dict(name, m)
    if args.json:
        print_json(d)
        return EXIT_OK
    print("name:            %s" % d["name"])
    if d["hostname"] is not None:
        print("hostname:        %s" % d["hostname"])
    if d["path"] is not None:
        print("path:            %s" % d["path"])
    print("length:          %d bytes (%s)" % (d["len"], fmt_size(d["len"])))
    print("ctime:           %s (%d.%09d)" % (fmt_time(m.ctime), m.ctime, m.ctime_ns))
    print("chunks:          %d (%d distinct, %d zero)" % (d["num_chunks"], d["distinct_chunks"],
                                                          d["zero_chunks"]))
    print("header_fprint:   %s" % d["header_fprint"])
    print("contents_fprint: %s" % d["contents_fprint"])
    if d["base_chunks_fprint"]:
        print("base chunk:      %s" % d["base_chunks_fprint"])
    print("version_id:      %s" % (d["version_id"] or "-"))
    print("generated_by:    %s" % (d["generated_by"] or "-"))
    print("bundled chunks:  %s" % (", ".join(map(str, d["bundled_chunks"])) or "-"))
    print("layout:          %s" % (d["layout"] if m.layout is None else "packed, %d packs" % len(d["packs"])))
    if args.chunks:
        for i, c in enumerate(d["chunks"]):
            source = fmt.chunk_source(m, i)
            where = "" if not source.ranged else "  %s [%d, %d)" % (source.key, source.start, source.end)
            print("  %6d %s%s" % (i, c, where))
    return EXIT_OK
