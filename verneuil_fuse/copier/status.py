"""How far each database in a spool is behind (for `verneuilctl lag`).

Everything comes from the spool itself (no copier state is needed): pending
snapshots in `ready`/`consuming`, staged chunks not yet uploaded, the age of
the staged manifest, whether the source database (its file, and its WAL in
WAL mode: source.py) moved past it; and, given a store, whether the store
holds exactly the staged manifest (`store.Reads.holds`, bounded by the
copier's `max_db_size`).

A database that stopped replicating says so (`stopped`, with the reason and
since when; never "in sync", its lag counted from then at least): its source
database is past `max_db_size` (the writer snapshots no such file), or a copier
refused its manifest as past it (`copier.stopped`). Each database also
carries its boot root's dead letters (entries, bytes, dropped).
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional

from verneuil_fuse import format as fmt
from verneuil_fuse.store import Reads, Store
from verneuil_fuse.copier import source as src
from verneuil_fuse.copier import spool as sp

# The size limit for the spool's own staged manifests: they come from this
# host's writer, not from the store, so any database size is fine and only
# Verneuil's cap on a manifest (MAX_MANIFEST_BYTES) bounds the decoding.
SPOOL_MAX_DB_SIZE = (1 << 64) - 1


def _snapshot_dirs(db: sp.DbDir, which: str) -> list[dict]:
    out = []
    top = db.sub(which)
    for name in sp.listdir_or_empty(top):
        path = os.path.join(top, name)
        try:
            mtime = os.stat(path).st_mtime
        except FileNotFoundError:
            continue
        files, size = sp.tree_size(os.path.join(path, sp.CHUNKS))
        out.append({"uuid": name, "age": max(0.0, time.time() - mtime),
                    "chunks": files, "chunk_bytes": size})
    return out


def source_uses_wal(source: Optional[str]) -> Optional[bool]:
    """Whether the database file's header says WAL (None: unreadable)."""
    if not source:
        return None
    try:
        with open(source, "rb") as f:
            header = f.read(src.HEADER_BYTES)
    except OSError:
        return None
    if len(header) < src.HEADER_BYTES:
        return None
    return src.uses_wal(header)


def _stopped(db: sp.DbDir, source: Optional[str], max_db_size: int) -> Optional[dict]:
    """Why and since when `db` stopped replicating (None: it did not)."""
    size = src.committed_size(source) if source else None
    try:
        record = json.loads(sp.read_regular(db.sub(sp.STOPPED_FILE), 4096))
        since = float(record["since"])
        reason = "a copier refused it: %s" % record.get("reason", "past max_db_size")
    except (OSError, ValueError, KeyError, TypeError):
        since, reason = None, None
    if reason is not None:
        return {"reason": reason, "since": since}
    if size is not None and size > max_db_size:
        return {"reason": "the source is %s (%d bytes), past max_db_size (%s): the writer does not "
                          "replicate it" % (fmt.format_size(size), size, fmt.format_size(max_db_size)),
                "since": None}
    return None


def db_status(db: sp.DbDir, reads: Optional[Reads] = None, max_db_size: int = fmt.MAX_REPLICATED_DB_SIZE) -> dict:
    """How far `db` is behind; with `reads` (the store's), whether the store
    holds its staged manifest."""
    now = time.time()
    source = db.source()
    info: dict = {"dbdir": db.name, "source": source, "wal": source_uses_wal(source)}
    info["stopped"] = _stopped(db, source, max_db_size)
    info["dead_letters"] = sp.dead_letters(os.path.join(db.root, sp.DEAD_LETTER))
    staged_files, staged_bytes = sp.tree_size(db.sub(sp.STAGING, sp.CHUNKS))
    info["staged_chunks"] = staged_files
    info["staged_chunk_bytes"] = staged_bytes
    info["ready"] = _snapshot_dirs(db, sp.READY)
    info["consuming"] = _snapshot_dirs(db, sp.CONSUMING)
    pending_bytes = staged_bytes + sum(s["chunk_bytes"] for s in info["ready"] + info["consuming"])
    info["pending_bytes"] = pending_bytes
    manifests = []
    meta_dir = db.sub(sp.STAGING, sp.META)
    for name in sorted(sp.listdir_or_empty(meta_dir)):
        path = os.path.join(meta_dir, name)
        entry: dict = {"name": name}
        try:
            mtime = os.stat(path).st_mtime
            raw = sp.read_regular(path)
        except (FileNotFoundError, IsADirectoryError):
            continue
        entry["age"] = max(0.0, now - mtime)
        try:
            m = fmt.decode_and_validate(raw, max_db_size=SPOOL_MAX_DB_SIZE)
        except fmt.ManifestError as e:
            # A chunk list XOR-ed with a base chunk needs the store to decode;
            # the spool status fetches nothing, so that is not an error here.
            m = None
            if e.rule != "base-chunk":
                entry["error"] = str(e)
        if m is not None:
            entry["len"] = m.len
            entry["chunks"] = len(m.chunks)
            entry["past_bound"] = m.len > max_db_size
            if source:
                header = src.committed_header(source)
                entry["source_changed"] = (None if header is None
                                           else fmt.header_fprint_of(header) != m.header_fprint)
        if reads is not None:
            held = reads.holds(name, raw)
            entry["in_store"] = "missing" if held is None else "current" if held else "behind"
        manifests.append(entry)
    info["manifests"] = manifests
    # The source moved past its staged snapshot: writes the VFS could not
    # snapshot (spool full or unwritable: the writer's log says which) or a
    # writer that does not use the VFS. Not in sync, whatever the store holds.
    changed = [e["age"] for e in manifests if e.get("source_changed")]
    info["source_changed"] = bool(changed)
    # Lag: how old the oldest snapshot not yet in the store is (0 if in sync);
    # for a database that stopped, at least since when it did.
    ages = [s["age"] for s in info["ready"] + info["consuming"]] + changed
    stopped = info["stopped"]
    if stopped is not None and stopped["since"] is not None:
        ages.append(max(0.0, now - stopped["since"]))
    # No snapshot at all yet (a spool directory the writer made before its
    # first snapshot, or whose every snapshot failed): never in sync, nothing to ship.
    info["snapshotted"] = bool(manifests or info["ready"] or info["consuming"])
    if reads is not None:
        ages += [e["age"] for e in manifests if e.get("in_store") != "current"]
        in_sync = bool(info["snapshotted"] and not ages and staged_files == 0 and stopped is None
                       and all(e.get("in_store") == "current" for e in manifests))
        info["lag"] = 0.0 if in_sync else (max(ages) if ages else None)
        info["in_sync"] = in_sync
    else:
        # Without a store, what is pending is what the spool still holds:
        # snapshots to publish and staged chunks (a staged manifest alone
        # stays in the spool after it was uploaded).
        if staged_files:
            ages += [e["age"] for e in manifests]
        info["lag"] = max(ages) if ages else (None if staged_files else 0.0)
        info["in_sync"] = None
    return info


def spool_status(spool_dir: str, store: Optional[Store] = None,
                 max_db_size: int = fmt.MAX_REPLICATED_DB_SIZE) -> list[dict]:
    """`db_status` of every database of the spool's current boot root,
    against `store` when given, with the bound `max_db_size` (the copier's)."""
    sp.check_spool(spool_dir)
    reads = Reads(store, max_db_size=max_db_size) if store is not None else None
    return [db_status(db, reads, max_db_size) for root in sp.boot_roots(spool_dir)[0]
            for db in sp.list_dbdirs(root)]
